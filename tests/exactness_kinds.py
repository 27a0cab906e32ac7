"""The model kinds people really train, each with its batches, loss and optimizer, for tests/test_exactness.py.

Every kind is float64 and seeded: built twice, it gives the same weights. ``python tests/test_exactness.py``
prints the measured maxima table of docs/design.md.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

PAD = -100
F64 = torch.float64


@dataclass
class Kind:
    model: Callable[[], nn.Module]
    batches: list[tuple[Any, Any]]
    loss: Callable[[Any, Any], torch.Tensor]
    weight: Callable[[Any, Any], Any] | None = None
    optimizer: Callable = field(default=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    accum: int = 1
    clip: float = 0.0


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- losses whose mean is not over samples ------------------------------------------------------------
class TokenModel(nn.Module):
    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.emb(tokens))))  # (B, T, vocab)


def token_batches(steps: int = 3, batch: int = 12, length: int = 7, vocab: int = 11) -> list:
    out = []
    for s in range(steps):
        g = _gen(100 + s)
        tokens = torch.randint(0, vocab, (batch, length), generator=g)
        target = torch.randint(0, vocab, (batch, length), generator=g)
        lengths = torch.randint(0, length + 1, (batch,), generator=g)
        lengths[:3] = 0  # the first samples are all padding: with [1, 3] weights lane 0 holds no token
        lengths[3] = length
        target[torch.arange(length)[None, :] >= lengths[:, None]] = PAD
        out.append((tokens, target))
    return out


def token_ce(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=PAD)


def token_count(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (target != PAD).sum()


CLASS_WEIGHTS = torch.tensor([0.2, 1.0, 3.0, 0.7, 1.5], dtype=F64)


def mlp(features: int = 8, out: int = 5) -> nn.Module:
    return nn.Sequential(nn.Linear(features, 16), nn.Tanh(), nn.Linear(16, out)).double()


def class_batches(steps: int = 3, batch: int = 13, classes: int = 5) -> list:
    out = []
    for s in range(steps):
        g = _gen(200 + s)
        out.append((torch.randn(batch, 8, generator=g, dtype=F64), torch.randint(0, classes, (batch,), generator=g)))
    return out


def class_weighted_ce(output, target):
    return F.cross_entropy(output, target, weight=CLASS_WEIGHTS)


def class_weight_sum(output, target):
    return CLASS_WEIGHTS[target].sum()


def masked_batches(steps: int = 3, batch: int = 12) -> list:
    out = []
    for s in range(steps):
        g = _gen(300 + s)
        x = torch.randn(batch, 8, generator=g, dtype=F64)
        y = torch.randn(batch, 5, generator=g, dtype=F64)
        mask = (torch.rand(batch, 5, generator=g) > 0.5).to(F64)
        mask[:3] = 0  # a shard with nothing to learn from: its own mean is 0/0
        mask[3] = 1
        out.append((x, (y, mask)))
    return out


def masked_mse(output, target):
    y, mask = target
    return ((output - y) ** 2 * mask).sum() / mask.sum()  # NaN gradient on an all-masked shard


def mask_count(output, target):
    return target[1].sum()


# -- true replicas ------------------------------------------------------------------------------------
class TiedMaxNorm(nn.Module):
    """Embedding(max_norm) tied to the output layer: the forward renormalises rows in place, and the
    output layer reads every row."""

    def __init__(self, vocab: int = 13, dim: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, max_norm=1.0)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.emb.weight
        with torch.no_grad():
            self.emb.weight.mul_(3.0)  # rows well above max_norm: every lookup renormalises

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(tokens).mean(dim=1)))


class UntiedMaxNorm(TiedMaxNorm):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(6, 13, bias=False)


def maxnorm_batches(steps: int = 3, batch: int = 10) -> list:
    out = []
    for s in range(steps):
        g = _gen(400 + s)
        out.append((torch.randint(0, 13, (batch, 3), generator=g), torch.randint(0, 13, (batch,), generator=g)))
    return out


class L2InForward(nn.Module):
    """Returns (prediction, penalty), the penalty read from ``self.parameters()`` in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp(8, 3)

    def forward(self, x):
        penalty = 1e-2 * sum((p**2).sum() for p in self.parameters())
        return self.body(x), penalty


def with_penalty(output, target):
    return F.mse_loss(output[0], target) + output[1]


def regression_batches(steps: int = 3, batch: int = 11, features: int = 8, out: int = 3, seed: int = 500) -> list:
    res = []
    for s in range(steps):
        g = _gen(seed + s)
        res.append(
            (torch.randn(batch, features, generator=g, dtype=F64), torch.randn(batch, out, generator=g, dtype=F64))
        )
    return res


