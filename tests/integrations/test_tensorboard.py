"""TensorBoard out (``train.tensorboard = true``) and in (a logdir read into the app), with TensorBoard's own code."""

import subprocess
import sys

import pytest
from helpers import CLI
from multilane.engine.rundir.runlog import read_metrics
from multilane.integrations.tensorboard import TensorBoardLogdir
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter


def scalars(logdir) -> dict[str, dict[int, list[float]]]:
    """Every scalar TensorBoard's own EventAccumulator reads: tag -> step -> values."""
    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    ea.Reload()
    out: dict[str, dict[int, list[float]]] = {}
    for tag in ea.Tags()["scalars"]:
        for e in ea.Scalars(tag):
            out.setdefault(tag, {}).setdefault(e.step, []).append(e.value)
    return out


def f32(x: float) -> float:
    return pytest.approx(x, rel=1e-6, abs=1e-30)  # TensorBoard keeps scalars as float32


@pytest.mark.slow
def test_a_runs_tensorboard_files_read_back_to_its_records(tmp_path):
    runs = tmp_path / "runs"
    args = [*CLI, "train", "--task", "mlp", "--steps", "60", "--devices", "cpu:0,cpu:1", "--runs-dir", str(runs)]
    sets = ("train.tensorboard=true", "train.log_every=3", "train.eval_every=20", "telemetry.record_s=0.1")
    for s in (*sets, "health.every=6"):
        args += ["--set", s]
    r = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    (run,) = runs.iterdir()
    assert list(run.glob("events.out.tfevents.*")), "event files in the run folder itself"
    recs = read_metrics(run)
    tb = scalars(run)
    train = [x for x in recs if x["kind"] == "train"]
    assert len(train) == 20
    for rec in train:
        assert tb["train/loss"][rec["step"]] == [f32(rec["loss"])]
        assert tb["train/lr"][rec["step"]] == [f32(rec["lr"])]
        for dev, v in rec["device_loss"].items():
            assert tb[f"train/device_loss/{dev}"][rec["step"]] == [f32(v)]
    evals = [x for x in recs if x["kind"] == "eval"]
    assert evals
    for rec in evals:
        assert tb["val/loss"][rec["step"]] == [f32(rec["val_loss"])]
        for name, v in rec["metrics"].items():
            assert tb[f"val/{name}"][rec["step"]] == [f32(v)]
    tele = [x for x in recs if x["kind"] == "telemetry"]
    assert tele, "a run of 60 steps samples its devices"
    busy = sorted(
        x["devices"]["cpu:0"]["busy_pct"]["mean"] for x in tele if "busy_pct" in x["devices"].get("cpu:0", {})
    )
    got = sorted(v for vs in tb["telemetry/busy_pct/cpu:0"].values() for v in vs)
    assert busy and got == [f32(b) for b in busy]
    # Multilane's own reader of a logdir gives the same records back
    reader = TensorBoardLogdir(run)
    back = reader.read() + reader.read()
    back_train = [x for x in back if x["kind"] == "train"]
    assert [x["step"] for x in back_train] == [x["step"] for x in train]
    for mine, orig in zip(back_train, train, strict=True):
        assert mine["loss"] == f32(orig["loss"]) and mine["device_loss"] == {
            k: f32(v) for k, v in orig["device_loss"].items()
        }
    assert [(x["step"], x["val_loss"]) for x in back if x["kind"] == "eval"] == [
        (x["step"], f32(x["val_loss"])) for x in evals
    ]
    # the noise scale and the per-layer health, out and back
    noisy = [x for x in train if (x.get("noise") or {}).get("b_simple") is not None]
    assert noisy
    for rec in noisy:
        assert tb["train/noise_scale"][rec["step"]] == [f32(rec["noise"]["b_simple"])]
    health = [x for x in recs if x["kind"] == "health"]
    back_health = [x for x in back if x["kind"] == "health"]
    assert [x["step"] for x in health] == list(range(6, 61, 6)) == [x["step"] for x in back_health]
    for mine, orig in zip(back_health, health, strict=True):
        assert mine["rows"] == orig["rows"] and mine["act_rows"] == orig["act_rows"]
        for key in ("grad_norm", "weight_norm", "update_ratio", "act_mean", "act_std", "act_zero"):
            assert mine[key] == [f32(v) for v in orig[key]], key


