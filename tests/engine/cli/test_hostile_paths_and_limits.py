"""Hostile paths, terminals and folders; the machine's limits; messages that name the culprit.

Each case is the real CLI (``multilane.engine.cli.main``) called in-process with its output captured:
none of these promises depends on a process of its own. Each case failed (a traceback, a wait, a
file written where it should not be, a line blaming the wrong thing) before the fix it holds.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from multilane.engine.cli.main import main
from multilane.engine.display.terminal_text import printable

HOSTILE = "\x1b]0;pwned\x07\x1b]52;c;ZXZpbA==\x07\x1b[2J\r\x9b31m\u202e"


def one_error_line(capsys, code: int, *words: str, status: int = 2) -> str:
    out, err = capsys.readouterr()
    assert code == status, (out, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("multilane: error: "), err
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every entry under ``folder`` with its size and mtime: what 'nothing written' compares."""
    out = {}
    for p in sorted(folder.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(folder))] = (st.st_size, st.st_mtime_ns)
    return out


def hand_made_run(folder: Path, message: str = "done", device: str = "cpu:0") -> Path:
    """A finished run folder as the trainer writes one (status, config, records), written by hand."""
    folder.mkdir(parents=True)
    now = time.time()
    status = {"state": "finished", "message": message, "updated": now, "step": 3, "total_steps": 3}
    (folder / "status.json").write_text(json.dumps(status))
    (folder / "config.json").write_text(json.dumps({"task": {"name": "linear"}}))
    records = [
        {"kind": "event", "event": "started", "wall_time": now, "step": 0, "total_steps": 3},
        {"kind": "train", "step": 3, "wall_time": now, "loss": 0.5, "device_loss": {device: 0.5}},
        {"kind": "telemetry", "wall_time": now, "devices": {device: {"busy_pct": {"mean": 50, "min": 1, "max": 90}}}},
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


# -- terminal escapes ---------------------------------------------------------------------------


def test_printable_escapes_every_control_character_and_keeps_the_rest():
    assert printable("plain text, ünïcödé, 日本, 🙂") == "plain text, ünïcödé, 日本, 🙂"
    shown = printable(HOSTILE + "\t\n\x7f\x00")
    assert shown == "\\x1b]0;pwned\\x07\\x1b]52;c;ZXZpbA==\\x07\\x1b[2J\\r\\x9b31m\\u202e\\t\\n\\x7f\\x00"
    assert shown.isprintable()
    assert all(printable(chr(c)).isprintable() for c in range(0x20))  # every C0, one by one
    assert all(printable(chr(c)).isprintable() for c in range(0x7F, 0xA0))  # DEL and every C1


def test_watch_shows_a_run_folders_status_and_device_names_escaped(tmp_path, capsys):
    run = hand_made_run(tmp_path / "run", message=HOSTILE, device="cuda:0" + HOSTILE)
    (run / "status.json").write_text(json.dumps({**json.loads((run / "status.json").read_text()), "state": "failed"}))
    code = main(["watch", str(run), "--interval", "0.05"])
    out, err = capsys.readouterr()
    assert code == 1, err
    for raw in ("\x1b", "\x07", "\x9b", "\r", "\u202e"):
        assert raw not in out + err
    assert "\\x1b]0;pwned\\x07" in out and "failed: step 3/3" in out


@pytest.mark.slow  # export's first import of the plotting code
def test_export_prints_the_paths_it_wrote_escaped(tmp_path, capsys):
    run = hand_made_run(tmp_path / ("run" + "\x1b[2J"))
    assert main(["export", str(run), "--out", str(tmp_path / "out\x1b]0;x\x07"), "--format", "csv"]) == 0
    out, _ = capsys.readouterr()
    assert "\x1b" not in out and "out\\x1b]0;x\\x07/metrics.csv" in out


def test_control_and_the_progress_line_print_run_folder_text_escaped(tmp_path, capsys):
    from multilane.engine.display.progress import ProgressDisplay, summary
    from multilane.engine.run.callbacks import RunResult
    from rich.console import Console

    run = hand_made_run(tmp_path / ("run" + "\x1b[2J"))
    assert main(["control", str(run), "stop"]) == 0
    out, _ = capsys.readouterr()
    assert "\x1b" not in out and out.count("\\x1b[2J") == 1
    # train's plain progress lines and summary: a task's warning (with rich markup), metric names, message
    buf = io.StringIO()
    display = ProgressDisplay(Console(file=buf, force_terminal=False, width=200))
    display.on_event({"kind": "event", "event": "warning", "message": "[/bold] " + HOSTILE})
    display.on_eval({"val_loss": 1.0, "metrics": {"acc" + HOSTILE: 0.5}})
    display.on_log({"step": 1, "loss": 1.0})
    result = RunResult("failed", 1, run, message=HOSTILE, last_eval={"val_loss": 1.0, "metrics": {HOSTILE: 1.0}})
    text = buf.getvalue() + summary(result)
    assert "\x1b" not in text and "\x9b" not in text and "[/bold] \\x1b]0;pwned" in text


def test_the_devices_table_shows_a_driver_given_name_as_text(monkeypatch, capsys):
    from multilane.engine.cli.monitor import devices_table
    from rich.console import Console

    row = {"name": "cuda:0", "kind": "cuda", "model": "[bold]H100" + HOSTILE, "util_pct": 5.0}
    buf = io.StringIO()
    Console(file=buf, force_terminal=False, width=300).print(devices_table([row]))
    assert "[bold]H100\\x1b]0;pwned" in buf.getvalue() and "\x1b" not in buf.getvalue()


# -- paths the system refuses -------------------------------------------------------------------

BAD_PATHS = {
    "no such user": ("~nosuchuser34/x", "no user 'nosuchuser34'"),
    "a 300-byte name": ("/tmp/" + "a" * 300 + "/x", "300 bytes long"),
    "a 5,000-byte path": ("a/" * 2500, "at most 4,095 bytes"),
    "a lone surrogate": ("run\udfff\ud800", "not a file name|not a valid string|unable to parse"),
}


def commands(path: str, tmp_path: Path, run: Path) -> dict[str, list[str]]:
    return {
        "watch": ["watch", path],
        "control": ["control", path, "stop"],
        "export": ["export", path, "--out", str(tmp_path / "out")],
        "export --out": ["export", str(run), "--out", path],
        "export --compare": ["export", str(run), "--out", str(tmp_path / "out"), "--compare", path],
        "train --resume": ["train", "--resume", path],
        "train --runs-dir": ["train", "--task", "linear", "--steps", "1", "--runs-dir", path],
        "train --config": ["train", "--config", path],
        "train --task": ["train", "--task", path + ".py", "--runs-dir", str(tmp_path / "runs")],
    }


@pytest.mark.parametrize("bad", list(BAD_PATHS))
def test_a_path_no_system_call_takes_is_one_line_in_every_command(tmp_path, capsys, bad):
    path, words = BAD_PATHS[bad]
    run = hand_made_run(tmp_path / "run")
    before = snapshot(tmp_path)
    for name, argv in commands(path, tmp_path, run).items():
        line = one_error_line(capsys, main(argv))
        assert re.search(words, line), (name, line)
        assert len(line) < 1100, name
    assert snapshot(tmp_path) == before  # nothing written anywhere (no ./~nosuchuser34 folder either)
    assert not Path("~nosuchuser34").exists()


def test_an_idna_rejected_host_name_is_one_line(capsys):
    for argv in (["devices", "--host", "a..b"], ["watch", "a..b:/runs/x"], ["devices", "--host", "x" * 70 + ".com"]):
        one_error_line(capsys, main(argv), "not a host name")


def test_a_host_name_or_port_in_the_ssh_config_that_no_resolver_takes_is_one_line(tmp_path, capsys, monkeypatch):
    """The same promise for what ~/.ssh/config says of an alias: its HostName is asked of the resolver."""
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "config").write_text(
        "Host zw\n  HostName \u200b\u200b..example\n"
        f"Host long\n  HostName {'a' * 70}.com\n"
        "Host port\n  HostName 127.0.0.1\n  Port abc\n"
    )
    monkeypatch.setenv("HOME", str(tmp_path))
    for alias, words in (("zw", ("HostName", "not a host name")), ("long", ("HostName",)), ("port", ("Port", "abc"))):
        line = one_error_line(capsys, main(["devices", "--host", alias]), *words, f"host {alias!r}")
        assert "\u200b" not in line  # escaped, never printed raw


