"""The training text: .txt and .jsonl files read, tokenized once (cached beside the data), packed.

- A ``.txt`` file is one document. A ``.jsonl`` line is one: ``{"text": ...}``, or ``{"prompt": ...,
  "completion": ...}`` whose loss is on the completion only (the prompt's tokens are context, not targets).
- Documents are tokenized as the tokenizer does by default (its BOS, if it adds one) and each ends with
  the tokenizer's EOS; they are concatenated into one stream of token ids, with a flag per token saying
  whether predicting it is trained (``loss``).
- The stream is cached in ``.multilane-tokens/`` beside the data (the folder given, or the first file's
  folder), under a key made of the tokenizer (its whole definition) and every file's path and content
  hash: the same tokenizer on the same files reads the cache, any change tokenizes again. The packing is
  not cached (it is a view of the stream), so changing ``context`` keeps the cache.
- Packing: sample ``i`` is the stream's tokens ``i*context`` to ``(i+1)*context`` (inputs) and the next
  token of each (targets), so every token of the stream but the first is a target exactly once. Only the
  last sample can be short: it is padded, its padding masked out of attention (``attention_mask`` 0) and
  of the loss (target -100), as is every target whose token is not trained (a prompt's).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from multilane.engine.errors import UserError
from torch.utils.data import Dataset

WHO = "task causal-lm"
IGNORE = -100
"""The target where no loss is due (padding, a prompt's tokens): cross-entropy skips it."""
SUFFIXES = (".txt", ".jsonl")
CACHE = ".multilane-tokens"
BATCH = 512  # documents tokenized in one call


def data_files(paths: list[str]) -> list[Path]:
    """The .txt and .jsonl files the paths name (a folder: every such file under it, sorted), in order."""
    if not paths:
        raise UserError(f"{WHO}: data is empty; give .txt or .jsonl files or folders")
    files: list[Path] = []
    for name in paths:
        p = Path(name).expanduser()
        if p.is_dir():
            found = sorted(
                f
                for f in p.rglob("*")
                if f.suffix in SUFFIXES
                and f.is_file()
                and not any(part.startswith(".") for part in f.relative_to(p).parts)
            )
            if not found:
                raise UserError(f"{WHO}: data = {name!r}: the folder holds no .txt or .jsonl file")
            files += found
        elif p.is_file():
            if p.suffix not in SUFFIXES:
                raise UserError(f"{WHO}: data = {name!r}: not a .txt or .jsonl file")
            files.append(p)
        else:
            raise UserError(f"{WHO}: data = {name!r}: no such file or folder")
    return [f.resolve() for f in files]


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{WHO}: {path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise UserError(f"{WHO}: {path}: cannot read it ({e.strerror or e})") from None


def documents(path: Path) -> Iterator[tuple[str, str | None]]:
    """``(text, None)`` or ``(prompt, completion)`` per document of one file; one line naming file:line
    for a .jsonl line that holds neither."""
    text = _read(path)
    if path.suffix == ".txt":
        yield text, None
        return
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{WHO}: {path}:{i}: not a JSON object ({e.msg})") from None
        if isinstance(rec, dict) and isinstance(rec.get("text"), str):
            yield rec["text"], None
        elif isinstance(rec, dict) and isinstance(rec.get("prompt"), str) and isinstance(rec.get("completion"), str):
            yield rec["prompt"], rec["completion"]
        else:
            raise UserError(f'{WHO}: {path}:{i}: the line holds no "text" (nor "prompt" and "completion") string')


def _ids(tok: Any, texts: list[str], special: bool) -> list[list[int]]:
    return tok(texts, add_special_tokens=special)["input_ids"] if texts else []


def tokenize(files: list[Path], tok: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The token stream of every document of ``files`` (int32) and its loss flags (bool)."""
    eos = int(tok.eos_token_id)
    id_parts: list[torch.Tensor] = []  # one tensor per chunk of documents: no Python int per token is kept
    loss_parts: list[torch.Tensor] = []
    docs = [d for f in files for d in documents(f)]  # every line checked before any token is kept
    for start in range(0, len(docs), BATCH):
        chunk = docs[start : start + BATCH]
        heads = _ids(tok, [a for a, _ in chunk], special=True)
        tails = iter(_ids(tok, [b for _, b in chunk if b is not None], special=False))
        ids: list[int] = []
        loss: list[bool] = []
        for (_, completion), head in zip(chunk, heads, strict=True):
            if completion is None:
                body = head if head and head[-1] == eos else [*head, eos]
                ids += body
                loss += [True] * len(body)
            else:
                prompt = head[:-1] if head and head[-1] == eos else head
                answer = [*next(tails), eos]
                ids += prompt + answer
                loss += [False] * len(prompt) + [True] * len(answer)
        id_parts.append(torch.tensor(ids, dtype=torch.int32))
        loss_parts.append(torch.tensor(loss, dtype=torch.bool))
    if not id_parts:
        return torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.bool)
    return torch.cat(id_parts), torch.cat(loss_parts)


def cache_key(files: list[Path], tokenizer_key: str) -> str:
    h = hashlib.sha256(tokenizer_key.encode())
    for f in files:
        h.update(str(f).encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()[:32]


def cache_folder(paths: list[str], files: list[Path]) -> Path:
    first = Path(paths[0]).expanduser().resolve()
    return (first if first.is_dir() else files[0].parent) / CACHE


def token_stream(paths: list[str], tok: Any, tokenizer_key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The stream of ``paths`` tokenized by ``tok``, read from the cache or tokenized and cached (the cache
    is written only once every document was read; a folder that cannot be written is left without)."""
    files = data_files(paths)
    folder = cache_folder(paths, files)
    path = folder / f"{cache_key(files, tokenizer_key)}.pt"
    with contextlib.suppress(Exception):  # a damaged or foreign cache file: tokenized again
        got = torch.load(path, weights_only=True)
        if isinstance(got, dict) and isinstance(got.get("ids"), torch.Tensor) and got["ids"].shape == got["loss"].shape:
            return got["ids"], got["loss"]
    ids, loss = tokenize(files, tok)
    if ids.numel() < 2:
        raise UserError(f"{WHO}: data holds {ids.numel()} token(s); at least 2 are needed to learn one")
    with contextlib.suppress(OSError):
        folder.mkdir(exist_ok=True)
        tmp = folder / f".{path.name}.{os.getpid()}.tmp"
        torch.save({"ids": ids, "loss": loss}, tmp)
        os.replace(tmp, path)
    return ids, loss


class PackedTokens(Dataset):
    """Item ``i``: ``({"input_ids", "attention_mask"}, target)``, each ``context`` long (see the module)."""

    def __init__(self, ids: torch.Tensor, loss: torch.Tensor, context: int, pad_id: int) -> None:
        self.ids, self.loss, self.context, self.pad_id = ids, loss, context, pad_id
        self.n = max(1, -(-(ids.numel() - 1) // context))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        t = self.context
        a = i * t
        chunk = self.ids[a : a + t + 1].long()
        trained = self.loss[a + 1 : a + t + 1]
        real = chunk.numel() - 1
        inputs = torch.full((t,), self.pad_id, dtype=torch.long)
        inputs[:real] = chunk[:-1]
        mask = torch.zeros(t, dtype=torch.long)
        mask[:real] = 1
        target = torch.full((t,), IGNORE, dtype=torch.long)
        target[:real] = torch.where(trained, chunk[1:], IGNORE)
        return {"input_ids": inputs, "attention_mask": mask}, target
