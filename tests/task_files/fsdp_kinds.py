"""Float64 model kinds for fsdp's exactness tests (tests/engine/fsdp/): ``kind`` picks one.

- ``mlp``: the built-in hidden-layer MLP (``mlp`` task's model) on synthetic data;
- ``cnn``: the digits CNN (the ``digits`` task's model) on the first 72 of scikit-learn's digits;
- ``charlm``: the charlm transformer (``ByteGPT``) on a short text, token-weighted loss, with a text
  sample at each evaluation (rank 0 writes it from the gathered model);
- ``tiedbn``: an embedding tied to the output head, BatchNorm between them (tied weights stay in the
  root's FSDP unit; BatchNorm's statistics over the whole batch with ``devices.sync_batchnorm``).
"""

from typing import Literal

import torch
from multilane.engine.tasks import ArrayData, Task
from multilane.engine.tasks.builtin import DigitsNet, mlp
from multilane.engine.tasks.charlm import IGNORE, ByteGPT, ByteLines, CharLMParams, pad_collate
from pydantic import BaseModel
from torch import nn
from torch.nn import functional as F

TEXT = (b"the quick brown fox jumps over the lazy dog\nsphinx of black quartz, judge my vow\n" * 3)[:230]


class Params(BaseModel):
    kind: Literal["mlp", "cnn", "charlm", "tiedbn"] = "mlp"
    samples: int = 40


class TiedBN(nn.Module):
    def __init__(self, vocab: int = 13, dim: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.bn = nn.BatchNorm1d(dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)
        self.head.weight = self.emb.weight  # tied

    def forward(self, tokens):
        h = self.bn(self.emb(tokens).transpose(1, 2)).transpose(1, 2)
        return self.head(torch.tanh(self.mix(h)))


class FsdpKinds(Task):
    name = "fsdpkinds"
    Params = Params

    def _lm(self) -> CharLMParams:
        return CharLMParams(context=16, layers=2, heads=2, width=8, dropout=0.0, sample_bytes=6)

    def build_model(self) -> nn.Module:
        kind = self.params.kind
        if kind == "mlp":
            return mlp(8, 16, 2, 5).double()
        if kind == "cnn":
            return DigitsNet(4, 16).double()
        if kind == "charlm":
            return ByteGPT(self._lm()).double()
        return TiedBN().double()

    def data(self):
        kind, n = self.params.kind, self.params.samples
        g = torch.Generator().manual_seed(3)
        if kind == "mlp":
            x = torch.randn(n, 8, generator=g, dtype=torch.float64)
            return ArrayData(x, (x[:, :5].sum(1) * 2).long().clamp(0, 4))
        if kind == "cnn":
            from sklearn.datasets import load_digits

            d = load_digits()
            x = torch.tensor(d.images[:n], dtype=torch.float64).unsqueeze(1) / 16.0
            return ArrayData(x, torch.tensor(d.target[:n], dtype=torch.long))
        if kind == "charlm":
            return ByteLines(TEXT, self._lm().context + 1)
        tokens = torch.randint(0, 13, (n, 5), generator=g)
        return ArrayData(tokens, torch.roll(tokens, 1, dims=1))

    def collate(self, samples):
        return pad_collate(samples)

    def loss(self, output, target):
        return F.cross_entropy(
            output.flatten(0, -2) if output.dim() > 2 else output, target.flatten(), ignore_index=IGNORE
        )

    def loss_weight(self, output, target):
        return (target != IGNORE).sum()

    def metrics(self, output, target):
        return {}

    def sample_text(self, model, device, step):
        if self.params.kind != "charlm":
            return None
        g = torch.Generator().manual_seed(step)
        prompt = torch.tensor([[ord("\n")]], device=device)
        was = model.training
        model.eval()
        try:
            out = model.generate(prompt, 6, 0.8, g)
        finally:
            model.train(was)
        return bytes(out[0].tolist()).decode("utf-8", errors="replace")
