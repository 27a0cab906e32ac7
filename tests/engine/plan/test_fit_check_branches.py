"""A layer only some samples reach (task_files/branch_kinds.py: an optional layer, or a mixture whose experts
only some samples pick), with the fit check on: every strategy trains it exactly as one device does, in
float64, or refuses it in one line before step 1.

With the run's seed 1 and uneven shares the data puts the branch's samples on some lanes' shards and never
on the first lane's, and three of the six steps hold none at all (the layer keeps no gradient there, as on
one device). The fit check's probe takes the run's own steps (engine/plan/probe.py drives the strategy's
``train_step``): under ddp it finds the parameters a rank reaches as the ddp trainer does, so what the run
trains the probe measures; under fsdp, whose units' collectives every rank must enter, the check runs each rank's shard of
the first micro-batches and refuses the model before any rank starts (engine/fsdp/reach.py), and a run
without the check stops at its first such step with the same line, never torch's abort.
"""

from __future__ import annotations

import itertools
import json
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import CLI, TASK_FILES
from multilane.engine.config import build_config
from multilane.engine.data.loader import build_loader
from multilane.engine.distributed.worker import probe_loop
from multilane.engine.errors import UserError
from multilane.engine.fsdp.reach import check_shards, first_difference
from multilane.engine.fsdp.units import default_units
from multilane.engine.parallel import chunk_sizes
from multilane.engine.plan.fit import plan_run
from multilane.engine.run.trainer import Trainer
from multilane.engine.rundir.runlog import read_metrics
from multilane.engine.tasks import ArrayData, Task, make_task
from multilane.engine.telemetry.devices import parse_devices
from torch import nn

BRANCH = str(TASK_FILES / "branch_kinds.py")
BOUND = 1e-10
REFUSAL = "devices.strategy = fsdp cannot train this model: a layer only some samples reach ("
REFUSED = {  # what each kind's refusal names
    "branch": "'extra' runs on rank 1's shard of micro-batch 1 but not on rank 0's",
    "experts": "'experts.1' runs on rank 1's shard of micro-batch 1 but not on rank 0's",
    "output": "'extra.weight' gets a gradient from rank 1's shard of micro-batch 1 but not from rank 0's",
}
KINDS = list(REFUSED)


@pytest.fixture(autouse=True)
def _fit_check_on(monkeypatch):
    monkeypatch.setenv("MULTILANE_FIT_CHECK", "1")


def settings(tmp_path: Path, kind: str, strategy: str, weights: list[int]) -> dict:
    return {
        "task": {"name": BRANCH, "params": {"kind": kind}},
        "data": {"batch_size": 11, "val_fraction": 0.0, "workers": 0},
        "optim": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "train": {"steps": 6, "log_every": 1, "seed": 1, "fit_check": True},
        "devices": {"use": ",".join(f"cpu:{i}" for i in range(len(weights))), "strategy": strategy, "weights": weights},
        "telemetry": {"enabled": False},
        "run": {"runs_dir": str(tmp_path / strategy), "name": strategy},
    }


def shards_taking_the_branch(cfg: dict) -> list[list[bool]]:
    """For each of the run's steps, whether each lane's shard holds a sample that takes the branch."""
    config = build_config(cfg)
    weights = config.devices.weights
    loader = build_loader(make_task(BRANCH, cfg["task"]["params"]), config, None)
    loader.start(0, config.train.steps)
    try:
        out = []
        for _ in range(config.train.steps):
            x, _, size = loader.next()
            edges = torch.tensor([0, *chunk_sizes(size, len(weights), weights)]).cumsum(0).tolist()
            out.append([bool((x[a:b, 0] > 2).any()) for a, b in itertools.pairwise(edges)])
        return out
    finally:
        loader.close()


