"""`multilane control` on a run on a host (a real sshd on 127.0.0.1): `HOST:RUN_DIR` and a local mirror
both reach the run there, or are refused in one line; `train --host H --resume RUN` follows the resumed
run to its end like a started one; a remote path with a newline in it is handled byte for byte."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from helpers import CLI
from sshd_server import MULTILANE

pytestmark = pytest.mark.timeout(300)


def cli(env: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL
    )


def status(folder: Path) -> dict:
    try:
        return json.loads((folder / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def wait_for(predicate, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def one_error_line(p: subprocess.CompletedProcess) -> str:
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("multilane: error: "), (p.returncode, p.stderr)
    return lines[0]


@pytest.mark.slow
def test_control_reaches_a_run_on_a_host_directly_and_through_its_mirror_and_resume_is_followed_to_its_end(
    sshd, ssh_home, tmp_path
):
    from multilane.engine.remote.connection import connect
    from multilane.engine.remote.mirror import RemoteMirror

    runs = sshd.runs / "control\nwith a newline"  # a path no line-based parsing can carry
    env = sshd.env()
    p = cli(
        env,
        "train", "--host", "testhost", "--remote-command", MULTILANE, "--remote-runs-dir", str(runs),
        "--task", "linear", "--steps", "1000000", "--set", "train.log_every=5", "--set", "train.eval_every=0",
        "--set", "train.checkpoint_every=10", "--detach",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    (folder,) = [f for f in runs.iterdir() if not f.name.startswith(".")]
    assert p.stdout == "testhost:" + str(folder).replace("\n", "\\n") + "\n"  # escaped on the terminal
    wait_for(lambda: (status(folder).get("step") or 0) >= 20 and (folder / "checkpoints" / "last.pt").exists(), "steps")

    p = cli(env, "control", f"testhost:{folder}", "pause")
    assert p.returncode == 0, p.stderr
    wait_for(lambda: status(folder).get("state") == "paused", "the run there to pause")

    mirror = tmp_path / "mirrors" / "m"
    with connect("testhost") as conn:
        RemoteMirror(conn, str(folder), mirror).sync()  # what `train --host` leaves here: it knows host and folder
    p = cli(env, "control", str(mirror), "stop")
    assert p.returncode == 0, p.stderr
    wait_for(lambda: status(folder).get("state") == "stopped", "the run there to stop")
    stopped_at = status(folder)["step"]
    line = one_error_line(cli(env, "control", str(mirror), "stop"))
    assert "the run there has ended (stopped); nothing to stop" in line and str(mirror) in line

    target = stopped_at + 15
    p = cli(
        env, "train", "--host", "testhost", "--remote-command", MULTILANE, "--resume", str(folder),
        "--steps", str(target), "--runs-dir", str(tmp_path / "local"), timeout=240,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert f"finished: step {target}/{target}" in p.stdout and "stopped" not in p.stdout, p.stdout
    assert status(folder)["state"] == "finished"
    (local,) = (tmp_path / "local").iterdir()
    assert (local / "metrics.jsonl").read_bytes() == (folder / "metrics.jsonl").read_bytes()
    assert json.loads((local / "remote.json").read_text())["path"] == str(folder)


def test_control_of_what_is_not_a_live_run_there_is_one_line(sshd, tmp_path):
    env = sshd.env()
    line = one_error_line(cli(env, "control", f"testhost:{sshd.runs}/no such run", "pause"))
    assert f"testhost:{sshd.runs}/no such run is not a run folder there" in line
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / "remote.json").write_text(json.dumps({"host": "nosuchalias.invalid", "path": "/runs/x"}))
    line = one_error_line(cli(env, "control", str(mirror), "pause"))
    assert line.startswith(f"multilane: error: control: {mirror} mirrors nosuchalias.invalid:/runs/x: ")


@pytest.mark.slow
def test_text_from_a_host_is_escaped_on_the_terminal(sshd, tmp_path):
    from multilane.engine.display.terminal_text import printable

    hostile = "\x1b]0;pwned\x07\x1b[2J\x9b31m\u202eevil\r"
    folder = sshd.runs / f"escapes{hostile}"
    folder.mkdir()
    (folder / "config.json").write_text('{"run": {"name": "x"}}\n')
    (folder / "metrics.jsonl").write_text('{"kind": "train", "step": 3, "loss": 0.5}\n')
    status = {"state": "failed", "step": 3, "total_steps": 10, "message": f"boom {hostile}"}
    (folder / "status.json").write_text(json.dumps(status))
    p = cli(sshd.env(), "watch", f"testhost:{folder}", "--runs-dir", str(tmp_path / "local"), "--interval", "0.05")
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert f"failed: step 3/10 · loss 0.5000 (boom {printable(hostile)})" in p.stdout
    assert not any(c in out for c in "\x1b\x07\x9b\u202e\r"), repr(out)
    (mirror,) = (tmp_path / "local").iterdir()  # the mirror's own name carries no control character either
    assert mirror.name == f"escapes{printable(hostile)}@testhost"
    assert printable(hostile) == "\\x1b]0;pwned\\x07\\x1b[2J\\x9b31m\\u202eevil\\r"
    assert printable("naïve 日本 🙂 tab-free") == "naïve 日本 🙂 tab-free"
