"""Every worker of one study proposes its own parameters, with or without --seed: each trial's sampler is
seeded from the study's seed and the trial's number (engine/sweep/sampling.py). Workers here are real
processes asking one study (its journal) at the same time, as `sweep` and `sweep-worker` do."""

import json
import subprocess
import sys

import pytest

PARAMS = ["optim.lr=log:1e-4:1e-1", "task.params.hidden=int:8:128"]

WORKER = """
import json, sys
from multilane.engine.sweep.study import Sweep
sweep = Sweep.open(sys.argv[1])
sys.stdin.readline()  # every worker starts asking at the same moment
out = {}
for _ in range(int(sys.argv[2])):
    trial, params = sweep.ask()
    sweep.study.tell(trial, params["optim.lr"])
    out[trial.number] = params
print(json.dumps(out))
"""


def _sweep(tmp_path, sampler="tpe", seed=None, name="s"):
    from multilane.engine.sweep.space import parse_params
    from multilane.engine.sweep.spec import SweepSpec
    from multilane.engine.sweep.study import Sweep

    spec = SweepSpec(
        task="digits", params=parse_params(PARAMS, "digits"), trials=9, sampler=sampler, seed=seed, name=name
    )
    return Sweep.create(spec, tmp_path)


def _ask_in_workers(folder, workers: int, each: int) -> dict[int, dict]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(folder), str(each)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(workers)
    ]
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    got: dict[int, dict] = {}
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0
        got.update({int(k): v for k, v in json.loads(out).items()})
    return got


def _in_order(sweep, n: int) -> dict[int, dict]:
    out = {}
    for _ in range(n):
        trial, params = sweep.ask()
        sweep.study.tell(trial, params["optim.lr"])
        out[trial.number] = params
    return out


@pytest.mark.parametrize("seed", [None, 11])
def test_two_workers_of_one_study_in_one_process_propose_distinct_parameters(tmp_path, seed):
    from multilane.engine.sweep.study import Sweep

    first = _sweep(tmp_path, seed=seed)
    second = Sweep.open(first.folder)  # its own sampler, as another worker builds it
    seen = []
    for _ in range(4):
        for w in (first, second):
            trial, params = w.ask()
            seen.append(tuple(params.values()))
            w.study.tell(trial, 1.0)
    assert len(set(seen)) == len(seen) == 8


@pytest.mark.parametrize("sampler", ["tpe", "random"])
def test_the_same_seed_gives_the_same_parameters_per_trial_number_with_one_worker_or_three(tmp_path, sampler):
    # One worker asking 9 trials in order, and three worker processes asking 3 each at once, on two
    # studies of the same seed: trial n has the same parameters in both (TPE's first 10 trials are its
    # seeded random start-up), and no two trials share parameters.
    alone = _in_order(_sweep(tmp_path / "a", sampler, seed=5), 9)
    together = _ask_in_workers(_sweep(tmp_path / "b", sampler, seed=5).folder, 3, 3)
    assert sorted(together) == list(range(9))
    assert together == alone
    assert len({tuple(p.values()) for p in together.values()}) == 9
    other = _in_order(_sweep(tmp_path / "c", sampler, seed=6), 9)
    assert all(other[n] != alone[n] for n in range(9))


@pytest.mark.slow
def test_three_worker_processes_without_a_seed_propose_distinct_parameters(tmp_path):
    got = _ask_in_workers(_sweep(tmp_path).folder, 3, 3)
    assert sorted(got) == list(range(9))
    assert len({tuple(p.values()) for p in got.values()}) == 9


TAKER = """
import json, sys
from multilane.engine.sweep.study import Sweep
sweep = Sweep.open(sys.argv[1])
sys.stdin.readline()  # every worker starts asking at the same moment
taken = []
while (asked := sweep.ask(target=int(sys.argv[2]))) is not None:
    taken.append(asked[0].number)  # left running, as a trial that trains: it counts toward the target
print(json.dumps(taken))
"""


def test_workers_of_one_machine_asking_at_once_never_take_more_trials_than_the_target(tmp_path):
    # The count and the ask happen under one lock of this machine: four worker processes that start at
    # the same moment take exactly the target between them (the count read outside the lock let two
    # workers both take the last trial: a PostgreSQL sweep with a worker ran 4 trials of 3).
    folder = _sweep(tmp_path).folder
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TAKER, str(folder), "5"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    taken = [n for p in procs for n in json.loads(p.communicate(timeout=120)[0])]
    assert sorted(taken) == list(range(5))
