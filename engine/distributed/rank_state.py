"""What keeps every rank of a ddp run one model, by the lanes' rules (engine/parallel/replicas/).

- **Random streams** (``RankStreams``, lane_rng.py's rule): rank 0 draws from the generators the run
  seeds, rank r > 0 from its own stream seeded with ``lane_seed(seed, r)``, exactly as lane r does;
  so ddp on n ranks draws the dropout masks the single-process engine draws on n lanes. Every
  rank's stream is saved in the checkpoint (the lanes' ``lane_rng`` format: one lane per rank).
- **Buffers** (``BufferMerge``, buffers.py's rule): after each forward that counts, the buffers a rank
  changed (BatchNorm's running statistics) become the sample-weighted mean over the ranks that had
  samples, integer buffers the first such rank's; not DDP's ``broadcast_buffers`` (rank 0's alone).
- **In-place parameter writes** (``check_param_writes``): the lanes merge them; ddp refuses them with
  one line (each rank renormalises only its own shard's rows, and a tied layer reads them all).
- **Every parameter in the gradient all-reduce** (``zero_loss``, ``reached``): an empty shard
  back-propagates zero through every output and, when DDP expects every parameter, every parameter;
  the first steps find the parameters each rank reaches (``RankRules.reduce_probe``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from inspect import signature
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from multilane.engine.distributed.batchnorm import empty_shard
from multilane.engine.fsdp.reach import reached
from multilane.engine.parallel.lane_loss import LaneLoss, LossWeightError, check_batch, model_args
from multilane.engine.parallel.replicas.buffers import merge_values, set_buffer
from multilane.engine.parallel.replicas.lane_rng import _generators, lane_seed
from torch import nn
from torch.nn.parallel import DistributedDataParallel

T = TypeVar("T")


class InplaceWriteError(RuntimeError):
    """A forward changed a parameter in place, which ddp cannot make equal to one device."""


class RankStreams:
    """This rank's random stream (the lanes' rule; see the module docstring)."""

    def __init__(self, rank: int, world: int, device: torch.device, seed: int, group: Any = None) -> None:
        self.rank, self.world, self.device, self.seed, self.group = rank, world, device, seed, group

    def begin(self, saved: dict[str, Any] | None) -> None:
        """Start this rank's stream: from ``saved`` (a checkpoint's ``lane_rng``) when it holds one lane
        per rank, else afresh (rank 0 keeps the run's generators, which a resume has restored)."""
        lanes = (saved or {}).get("lanes") or []
        mine = lanes[self.rank] if len(lanes) == self.world else None
        if mine is not None:
            self.set_own(mine)
        elif self.rank > 0:
            for g in _generators(self.device):
                g.manual_seed(lane_seed(self.seed, self.rank))

    def own(self) -> list[torch.Tensor]:
        """This rank's generator states (no collective)."""
        return [g.get_state() for g in _generators(self.device)]

    def set_own(self, states: Sequence[torch.Tensor]) -> None:
        for g, s in zip(_generators(self.device), states, strict=False):
            g.set_state(s)

    def state_dict(self) -> dict[str, Any]:
        """Every rank's generator states (a collective: every rank calls it at the same step)."""
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, self.own(), group=self.group)
        return {"seed": self.seed, "lanes": everyone}


class BufferMerge:
    """The model's buffers made the ranks' sample-weighted mean after each forward (see the module docstring).

    Which buffers changed is agreed on with one tiny all-reduce per forward (on the CPU group), only
    for models with buffers; the changed ones then travel in one all-gather, on the rank's device.
    A buffer changed is one whose values differ from a copy taken before the forward: BatchNorm's
    kernels update the running statistics without moving their version counters.
    """

    def __init__(self, model: nn.Module, group: Any) -> None:
        self.slots = [(m, name) for m in model.modules() for name, b in m._buffers.items() if b is not None]
        self.group = group
        self._before: list[torch.Tensor] = []

    def before(self) -> None:
        if self.slots:
            self._before = [m._buffers[name].detach().clone() for m, name in self.slots]

    def after(self, sizes: Sequence[int], extra_flag: bool = False) -> bool:
        """Merge the buffers the forward changed (``sizes``: every rank's samples in this batch).

        ``extra_flag`` rides along in the same all-reduce; returns whether any rank raised it (models
        without buffers: this rank's own flag)."""
        if not self.slots:
            return extra_flag
        bufs = [m._buffers[name] for m, name in self.slots]
        flags = [int(extra_flag)] + [
            int(b.shape != v.shape or not torch.equal(b.detach(), v)) for b, v in zip(bufs, self._before, strict=True)
        ]
        self._before = []
        agreed = torch.tensor(flags, dtype=torch.int32)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        changed = [k for k, f in enumerate(agreed.tolist()[1:]) if f]
        if changed:
            self._merge(changed, bufs, sizes)
        return bool(agreed[0])

    def _merge(self, changed: list[int], bufs: list[torch.Tensor], sizes: Sequence[int]) -> None:
        # float64 carries every buffer's values exactly (float32, bf16, counts below 2**53).
        flat = torch.cat([bufs[k].detach().reshape(-1).double() for k in changed])
        rows = [torch.empty_like(flat) for _ in sizes]
        dist.all_gather(rows, flat)
        active = [r for r, n in enumerate(sizes) if n > 0]
        total = float(sum(sizes[r] for r in active))
        weights = [sizes[r] / total for r in active]
        at = 0
        for k in changed:
            own = bufs[k]
            n = own.numel()
            values = [rows[r][at : at + n].reshape(own.shape).to(own.dtype) for r in active]
            at += n
            module, name = self.slots[k]
            set_buffer(module, name, merge_values(values, weights, own.device))


