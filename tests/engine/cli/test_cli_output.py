"""What the ``multilane`` command prints: help with defaults, typos, fast config errors, honest timing,
and progress lines that end with the run's last validation, whole, off a terminal."""

import re
import subprocess
import sys
import time

import pytest
from helpers import CLI


def multilane(*args, timeout=300):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def test_help_shows_each_options_default_and_version():
    r = multilane("train", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    for option, default in (("--batch-size", "64"), ("--lr", "0.003"), ("--optimizer", "adam"), ("--epochs", "5")):
        assert re.search(rf"{option} \S+ .*?\(default: {re.escape(default)}\)", text), option
    assert "learning rate" in text and "global batch" in text
    v = multilane("--version")
    assert v.returncode == 0 and v.stdout.strip() == "multilane 0.1.0"


def test_a_mistyped_option_suggests_the_right_one_and_a_prefix_is_not_taken():
    r = multilane("train", "--epoch", "3")
    assert r.returncode == 2
    assert "unrecognized arguments: --epoch 3; did you mean --epochs?" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = multilane("export", "RUN", "--out", "x", "--form", "png")
    assert r.returncode == 2 and "did you mean --format?" in r.stderr


def test_a_config_error_shows_before_torch_is_imported(tmp_path):
    code = (
        "import sys; from multilane.engine.cli import main; rc = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    t = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-c", code, "train", "--set", "train.steps=-3", "--runs-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "train.steps = -3" in r.stderr, r.stderr
    assert "torch imported" not in r.stderr
    assert time.monotonic() - t < 30  # seconds at worst on a loaded machine; ~0.3 s alone


@pytest.mark.slow
def test_off_a_terminal_progress_lines_are_whole_and_the_last_has_the_final_validation(tmp_path):
    r = multilane(
        *("train", "--task", "linear", "--steps", "40", "--devices", "cpu:0,cpu:1", "--runs-dir", str(tmp_path)),
        *("--set", "train.eval_every=15", "--set", "train.log_every=5"),
    )
    assert r.returncode == 0, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[0] == "linear on cpu:0,cpu:1: 40 steps from step 0"
    last = lines[-1]
    assert last.startswith("step 40/40 · loss ") and "…" not in r.stderr
    final_val = re.search(r"validation loss (\d+\.\d+)", r.stdout).group(1)
    assert f"val {float(final_val):.4f}" in last  # the summary's validation, not the one of step 30
    head = r.stdout.splitlines()[0]
    m = re.fullmatch(
        r"finished: step 40/40 · training (\d+\.\d) s · (\d+\.\d) s in all \((\d+\.\d) s to the first step: "
        r"imports, data, model\)",
        head,
    )
    assert m, head
    training, total, first = (float(g) for g in m.groups())
    assert training <= total and first <= total and abs(training + first - total) <= 0.2
