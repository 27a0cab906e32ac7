"""A token model with padding, a token-mean loss, and a dataclass output with a 0-dim field.

Its loss is a mean over the non-padding tokens (``loss_weight``), and its model returns a dataclass whose
``aux`` field is one number per call (gathered into one number per lane at evaluation).
"""

from dataclasses import dataclass

import torch
from multilane.engine.tasks import ArrayData, Task
from torch import nn
from torch.nn import functional as F

PAD = -100
VOCAB, LENGTH = 11, 6


@dataclass
class LMOutput:
    logits: torch.Tensor
    aux: torch.Tensor


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.mix = nn.Linear(8, 8)
        self.out = nn.Linear(8, VOCAB)

    def forward(self, tokens: torch.Tensor) -> LMOutput:
        logits = self.out(torch.tanh(self.mix(self.emb(tokens))))
        return LMOutput(logits, 1e-3 * logits.pow(2).mean())


class PaddedTokens(Task):
    name = "padded-tokens"
    metric = "token_accuracy"

    def build_model(self) -> nn.Module:
        return TinyLM().double()

    def data(self) -> ArrayData:
        g = torch.Generator().manual_seed(5)
        n = 90
        tokens = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
        target = torch.roll(tokens, -1, dims=1)
        lengths = torch.randint(0, LENGTH + 1, (n,), generator=g)
        lengths[::7] = 0  # some sequences are all padding
        target[torch.arange(LENGTH)[None, :] >= lengths[:, None]] = PAD
        return ArrayData(tokens, target)

    def loss(self, output: LMOutput, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.logits.flatten(0, 1), target.flatten(), ignore_index=PAD)

    def loss_weight(self, output: LMOutput, target: torch.Tensor) -> torch.Tensor:
        return (target != PAD).sum()

    def metrics(self, output: LMOutput, target: torch.Tensor) -> dict[str, torch.Tensor]:
        real = target != PAD
        hits = (output.logits.argmax(-1) == target) & real
        return {"token_accuracy": hits.sum() / real.sum().clamp_min(1)}