def one_device(tmp_path: Path, cfg: dict) -> tuple[dict, list[float]]:
    """The reference: the same run on one device."""
    cfg = {**cfg, "devices": {"use": "cpu:0"}, "run": {"runs_dir": str(tmp_path / "ref"), "name": "ref"}}
    trainer = Trainer(build_config(cfg), task=make_task(BRANCH, cfg["task"]["params"]))
    result = trainer.run()
    assert result.status == "finished", result.message
    return trainer.model.state_dict(), losses(result.run_dir)


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run) if r["kind"] == "train"]


def assert_equal(state: dict, ref_state: dict, got: list[float], ref: list[float], what: str) -> None:
    assert len(got) == len(ref) == 6, what
    for a, b in zip(got, ref, strict=True):
        assert abs(a - b) <= BOUND * abs(b), f"{what}: losses {got} != {ref}"
    for key, b in ref_state.items():
        a = state[key].double()
        diff = float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))
        assert diff <= BOUND, f"{what}: {key} differs by {diff:.2e}"


def test_the_chosen_data_puts_the_branch_on_some_shards_and_never_on_the_first():
    """The premise of every test here, from the engine's own loader."""
    for weights in ([1, 3], [1, 1, 3]):
        took = shards_taking_the_branch(settings(Path("."), "branch", "replicate", weights))
        assert not any(step[0] for step in took), took  # the first lane's shard never takes it
        assert any(len(set(step)) > 1 for step in took), took  # some step: some shards take it, others not
        assert any(not any(step) for step in took), took  # some step: no shard does (no gradient at all)


@pytest.mark.parametrize("kind", KINDS)
def test_the_fsdp_check_refuses_before_any_rank_starts_naming_the_layer_and_the_strategies_that_train_it(kind):
    cfg = build_config(settings(Path("."), kind, "fsdp", [1, 3]))
    task = make_task(BRANCH, {"kind": kind})
    with pytest.raises(UserError) as e:
        check_shards(cfg, task, default_units, 2, torch.device("cpu"))
    line = str(e.value)
    assert line.startswith(REFUSAL + REFUSED[kind]), line
    assert '"ddp", "replicate" or "persistent"' in line and "\n" not in line
    cfg.devices.weights = []
    check_shards(cfg, task, default_units, 1, torch.device("cpu"))  # one rank: nothing to differ


def test_where_the_ranks_units_first_part():
    assert first_difference([[0, 1, 2], [0, 1, 2]]) is None
    assert first_difference([[0, 1, 2], [0, 2]]) == (1, 0, 1)  # unit 1 ran on rank 0, not on rank 1
    assert first_difference([[0, 2], [0, 1, 2]]) == (1, 1, 0)  # rank 0 went on to unit 2 without it
    assert first_difference([[0], [0, 1]]) == (1, 1, 0)  # rank 0's forward ended first
    assert first_difference([[0, 3, 4], [0, 2, 4], [0, 4]]) == (2, 1, 0)  # three ranks, three paths


class Broken(Task):
    """A task whose forward fails: the probe's step, the run's own, fails the same way."""

    name = "broken"

    def build_model(self) -> nn.Module:
        return _Broken()

    def data(self) -> ArrayData:
        return ArrayData(torch.randn(16, 3), torch.randn(16, 1))

    def loss(self, output, target):
        return ((output - target) ** 2).mean()


class _Broken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)

    def forward(self, x):
        raise ValueError("the task's forward failed")


def test_a_probe_step_that_fails_is_one_line_naming_the_task_the_error_and_the_way_to_skip_the_check():
    cfg = build_config({"task": {"name": "mlp"}, "data": {"batch_size": 8}, "devices": {"strategy": "replicate"}})
    with pytest.raises(UserError) as e:
        plan_run(cfg, Broken(), parse_devices("cpu:0,cpu:1"), Trainer.for_probe)
    line = str(e.value)
    assert "\n" not in line and line.startswith("task broken: the fit check's probe step failed at "), line
    assert "ValueError" in line and "the task's forward failed" in line and "train.fit_check = false" in line, line


