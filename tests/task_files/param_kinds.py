"""Float64 models whose parameters or gradients are unusual, for every strategy and instrument.

``kind`` picks one:

- ``sparse``: ``Embedding(sparse=True)`` (sparse gradient) into a linear head;
- ``sparse_tied``: the same embedding tied to the output head (its gradient: sparse from the lookup
  plus dense from the head, accumulated into a dense one);
- ``sparse_bag``: ``EmbeddingBag(sparse=True, mode="sum")`` beside a dense embedding, with a layer
  that no sample uses (no gradient at all);
- ``paramread``: a forward that reads ``self.parameters()`` (an L2 penalty added to the output);
- ``scalar``: a 0-dim learnable scale (``nn.Parameter(torch.tensor(1.5))``) and a 0-dim bias;
- ``maxnorm``: ``Embedding(max_norm=1.0)`` (the forward renormalises the rows it reads, in place);
- ``viewadd``: a ``Linear`` on a 3-d input (its output is a view) whose output the parent changes in
  place (``h += ...``): fine on one device, wrong gradients under FSDP2 (it skips the unit's gathering);
- ``views``: the same with ``h = h + ...`` (out of place): every strategy trains it.

``one_unit``: under fsdp the whole model is one unit (``fsdp_units`` returns none), so that a forward
that reads ``self.parameters()`` sees every parameter gathered.

Input: token ids ``(N, 4)``; target: a class out of ``VOCAB``.
"""

import warnings
from typing import Literal

import torch
from multilane.engine.tasks import ArrayData, Task
from pydantic import BaseModel
from torch import nn
from torch.nn import functional as F

VOCAB, DIM = 13, 6


class Params(BaseModel):
    kind: Literal["sparse", "sparse_tied", "sparse_bag", "paramread", "scalar", "maxnorm", "viewadd", "views"] = (
        "sparse"
    )
    samples: int = 40
    warn: bool = False  # the model's forward raises a warning of its own (it must reach the user once)
    nan_token: int = -1  # >= 0: that row of the sparse embedding is NaN (the NaN replay's case)
    one_unit: bool = False  # fsdp: the whole model one unit (``fsdp_units`` returns none)


class Sparse(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, sparse=True)
        self.mix = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.emb(tokens).mean(1))))


class SparseBag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, DIM, mode="sum", sparse=True)
        self.dense = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.never = nn.Linear(DIM, DIM)  # no sample uses it: no gradient

    def forward(self, tokens):
        return self.head(torch.tanh(self.bag(tokens) + self.dense(tokens[:, 0])))


class ParamRead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        penalty = 1e-2 * sum((p**2).sum() for p in self.parameters())
        return self.head(torch.tanh(self.emb(tokens).mean(1))) + penalty


class Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.shift = nn.Parameter(torch.tensor(0.25))

    def forward(self, tokens):
        return self.head(torch.tanh(self.scale * self.emb(tokens).mean(1) + self.shift))


class MaxNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, max_norm=1.0)
        self.head = nn.Linear(DIM, VOCAB)
        with torch.no_grad():
            self.emb.weight.mul_(3.0)  # rows above max_norm: every lookup renormalises

    def forward(self, tokens):
        return self.head(torch.tanh(self.emb(tokens).mean(1)))


class Warns(nn.Module):
    """Wraps a model; its forward warns (a UserWarning of the user's own) every call."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, tokens):
        warnings.warn("paramkinds: this model warns in its forward", UserWarning, stacklevel=1)
        return self.inner(tokens)


class ViewAdd(nn.Module):
    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.inplace = inplace
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        h = self.mix(self.emb(tokens))  # (N, 4, DIM): a view
        if self.inplace:
            h += 0.5
        else:
            h = h + 0.5
        return self.head(torch.tanh(h).mean(1))


class ParamKinds(Task):
    name = "paramkinds"
    Params = Params

    def build_model(self) -> nn.Module:
        kind = self.params.kind
        if kind in ("sparse", "sparse_tied"):
            model = Sparse(kind == "sparse_tied")
            if self.params.nan_token >= 0:
                with torch.no_grad():
                    model.emb.weight[self.params.nan_token] = float("nan")
        else:
            model = {
                "sparse_bag": SparseBag,
                "paramread": ParamRead,
                "scalar": Scalar,
                "maxnorm": MaxNorm,
                "viewadd": lambda: ViewAdd(True),
                "views": lambda: ViewAdd(False),
            }[kind]()
        return (Warns(model) if self.params.warn else model).double()

    def fsdp_units(self, model: nn.Module) -> list[nn.Module]:
        from multilane.engine.fsdp.units import default_units

        return [] if self.params.one_unit else default_units(model)

    def data(self) -> ArrayData:
        g = torch.Generator().manual_seed(4)
        tokens = torch.randint(0, VOCAB, (self.params.samples, 4), generator=g)
        return ArrayData(tokens, (tokens.sum(1) * 3) % VOCAB)

    def loss(self, output, target):
        return F.cross_entropy(output, target)
