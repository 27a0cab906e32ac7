"""Pretrained causal language models (Hugging Face): loading, tokenized and packed data, LoRA; the causal-lm task's parts."""