# -- outputs with auxiliary values --------------------------------------------------------------------
@dataclass
class Prediction:
    logits: torch.Tensor
    aux: torch.Tensor  # 0-dim
    name: str = "prediction"


Pair = namedtuple("Pair", "logits aux")


class AuxOutputs(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.body = mlp(8, 5)

    def forward(self, x):
        logits = self.body(x)
        aux = 0.1 * logits.pow(2).mean()  # an auxiliary loss: one number per call
        if self.kind == "scalar":
            return logits, aux
        if self.kind == "dataclass":
            return Prediction(logits, aux)
        return Pair(logits, aux)


def ce_plus_aux(output, target):
    logits, aux = (output.logits, output.aux) if isinstance(output, Prediction) else (output[0], output[1])
    return F.cross_entropy(logits, target) + aux


# -- the kinds already exact before true replicas -------------------------------------------------------
class DictInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(3, 4)
        self.register_buffer("scale", torch.tensor([1.0, 2.0, 0.5, 1.5]))

    def forward(self, x, z, shift=0.0):
        return (self.a(x) + self.b(z)) * self.scale + shift


def dict_batches(steps: int = 3, batch: int = 10) -> list:
    res = []
    for s in range(steps):
        g = _gen(600 + s)
        inputs = {"x": torch.randn(batch, 8, generator=g), "z": torch.randn(batch, 3, generator=g), "shift": 0.25}
        res.append(
            (
                {k: v.double() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()},
                torch.randn(batch, 4, generator=g).double(),
            )
        )
    return res


class TiedLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.b.weight = self.a.weight
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


class UnusedParams(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = mlp(8, 3)
        self.unused = nn.Linear(8, 3)

    def forward(self, x):
        return self.used(x)


class LSTMModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 6, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def seq_batches(steps: int = 3, batch: int = 9) -> list:
    res = []
    for s in range(steps):
        g = _gen(700 + s)
        res.append((torch.randn(batch, 5, 4, generator=g, dtype=F64), torch.randn(batch, 3, generator=g, dtype=F64)))
    return res


class ScalarScale(nn.Module):
    """Two 0-dim parameters: a learnable scale and shift around an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp(8, 3)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.shift = nn.Parameter(torch.tensor(0.25))

    def forward(self, x):
        return self.scale * self.body(x) + self.shift


def seeded(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(7)
        return build().double()

    return make


def adam(p):
    return torch.optim.Adam(p, lr=0.01)


KINDS: dict[str, Kind] = {
    "token-mean CE, padding": Kind(seeded(TokenModel), token_batches(), token_ce, token_count),
    "class-weighted CE": Kind(seeded(mlp), class_batches(), class_weighted_ce, class_weight_sum),
    "masked loss": Kind(seeded(mlp), masked_batches(), masked_mse, mask_count),
    "tied Embedding(max_norm)": Kind(seeded(TiedMaxNorm), maxnorm_batches(), F.cross_entropy),
    "untied Embedding(max_norm)": Kind(seeded(UntiedMaxNorm), maxnorm_batches(), F.cross_entropy),
    "L2 penalty in forward": Kind(seeded(L2InForward), regression_batches(), with_penalty),
    "aux 0-dim output": Kind(seeded(lambda: AuxOutputs("scalar")), class_batches(), ce_plus_aux),
    "dataclass output": Kind(seeded(lambda: AuxOutputs("dataclass")), class_batches(), ce_plus_aux),
    "namedtuple output": Kind(seeded(lambda: AuxOutputs("namedtuple")), class_batches(), ce_plus_aux),
    "dict inputs + buffer": Kind(seeded(DictInputs), dict_batches(), F.mse_loss),
    "tied weights": Kind(seeded(TiedLinear), regression_batches(), F.mse_loss),
    "unused parameters (Adam)": Kind(seeded(UnusedParams), regression_batches(), F.mse_loss, optimizer=adam),
    "LSTM": Kind(seeded(LSTMModel), seq_batches(), F.mse_loss),
    "0-dim parameters": Kind(seeded(ScalarScale), regression_batches(), F.mse_loss),
    "grad accumulation (3)": Kind(seeded(mlp), class_batches(steps=6), class_weighted_ce, class_weight_sum, accum=3),
    "clipping": Kind(seeded(TiedLinear), regression_batches(), F.mse_loss, clip=0.05),
}
