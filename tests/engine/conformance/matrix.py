"""The conformance matrix as data: model kinds (rows) x strategies (columns), every instrument on.

A new model kind is a row of ``KINDS`` (and, where it needs a model of its own, a kind in
tests/task_files/conformance_kinds.py); a new strategy is a column of ``STRATEGIES``; a new instrument
is an entry of ``INSTRUMENTS``: its config and what in the run folder shows it ran. A cell whose outcome
is not "equal to the plain loop" says so in ``EXPECTED``: a refusal (a substring of its one line) or a
known failure (``xfail``, the reason naming the class of bug and where it is being fixed).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers import TASK_FILES

TASK = str(TASK_FILES / "conformance_kinds.py")


@dataclass(frozen=True)
class Kind:
    """A row: the task file's ``kind`` and how the run is set up around it."""

    model: str  # the task file's ``kind``
    batch: int = 8
    samples: int = 24  # the training set (no validation split): 3 batches of 8
    steps: int = 3
    accum: int = 1
    clip: float = 0.0
    sync_batchnorm: bool = False
    per_share: bool = False
    """The plain loop forwards each device's share of the batch on its own, as the run does (with that
    device's random stream, its own BatchNorm statistics, the buffers merged by sample count): for
    dropout and an unsynchronized BatchNorm, whose result on n devices is defined by the shares."""


@dataclass(frozen=True)
class Strategy:
    """A column: ``launch`` runs it through ``multilane train`` (one process per device), else in-process."""

    launch: bool
    min_devices: int = 1


@dataclass(frozen=True)
class Instrument:
    config: dict[str, Any]  # dotted keys
    env: dict[str, str] = field(default_factory=dict)  # the suite turns some off by default (tests/conftest.py)
    shows: Callable[[Path, list[dict]], bool] = field(default=lambda run, records: True)


KINDS: dict[str, Kind] = {
    "dict inputs, dataclass output": Kind("dict-dataclass"),
    "tuple inputs, namedtuple output and target": Kind("tuple-namedtuple"),
    "BatchNorm": Kind("batchnorm", batch=12, samples=36, per_share=True),
    "BatchNorm, sync_batchnorm": Kind("batchnorm", batch=12, samples=36, sync_batchnorm=True),
    "unused parameter": Kind("unused"),
    "never-taken branch": Kind("never-taken"),
    "frozen parameter": Kind("frozen"),
    "data-dependent branch": Kind("data-dependent"),
    "transformer, padding mask, dropout": Kind("transformer", per_share=True),
    "tied embedding": Kind("tied-embedding"),
    "tied embedding, max_norm": Kind("tied-maxnorm"),
    "sparse embedding": Kind("sparse-embedding"),
    "LSTM": Kind("lstm"),
    "0-dim parameter": Kind("zero-dim"),
    "forward reads its own parameters": Kind("reads-own-params"),
    "gradient penalty (create_graph)": Kind("grad-penalty"),
    "buffer that requires grad": Kind("buffer-requires-grad"),
    "ignore_index targets": Kind("ignore-index"),
    "1-sample last batch": Kind("mlp", samples=17),  # batches of 8, 8, 1
    "accumulation with clipping": Kind("mlp", accum=2, clip=0.05, steps=2),
}

STRATEGIES: dict[str, Strategy] = {
    "replicate": Strategy(launch=False),
    "persistent": Strategy(launch=False),
    "ddp": Strategy(launch=True, min_devices=2),
    "fsdp": Strategy(launch=True, min_devices=2),
}

SHARES: list[list[int]] = [[1], [1, 3], [3, 1, 2]]
"""The device counts and uneven shares (``devices.weights``) the cells cycle through."""


def _has_tfevents(run: Path, records: list[dict]) -> bool:
    return any(run.glob("events.out.tfevents.*"))


def _health_every_step(run: Path, records: list[dict]) -> bool:
    steps = {r["step"] for r in records if r["kind"] == "train"}
    return {r["step"] for r in records if r["kind"] == "health"} == steps


