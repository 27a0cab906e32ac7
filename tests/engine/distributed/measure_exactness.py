"""The ddp column of docs/design.md's exactness table: every model kind of tests/exactness_kinds.py
trained by the engine's ddp trainer on 2 and 3 Gloo ranks (127.0.0.1), against the single-process
engine on one device, float64, 3 steps, uneven weights ([1, 3] and [3, 1, 2]).

    python tests/engine/distributed/measure_exactness.py

Each rank count is one set of processes (torch.multiprocessing) that trains every kind in turn with
the ddp strategy under the engine's loop (``Trainer(strategy=Ddp(...))``), as ``multilane train --strategy ddp`` does. Printed: the largest relative difference
(max |a - b| / max |b|) of the logged losses and of the final parameters and buffers, or the
one-line refusal.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

TESTS = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(TESTS))
from exactness_kinds import KINDS  # noqa: E402

WEIGHTS = {1: [], 2: [1, 3], 3: [3, 1, 2]}


def _cat(parts: list) -> object:
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, tuple):
        return tuple(_cat([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, dict):  # constants (a float argument) cannot be split by sample: left out
        return {k: _cat([p[k] for p in parts]) for k, v in first.items() if isinstance(v, torch.Tensor)}
    raise TypeError(type(first).__name__)


def make_task(name: str):
    from multilane.engine.tasks import ArrayData, Task

    kind = KINDS[name]

    class KindTask(Task):
        def build_model(self):
            return kind.model()

        def data(self):
            return ArrayData(_cat([b[0] for b in kind.batches]), _cat([b[1] for b in kind.batches]))

        def loss(self, output, target):
            return kind.loss(output, target)

    if kind.weight is not None:
        KindTask.loss_weight = lambda self, output, target: kind.weight(output, target)
    return KindTask()


def config(name: str, devices: int, runs: str) -> dict:
    from multilane.engine.config import build_config

    kind = KINDS[name]
    batch = len(kind.batches[0][1][0] if isinstance(kind.batches[0][1], tuple) else kind.batches[0][1])
    return build_config(
        {
            "task": {"name": "mlp"},
            "data": {"batch_size": batch, "val_fraction": 0.0},
            "optim": {"name": "adam", "lr": 0.01},
            "train": {"steps": 3, "grad_accum": kind.accum, "grad_clip": kind.clip, "log_every": 1, "seed": 5},
            "devices": {"use": ",".join(f"cpu:{i}" for i in range(devices)), "weights": WEIGHTS[devices]},
            "telemetry": {"enabled": False},
            "run": {"runs_dir": runs},
        }
    )


def _rank(rank: int, world: int, port: int, runs: str, out: dict) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), MASTER_PORT=str(port)
    )
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    from multilane.engine.distributed.ddp import Ddp
    from multilane.engine.distributed.rank import RankInfo, init_process_group
    from multilane.engine.run.trainer import Trainer

    devices = ",".join(f"cpu:{i}" for i in range(world))
    info = RankInfo.from_env(devices)
    init_process_group(info, 60)
    for k, name in enumerate(KINDS):
        run_dir = Path(runs) / f"ddp{world}-{k}"
        strategy = Ddp(info, run_dir=run_dir)
        trainer = Trainer(config=config(name, world, runs), task=make_task(name), strategy=strategy)
        result = trainer.run()
        if rank == 0:
            out[name] = (result.status, result.message, str(run_dir))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300))


def main() -> None:
    from multilane.engine.run.trainer import Trainer
    from multilane.engine.rundir.runlog import read_metrics

    with tempfile.TemporaryDirectory() as runs:
        refs = {}
        for name in KINDS:
            t = Trainer(config(name, 1, runs), task=make_task(name))
            r = t.run()
            refs[name] = (t.model.state_dict(), [x["loss"] for x in read_metrics(r.run_dir) if x["kind"] == "train"])
        table: dict[str, list[str]] = {name: [] for name in KINDS}
        for world in (2, 3):
            for k in range(len(KINDS)):
                (Path(runs) / f"ddp{world}-{k}" / "checkpoints").mkdir(parents=True)
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            out = mp.Manager().dict()
            mp.spawn(_rank, args=(world, port, runs, out), nprocs=world)
            for name in KINDS:
                status, message, run_dir = out[name]
                if status != "finished":
                    table[name].append(f"refused: {message}" if status == "failed" else status)
                    continue
                state, losses = refs[name]
                ck = torch.load(Path(run_dir) / "checkpoints" / "last.pt", weights_only=True)["model"]
                mine = [x["loss"] for x in read_metrics(Path(run_dir)) if x["kind"] == "train"]
                loss = max(abs(a - b) / abs(b) for a, b in zip(mine, losses, strict=True))
                params = max(_rel(ck[key], v) for key, v in state.items() if v.is_floating_point())
                table[name].append(f"{loss:.1e} / {params:.1e}")
    print("| model kind | ddp, 2 ranks [1,3]: loss / parameters, buffers | ddp, 3 ranks [3,1,2] |")
    print("| --- | --- | --- |")
    for name, cells in table.items():
        print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