@pytest.mark.parametrize(
    "command",
    ["devices", "devices --json", "watch", "control", pytest.param("export", marks=pytest.mark.slow), "train --help"],
)
def test_stdout_on_a_full_device_is_one_line_exit_1(tmp_path, capsys, monkeypatch, command):
    run = hand_made_run(tmp_path / "run")
    argv = {
        "watch": ["watch", str(run)],
        "control": ["control", str(run), "stop"],
        "export": ["export", str(run), "--out", str(tmp_path / "out"), "--format", "csv"],
    }.get(command, command.split())
    full = open("/dev/full", "w")  # noqa: SIM115 (closed below; main points its fd at /dev/null)
    monkeypatch.setattr(sys, "stdout", full)
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's --help: it swallows a failed write of its own
        code = e.code
    finally:
        monkeypatch.undo()
        full.close()
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert code == 1 and err.splitlines() == [
        "multilane: error: cannot write to standard output (No space left on device)"
    ]


def test_a_closed_pipe_on_stdout_ends_quietly_exit_1(capsys, monkeypatch):
    read_end, write_end = os.pipe()
    os.close(read_end)  # `multilane devices --json | head -0`: the reader is gone
    pipe = os.fdopen(write_end, "w")
    monkeypatch.setattr(sys, "stdout", pipe)
    try:
        code = main(["devices", "--json"])
    finally:
        monkeypatch.undo()
        pipe.close()
    assert code == 1 and capsys.readouterr().err == ""