def snapshot(folder) -> dict:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def test_a_logdir_written_live_is_followed_and_never_written_to(tmp_path):
    logdir = tmp_path / "tb"
    w = SummaryWriter(str(logdir))
    for step in range(5):
        w.add_scalar("Loss/train", 1.0 / (step + 1), step)
        w.add_scalar("Loss/val", 2.0 / (step + 1), step)
        w.add_scalar("accuracy", step / 10, step)
        w.add_scalar("learning_rate", 0.1, step)
    w.flush()
    reader = TensorBoardLogdir(logdir)
    before = snapshot(logdir)
    got = reader.read() + reader.read()
    train = [r for r in got if r["kind"] == "train"]
    assert [(r["step"], r["loss"], r["lr"]) for r in train] == [(s, f32(1 / (s + 1)), f32(0.1)) for s in range(5)]
    evals = [r for r in got if r["kind"] == "eval"]
    assert [(r["step"], r["val_loss"]) for r in evals] == [(s, f32(2 / (s + 1))) for s in range(5)]
    assert [r["metrics"] for r in evals] == [{"accuracy": f32(s / 10)} for s in range(5)]
    assert reader.read() == []
    for step in range(5, 8):
        w.add_scalar("Loss/train", 1.0 / (step + 1), step)
    w.flush()
    more = reader.read() + reader.read()
    assert [r["step"] for r in more] == [5, 6, 7], "only what was appended"
    w.close()
    after = snapshot(logdir)
    assert set(after) == set(before), "no file of the reader's own in the logdir"
    reader.read()
    assert snapshot(logdir) == after, "reading wrote nothing into the logdir"


def test_a_torn_last_record_is_skipped_until_it_is_complete(tmp_path):
    src = tmp_path / "src"
    w = SummaryWriter(str(src))
    for step in range(4):
        w.add_scalar("train/loss", 10.0 + step, step)
    w.close()
    (events,) = src.glob("events.out.tfevents.*")
    data = events.read_bytes()
    live = tmp_path / "live"
    live.mkdir()
    copy = live / events.name
    for cut in (7, 1, 20):  # torn inside the last record: its header, its payload, its checksum
        copy.write_bytes(data[:-cut])
        reader = TensorBoardLogdir(live)
        got = reader.read() + reader.read()
        assert [r["step"] for r in got] == [0, 1, 2], f"cut {cut}: the torn record is not read"
        with open(copy, "ab") as f:
            f.write(data[-cut:])
        rest = reader.read() + reader.read()
        assert [(r["step"], r["loss"]) for r in rest] == [(3, 13.0)], f"cut {cut}: read once complete"


def test_reading_a_folder_without_event_files_is_one_line(tmp_path):
    (tmp_path / "a").mkdir()
    SummaryWriter(str(tmp_path / "a" / "run1")).close()
    with pytest.raises(Exception, match=r"holds no event files .*open one of its runs: run1") as e:
        TensorBoardLogdir(tmp_path / "a")
    assert "\n" not in str(e.value)


BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {blocked!r}:
            raise ImportError('blocked: ' + name, name=name)
sys.meta_path.insert(0, Block())
"""


@pytest.mark.parametrize(
    ("module", "blocked", "extra"),
    [
        ("multilane.integrations.lightning", ("lightning", "pytorch_lightning"), "lightning"),
        ("multilane.integrations.transformers", ("transformers",), "transformers"),
        ("multilane.integrations.tensorboard", ("tensorboard",), "tensorboard"),
    ],
)
def test_an_integration_without_its_library_is_one_line_naming_the_extra(module, blocked, extra):
    code = (
        BLOCK.format(blocked=blocked)
        + f"""
try:
    import {module}
except ImportError as e:
    print(str(e))
"""
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (line,) = r.stdout.strip().splitlines()
    assert line == f"{module} needs {blocked[0]}, which is not installed: pip install 'multilane[{extra}]'" or (
        extra == "tensorboard"
        and line.endswith("needs tensorboard, which is not installed: pip install 'multilane[tensorboard]'")
    ), line


@pytest.mark.slow
def test_train_tensorboard_without_tensorboard_is_one_line_and_writes_nothing(tmp_path):
    code = (
        BLOCK.format(blocked=("tensorboard",))
        + f"""
from multilane.engine.cli import main
sys.exit(main(['train', '--task', 'linear', '--steps', '3', '--devices', 'cpu:0', '--runs-dir', {str(tmp_path / "runs")!r},
               '--set', 'train.tensorboard=true']))
"""
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        "multilane: error: multilane.integrations.tensorboard (train.tensorboard, File → Open TensorBoard logdir) "
        "needs tensorboard, which is not installed: pip install 'multilane[tensorboard]'"
    ]
    assert not list((tmp_path / "runs").glob("*/metrics.jsonl"))


@pytest.mark.slow
def test_a_ddp_run_writes_one_set_of_event_files_with_every_ranks_loss(tmp_path):
    runs = tmp_path / "runs"
    args = [*CLI, "train", "--task", "linear", "--steps", "6", "--devices", "cpu:0,cpu:1", "--strategy", "ddp"]
    args += ["--runs-dir", str(runs), "--set", "train.tensorboard=true", "--set", "train.log_every=2"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (run,) = runs.iterdir()
    assert len(list(run.glob("events.out.tfevents.*"))) == 1, "rank 0 writes; the other rank writes nothing"
    tb = scalars(run)
    train = [x for x in read_metrics(run) if x["kind"] == "train"]
    assert [x["step"] for x in train] == [2, 4, 6]
    for rec in train:
        assert len(rec["device_loss"]) == 2
        for dev, v in rec["device_loss"].items():
            assert "/rank" in dev and tb[f"train/device_loss/{dev}"][rec["step"]] == [f32(v)]
