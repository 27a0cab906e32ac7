"""The search space from the config schema: every bad --param spec is one line; the same seed proposes the
same parameters (real Optuna samplers, asked directly: no training needed to see what they propose)."""

import pytest
from multilane.engine.errors import UserError
from multilane.engine.sweep.space import parse_param
from sweep_helpers import sweep_cli, sweep_folder


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("optim.lr", "expected KEY=log:LOW:HIGH"),
        ("optim.lr=exp:1:2", "unknown kind 'exp'"),
        ("optim.lr=log:0:1", "log range needs LOW > 0"),
        ("optim.lr=float:0.1:0.01", "LOW must be below HIGH"),
        ("optim.lr=float:0.1", "needs LOW:HIGH"),
        ("optim.lr=float:a:1", "'a' is not a number"),
        ("optim.lr=float:1e-3:nan", "not a finite number"),
        ("optim.lr=log:1e-4:20", "optim.lr = 20"),  # the schema's own bound (lr <= 10)
        ("optim.lrr=log:1e-4:1e-1", "did you mean optim.lr?"),
        ("optim.name=choice:sgd,adamx", "'adamx' is not one of sgd, adam, adamw"),
        ("optim.name=float:1:2", "is not a number"),
        ("optim.name=choice:", "choice needs values"),
        ("optim.name=choice:sgd,sgd", "listed twice"),
        ("data.batch_size=int:1.5:8", "whole numbers"),
        ("data.batch_size=int:0:8", "data.batch_size = 0"),
        ("task.params.hidden=int:0:8", "task.params.hidden = 0"),
        ("task.params.widthh=int:1:8", "not a config key"),
        ("task.hidden=int:1:8", "task.params.NAME"),
        ("devices.use=choice:cpu:0", "not what it learns"),
        ("run.name=choice:a,b", "not what it learns"),
        ("lr=log:1e-4:1", "section.name"),
        ("nosuch.key=int:1:2", "not a config key"),
        ("task.name=choice:digits,mlp", "task.params.NAME"),
    ],
)
def test_a_bad_param_spec_is_one_line_naming_it(spec, says):
    with pytest.raises(UserError) as e:
        parse_param(spec, "digits")
    line = str(e.value)
    assert says in line and "\n" not in line
    assert line.startswith("--param ")


def test_good_specs_take_the_schema_types():
    assert parse_param("optim.lr=log:1e-4:1e-1").kind == "log"
    assert parse_param("train.grad_clip=float:0:5").whole is False
    batch = parse_param("data.batch_size=float:16:128")  # an int field: drawn as whole numbers
    assert batch.whole and batch.grid()[:2] == [16, 17]
    assert parse_param("optim.name=choice:sgd,adam").choices == ("sgd", "adam")
    assert parse_param("optim.nesterov=choice:true,false").choices == (True, False)
    assert parse_param("task.params.width=int:8:64", "mlp").whole


@pytest.mark.slow
def test_bad_specs_on_the_command_line_are_one_line_and_exit_2(tmp_path):
    for args in (["--param", "optim.lr=log:0:1"], ["--param", "x=1"], []):
        r = sweep_cli("sweep", "--devices", "cpu:0", "--sweeps-dir", str(tmp_path), *args, timeout=600)
        assert r.returncode == 2
        assert r.stderr.startswith("multilane: error: ") and r.stderr.count("\n") == 1, r.stderr
    assert not any(tmp_path.iterdir())  # nothing made for a sweep that never started
    r = sweep_cli("sweep", "--devices", "cpu:0,cpu:1,cpu:2", "--per-trial", "2", "--param", "optim.lr=log:1e-3:1e-2",
                  "--sweeps-dir", str(tmp_path), timeout=600)  # fmt: skip
    assert r.returncode == 2 and "left over" in r.stderr


def _proposals(tmp_path, sampler: str, seed: int, name: str) -> list[dict]:
    from multilane.engine.sweep.space import parse_params
    from multilane.engine.sweep.spec import SweepSpec
    from multilane.engine.sweep.study import Sweep

    params = parse_params(
        ["optim.lr=log:1e-4:1e-1", "task.params.hidden=int:8:128", "optim.name=choice:sgd,adam"], "digits"
    )
    spec = SweepSpec(task="digits", params=params, trials=6, sampler=sampler, seed=seed, name=name)
    sweep = Sweep.create(spec, tmp_path)
    out = []
    for _ in range(6):
        trial = sweep.study.ask()
        out.append({p.key: p.suggest(trial) for p in params})
        sweep.study.tell(trial, 1.0)
    return out


@pytest.mark.parametrize("sampler", ["tpe", "random"])
def test_the_same_seed_proposes_the_same_parameters(tmp_path, sampler):
    a = _proposals(tmp_path, sampler, 3, "a")
    b = _proposals(tmp_path, sampler, 3, "b")
    c = _proposals(tmp_path, sampler, 4, "c")
    assert a == b
    assert a != c


@pytest.mark.slow
def test_a_combination_the_config_refuses_is_a_failed_trial_not_a_stuck_sweep(tmp_path):
    # Each value is valid alone; with the base's SGD + Nesterov, momentum 0 is refused for that trial only.
    r = sweep_cli(
        "sweep", "--devices", "cpu:0", "--trials", "2", "--sweeps-dir", str(tmp_path), "--set", "optim.name=sgd",
        "--set", "optim.nesterov=true", "--param", "optim.momentum=choice:0.0", timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("failed") >= 2 and "nesterov needs momentum > 0" in r.stdout
    assert "2 of 2 trials done" in r.stdout
    folder = sweep_folder(tmp_path)
    assert not list(folder.glob("trial-*"))  # no process started for a config that cannot run


def test_a_grid_sweep_visits_every_combination_once_through_ask_and_tell(tmp_path):
    # Optuna's GridSampler stops the study when the grid is done, which fails outside study.optimize:
    # the sweep's slots ask and tell, so the grid is enqueued whole.
    from multilane.engine.sweep.space import parse_params
    from multilane.engine.sweep.spec import SweepSpec
    from multilane.engine.sweep.study import Sweep

    params = parse_params(["optim.name=choice:sgd,adam", "task.params.hidden=int:8:10"], "digits")
    sweep = Sweep.create(SweepSpec(task="digits", params=params, trials=6, sampler="grid", seed=0), tmp_path)
    seen = []
    for _ in range(6):
        trial = sweep.study.ask()
        seen.append(tuple(p.suggest(trial) for p in params))
        sweep.study.tell(trial, 1.0)
    assert sorted(seen) == sorted((a, b) for a in ("sgd", "adam") for b in (8, 9, 10))
