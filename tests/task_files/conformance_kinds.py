"""The model kinds of the conformance matrix (tests/engine/conformance/): ``kind`` picks one.

Every kind is tiny, float64 and seeded (its data from its own generator, its weights from the run's
seed), so that a few steps on any strategy can be compared with a plain one-device loop to 1e-10.
``samples`` sets the training set's size (the matrix runs with ``data.val_fraction = 0``): with
``batch_size`` it decides where an epoch's short last batch falls.
"""

from collections import namedtuple
from dataclasses import dataclass
from typing import Literal

import torch
from multilane.engine.tasks import ArrayData, Task
from pydantic import BaseModel
from torch import nn
from torch.nn import functional as F

IGNORE = -100
VOCAB, DIM, LENGTH = 11, 8, 5
KindName = Literal[
    "dict-dataclass",
    "tuple-namedtuple",
    "batchnorm",
    "unused",
    "never-taken",
    "frozen",
    "data-dependent",
    "transformer",
    "tied-embedding",
    "tied-maxnorm",
    "sparse-embedding",
    "lstm",
    "zero-dim",
    "reads-own-params",
    "grad-penalty",
    "buffer-requires-grad",
    "ignore-index",
    "mlp",
]


class Params(BaseModel):
    kind: KindName = "mlp"
    samples: int = 24


@dataclass
class Prediction:
    value: torch.Tensor
    aux: torch.Tensor  # 0-dim: an auxiliary loss, one number per call


Pair = namedtuple("Pair", "value aux")


def mlp(inp: int = 6, out: int = 3) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inp, 8), nn.Tanh(), nn.Linear(8, out))


class DictDataclass(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 3), nn.Linear(2, 3)

    def forward(self, x, z):
        v = torch.tanh(self.a(x) + self.b(z))
        return Prediction(v, 0.1 * v.pow(2).mean())


class TupleNamedtuple(DictDataclass):
    def forward(self, x, z):
        p = super().forward(x, z)
        return Pair(p.value, p.aux)


class BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.bn, self.out = nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.bn(self.inp(x))))


class Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.unused = mlp(), nn.Linear(6, 3)  # ``unused`` is never called

    def forward(self, x):
        return self.body(x)


class NeverTaken(Unused):
    def forward(self, x):
        if x.abs().max() > 1e6:  # never true for this data: the branch's layer never gets a gradient
            return self.unused(x)
        return self.body(x)


class Frozen(Unused):
    def __init__(self) -> None:
        super().__init__()
        self.unused.requires_grad_(False)  # used, but frozen

    def forward(self, x):
        return self.body(x) + self.unused(x)


class DataDependent(Unused):
    def forward(self, x):
        h = self.body(x)
        rare = x[:, 0] > 1.0  # some samples only: a shard without one skips ``unused`` entirely
        if rare.any():
            h = h.clone()
            h[rare] = h[rare] + self.unused(x[rare])
        return h


class Transformer(nn.Module):
    """One encoder layer with dropout; padding positions are masked out of attention and the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layer = nn.TransformerEncoderLayer(DIM, 2, 16, dropout=0.2, batch_first=True)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens, pad):
        return self.head(self.layer(self.emb(tokens), src_key_padding_mask=pad))


class TiedEmbedding(nn.Module):
    def __init__(self, max_norm: float | None = None, sparse: bool = False, tied: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, max_norm=max_norm, sparse=sparse)
        self.mix = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        if max_norm is not None:
            with torch.no_grad():
                self.emb.weight.mul_(3.0)  # rows above max_norm: every lookup renormalises in place

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.emb(tokens).mean(dim=1))))


class LSTMNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.head = nn.LSTM(DIM, 6, batch_first=True), nn.Linear(6, VOCAB)
        self.emb = nn.Embedding(VOCAB, DIM)

    def forward(self, tokens):
        out, _ = self.lstm(self.emb(tokens))
        return self.head(out[:, -1])


class ZeroDim(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.scale = mlp(), nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.scale * self.body(x)


class ReadsOwnParams(nn.Module):
    """Returns (prediction, penalty), the penalty read from ``self.parameters()`` in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()

    def forward(self, x):
        return self.body(x), 1e-2 * sum((p**2).sum() for p in self.parameters())


