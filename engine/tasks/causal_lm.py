"""``causal-lm``: fine-tune a pretrained Hugging Face causal language model on your text, fully or with LoRA.

The model, its tokenizer and the data are found and checked when the task is made (one line each, before a
run folder exists); the model's weights are read at ``build_model``, the text tokenized (once, cached) at
``data``. The parts live in ``engine/lm/``: ``model.py`` (loading, checks, LoRA), ``data.py`` (files,
tokenizing, the cache, packing).

The loss is the mean cross-entropy over the batch's trained tokens (``loss_weight``: their count), so the
engine's combination of devices, ``Σ tokensᵢ·lossᵢ / Σ tokensᵢ``, is the full batch's token mean whatever
each device's share; the validation loss is that mean over the whole validation set, and its exponential
the eval record's ``perplexity``.
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any, Literal

import torch
from multilane.engine.lm import data as lm_data
from multilane.engine.lm import model as lm_model
from multilane.engine.tasks.base import Task
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from torch import nn
from torch.nn import functional as F


class CausalLMParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(
        "",
        description="The pretrained model: a folder in save_pretrained layout (config.json and weights), or a Hub "
        "name such as org/model where the Hub is reachable",
        json_schema_extra={"picker": "folder"},
    )
    tokenizer: str = Field(
        "",
        description="The tokenizer's folder or Hub name (empty: the model's own)",
        json_schema_extra={"picker": "folder"},
    )
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = Field(
        "float32", description="The dtype the weights are loaded in (train.precision adds autocast on top)"
    )
    data: list[str] = Field(
        default_factory=list,
        description='.txt or .jsonl files or folders of them; a .jsonl line holds "text", or "prompt" and '
        '"completion" (the loss on the completion only)',
        json_schema_extra={"picker": "path"},
    )
    context: int = Field(512, ge=2, le=1_048_576, description="Tokens per sample (at most the model's positions)")
    lora_rank: int = Field(8, ge=0, le=4096, description="LoRA adapters' rank (0: fine-tune every weight)")
    lora_alpha: float = Field(16.0, gt=0.0, le=1e6, description="LoRA's scale numerator (the update is alpha/rank)")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA adapters' input")
    lora_targets: list[str] = Field(
        default_factory=list,
        description="Module names to adapt, e.g. q_proj, v_proj (empty: PEFT's choice for the architecture, "
        "its attention projections)",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute each layer's activations in backward (less memory, about a third more time)"
    )
    prompts: list[str] = Field(
        default_factory=lambda: ["The", "Once upon a time"],
        description="Prompts the model continues greedily at each evaluation (written to samples.txt)",
        json_schema_extra={"separator": "|"},  # the form's list: a prompt may hold commas
    )
    sample_tokens: int = Field(
        24, ge=0, le=4096, description="Tokens generated per prompt at each evaluation (0: none)"
    )

    @field_validator("data", "lora_targets", "prompts", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any, info: ValidationInfo) -> Any:
        """A list; or one string: a JSON list (``["a", "b"]``, as a form's text field holds one), names
        separated by commas (``lora_targets``: ``q_proj, v_proj``), else the one path or prompt."""
        if not isinstance(v, str):
            return v
        if v.strip().startswith("["):
            with contextlib.suppress(ValueError):
                return json.loads(v)
        if info.field_name == "lora_targets":
            return [t for t in re.split(r"[,\s]+", v) if t]
        return [v] if v else []


class CausalLMTask(Task):
    """A pretrained causal LM and its tokenizer, fine-tuned on text files (LoRA or full); perplexity."""

    name = "causal-lm"
    description = "Fine-tune a pretrained Hugging Face causal LM (a save_pretrained folder) on text, LoRA or full"
    Params = CausalLMParams
    metric = None
    loss_unit = "tokens"

    def __init__(self, params: BaseModel | None = None) -> None:
        super().__init__(params)
        p = self.params
        self.source = lm_model.resolve(p.model, "model")
        self.tokenizer_source = lm_model.resolve(p.tokenizer, "tokenizer") if p.tokenizer else self.source
        config = lm_model.load_config(self.source)
        self.tokenizer = lm_model.load_tokenizer(self.tokenizer_source, "tokenizer" if p.tokenizer else "model")
        lm_model.check_pair(config, self.tokenizer, p.context, p.model, p.tokenizer or p.model)
        if p.lora_rank > 0 and p.lora_targets:
            lm_model.check_targets(p.lora_targets, lm_model.module_names(config))
        lm_data.data_files(p.data)  # the files are there (their lines are read at data())
        tok = self.tokenizer
        self.pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        self._data: lm_data.PackedTokens | None = None

    def build_model(self) -> nn.Module:
        return lm_model.load_model(self.params, self.source)

    def base_source(self) -> str:
        """Where the pretrained weights come from: a checkpoint of a LoRA run names its frozen base so."""
        return self.source

    def data(self) -> lm_data.PackedTokens:
        if self._data is None:  # the fit check and the run both ask: tokenized (or read) once
            key = lm_model.tokenizer_key(self.tokenizer)
            ids, loss = lm_data.token_stream(self.params.data, self.tokenizer, key)
            self._data = lm_data.PackedTokens(ids, loss, self.params.context, self.pad_id)
        return self._data

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy over the trained tokens given (targets -100 skipped)."""
        logits = output if output.dtype in (torch.float32, torch.float64) else output.float()
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=lm_data.IGNORE)

    def loss_weight(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """What the loss is a mean over: the trained tokens (not padding, not a prompt's)."""
        return (target != lm_data.IGNORE).sum()

    def tokens_per_sample(self) -> int:
        """Token positions the model computes per sample: ``context`` (train records' ``tokens_per_s``)."""
        return self.params.context

    def fsdp_units(self, model: nn.Module) -> list[nn.Module]:
        """fsdp: one unit per decoder layer (the classes transformers keeps whole, ``_no_split_modules``)."""
        names = set(getattr(_base(model), "_no_split_modules", None) or ())
        return [m for m in model.modules() if type(m).__name__ in names]

    @torch.no_grad()
    def sample_text(self, model: nn.Module, device: torch.device, step: int) -> str | None:
        """Each prompt continued greedily by ``sample_tokens`` tokens (the same text on any device count)."""
        n = self.params.sample_tokens
        if n == 0 or not self.params.prompts:
            return None
        tok, context = self.tokenizer, self.params.context
        was_training = model.training
        model.eval()
        parts = []
        try:
            for prompt in self.params.prompts:
                ids = tok(prompt, add_special_tokens=True)["input_ids"][-context:] or [int(tok.eos_token_id)]
                seq = torch.tensor([ids], dtype=torch.long, device=device)
                new: list[int] = []
                for _ in range(n):
                    x = seq[:, -context:]
                    nxt = model(x, torch.ones_like(x))[0, -1].argmax().item()
                    new.append(int(nxt))
                    if nxt == tok.eos_token_id:
                        break
                    seq = torch.cat([seq, seq.new_tensor([[nxt]])], dim=1)
                parts.append(prompt + tok.decode(new, skip_special_tokens=False))
        finally:
            model.train(was_training)
        return "\n\n".join(parts)


def _base(model: nn.Module) -> nn.Module:
    """The transformers model inside the engine's ``CausalLM`` (and PEFT's wrapper, with LoRA)."""
    lm = getattr(model, "lm", model)
    get = getattr(lm, "get_base_model", None)
    return get() if callable(get) else lm
