"""Running one cell of the matrix as a user would: in-process through ``Trainer`` (one-process strategies)
or as ``multilane train --config`` (ddp, fsdp: the launcher and its ranks, started warm as the suite's
commands are: tests/warm_cli.py), and checking it against the plain loop or its expected refusal."""

from __future__ import annotations

import json
import math
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch
from helpers import CLI
from matrix import INSTRUMENTS, STRATEGIES, config
from multilane.engine.config import build_config
from multilane.engine.errors import UserError
from multilane.engine.fsdp.sharded import read_model_state
from multilane.engine.run.trainer import Trainer
from multilane.engine.rundir.checkpoint_file import load_checkpoint
from multilane.engine.rundir.runlog import read_metrics
from multilane.engine.tensors.frozen import tensors_sha256
from reference import reference

BOUND = 1e-10  # the engine tests' bound: tests/engine/parallel/test_exactness.py, fsdp_helpers.py


@dataclass
class Outcome:
    run: Path | None  # the run folder, where one was made
    refusal: str | None  # the one line of a refusal (exit 2), else None
    failure: str | None = None  # anything else: a traceback, a non-zero exit, a run that did not finish


def run_cell(kind: str, strategy: str, tmp: Path) -> Outcome:
    runs = tmp / "runs"
    cfg = config(kind, strategy, runs)
    env = {k: v for instrument in INSTRUMENTS.values() for k, v in instrument.env.items()}
    if not STRATEGIES[strategy].launch:
        before = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            result = Trainer(build_config(cfg)).run()
        except UserError as e:
            return Outcome(_only_run(runs), str(e))
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        if result.status != "finished":
            return Outcome(result.run_dir, None, f"{result.status}: {result.message}")
        return Outcome(result.run_dir, None)
    path = tmp / "cell.json"
    path.write_text(json.dumps(cfg))
    r = subprocess.run(
        [*CLI, "train", "--config", str(path)], capture_output=True, text=True, timeout=240, env={**os.environ, **env}
    )
    run = _only_run(runs)
    if r.returncode == 2:
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        if len(lines) == 1:
            return Outcome(run, lines[0])
        return Outcome(run, None, f"exit 2 in {len(lines)} lines:\n{r.stderr[-3000:]}")
    if r.returncode != 0:
        return Outcome(run, None, f"exit {r.returncode}:\n{r.stderr[-3000:]}")
    return Outcome(run, None)


def _only_run(runs: Path) -> Path | None:
    found = sorted(p for p in runs.glob("*") if p.is_dir()) if runs.is_dir() else []
    assert len(found) <= 1, found
    return found[0] if found else None


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|; infinite where either holds a NaN."""
    a, b = a.detach().double(), b.detach().double()
    if not b.numel():
        return 0.0
    d = float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))
    return math.inf if math.isnan(d) else d


def check_refused(out: Outcome, expected: tuple[str, ...], what: str) -> None:
    """Refused before step 1, in one line naming each of ``expected``; no step was trained or logged."""
    assert out.failure is None, f"{what}: {out.failure}"
    assert out.refusal is not None, f"{what}: trained, expected a refusal naming {expected}"
    assert "\n" not in out.refusal and all(e in out.refusal for e in expected), f"{what}: {out.refusal}"
    if out.run is not None:
        assert not [r for r in read_metrics(out.run) if r["kind"] == "train"], f"{what}: refused after a step"


def check_exact(out: Outcome, kind: str, strategy: str, tmp: Path) -> dict[str, float]:
    """Every logged loss and the final parameters and buffers equal the plain loop's within BOUND;
    every instrument left its mark. Returns the largest differences (for the report)."""
    what = f"{kind} / {strategy}"
    assert out.failure is None and out.refusal is None, f"{what}: {out.failure or out.refusal}"
    assert out.run is not None
    ref = reference(kind, strategy, tmp / "ref")
    records = read_metrics(out.run)
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, len(ref.losses) + 1)), what
    loss = max(abs(r["loss"] - b) / max(abs(b), 1e-300) for r, b in zip(train, ref.losses, strict=True))
    assert loss <= BOUND, f"{what}: losses {[r['loss'] for r in train]} vs {ref.losses}"
    state = read_model_state(out.run)
    # frozen parameters are named by the checkpoint (source and hash), not copied: the hash must be the
    # reference's unchanged frozen tensors'
    frozen = {k: v for k, v in ref.state.items() if k not in state}
    base = load_checkpoint(out.run / "checkpoints" / "last.pt").get("frozen_base")
    assert (base or {}).get("sha256") == (tensors_sha256(frozen)[0] if frozen else None), f"{what}: {base}"
    assert state.keys() == ref.state.keys() - frozen.keys(), f"{what}: {sorted(state)} vs {sorted(ref.state)}"
    worst = max(((rel(state[k], v), k) for k, v in ref.state.items() if k in state), default=(0.0, ""))
    assert worst[0] <= BOUND, f"{what}: {worst[1]} differs by {worst[0]:.2e}"
    for name, instrument in INSTRUMENTS.items():
        assert instrument.shows(out.run, records), f"{what}: {name} left no mark in {out.run}"
    return {"loss": loss, "state": worst[0]}
