"""A tiny Llama-shaped causal LM under LoRA adapters (peft), float64: the frozen-base case as a user brings
it in a task file. ``model`` is a folder in ``save_pretrained`` layout (``make_base`` writes one with
random weights); its weights are frozen, only the adapters (``rank``) train. Data: seeded random tokens.

``make_base(folder, seed)`` builds the base; ``LoraLlama.base_source()`` names it in checkpoints.
"""

from __future__ import annotations

import torch
from multilane.engine.integrations.extras import _torchvision_importable
from multilane.engine.tasks import ArrayData, Task
from pydantic import BaseModel
from torch import nn
from torch.nn import functional as F

_torchvision_importable()  # torchvision beside a CPU torch: docs/integrations.md


def _quiet() -> None:
    from transformers.utils import logging

    logging.disable_progress_bar()  # "Loading weights: 100%": not a line a run's output needs


VOCAB = 96


class Params(BaseModel):
    model: str
    rank: int = 8
    alpha: float = 16.0
    targets: list[str] = ["q_proj", "v_proj"]
    samples: int = 24
    context: int = 12


def llama_config(hidden: int = 64, layers: int = 2):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )


def make_base(folder, seed: int = 0, hidden: int = 64, layers: int = 2) -> None:
    """A random tiny Llama, float64, written with ``save_pretrained`` into ``folder``."""
    from transformers import LlamaForCausalLM

    _quiet()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(hidden, layers)).to(torch.float64)
    model.save_pretrained(folder)


class Logits(nn.Module):
    """The PEFT model, called on token ids, returning the logits (a tensor every strategy gathers)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids).logits


def lora_model(folder: str, rank: int, alpha: float, targets: list[str]) -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    _quiet()
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="eager")
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM")
    peft = get_peft_model(base, config)
    for name, p in peft.named_parameters():  # LoRA's B starts at zero: a nonzero start tests more
        if "lora_B" in name:
            with torch.no_grad():
                p.normal_(0, 0.02)
    return peft


class LoraLlama(Task):
    name = "lora_llama"
    Params = Params

    def base_source(self) -> str:
        return self.params.model

    def build_model(self) -> nn.Module:
        p = self.params
        return Logits(lora_model(p.model, p.rank, p.alpha, p.targets))

    def data(self) -> ArrayData:
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(0, VOCAB, (self.params.samples, self.params.context + 1), generator=g)
        return ArrayData(inputs=ids[:, :-1], target=ids[:, 1:])

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