INSTRUMENTS: dict[str, Instrument] = {
    "fit check": Instrument(
        {"train.fit_check": True},
        {"MULTILANE_FIT_CHECK": "1"},
        lambda run, records: any(r.get("event") == "memory_peaks" or "peaks" in r for r in records),
    ),
    "memory split": Instrument(
        {}, shows=lambda run, records: all("memory" in r for r in records if r["kind"] == "train")
    ),
    "health every step, activations": Instrument(
        {"health.enabled": True, "health.every": 1, "health.activations": "Tanh,ReLU,GELU"},
        shows=_health_every_step,
    ),
    "NaN replay": Instrument({"health.nan_replay": True}),
    "telemetry": Instrument({"telemetry.enabled": True, "telemetry.rate_hz": 10.0, "telemetry.record_s": 0.2}),
    "TensorBoard": Instrument({"train.tensorboard": True}, shows=_has_tfevents),
}


@dataclass(frozen=True)
class Expect:
    """A cell that is not simply "equal to the plain loop"."""

    refused: tuple[str, ...] = ()
    """Refused before step 1 in one line (exit 2) containing each of these: the model feature, a strategy that
    trains it."""
    xfail: str | None = None
    """Known to fail today: the class of bug and the branch fixing it (the mark goes once it is merged)."""


EXPECTED: dict[tuple[str, str], Expect] = {
    ("data-dependent branch", "fsdp"): Expect(refused=("cannot train this model: a layer only some samples reach",)),
    ("tied embedding, max_norm", "ddp"): Expect(refused=("Embedding(max_norm=", '"replicate"')),
    ("tied embedding, max_norm", "fsdp"): Expect(refused=("Embedding(max_norm=", '"replicate"')),
    ("sparse embedding", "fsdp"): Expect(refused=("sparse gradients", '"ddp"')),
    ("0-dim parameter", "fsdp"): Expect(refused=("is 0-dim", '"ddp"')),
    ("forward reads its own parameters", "fsdp"): Expect(refused=("parameters outside the unit", '"ddp"')),
    ("gradient penalty (create_graph)", "fsdp"): Expect(refused=("create_graph=True", '"ddp"')),
    ("buffer that requires grad", "persistent"): Expect(refused=("buffer 'shift' requires grad", '"replicate"')),
}
"""(kind, strategy) -> what the cell does instead of training exactly; every other cell is exact."""


def devices_for(kind: str, strategy: str) -> tuple[str, list[int]]:
    """The cell's devices and shares: cycled across rows and columns (not a product over counts)."""
    k, s = list(KINDS).index(kind), list(STRATEGIES).index(strategy)
    shares = SHARES[(k + s) % len(SHARES)]
    if len(shares) < STRATEGIES[strategy].min_devices:
        shares = [1, 1]
    return ",".join(f"cpu:{i}" for i in range(len(shares))), shares if len(set(shares)) > 1 else []


def config(kind: str, strategy: str, runs_dir: Path) -> dict[str, Any]:
    """The cell's run config: the kind's task and set-up, the strategy, and every instrument on."""
    row = KINDS[kind]
    use, weights = devices_for(kind, strategy)
    cfg: dict[str, Any] = {
        "task": {"name": TASK, "params": {"kind": row.model, "samples": row.samples}},
        "data": {"batch_size": row.batch, "val_fraction": 0.0, "workers": 0},
        "optim": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "train": {
            "steps": row.steps,
            "grad_accum": row.accum,
            "grad_clip": row.clip,
            "log_every": 1,
            "eval_every": 0,
            "seed": 5,
        },
        # A rank left waiting on a dead peer ends the run in 30 s, not 120: a failing cell fails quickly.
        "devices": {
            "use": use,
            "strategy": strategy,
            "weights": weights,
            "sync_batchnorm": row.sync_batchnorm,
            "collective_timeout_s": 30.0,
        },
        "run": {"runs_dir": str(runs_dir), "name": "cell"},
    }
    for instrument in INSTRUMENTS.values():
        for dotted, value in instrument.config.items():
            section, key = dotted.split(".")
            cfg.setdefault(section, {})[key] = value
    return json.loads(json.dumps(cfg))


def cells() -> list[tuple[str, str]]:
    return [(k, s) for k in KINDS for s in STRATEGIES]


DIAGONAL = [
    ("dict inputs, dataclass output", "replicate"),
    ("unused parameter", "replicate"),
    ("buffer that requires grad", "persistent"),
    ("accumulation with clipping", "persistent"),
]
"""The fast tier's cells: in-process, cheap, one of each strategy run in-process."""