def test_an_os_error_no_check_foresaw_is_one_line_naming_the_file(capsys, monkeypatch):
    import errno
    import importlib

    cli_main = importlib.import_module("multilane.engine.cli.main")

    def refused(args):  # what a file system's own limit looks like to the code (faked: the net under test)
        raise OSError(errno.EOVERFLOW, os.strerror(errno.EOVERFLOW), "/data/runs/x\x1b[2J/metrics.jsonl")

    monkeypatch.setattr(cli_main, "cmd_devices", refused)
    line = one_error_line(capsys, main(["devices"]), "/data/runs/x\\x1b[2J/metrics.jsonl: ", status=1)
    assert line.endswith(os.strerror(errno.EOVERFLOW))


# -- acting only on run folders -----------------------------------------------------------------


def not_runs(tmp_path: Path) -> dict[str, Path]:
    empty = tmp_path / "empty"
    empty.mkdir()
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "notes.txt").write_text("my notes")
    (docs / "config.json").write_text('{"theme": "dark"}')  # a config.json, but not a run's
    tb = tmp_path / "tb"
    tb.mkdir()
    (tb / "events.out.tfevents.1700000000.host").write_bytes(b"\x00" * 64)
    (tb / "metrics.jsonl").write_text("step,loss\n1,0.5\n")  # another tool's file of that name
    return {"an empty folder": empty, "a documents folder": docs, "a TensorBoard logdir": tb}


def test_control_watch_and_export_act_only_on_a_run_folder_and_write_nothing_elsewhere(tmp_path, capsys):
    for what, folder in not_runs(tmp_path).items():
        before = snapshot(tmp_path)
        for argv in (
            ["control", str(folder), "stop"],
            ["watch", str(folder)],
            ["export", str(folder), "--out", str(tmp_path / "out")],
        ):
            line = one_error_line(capsys, main(argv), "is not a run folder")
            assert str(folder) in line, (what, line)
        assert snapshot(tmp_path) == before, what
    run = hand_made_run(tmp_path / "run")  # a run folder, for contrast: control writes its control.json
    assert main(["control", str(run), "stop"]) == 0
    assert json.loads((run / "control.json").read_text())["command"] == "stop"


