"""Frozen weights in a checkpoint: a model whose parameters are partly frozen (``requires_grad=False``,
e.g. a pretrained base under LoRA adapters) is saved as its trainable state only, and its frozen base
is named, not copied: by its source (where the task says it came from) and a SHA-256 of its bytes.

``checkpoint_model_state`` is what every strategy's checkpoint calls for the model's part;
``load_trainable`` is what a resume calls; ``sharded_options`` is the DCP counterpart (fsdp). A
resume against a base whose bytes differ is refused in one line: the trainable state was trained on
that base and means nothing on another.

A model without a frozen parameter is saved whole, as before (``frozen_base`` is None).
Buffers (BatchNorm's running statistics, and the like) are always saved: they may change in training.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Any

import torch
from multilane.engine.errors import UserError
from torch import nn

_HASHES: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[int, ...], str]] = weakref.WeakKeyDictionary()


def frozen_names(model: nn.Module) -> list[str]:
    """The state-dict names of ``model``'s frozen parameters, in the state dict's order. A tensor
    shared by a trainable and a frozen name (tied) is trainable: it changes in training."""
    params = dict(model.named_parameters(remove_duplicate=False))
    trainable = {id(p) for p in params.values() if p.requires_grad}
    return [n for n in model.state_dict(keep_vars=True) if n in params and id(params[n]) not in trainable]


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor gathered (a collective: every rank calls it, in the same order)."""
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t


def base_fingerprint(model: nn.Module, source: str | None = None) -> dict[str, Any] | None:
    """``{"source", "sha256", "tensors", "bytes"}`` of ``model``'s frozen parameters, or None when it
    has none. The hash covers each frozen tensor's name, dtype, shape and bytes, in name order, so it is
    the same on every strategy and device count; it is computed once per model while the frozen
    tensors are unchanged (their version counters)."""
    names = sorted(frozen_names(model))
    if not names:
        return None
    state = model.state_dict(keep_vars=True)
    versions = tuple(int(state[n]._version) for n in names)
    cached = _HASHES.get(model)
    nbytes = 0
    if cached is not None and cached[0] == versions:
        digest = cached[1]
        nbytes = sum(state[n].numel() * state[n].element_size() for n in names)
    else:
        digest, nbytes = tensors_sha256({n: _full(state[n].detach()) for n in names})
        _HASHES[model] = (versions, digest)
    return {"source": source, "sha256": digest, "tensors": len(names), "bytes": nbytes}


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> tuple[str, int]:
    """The SHA-256 of named whole tensors (each one's name, dtype, shape and bytes, in name order) and
    their bytes: what a checkpoint's ``frozen_base`` holds, so a reader can check a base it has."""
    h = hashlib.sha256()
    nbytes = 0
    for n in sorted(tensors):
        t = tensors[n].detach().cpu().contiguous()
        h.update(f"{n}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        nbytes += t.numel() * t.element_size()
    return h.hexdigest(), nbytes


def base_source(task: Any, model: nn.Module) -> str | None:
    """Where the frozen base came from: the task's ``base_source()`` when it defines one, else the
    ``name_or_path`` a Hugging Face model (or a PEFT adapter's config) keeps; None when nothing says."""
    own = getattr(task, "base_source", None)
    if callable(own):
        said = own()
        if said:
            return str(said)
    for m in model.modules():
        configs = getattr(m, "peft_config", None)
        if isinstance(configs, dict):
            for c in configs.values():
                if getattr(c, "base_model_name_or_path", None):
                    return str(c.base_model_name_or_path)
        path = getattr(m, "name_or_path", None)
        if isinstance(path, str) and path:
            return path
    return None


def checkpoint_model_state(model: nn.Module, source: str | None = None) -> dict[str, Any]:
    """The model's part of a checkpoint: ``{"model": state, "frozen_base": fingerprint or None}``.
    With frozen parameters, ``state`` holds every other entry (trainable parameters and buffers) and
    ``frozen_base`` names the base; otherwise ``state`` is the whole state dict."""
    base = base_fingerprint(model, source)
    state = model.state_dict()
    if base is not None:
        frozen = set(frozen_names(model))
        state = {k: v for k, v in state.items() if k not in frozen}
    return {"model": state, "frozen_base": base}


def _short(base: dict[str, Any]) -> str:
    source = base.get("source") or "a base the task built"
    return f"{source} (sha256 {str(base.get('sha256'))[:12]}, {base.get('tensors')} frozen tensors)"


def check_base(model: nn.Module, saved: dict[str, Any] | None, where: str) -> None:
    """Refuse, in one line, resuming a checkpoint whose frozen base is not this model's (other bytes,
    another set of frozen tensors), or a trainable-only checkpoint into a model with nothing frozen."""
    if saved is None:
        return
    now = base_fingerprint(model, saved.get("source"))
    if now is None:
        raise UserError(
            f"checkpoint {where}: holds only trainable weights over the frozen base {_short(saved)}, "
            "but this run's model has no frozen parameter; resume with the same task and base model"
        )
    if now["sha256"] != saved.get("sha256"):
        raise UserError(
            f"checkpoint {where}: was trained over the frozen base {_short(saved)}, but this run's frozen "
            f"weights differ (sha256 {now['sha256'][:12]}, {now['tensors']} frozen tensors); "
            "resume with the same base model"
        )


def load_trainable(model: nn.Module, state: dict[str, Any], saved_base: dict[str, Any] | None) -> None:
    """Load a checkpoint's model state: whole (``saved_base`` None), or its trainable entries over the
    model's own frozen base (checked first by ``check_base``); every trainable entry must be there."""
    if saved_base is None:
        model.load_state_dict(state)
        return
    frozen = set(frozen_names(model))
    missing = [k for k in model.state_dict() if k not in frozen and k not in state]
    extra = [k for k in state if k in frozen]
    if missing or extra:
        raise ValueError(f"missing trainable entries {missing[:3]}, frozen entries saved {extra[:3]}")
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"unexpected entries {list(result.unexpected_keys)[:3]}")


def sharded_options(model: nn.Module) -> Any:
    """The ``StateDictOptions`` a sharded (DCP) save uses: frozen parameters left out, as above."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True)
