"""The language-model tests' shared pieces: tiny models and a tokenizer, built once per session (lm_tiny.py)."""

from __future__ import annotations

import json

import pytest
from lm_tiny import TEXT, tiny_model


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory):
    """A folder in save_pretrained layout: a random 2-layer GPT-2 (hidden 32, vocabulary 200) and its tokenizer."""
    return tiny_model(tmp_path_factory.mktemp("gpt2"), "gpt2")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """As ``tiny_gpt2``, Llama-shaped: RMSNorm, rotary positions, grouped-query attention, a gated MLP."""
    return tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture
def lm_text(tmp_path):
    """A data folder as fine-tuners bring it: a .txt file and a .jsonl of text and prompt/completion lines."""
    folder = tmp_path / "text"
    folder.mkdir()
    (folder / "notes.txt").write_text(TEXT * 2)
    lines = [{"text": "the cat sat on the mat."}, {"prompt": "one two three", "completion": " four five six."}]
    (folder / "pairs.jsonl").write_text("\n".join(json.dumps(x) for x in lines * 4) + "\n")
    return folder