def test_a_run_just_made_before_its_first_file_is_a_run_folder(tmp_path, capsys):
    from multilane.engine.rundir.runs_folder import says_it_is_a_run

    made = tmp_path / "20260101-000000-r"
    (made / "checkpoints").mkdir(parents=True)
    (made / ".lock").write_text("")
    assert says_it_is_a_run(made)
    assert main(["control", str(made), "pause"]) == 0


# -- the machine ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--set", "devices.ddp_backend=nccl"], "nccl needs a GPU per process; devices.use = auto is cpu:0,cpu:1"),
        (["--set", "devices.ddp_backend=nccl", "--devices", "cuda:0,cuda:0"], "torch sees no CUDA GPU"),
        (["--devices", "cuda:1"], "torch sees no CUDA GPU"),
        (["--devices", ",".join(f"cpu:{i}" for i in range(65))], "65 CPU lanes asked for; at most 64"),
    ],
)
def test_a_ddp_run_the_machine_cannot_run_is_refused_before_any_process_or_folder(tmp_path, capsys, flags, words):
    runs = tmp_path / "runs"
    argv = ["train", "--task", "linear", "--strategy", "ddp", "--steps", "2", "--runs-dir", str(runs), *flags]
    one_error_line(capsys, main(argv), words)
    assert not runs.exists()


def test_nccl_with_one_gpu_twice_is_refused_where_the_machine_has_gpus(monkeypatch):
    from multilane.engine.config import build_config
    from multilane.engine.distributed.launcher import processes_per_node
    from multilane.engine.errors import UserError
    from multilane.engine.telemetry import devices

    monkeypatch.setattr(devices, "_cuda_count", lambda: 2)  # faked: no GPU here
    cfg = build_config({"devices": {"use": "cuda:0,cuda:0", "strategy": "ddp", "ddp_backend": "nccl"}})
    with pytest.raises(UserError, match="cuda:0 is listed twice, and NCCL refuses two processes on one GPU"):
        processes_per_node(cfg)
    cfg = build_config({"devices": {"use": "cuda:0,cuda:1", "strategy": "ddp", "ddp_backend": "nccl"}})
    assert processes_per_node(cfg) == 2


# -- messages -------------------------------------------------------------------------------------


def test_a_500000_character_imagefolder_root_is_refused_naming_the_key(tmp_path, capsys):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"task": {"name": "imagefolder", "params": {"root": "r" * 500_000}}}))
    line = one_error_line(capsys, main(["train", "--config", str(config), "--runs-dir", str(tmp_path / "runs")]))
    assert "task.params.root" in line and len(line) < 400


@pytest.mark.slow
def test_an_image_folder_with_an_empty_class_is_refused_naming_the_class_folder(tmp_path):
    from helpers import CLI
    from PIL import Image

    for layout in ("flat",):  # root/train + root/val: the same make_dataset, each folder checked
        root = tmp_path / layout.replace("/", "_")
        top = root / "train" if layout == "train/val" else root
        for cls in ("cat", "dog", "emu"):
            (top / cls).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (4, 4)).save(top / "cat" / f"{i}.png")
            Image.new("RGB", (4, 4)).save(top / "emu" / f"{i}.png")
        (top / "dog" / "broken.png").symlink_to("/nonexistent")  # skipped (unreadable): dog has no image
        if layout == "train/val":
            for cls in ("cat", "dog", "emu"):
                (root / "val" / cls).mkdir(parents=True)
                Image.new("RGB", (4, 4)).save(root / "val" / cls / "0.png")
        runs = tmp_path / "runs"
        # a process of its own: torchvision's operators do not register beside the suite's other imports
        out = subprocess.run(
            [
                *CLI,
                "train",
                "--task",
                "imagefolder",
                "--set",
                f"task.params.root={root}",
                *("--steps", "1"),
                "--runs-dir",
                str(runs),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.splitlines() == [
            f"multilane: error: task imagefolder: class folder {top / 'dog'} holds no image that can be read; "
            "add images or remove the folder"
        ]
        assert not runs.exists()
