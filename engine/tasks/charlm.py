"""``charlm``: a small GPT-style decoder on the bytes of a text file (default: the corpus in assets/).

Samples are whole lines of the text packed up to ``context + 1`` bytes, so they differ in length; the
collate pads them, and the loss is the mean over real (not padded) next-byte predictions. Bits per
byte is the metric. At every evaluation the model writes a short text of its own (``sample_text``).
"""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from multilane.engine.errors import UserError
from multilane.engine.rundir.readfile import user_path
from multilane.engine.tasks.base import Task
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import Dataset

IGNORE = -100
"""The target of a padded position: cross-entropy skips it."""


class CharLMParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(
        "",
        description="A UTF-8 (or any byte) text file to learn; empty: the public-domain corpus shipped in assets/",
        json_schema_extra={"picker": "file"},
    )
    context: int = Field(128, ge=8, le=4096, description="Longest sequence, in bytes (the model's context)")
    layers: int = Field(2, ge=1, le=48, description="Transformer blocks")
    heads: int = Field(4, ge=1, le=64, description="Attention heads per block (width must divide by it)")
    width: int = Field(128, ge=8, le=8192, description="Model width (embedding size)")
    dropout: float = Field(0.1, ge=0.0, lt=1.0, description="Dropout after attention and MLP, and on embeddings")
    checkpointing: bool = Field(
        False, description="Activation checkpointing: recompute each block in backward (less memory, more time)"
    )
    sample_bytes: int = Field(
        200, ge=0, le=100_000, description="Bytes of text the model writes at each evaluation (0: none)"
    )
    temperature: float = Field(
        0.8, ge=0.01, le=10.0, description="Sampling temperature of that text (0.01 to 10; lower is greedier)"
    )

    @model_validator(mode="after")
    def _heads_divide_width(self) -> CharLMParams:
        if self.width % self.heads:
            raise ValueError(f"width {self.width} must be a multiple of heads {self.heads}")
        return self


def default_corpus() -> Path:
    return Path(str(resources.files("multilane.assets").joinpath("corpus.txt")))


def read_corpus(path: str) -> bytes:
    p = user_path(path, "task charlm: task.params.path") if path else default_corpus()
    if not p.is_file():
        raise UserError(f"task charlm: path = {str(p)!r}: no such file")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise UserError(f"task charlm: path = {str(p)!r}: cannot read it ({e.strerror or e})") from None
    if len(data) < 2:
        raise UserError(f"task charlm: path = {str(p)!r}: the file holds fewer than 2 bytes")
    return data


def pack_lines(text: bytes, longest: int) -> list[tuple[int, int]]:
    """``(start, end)`` byte spans of the text: whole lines packed greedily up to ``longest`` bytes (a line
    longer than that is cut). Spans differ in length, cover the text, and have at least 2 bytes."""
    spans: list[tuple[int, int]] = []
    start = pos = 0
    n = len(text)
    while pos < n:
        nl = text.find(b"\n", pos)
        end = n if nl < 0 else nl + 1
        if end - start > longest:
            if pos > start:  # close the span before this line
                spans.append((start, pos))
                start = pos
            while end - start > longest:
                spans.append((start, start + longest))
                start += longest
        pos = end
    if pos > start:
        spans.append((start, pos))
    return [(a, b) for a, b in spans if b - a >= 2]


class ByteLines(Dataset):
    """Item ``i``: ``(inputs, target)``, the span's bytes and the same shifted by one (variable length)."""

    def __init__(self, text: bytes, longest: int) -> None:
        self.data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        self.spans = pack_lines(text, longest)

    def __len__(self) -> int:
        return len(self.spans)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.spans[i]
        chunk = self.data[a:b].long()
        return chunk[:-1], chunk[1:]


def pad_collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest sample: inputs with 0, targets with IGNORE (no loss there). Padding sits
    after the real bytes, so the causal mask already keeps it out of every real position's attention."""
    longest = max(x.shape[0] for x, _ in samples)
    inputs = torch.zeros(len(samples), longest, dtype=torch.long)
    target = torch.full((len(samples), longest), IGNORE, dtype=torch.long)
    for k, (x, y) in enumerate(samples):
        inputs[k, : x.shape[0]] = x
        target[k, : y.shape[0]] = y
    return inputs, target


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.drop1, self.drop2 = nn.Dropout(dropout), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        # Causal self-attention; dropout on the attention weights only while training.
        att = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        x = x + self.drop1(self.proj(att.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop2(self.mlp(self.ln2(x)))


class ByteGPT(nn.Module):
    """A GPT-style decoder over bytes: embeddings, ``layers`` causal blocks, a linear head to 256 logits."""

    def __init__(self, p: CharLMParams) -> None:
        super().__init__()
        self.context, self.checkpointing = p.context, p.checkpointing
        self.tok = nn.Embedding(256, p.width)
        self.pos = nn.Embedding(p.context, p.width)
        self.drop = nn.Dropout(p.dropout)
        self.blocks = nn.ModuleList(Block(p.width, p.heads, p.dropout) for _ in range(p.layers))
        self.ln = nn.LayerNorm(p.width)
        self.head = nn.Linear(p.width, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.drop(self.tok(x) + self.pos(torch.arange(t, device=x.device)))
        for block in self.blocks:
            if self.checkpointing and self.training and torch.is_grad_enabled():
                h = checkpoint(block, h, use_reentrant=False)
            else:
                h = block(h)
        return self.head(self.ln(h))

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, n: int, temperature: float, generator: torch.Generator) -> torch.Tensor:
        seq = prompt
        for _ in range(n):
            logits = self(seq[:, -self.context :])[:, -1, :] / temperature
            probs = torch.softmax(logits.float(), dim=-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(seq.device)
            seq = torch.cat([seq, nxt], dim=1)
        return seq[:, prompt.shape[1] :]


class CharLMTask(Task):
    """A byte-level language model: a small GPT on a text file, bits per byte."""

    name = "charlm"
    description = "Small GPT-style decoder on the bytes of a text file (default: a public-domain corpus), bits/byte"
    Params = CharLMParams
    metric = "bits_per_byte"
    loss_unit = "tokens"  # loss_weight counts the real target bytes (tokens): the noise scale is in them

    def build_model(self) -> nn.Module:
        return ByteGPT(self.params)

    def data(self) -> Dataset:
        return ByteLines(read_corpus(self.params.path), self.params.context + 1)

    def collate(self, samples: list[Any]) -> Any:
        return pad_collate(samples)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the real next-byte predictions of the shard (padding ignored)."""
        return F.cross_entropy(output.flatten(0, 1).float(), target.flatten(), ignore_index=IGNORE)

    def loss_weight(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """What the loss is a mean over: the shard's real (not padded) target bytes."""
        return (target != IGNORE).sum()

    def metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"bits_per_byte": self.loss(output, target) / math.log(2)}

    def sample_text(self, model: nn.Module, device: torch.device, step: int) -> str | None:
        """A few hundred bytes written by the model from a newline, seeded by the step (reproducible)."""
        n = self.params.sample_bytes
        if n == 0:
            return None
        assert isinstance(model, ByteGPT)
        g = torch.Generator().manual_seed(step)
        prompt = torch.tensor([[ord("\n")]], device=device)
        was_training = model.training
        model.eval()
        try:
            out = model.generate(prompt, n, self.params.temperature, g)
        finally:
            model.train(was_training)
        return bytes(out[0].tolist()).decode("utf-8", errors="replace")
