"""The command's small traps a newcomer meets in the first hour: resuming a run that is done, a misspelt
key, a task class missing a method, a task file that is not there (said before torch loads), and a ddp or
fsdp run's lines (each rank's device, the time in all)."""

import hashlib
import subprocess
import sys

import pytest
from helpers import CLI, TESTS
from multilane.engine.errors import UserError
from multilane.engine.tasks import make_task
from multilane.engine.tasks.loader import load_task_file


def multilane(*args, timeout=300):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def folder_bytes(run):
    return {p.relative_to(run): hashlib.sha256(p.read_bytes()).hexdigest() for p in run.rglob("*") if p.is_file()}


def test_resuming_a_finished_run_says_so_and_how_to_go_on_and_writes_nothing(tmp_path):
    r = multilane("train", "--task", "linear", "--steps", "3", "--devices", "cpu:0", "--runs-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    before = folder_bytes(run)
    for more in ((), ("--steps", "2"), ("--steps", "3", "--devices", "cpu:0,cpu:1")):
        r = multilane("train", "--resume", str(run), *more)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.strip().splitlines()
        assert len(lines) == 1, r.stdout
        assert "nothing to train" in lines[0] and "--steps N (N > 3)" in lines[0], lines[0]
        assert ("finished at step 3/3" if "2" not in more else "past its budget of 2 steps") in lines[0]
        assert folder_bytes(run) == before, more  # no event appended, no status rewritten
    r = multilane("train", "--resume", str(run), "--steps", "5")
    assert r.returncode == 0 and "finished: step 5/5" in r.stdout, r.stdout + r.stderr


def test_a_misspelt_task_key_names_the_nearest_known_one_in_full():
    with pytest.raises(UserError, match=r"task\.params\.contxt: unknown key; did you mean task\.params\.context\?"):
        make_task("charlm", {"contxt": 3})
    r = multilane("train", "--task", "linear", "--set", "train.stesp=3")
    assert r.returncode == 2 and "did you mean train.steps?" in r.stderr, r.stderr


def test_a_task_class_missing_a_method_is_told_which(tmp_path):
    path = tmp_path / "half.py"
    path.write_text(
        "from multilane.engine.tasks import Task\n"
        "class Half(Task):\n"
        "    def data(self):\n        return None\n"
        "    def loss(self, output, target):\n        return output\n"
    )
    with pytest.raises(UserError, match=r"half\.py: Half does not define build_model"):
        load_task_file(path)


@pytest.mark.parametrize(
    "command",
    [
        ("train", "--task", "{missing}"),
        ("plan", "--task", "{missing}"),
        ("sweep", "--task", "{missing}", "--param", "optim.lr=log:1e-4:1e-1"),
    ],
)
def test_a_task_file_that_is_not_there_is_refused_before_torch_is_imported(tmp_path, command):
    missing = str(tmp_path / "no_such_task.py")
    code = (
        "import sys; from multilane.engine.cli import main; rc = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    argv = [a.format(missing=missing) for a in command]
    r = subprocess.run(
        [sys.executable, "-c", code, *argv, "--runs-dir", str(tmp_path / "runs")]
        if command[0] == "train"
        else [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == f"multilane: error: task file {missing}: no such file", r.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_rank_runs_lines_show_every_ranks_device_and_the_time_in_all(tmp_path, strategy):
    r = multilane(
        *("train", "--task", "mlp", "--strategy", strategy, "--devices", "cpu:0,cpu:1", "--steps", "200"),
        *("--runs-dir", str(tmp_path), "--set", "telemetry.record_s=0.2"),
    )
    assert r.returncode == 0, r.stderr
    progress = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("step 200/200")]
    assert progress and "vm/rank0/cpu:0" in progress[-1] and "vm/rank1/cpu:1" in progress[-1], r.stdout + r.stderr
    (finish,) = [line for line in r.stdout.splitlines() if line.startswith("finished: step 200/200")]
    assert " s in all (" in finish and "to the first step" in finish, finish


assert TESTS  # the tests' folder is importable (helpers)