BROKEN_FILE = """
import torch
from multilane.engine.tasks import ArrayData, Task
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 1)

    def forward(self, x):
        raise ValueError("the task's forward failed")


class Broken(Task):
    name = "broken"

    def build_model(self):
        return Model()

    def data(self):
        return ArrayData(torch.randn(16, 3), torch.randn(16, 1))

    def loss(self, output, target):
        return ((output - target) ** 2).mean()
"""


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_process_strategys_probe_step_that_fails_is_one_line_exit_2_and_no_run_folder(tmp_path, strategy):
    task = tmp_path / "broken.py"
    task.write_text(BROKEN_FILE)
    runs = tmp_path / "runs"
    r = subprocess.run(
        [*CLI, "train", "--task", str(task), "--devices", "cpu:0,cpu:1", "--strategy", strategy, "--batch-size", "8",
         "--steps", "2", "--runs-dir", str(runs)],
        capture_output=True, text=True, timeout=240, env={**__import__("os").environ, "MULTILANE_FIT_CHECK": "1"},
    )  # fmt: skip
    lines = [x for x in r.stderr.splitlines() if x.strip() and "USDT" not in x]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("multilane: error: task broken: the fit check's probe step failed at "), lines
    assert "ValueError: the task's forward failed" in lines[0] and f"strategy {strategy}" in lines[0], lines
    assert not runs.exists() or not any(runs.iterdir())