class GradPenalty(nn.Module):
    """A gradient penalty: the input gradient's norm, taken with ``create_graph`` inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()

    def forward(self, x):
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            y = self.body(x)
            (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return y, 0.1 * g.pow(2).sum(dim=1).mean()


class BufferRequiresGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()
        self.register_buffer("shift", torch.linspace(-1, 1, 3).requires_grad_(True))

    def forward(self, x):
        return self.body(x) + self.shift


class TokenTagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mix, self.head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.emb(tokens))))


MODELS = {
    "dict-dataclass": DictDataclass,
    "tuple-namedtuple": TupleNamedtuple,
    "batchnorm": BatchNormNet,
    "unused": Unused,
    "never-taken": NeverTaken,
    "frozen": Frozen,
    "data-dependent": DataDependent,
    "transformer": Transformer,
    "tied-embedding": TiedEmbedding,
    "tied-maxnorm": lambda: TiedEmbedding(max_norm=1.0),
    "sparse-embedding": lambda: TiedEmbedding(sparse=True, tied=False),
    "lstm": LSTMNet,
    "zero-dim": ZeroDim,
    "reads-own-params": ReadsOwnParams,
    "grad-penalty": GradPenalty,
    "buffer-requires-grad": BufferRequiresGrad,
    "ignore-index": TokenTagger,
    "mlp": mlp,
}
TOKENS_IN = ("tied-embedding", "tied-maxnorm", "sparse-embedding", "lstm")  # tokens in, one class out
PER_TOKEN = ("transformer", "ignore-index")  # a class per token, padding ignored


def _value(output):
    return output.value if isinstance(output, Prediction | Pair) else output[0] if isinstance(output, tuple) else output


class ConformanceKinds(Task):
    name = "conformance"
    Params = Params

    def build_model(self) -> nn.Module:
        return MODELS[self.params.kind]().double()

    def data(self) -> ArrayData:
        kind, n = self.params.kind, self.params.samples
        g = torch.Generator().manual_seed(11)
        if kind in TOKENS_IN:
            tokens = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
            return ArrayData(tokens, tokens[:, 0])
        if kind in PER_TOKEN:
            tokens = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
            lengths = torch.randint(1, LENGTH + 1, (n,), generator=g)  # at least one real token a sample
            pad = torch.arange(LENGTH)[None, :] >= lengths[:, None]
            target = torch.roll(tokens, 1, dims=1).masked_fill(pad, IGNORE)
            return ArrayData((tokens, pad) if kind == "transformer" else tokens, target)
        x = torch.randn(n, 6, generator=g, dtype=torch.float64)
        y = torch.stack([x[:, :3].sum(1).sin(), x[:, 3:].sum(1).cos(), x[:, 0] * x[:, 5]], dim=1)
        if kind == "dict-dataclass":
            return ArrayData({"x": x, "z": x[:, :2].exp()}, y)
        if kind == "tuple-namedtuple":
            return ArrayData((x, x[:, :2].exp()), (y, y.abs()))
        return ArrayData(x, y)

    def loss(self, output, target):
        kind = self.params.kind
        if kind in TOKENS_IN:
            return F.cross_entropy(output, target)
        if kind in PER_TOKEN:
            return F.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=IGNORE)
        if kind == "tuple-namedtuple":
            return F.mse_loss(output.value, target[0]) + F.l1_loss(output.value.abs(), target[1]) + output.aux
        loss = F.mse_loss(_value(output), target)
        if isinstance(output, Prediction):
            return loss + output.aux
        return loss + output[1] if isinstance(output, tuple) else loss

    def loss_weight(self, output, target):
        """The loss is a mean over tokens where padding is ignored: each shard weighs by its tokens."""
        if self.params.kind in PER_TOKEN:
            return (target != IGNORE).sum()
        return _length(target)

    def metrics(self, output, target):
        return {}


def _length(target) -> int:
    return (target[0] if isinstance(target, tuple) else target).shape[0]
