"""The mirror of a run on a host (a real sshd on 127.0.0.1) copies regular files only, checked without
following links; a file too large to copy whole is skipped; a large growing file streams in bounded
chunks with its progress, and the final status waits for the records before it."""

from __future__ import annotations

import json
import os
import time
import tracemalloc

import pytest

pytestmark = pytest.mark.timeout(120)


def run_folder(root, name: str, state: str = "running"):
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"run": {"name": "x"}}\n')
    (folder / "status.json").write_text(json.dumps({"state": state, "step": 1, "total_steps": 10}))
    (folder / "metrics.jsonl").write_bytes(b"")
    return folder


def test_links_fifos_and_folders_in_a_files_place_are_one_warning_each_and_never_followed(sshd, ssh_home, tmp_path):
    from multilane.engine.remote.connection import Connection
    from multilane.engine.remote.mirror import RemoteFollower, RemoteMirror

    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET outside the run folder\n")
    folder = run_folder(sshd.runs, "links")
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(secret)  # a link to a file outside the run folder
    (folder / "metrics.jsonl").unlink()
    (folder / "metrics.jsonl").symlink_to(secret)
    (folder / "status.json").unlink()
    os.mkfifo(folder / "status.json")  # opening it would block until a writer comes
    (folder / "error.txt").mkdir()
    with Connection("testhost") as conn:
        mirror = RemoteMirror(conn, str(folder), tmp_path / "mirror")
        follower = RemoteFollower(mirror)
        t0 = time.monotonic()
        follower.poll()
        follower.poll()  # again: the warnings are not repeated
        assert time.monotonic() - t0 < 10
        assert follower.reconnecting is None and follower.lost is None
        warnings = follower.new_warnings()
        assert follower.new_warnings() == []
    assert sorted(w.split(f"{folder}/")[1] for w in warnings) == [
        "config.json: a symbolic link is in a file's place; skipped, never followed",
        "error.txt: a folder is in a file's place; skipped, never followed",
        "metrics.jsonl: a symbolic link is in a file's place; skipped, never followed",
        "status.json: a FIFO is in a file's place; skipped, never followed",
    ]
    assert all(w.startswith("testhost:") for w in warnings)
    copied = {p.name: p.read_bytes() for p in (tmp_path / "mirror").iterdir() if p.is_file()}
    assert set(copied) == {"remote.json"} and not any(b"SECRET" in v for v in copied.values())


def test_a_replaced_file_over_the_cap_is_skipped_with_a_warning(sshd, ssh_home, tmp_path):
    from multilane.engine.remote.connection import Connection
    from multilane.engine.remote.mirror import RemoteMirror

    folder = run_folder(sshd.runs, "capped")
    (folder / "config.json").write_bytes(b"{" + b" " * 5000 + b"}")
    with Connection("testhost") as conn:
        mirror = RemoteMirror(conn, str(folder), tmp_path / "mirror")
        mirror.max_whole = 4096
        mirror.sync()
    assert mirror.warnings == [f"testhost:{folder}/config.json: 5,002 bytes, more than the 4,096 copied whole; skipped"]
    assert not (tmp_path / "mirror" / "config.json").exists()
    assert (tmp_path / "mirror" / "status.json").read_bytes() == (folder / "status.json").read_bytes()


def test_a_large_metrics_file_streams_in_bounded_chunks_with_progress_and_the_status_waits(sshd, ssh_home, tmp_path):
    from multilane.engine.remote.connection import Connection
    from multilane.engine.remote.mirror import RemoteMirror

    folder = run_folder(sshd.runs, "large", state="finished")
    line = b'{"kind": "train", "step": 1, "loss": 0.5, "pad": "' + b"x" * 200 + b'"}\n'
    body = (line * (3 * (1 << 20) // len(line) + 1))[: 3 << 20]  # 3 MB, standing in for 500 MB with a lowered chunk
    (folder / "metrics.jsonl").write_bytes(body)
    with Connection("testhost") as conn:
        mirror = RemoteMirror(conn, str(folder), tmp_path / "mirror")
        mirror.chunk, mirror.budget = 64 << 10, 1 << 20
        conn.sftp()  # the SFTP session's own set-up is not the copy's memory
        tracemalloc.start()
        try:
            progress = []
            for _ in range(10):
                mirror.sync()
                progress.append(mirror.catching_up)
                if mirror.catching_up:  # behind: the final status is held back until the records are in
                    assert not (tmp_path / "mirror" / "status.json").exists()
                else:
                    break
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert progress == ["catching up metrics.jsonl: 1.0 / 3.0 MB", "catching up metrics.jsonl: 2.0 / 3.0 MB", None]
    assert (tmp_path / "mirror" / "metrics.jsonl").read_bytes() == body
    assert json.loads((tmp_path / "mirror" / "status.json").read_text())["state"] == "finished"
    assert peak < 1 << 20, f"{peak / 2**20:.2f} MB held while copying a 3 MB file in 64 KB chunks"
