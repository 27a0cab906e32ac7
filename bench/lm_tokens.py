"""Fine-tuning tokens/s: Multilane's ``causal-lm`` against a plain transformers + peft loop and against the
Hugging Face Trainer, on the same tiny Llama-shaped model, the same LoRA, batch and context; one table,
each row's ratio to the plain loop beside it. Then the size of the LoRA run's checkpoint against the base.

    python bench/lm_tokens.py [--hidden 256] [--rank 16] [--batch 4] [--context 128] [--steps 12] [--rounds 3]
                              [--lanes cpu:0]

The model (random weights, ``save_pretrained`` layout) and its tokenizer (byte-level BPE trained by
``tokenizers`` on generated text) are built in a temporary folder: nothing is downloaded. Each measure skips
its first ``--warmup`` steps (allocation, first-call costs) and gives the median step's rate; the three take
turns, ``--rounds`` times in a rotated order, and the table shows each one's median round, so that a busy
spell of a shared machine does not land on one of them alone. CPU here; on a GPU pass ``--lanes cuda:0``.
The checkpoint's goal: under 5 % of the base model's bytes for rank <= 16.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from multilane.engine.lm.hf import peft, transformers

WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "dog",
    "log",
    "bird",
    "sang",
    "tree",
    "one",
    "two",
    "three",
    "four",
    "five",
    "model",
    "device",
    "batch",
    "loss",
]


def build(folder: Path, hidden: int, layers: int, vocab: int, positions: int) -> None:
    """A random Llama-shaped model and a BPE tokenizer trained on generated text, in ``folder``."""
    tf = transformers()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    text = [" ".join(rng.choice(WORDS) for _ in range(60)) + "." for _ in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=min(vocab, 400), special_tokens=["<pad>", "<eos>"]))
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.save_pretrained(folder)
    config = tf.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(hidden * 8 / 3) // 16 * 16,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=positions,
        eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    (folder.parent / "text.txt").write_text("\n".join(text) * 4)


def batches(args: argparse.Namespace, steps: int, vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, vocab, (args.batch, args.context), generator=g) for _ in range(steps)]


def lora_model(folder: Path, rank: int) -> torch.nn.Module:
    base = transformers().AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    base.config.use_cache = False
    config = peft().LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, task_type="CAUSAL_LM")
    return peft().get_peft_model(base, config)


def plain(args: argparse.Namespace, folder: Path, vocab: int) -> float:
    """The loop people write: forward with labels, backward, AdamW step; tokens/s after the warm-up."""
    model = lora_model(folder, args.rank).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    times = []
    for ids in batches(args, args.steps, vocab):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return args.batch * args.context / statistics.median(times[args.warmup :])


def hf_trainer(args: argparse.Namespace, folder: Path, vocab: int, out: Path) -> float:
    """The Hugging Face Trainer on the same model, LoRA, batch and batches; tokens/s from its step times."""
    tf = transformers()
    rows = [
        {"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r}
        for b in batches(args, args.steps, vocab)
        for r in b
    ]
    times: list[float] = []

    class StepClock(tf.TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t0)

    targs = tf.TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=args.batch,
        max_steps=args.steps,
        learning_rate=1e-4,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_drop_last=True,
    )
    trainer = tf.Trainer(model=lora_model(folder, args.rank), args=targs, train_dataset=rows, callbacks=[StepClock()])
    trainer.train()
    return args.batch * args.context / statistics.median(times[args.warmup :])


def multilane(args: argparse.Namespace, folder: Path, runs: Path) -> tuple[float, Path]:
    """Multilane's causal-lm: the train records' tokens_per_s after the warm-up, and the run's folder."""
    from multilane.engine.config import build_config
    from multilane.engine.run.trainer import Trainer
    from multilane.engine.rundir.runlog import read_metrics

    params = {"model": str(folder), "data": [str(folder.parent / "text.txt")], "context": args.context}
    params |= {"lora_rank": args.rank, "lora_alpha": 2.0 * args.rank, "prompts": [], "sample_tokens": 0}
    cfg = {
        "task": {"name": "causal-lm", "params": params},
        "data": {"batch_size": args.batch, "val_fraction": 0.0, "workers": 0},
        "optim": {"name": "adamw", "lr": 1e-4},
        "train": {"steps": args.steps, "log_every": 1, "eval_every": 0},
        "devices": {"use": args.lanes},
        "telemetry": {"enabled": False},
        "health": {"enabled": False},
        "run": {"runs_dir": str(runs), "name": "lm-tokens"},
    }
    result = Trainer(build_config(cfg)).run()
    assert result.status == "finished", result.message
    rates = [r["tokens_per_s"] for r in read_metrics(result.run_dir) if r["kind"] == "train" and "tokens_per_s" in r]
    return statistics.median(rates[args.warmup :]), Path(result.run_dir)


def checkpoint_ratio(run: Path, folder: Path) -> tuple[int, int]:
    ck = run / "checkpoints" / "last.pt"
    base = sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".safetensors", ".bin"))
    return ck.stat().st_size, base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lanes", default="cpu:0", help="Multilane's devices (devices.use)")
    ap.add_argument("--json", metavar="FILE", help="also write the numbers as JSON")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lm-tokens-"))
    folder = tmp / "model"
    build(folder, args.hidden, args.layers, args.vocab, max(256, args.context))
    torch.set_num_threads(os.cpu_count() or 1)
    runs: list[Path] = []
    measures = {
        "multilane": lambda r: (lambda rate, run: runs.append(run) or rate)(*multilane(args, folder, tmp / f"runs{r}")),
        "plain": lambda r: plain(args, folder, args.vocab),
        "hf": lambda r: hf_trainer(args, folder, args.vocab, tmp / f"hf{r}"),
    }
    rates: dict[str, list[float]] = {k: [] for k in measures}
    for r in range(args.rounds):
        order = list(measures)[r % 3 :] + list(measures)[: r % 3]
        for name in order:
            rates[name].append(measures[name](r))
    ml, pl, hf = (statistics.median(rates[k]) for k in measures)
    ck, base = checkpoint_ratio(runs[0], folder)
    shape = f"Llama hidden {args.hidden} x {args.layers} layers, LoRA rank {args.rank}"
    print(
        f"{shape}, batch {args.batch} x context {args.context} tokens, {args.steps} steps (median after {args.warmup})"
    )
    rounds = ", ".join(f"{k} " + "/".join(f"{v:,.0f}" for v in rates[k]) for k in rates)
    print(f"each the median of {args.rounds} rounds ({rounds})")
    print(f"{'loop':<34}{'tokens/s':>12}{'vs plain':>10}")
    for name, rate in (
        (f"Multilane causal-lm ({args.lanes})", ml),
        ("plain transformers + peft", pl),
        ("HF Trainer + peft", hf),
    ):
        print(f"{name:<34}{rate:>12,.0f}{rate / pl:>10.3f}")
    print(
        f"LoRA checkpoint {ck / 1e6:.3f} MB = {100 * ck / base:.2f} % of the base model's {base / 1e6:.2f} MB (goal < 5 %)"
    )
    if args.json:
        numbers = {"multilane": ml, "plain": pl, "hf_trainer": hf, "rounds_measured": rates}
        numbers |= {"checkpoint_bytes": ck, "base_bytes": base}
        Path(args.json).write_text(json.dumps({**vars(args), **numbers}, indent=1))


if __name__ == "__main__":
    main()