def build_ddp(model: nn.Module, device: Any, find_unused: bool) -> DistributedDataParallel:
    """DDP over ``model`` on ``device`` (a ``Device``). Buffers are not broadcast from rank 0 before each
    forward: every rank holds the ranks' sample-weighted merge (``BufferMerge``), the lanes' rule."""
    # torch 2.13 names it forward_sync_buffers (broadcast_buffers is deprecated); older torch (>= 2.4) only
    # knows broadcast_buffers.
    no_sync = (
        "forward_sync_buffers"
        if "forward_sync_buffers" in signature(DistributedDataParallel).parameters
        else "broadcast_buffers"
    )
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.is_cuda else None,
        find_unused_parameters=find_unused,
        **{no_sync: False},
    )


def weight_share(weight: torch.Tensor | None, group: Any) -> tuple[float, float]:
    """``(w_r / Σ w, Σ w)``: this shard's share of a micro-batch's loss weight (the task's
    ``loss_weight``, e.g. its non-padding tokens), NaN when the whole batch has none (its mean is 0/0,
    as on one device), and the batch's total weight. The sum is one small all-reduce per micro-batch
    on the CPU group; only tasks that define ``loss_weight`` pay it."""
    w = 0.0 if weight is None else float(weight)
    if not 0 <= w < math.inf:
        raise LossWeightError(f"loss_weight must be a finite number >= 0, got {w}")
    total = torch.tensor([w], dtype=torch.float64)
    dist.all_reduce(total, group=group)
    t = float(total[0])
    return (w / t if t > 0 else math.nan), t


def param_versions(params: Sequence[torch.Tensor]) -> list[int]:
    return [p._version for p in params]


def check_param_writes(model: nn.Module, params: Sequence[torch.Tensor], before: list[int]) -> None:
    """Refuse a forward that changed a parameter in place (one line naming it)."""
    for p, v in zip(params, before, strict=True):
        if p._version != v:
            name = next((n for n, q in model.named_parameters() if q is p), "?")
            raise InplaceWriteError(
                f"parameter '{name}' was changed in place during the forward (as Embedding(max_norm=...) "
                "does): each ddp rank would change it for its own shard only; train this model with "
                'devices.strategy = "replicate" or "persistent", whose lanes merge such changes'
            )


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a model's output (tuples, lists, dicts, dataclasses, nested)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if hasattr(obj, "__dataclass_fields__") and not isinstance(obj, type):
        obj = [getattr(obj, f) for f in obj.__dataclass_fields__]
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    return [t for item in items for t in tensors(item)]


def zero_loss(output: Any, params: Sequence[torch.Tensor] | None, sparse: frozenset[int] = frozenset()) -> torch.Tensor:
    """A zero that back-propagates through every output (so a rank's collectives in backward, such as
    synchronized BatchNorm's, run as on the other ranks) and, with ``params``, reaches every parameter
    (so every bucket of DDP's all-reduce fills). A parameter whose id is in ``sparse`` (the weight of an
    ``Embedding(sparse=True)``) gets its zero as a sparse gradient, the layout DDP expects of it."""
    terms = [t.sum() for t in tensors(output) if t.requires_grad]
    if params is not None:
        terms += [_zero_lookup(p) if id(p) in sparse else p.sum() for p in params if p.requires_grad]
    if not terms:
        raise RuntimeError("the model's output does not depend on any parameter")
    return sum(terms[1:], terms[0]) * 0.0


def _zero_lookup(weight: torch.Tensor) -> torch.Tensor:
    """A sum through a sparse lookup of row 0: its gradient is sparse (one row)."""
    index = torch.zeros(1, dtype=torch.long, device=weight.device)
    return torch.nn.functional.embedding(index, weight, sparse=True).sum()


def sparse_weights(model: nn.Module) -> frozenset[int]:
    """The ids of the weights of ``model``'s ``Embedding``/``EmbeddingBag`` modules with ``sparse=True``."""
    kinds = (nn.Embedding, nn.EmbeddingBag)
    return frozenset(id(m.weight) for m in model.modules() if isinstance(m, kinds) and getattr(m, "sparse", False))


