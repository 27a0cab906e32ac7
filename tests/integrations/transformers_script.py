"""A user's Hugging Face Trainer script with Multilane's one line added (run by the tests as a real process).

A tiny GPT-2 built from a config (nothing downloaded) on random tokens, on the CPU. The Trainer's own
log history goes to ``--out``/log_history.json, so a test can compare it with the run folder.
"""

# First: on CPU torch beside PyPI's torchvision, importing transformers can fail on torchvision::nms
# unless Multilane's integration (which works around it) is imported before it (docs/integrations.md).
from multilane.integrations.transformers import MultilaneCallback  # isort: skip

import argparse
import json
import os
import time
from pathlib import Path

import torch
import transformers


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 64, (n, 12), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Regression(torch.nn.Module):
    """An MLP whose forward takes no loss kwargs: the Trainer averages its loss per device (per sample)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        nn = torch.nn
        self.net = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # every training micro-batch, in order

    def forward(self, x, y):
        if self.training:
            self.seen.append((x.detach().clone(), y.detach().clone()))
        return {"loss": torch.nn.functional.mse_loss(self.net(x), y)}


def rows(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g)
    return [{"x": x[i], "y": y[i]} for i in range(n)]


class Slow(transformers.TrainerCallback):
    def __init__(self, seconds: float, out: Path, crash_at: int, ours: MultilaneCallback) -> None:
        self.seconds, self.out, self.crash_at, self.ours = seconds, out, crash_at, ours

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.crash_at:  # the user's bug, in the middle of a step
            raise ValueError(f"the user's bug at step {self.crash_at}")

    def on_step_end(self, args, state, control, **kwargs):
        (self.out / "steps.txt").write_text(str(state.global_step))
        if self.ours.run_dir is None:  # under ddp, ranks other than 0
            return
        status = json.loads(
            (self.ours.run_dir / "status.json").read_text()
        )  # what a reader of status.json sees meanwhile
        with open(self.out / "status_seen.jsonl", "a") as f:
            f.write(
                json.dumps({"step": state.global_step, "state": status["state"], "status_step": status["step"]}) + "\n"
            )
        time.sleep(self.seconds)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--crash-at", type=int, default=0, help="raise in this step (0: never)")
    p.add_argument("--catch", action="store_true", help="the script catches the exception and carries on")
    p.add_argument("--model", default="gpt2", choices=["gpt2", "mlp"])
    p.add_argument("--samples", type=int, default=None, help="the training set's size (mlp: 44, gpt2: 64)")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--health-every", type=int, default=0, help="health.every (0: the default, -1: health off)")
    a = p.parse_args()
    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    transformers.set_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    mlp = a.model == "mlp"  # plain SGD, no clipping: a test replays it by hand
    args = transformers.TrainingArguments(
        output_dir=str(out / "hf"),
        max_steps=a.steps,
        per_device_train_batch_size=8 if mlp else 4,
        per_device_eval_batch_size=8,
        gradient_accumulation_steps=a.accumulate,
        learning_rate=0.2 if mlp else 1e-3,
        lr_scheduler_type="constant" if mlp else "linear",
        optim="sgd" if mlp else "adamw_torch",
        max_grad_norm=0.0 if mlp else 1.0,
        logging_steps=1,
        eval_strategy="no" if mlp else "steps",
        # mlp: each rank takes whole batches in turn, an epoch's last one short (not topped up from the start)
        accelerator_config={"even_batches": not mlp},
        eval_steps=4,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    # health.every, the default (0) or off (-1: bench/health_overhead.py)
    health = {"every": a.health_every} if a.health_every > 0 else {"enabled": False} if a.health_every < 0 else None
    ours = MultilaneCallback(runs_dir=a.runs_dir, name="hf", health=health)
    model = Regression() if mlp else transformers.GPT2LMHeadModel(config)
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=rows(a.samples or 44) if mlp else Tokens(a.samples or 64, 0),
        eval_dataset=None if mlp else Tokens(16, 1),
        callbacks=[ours, Slow(a.sleep, out, a.crash_at, ours)],
    )
    try:
        trainer.train()
    except ValueError as e:
        if not a.catch:
            raise
        (out / "caught.txt").write_text(str(e))
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        (out / "log_history.json").write_text(json.dumps(trainer.state.log_history))
    if mlp:
        torch.save(model.seen, out / f"seen-rank{rank}.pt")
    if torch.distributed.is_initialized():  # as docs/integrations.md asks: torch's c10d threads joined
        torch.distributed.destroy_process_group()  # before exit (else, now and then, SIGABRT at teardown)


if __name__ == "__main__":
    main()
