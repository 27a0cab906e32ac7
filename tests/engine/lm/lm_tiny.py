"""Tiny causal language models and a tokenizer, built in the test itself (no download).

``tiny_tokenizer(folder)`` trains a byte-level BPE tokenizer (``tokenizers``) on ``TEXT`` and saves it as a
``PreTrainedTokenizerFast``; ``tiny_model(folder, kind)`` saves a GPT-2 or a Llama-shaped model with random
weights (2 layers, hidden 32) in ``save_pretrained`` layout, with that tokenizer beside it. The fixtures in
this folder's conftest.py build each once per test session.
"""

from __future__ import annotations

from pathlib import Path

TEXT = (
    "the cat sat on the mat. the dog sat on the log. a bird sang in the tree.\n"
    "one two three four five six seven eight nine ten.\n"
    "multilane trains a model across the devices of one workstation.\n"
    "every device computes its share of the batch and the losses are combined.\n"
)
VOCAB = 200
"""The tokenizer's vocabulary; the models' embeddings hold exactly this many rows."""
SPECIAL = ["<pad>", "<eos>", "<bos>"]


def _transformers():
    """transformers as the engine imports it (engine/lm/hf.py: quiet, and importable beside a CPU torch)."""
    from multilane.engine.lm.hf import transformers

    return transformers()


def tiny_tokenizer(folder: Path, vocab: int = VOCAB, extra: int = 0) -> Path:
    """The tokenizer trained on ``TEXT`` (at most ``vocab`` tokens), plus ``extra`` added tokens."""
    _transformers()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL)
    tok.train_from_iterator([TEXT] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    fast.add_tokens([f"<extra_{i}>" for i in range(extra)])
    fast.save_pretrained(folder)
    return folder


def tiny_model(folder: Path, kind: str = "gpt2", vocab: int = VOCAB, positions: int = 64, seed: int = 0) -> Path:
    """A random-weight ``kind`` (``gpt2`` or ``llama``) model saved in ``folder`` with the tiny tokenizer."""
    import torch

    _transformers()
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    if kind == "gpt2":
        config = GPT2Config(
            vocab_size=vocab,
            n_positions=positions,
            n_embd=32,
            n_layer=2,
            n_head=2,
            bos_token_id=2,
            eos_token_id=1,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    elif kind == "llama":
        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=positions,
            bos_token_id=2,
            eos_token_id=1,
            pad_token_id=0,
        )
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    tiny_tokenizer(folder, vocab)
    return folder
