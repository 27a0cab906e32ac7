"""The whole CLI, fed random argument vectors (hypothesis).

Every subcommand, with random picks of its own flags and of hostile values (paths the system refuses,
numbers out of range, control characters, a run folder, an empty folder, a runs folder, files that
are not configs): each vector ends with exit 0, 1 or 2, no traceback, nothing written outside the
runs folder, the sweeps folder or ``--out``, within a time bound.

``main`` runs in-process (it returns its exit status; argparse's own ends are ``SystemExit``), in a
sandbox folder as the current directory. Stubbed, at their process boundary only: a ddp run's
launcher (``launch``: the machine check runs, then no ranks start) and a sweep trial's process (it
exits at once, failed). Left out: ``--host`` and ``--remote-command`` (SSH: tests/engine/remote/),
``devices --watch`` (until Ctrl+C) and ``sweep-worker --storage -`` (standard input).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from multilane.engine.cli.main import main
from multilane.engine.cli.parser import build_parser

EXAMPLES = int(os.environ.get("MULTILANE_CLI_EXAMPLES", "60"))  # fixed: derandomized, the same vectors each run
TIME_BOUND_S = 120.0  # one vector: a guard against a hang (a wait for ever), not a speed target
# --epochs: the built-in task's default epochs take a minute on a busy 2-core machine; --steps stays
LEFT_OUT = {"--host", "--remote-command", "--watch", "-h", "--help", "--version", "--epochs"}


def options_of(command: str) -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sorted({s for a in sub.choices[command]._actions for s in a.option_strings if s.startswith("--")} - LEFT_OUT)


COMMANDS = ["train", "watch", "control", "export", "devices", "sweep", "sweep-worker"]
OPTIONS = {c: options_of(c) for c in COMMANDS}


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Path:
    """The current folder of every vector: a finished run, an empty folder, notes, configs good and bad."""
    root = tmp_path_factory.mktemp("cli-sandbox")
    run = root / "runs" / "20260101-000000-r"
    run.mkdir(parents=True)
    (run / "status.json").write_text(json.dumps({"state": "finished", "message": "done\x1b]0;t\x07", "step": 2}))
    (run / "config.json").write_text(json.dumps({"task": {"name": "linear"}}))
    (run / "metrics.jsonl").write_text(
        '{"kind":"event","event":"started","wall_time":1,"step":0,"total_steps":2}\n'
        '{"kind":"train","step":2,"wall_time":2,"loss":0.5,"device_loss":{"cpu:0":0.5}}\n'
    )
    (root / "empty").mkdir()
    (root / "notes").mkdir()
    (root / "notes" / "todo.txt").write_text("buy milk")
    (root / "good.toml").write_text('[train]\nsteps = 2\n[devices]\nuse = "cpu:0"\n[data]\nbatch_size = 8\n')
    (root / "broken.toml").write_text("[train\nsteps = ")
    (root / "deep.json").write_text("[" * 5000 + "]" * 5000)
    return root


VALUES = [
    # paths: here, missing, refused by the system, odd
    "runs/20260101-000000-r", "runs", "empty", "notes", "notes/todo.txt", "good.toml", "broken.toml",
    "deep.json", "missing", "~nosuchuser34/x", "/tmp/" + "n" * 300, "a/" * 2100, "/proc", "/dev/zero",
    ".", "..", "a..b:/x", "",
    # numbers
    "0", "1", "2", "-1", "nan", "inf", "1e308", "99999999999999999999999", "0.5",
    # names and values
    "linear", "nosuch", "imagefolder", "auto", "cpu:0", "cpu:0,cpu:0", "cpu:0,cpu:1", "cuda:0", "tpu:0",
    ",".join(f"cpu:{i}" for i in range(65)), "ddp", "persistent", "replicate", "adam", "sgd", "fp16", "bf16",
    "stop", "pause", "resume", "png", "csv", "svg,pdf", "step", "time",
    "train.log_every=1", "devices.ddp_backend=nccl", "task.params.root=~nosuchuser34", "run.runs_dir=/proc",
    "optim.lr=log(1e-4,1e-1)", "optim.lr=bogus", "..=1", "postgresql://127.0.0.1:1/x",
    "val_loss:min", "x:sideways", "\x1b]0;title\x07", "\x1b[2J", "é" * 100, "-", "--",
]  # fmt: skip


RUN = "runs/20260101-000000-r"
VALID = [  # a command that works, to which random tokens are added: the paths past the parser
    ["watch", RUN, "--interval", "0.05"],
    ["control", RUN, "pause"],
    ["export", RUN, "--out", "out", "--format", "csv"],
    ["train", "--config", "good.toml"],
    ["train", "--task", "linear", "--devices", "cpu:0", "--steps", "1"],
    ["devices", "--json"],
]


def vectors() -> st.SearchStrategy[list[str]]:
    def tokens(command: str, most: int) -> st.SearchStrategy[list[str]]:
        values = st.sampled_from(VALUES)
        token = st.one_of(st.sampled_from(OPTIONS[command]), values) if OPTIONS[command] else values
        return st.lists(token, max_size=most)

    random = st.sampled_from(COMMANDS).flatmap(lambda c: tokens(c, 7).map(lambda rest: [c, *rest]))
    valid = st.sampled_from(VALID).flatmap(lambda v: tokens(v[0], 2).map(lambda rest: [*v, *rest]))
    return st.one_of(random, valid)


def allowed_outputs(argv: list[str]) -> set[str]:
    """Where a vector may write, as the sandbox names them: the runs and sweeps folders, and --out."""
    out = {"runs", "sweeps"}
    for flag in ("--out", "--runs-dir", "--sweeps-dir"):
        if flag in argv and argv.index(flag) + 1 < len(argv):
            out.add(os.path.normpath(argv[argv.index(flag) + 1]).split(os.sep)[0])
    return out


def tree(root: Path, allowed: set[str]) -> dict[str, tuple[int, int]]:
    out = {}
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if rel.parts[0] in allowed:
            continue
        st_ = p.lstat()
        out[str(rel)] = (st_.st_size, st_.st_mtime_ns)
    return out


@pytest.fixture
def stubs(monkeypatch, tmp_path):
    from multilane.engine.distributed import launcher
    from multilane.engine.sweep import trial_run

    def launch(argv, config, *args, **kwargs) -> int:  # the machine check, then no process
        launcher.processes_per_node(config)
        return 0

    monkeypatch.setattr(launcher, "launch", launch)
    monkeypatch.setattr(trial_run, "TRAIN", ["/bin/false"])  # a trial's process: ends at once, failed


@pytest.mark.slow  # EXAMPLES vectors, each a real CLI command (some train a real run): about a minute
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(argv=vectors())
def test_any_argument_vector_ends_in_0_1_or_2_without_a_traceback_or_a_stray_file(sandbox, stubs, argv):
    if "sweep-worker" in argv and "-" in argv:
        return  # --storage - reads standard input
    if argv[0] == "train" and not {"--steps", "--resume", "--config"} & set(argv):
        argv = [*argv, "--steps", "2"]  # a run of the defaults' length is not what is tested here
    allowed = allowed_outputs(argv)
    before = tree(sandbox, allowed)
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    t0 = time.monotonic()
    os.chdir(sandbox)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as e:  # argparse: a usage error (2)
                code = e.code if isinstance(e.code, int) else 2
    finally:
        os.chdir(cwd)
    elapsed = time.monotonic() - t0
    event(f"{argv[0]}: exit {code}")  # --hypothesis-show-statistics: what the vectors reached
    assert code in (0, 1, 2), (argv, code, err.getvalue()[-2000:])
    assert "Traceback" not in err.getvalue() + out.getvalue(), (argv, err.getvalue()[-3000:])
    assert elapsed < TIME_BOUND_S, (argv, elapsed)
    assert tree(sandbox, allowed) == before, argv