PROBE_STEPS = 4
"""This process's first steps, reduced by hand while the ranks note the parameters their backwards reach."""


class RankRules:
    """The rules above around one rank's forward and its first step (the trainer's helper)."""

    def __init__(self, model: nn.Module, device: torch.device, world: int, group: Any) -> None:
        self.model, self.device, self.world, self.group = model, device, world, group
        self.params = list(model.parameters())
        self.sparse = sparse_weights(model)
        self.buffers = BufferMerge(model, group)
        self.reached: set[int] | None = set()
        """While this process's first steps run (``PROBE_STEPS``): the parameters this rank's backward reaches."""
        self.probe_steps = PROBE_STEPS
        self.before_backward: Callable[[torch.Tensor], None] | None = None
        """Called with each loss just before its backward (fsdp: the ranks agree on what it reaches)."""

    def forward(self, fn: Callable[[], T], n: int, sizes: list[int]) -> T:
        """``fn()`` (a forward and its loss) by the lanes' rules: a rank with no samples of its own
        draws no random numbers and adds no BatchNorm statistics; the buffers become the ranks' merge;
        a forward that changes a parameter in place is refused on every rank."""
        gens = _generators(self.device) if n == 0 else []
        states = [g.get_state() for g in gens]
        before = param_versions(self.params)
        self.buffers.before()
        with empty_shard(n == 0):
            out = fn()
        for g, st in zip(gens, states, strict=True):
            g.set_state(st)
        wrote = param_versions(self.params) != before
        if self.buffers.after(sizes, wrote):
            check_param_writes(self.model, self.params, before)
            raise InplaceWriteError("another rank's forward changed a parameter in place (see its error)")
        return out

    def note(self, loss: torch.Tensor) -> None:
        """Just before ``loss``'s backward. While probing: remember which parameters it reaches."""
        if self.reached is not None:
            self.reached |= reached(loss)
        if self.before_backward is not None:
            self.before_backward(loss)

    def reduce_probe(self) -> bool:
        """A probed step's gradients, reduced by hand; whether DDP must find unused parameters.

        Each of this process's first ``PROBE_STEPS`` steps runs under ``no_sync`` (DDP reduces nothing)
        while each rank notes the parameters its backward reaches. Then one all-reduce of those marks: a
        parameter no rank reached keeps no gradient (``None``, as on one device and on lanes: Adam and
        weight decay leave it alone); the others are summed over the ranks and divided by the world
        size, as DDP does. Once a step finds a parameter some rank did not reach, DDP must run with
        ``find_unused_parameters`` (which leaves a parameter no rank used without a gradient and gives one
        some ranks used theirs) and the probing ends; if every rank reached every parameter in every
        probed step, DDP goes on as it is (no graph walk per step, and no torch warning that the walk
        found nothing). A layer only some samples reach whose samples the first steps did not spread
        unevenly still makes DDP wait, later, for a gradient that never comes (docs/design.md).
        """
        assert self.reached is not None
        params = [p for p in self.params if p.requires_grad]
        mine = [int(id(p) in self.reached) for p in params]
        self.probe_steps -= 1
        self.reached = set() if self.probe_steps > 0 else None
        # [used by some rank] and [not used by some rank], in one MAX all-reduce
        marks = torch.tensor(mine + [1 - m for m in mine], dtype=torch.int32)
        dist.all_reduce(marks, op=dist.ReduceOp.MAX, group=self.group)
        anywhere, missing = marks[: len(params)].tolist(), marks[len(params) :].tolist()
        for p, used in zip(params, anywhere, strict=True):
            if not used:
                p.grad = None
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif p.grad.layout != torch.strided:
                # Embedding(sparse=True): another rank may hold this one's gradient dense (it did not
                # reach the lookup, or a tied layer added a dense part): every rank reduces it dense.
                p.grad = p.grad.to_dense()
            dist.all_reduce(p.grad)
            p.grad.div_(self.world)
        if any(missing):
            self.reached = None
            return True
        return False


def shard_forward(
    ddp: nn.Module, task: Any, loss_weight: Any, kind: str, dtype: Any, inputs: Any, target: Any, n: int
) -> tuple[Any, torch.Tensor | None, torch.Tensor | None]:
    """A rank's forward of its shard: the output, the shard's loss and (with the task's ``loss_weight``)
    its weight, inside autocast with the run's dtype."""
    args, kwargs = model_args(inputs)
    cast = torch.autocast(kind, dtype=dtype) if dtype else contextlib.nullcontext()
    with cast:
        output = ddp(*args, **kwargs)
        if n == 0:
            return output, None, None
        check_batch(output, target)
        loss = LaneLoss.check(task.loss(output, target))
        weight = None
        if loss_weight is not None:
            weight = LaneLoss.weight(loss_weight(output, target), loss)
        return output, loss, weight