def test_plan_under_ddp_steps_a_layer_only_some_samples_reach(tmp_path):
    """The probe under ddp (a rank's step on a group of one, as the ddp trainer takes it): the layer that its
    first batch does not reach keeps DDP from waiting for its gradient; ``multilane plan`` forecasts.
    Unmarked though it can take 3-6 s on the busy 2-core machine: the fast tier's run of the ddp probe (in a
    process of its own: a Gloo group in the test's process is a hazard for later forks, test_rank_in_process)."""
    r = subprocess.run(
        [*CLI, "plan", "--task", BRANCH, "--devices", "cpu:0,cpu:1", "--strategy", "ddp", "--batch-size", "11", "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads(r.stdout.splitlines()[-1])
    assert plan["strategy"] == "ddp" and plan["needs"], plan


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["replicate", "persistent"])
@pytest.mark.parametrize("kind", KINDS)
def test_lanes_train_a_layer_only_some_samples_reach_exactly_with_the_fit_check_on(tmp_path, strategy, kind):
    cfg = settings(tmp_path, kind, strategy, [1, 1, 3])
    ref_state, ref = one_device(tmp_path, cfg)
    trainer = Trainer(build_config(cfg), task=make_task(BRANCH, cfg["task"]["params"]))
    result = trainer.run()
    assert result.status == "finished", result.message
    assert trainer.forecast is not None  # the check ran
    assert_equal(trainer.model.state_dict(), ref_state, losses(result.run_dir), ref, f"{strategy} {kind}")


def launch(tmp_path: Path, cfg: dict, fit_check: bool = True) -> subprocess.CompletedProcess:
    path = tmp_path / "run.json"
    path.write_text(json.dumps(cfg))
    env = {**__import__("os").environ, "MULTILANE_FIT_CHECK": "1" if fit_check else "0"}
    return subprocess.run([*CLI, "train", "--config", str(path)], capture_output=True, text=True, timeout=240, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_ddp_trains_a_layer_only_some_samples_reach_exactly_with_the_fit_check_on(tmp_path, kind):
    cfg = settings(tmp_path, kind, "ddp", [1, 3])
    ref_state, ref = one_device(tmp_path, cfg)
    r = launch(tmp_path, cfg)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "forecast" in r.stdout + r.stderr  # the check ran, and no traceback
    (run,) = [p for p in (tmp_path / "ddp").iterdir() if p.is_dir()]
    state = torch.load(run / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert_equal(state, ref_state, losses(run), ref, f"ddp {kind}")


@pytest.mark.slow
def test_ddp_trains_exactly_a_branch_every_rank_takes_at_step_1_and_one_rank_skips_at_step_2(tmp_path):
    """Every rank reaches every parameter at step 1: DDP, left without ``find_unused_parameters``, would wait
    at step 2 for the gradient one rank never makes (a hang until the collective timeout). The ranks note
    what their backwards reach for their first steps (RankRules.reduce_probe), so step 2 finds it."""
    cfg = settings(tmp_path, "branch", "ddp", [1, 1])
    cfg["task"]["params"]["rare"] = 8
    cfg["train"]["seed"] = 4
    took = shards_taking_the_branch(cfg)
    assert took[0] == [True, True] and took[1] == [True, False], took  # the premise
    ref_state, ref = one_device(tmp_path, cfg)
    r = launch(tmp_path, cfg)
    assert r.returncode == 0, r.stderr[-3000:]
    (run,) = [p for p in (tmp_path / "ddp").iterdir() if p.is_dir()]
    state = torch.load(run / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert_equal(state, ref_state, losses(run), ref, "ddp, the branch parting at step 2")


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_fsdp_refuses_a_layer_only_some_samples_reach_in_one_line_before_any_rank_starts(tmp_path, kind):
    r = launch(tmp_path, settings(tmp_path, kind, "fsdp", [1, 3]))
    lines = [x for x in r.stderr.splitlines() if x.strip() and "USDT" not in x]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith(f"multilane: error: {REFUSAL}{REFUSED[kind]}"), lines
    assert not (tmp_path / "fsdp").exists() or not any((tmp_path / "fsdp").iterdir())  # no run folder


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["branch", "output"])
def test_fsdp_without_the_check_stops_at_the_first_step_the_ranks_part_with_that_line_not_an_abort(tmp_path, kind):
    """The ranks agree on each unit before its all-gather, and on the parameters each loss reaches before its
    backward, in their first steps (reach.py ``UnitGuard``): the first step where one rank's shard takes the
    branch and another's does not fails there with the line, before any collective went astray."""
    r = launch(tmp_path, settings(tmp_path, kind, "fsdp", [1, 3]), fit_check=False)
    assert r.returncode != 0
    for abort in ("SIGABRT", "Fatal Python error", "EnforceNotMet", "Traceback"):
        assert abort not in r.stderr, r.stderr[-3000:]
    last = [x for x in r.stderr.splitlines() if x.startswith("failed: ")]
    assert last and "step 1: UnitMismatch: " + REFUSAL in last[-1], r.stderr[-3000:]
    assert REFUSED[kind].replace("micro-batch 1", "this step") in last[-1], last[-1]
    (run,) = [p for p in (tmp_path / "fsdp").iterdir() if p.is_dir()]
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed" and REFUSAL in status["message"], status


class DictInputs(Task):
    """A model that takes its inputs by name: every strategy's probe calls it as the run's step does."""

    name = "dictinputs"

    def build_model(self) -> nn.Module:
        return _DictInputs()

    def data(self) -> ArrayData:
        g = torch.Generator().manual_seed(1)
        inputs = {"x": torch.randn(40, 8, generator=g), "z": torch.randn(40, 3, generator=g)}
        return ArrayData(inputs, torch.randn(40, 4, generator=g))

    def loss(self, output, target):
        return ((output - target) ** 2).mean()


class _DictInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(3, 4)

    def forward(self, x, z):
        return self.a(x) + self.b(z)


@pytest.mark.slow
def test_the_fsdp_probe_steps_a_model_with_named_inputs_as_its_rank_does():
    cfg = build_config({"task": {"name": "mlp"}, "data": {"batch_size": 8}, "devices": {"strategy": "fsdp"}})
    forecast = plan_run(cfg, DictInputs(), parse_devices("cpu:0,cpu:1"), probe_loop)
    assert forecast.strategy == "fsdp" and forecast.needs[0].need > 0, forecast
