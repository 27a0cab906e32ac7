"""The pretrained model and its tokenizer: found, checked against each other and the task's params, loaded.

Every check here is one line (``UserError``) before the model's weights are read: a folder without
``config.json``, a tokenizer with more tokens than the model has embeddings, a context longer than the
model's positions, a tokenizer without an end-of-sequence token, LoRA targets that name no module.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import torch
from multilane.engine.errors import UserError
from multilane.engine.lm import hf
from torch import nn

WHO = "task causal-lm"
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
"""A Hub model id: ``name`` or ``org/name`` (letters, digits, ``_ . -``)."""


def _is_local(name: str) -> bool:
    """Whether ``name`` means a folder on this machine (else a Hub id such as ``org/model``), as transformers
    decides: an existing folder is local, and so is anything shaped like a path rather than a Hub id."""
    if Path(name).expanduser().exists() or name.startswith((".", "/", "~")):
        return True
    return not HUB_ID.match(name)


def resolve(name: str, field: str) -> str:
    """A model or tokenizer source: a local folder (which must hold ``config.json`` for the model), or a Hub name."""
    if not name:
        raise UserError(f"{WHO}: {field} is empty; give a folder in save_pretrained layout or a Hub name")
    if not _is_local(name):
        return name
    p = Path(name).expanduser()
    if not p.is_dir():
        raise UserError(f"{WHO}: {field} = {name!r}: no such folder")
    if field == "model" and not (p / "config.json").is_file():
        raise UserError(
            f"{WHO}: model = {name!r}: the folder holds no config.json (a model saved with save_pretrained has one)"
        )
    return str(p.resolve())


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return (lines[0][:300] if lines else type(e).__name__).rstrip(".")


def load_config(source: str) -> Any:
    tf = hf.transformers()
    try:
        with hf.quiet():
            return tf.AutoConfig.from_pretrained(source)
    except (OSError, ValueError, KeyError) as e:
        where = "" if _is_local(source) else "no such folder here, and from the Hub: "
        raise UserError(f"{WHO}: model = {source!r}: cannot read its config ({where}{_one_line(e)})") from None


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)
"""A local tokenizer folder holds at least one of these (else transformers builds an empty tokenizer from config.json)."""


def load_tokenizer(source: str, field: str = "tokenizer") -> Any:
    if Path(source).is_dir() and not any((Path(source) / f).is_file() for f in TOKENIZER_FILES):
        hint = "; give task.params.tokenizer" if field == "model" else ""
        raise UserError(
            f"{WHO}: tokenizer = {source!r}: the folder holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}){hint}"
        )
    tf = hf.transformers()
    try:
        with hf.quiet():
            tok = tf.AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{WHO}: tokenizer = {source!r}: cannot load it ({_one_line(e)})") from None
    if tok.eos_token_id is None:
        raise UserError(
            f"{WHO}: tokenizer = {source!r}: it has no end-of-sequence token (eos_token) to put between documents"
        )
    return tok


def max_positions(config: Any) -> int | None:
    """The longest input the model's position embeddings (or rotary table) are made for, if the config says."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        v = getattr(config, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def check_pair(config: Any, tok: Any, context: int, model: str, tokenizer: str) -> None:
    """The tokenizer's ids must have embeddings; ``context`` tokens must have positions."""
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and len(tok) > vocab:
        raise UserError(
            f"{WHO}: tokenizer = {tokenizer!r} holds {len(tok):,} tokens, more than the {vocab:,} embeddings of "
            f"model = {model!r} (config.json vocab_size): its ids {vocab:,} and up would index no embedding"
        )
    longest = max_positions(config)
    if longest is not None and context > longest:
        raise UserError(
            f"{WHO}: context = {context:,} tokens is beyond the {longest:,} positions of model = {model!r} "
            f"(config.json); give context <= {longest:,}"
        )


def module_names(config: Any) -> list[str]:
    """The model's module names, from a model built on the meta device (no memory, no weights read)."""
    tf = hf.transformers()
    with torch.device("meta"), hf.quiet():
        m = tf.AutoModelForCausalLM.from_config(config)
    return [n for n, _ in m.named_modules()]


def check_targets(targets: list[str], names: list[str]) -> None:
    """Every LoRA target must name a module as PEFT matches them (the name, or its last dotted parts)."""
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names if n})
    for t in targets:
        if not any(n == t or n.endswith("." + t) for n in names):
            linear = ", ".join(x for x in leaves if "proj" in x or "attn" in x or "fc" in x)[:200]
            raise UserError(
                f"{WHO}: lora_targets names {t!r}, which names no module of the model"
                + (f" (its layers include {linear})" if linear else "")
            )


class CausalLM(nn.Module):
    """The pretrained model (with its LoRA adapters, when ``lora_rank`` > 0) as the engine trains it:
    ``forward(input_ids, attention_mask)`` returns the logits. ``lm`` is the transformers (or PEFT) model."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def load_model(p: Any, source: str) -> CausalLM:
    """The pretrained weights in ``p.dtype``, with LoRA adapters (``p.lora_rank`` > 0: the base frozen) and
    gradient checkpointing as asked."""
    tf = hf.transformers()
    try:
        with hf.quiet():
            lm = tf.AutoModelForCausalLM.from_pretrained(source, dtype=DTYPES[p.dtype])
    except Exception as e:  # missing, damaged or foreign weight files: whatever the reader raises, one line
        raise UserError(f"{WHO}: model = {p.model!r}: cannot load it ({_one_line(e)})") from None
    lm.config.use_cache = False
    if p.gradient_checkpointing:  # non-reentrant: it needs no input that requires grad (a frozen embedding)
        with hf.quiet():
            if hasattr(lm, "activation_checkpointing_enable"):  # transformers 5.x's name
                lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if p.lora_rank > 0:
        lm = with_lora(lm, p)
    return CausalLM(lm)


def lora_config(p: Any) -> Any:
    peft = hf.peft()
    return peft.LoraConfig(
        r=p.lora_rank,
        lora_alpha=p.lora_alpha,
        lora_dropout=p.lora_dropout,
        target_modules=list(p.lora_targets) or None,
        task_type="CAUSAL_LM",
    )


def with_lora(lm: nn.Module, p: Any) -> nn.Module:
    """``get_peft_model``: the base model's weights frozen, adapters on ``lora_targets`` (default: PEFT's
    choice for the architecture, its attention projections)."""
    peft = hf.peft()
    try:
        with hf.quiet():
            return peft.get_peft_model(lm, lora_config(p))
    except ValueError as e:  # PEFT's own: targets not found, or no default for this architecture
        raise UserError(f"{WHO}: LoRA cannot be put on this model ({_one_line(e)}); set lora_targets") from None


def tokenizer_key(tok: Any) -> str:
    """What identifies a tokenizer's output: its class, its full definition (fast tokenizers), its vocabulary
    and special tokens. Part of the tokenized data's cache key."""
    h = hashlib.sha256(type(tok).__name__.encode())
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tok.get_vocab().items())).encode())
    h.update(json.dumps([tok.eos_token_id, tok.bos_token_id, str(tok.special_tokens_map)]).encode())
    return h.hexdigest()
