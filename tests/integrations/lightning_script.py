"""A user's Lightning script with Multilane's one line added (run by the tests as a real process).

A tiny regression, float32 on the CPU. Each rank writes the losses its ``training_step`` logged to
``--out``/losses-rank<R>.json, so a test can compare them with the run folder step for step.
"""

import argparse
import json
import time
from pathlib import Path

# First: on CPU torch beside PyPI's torchvision, importing Lightning fails on torchvision::nms unless
# Multilane's integration (which works around it) is imported before it (docs/integrations.md).
from multilane.integrations.lightning import MultilaneCallback  # isort: skip

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regression(pl.LightningModule):
    def __init__(
        self, out: Path, sleep_s: float, crash: tuple[int, int] | None = None, dump: int = 0, fsdp2: bool = False
    ) -> None:
        super().__init__()
        self.dump = dump  # at this step, each rank saves its batch and the weights it starts from
        self.fsdp2 = fsdp2  # shard every Linear and the whole net with FSDP2 (ModelParallelStrategy)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.out, self.sleep_s, self.logged = out, sleep_s, []
        self.crash = crash  # (step, rank): that rank's training_step raises at that step

    def configure_model(self):
        if self.fsdp2:  # as Lightning's docs do it: each layer, then the root
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in (self.net[0], self.net[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.crash is not None and (self.global_step + 1, self.global_rank) == self.crash:
            raise ValueError(f"the user's bug at step {self.global_step + 1} on rank {self.global_rank}")
        if self.global_step + 1 == self.dump:  # every micro-batch of the step; the weights at its first
            path = self.out / f"step{self.dump}-rank{self.global_rank}.pt"
            state = {
                k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
                for k, v in self.net.state_dict().items()
            }
            d = torch.load(path) if path.exists() else {"micro": [], "state": state}
            d["micro"].append((x, y))
            torch.save(d, path)
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        self.logged.append({"step": self.global_step + 1, "loss": loss.item()})
        (self.out / f"losses-rank{self.global_rank}.json").write_text(json.dumps(self.logged))
        ours = next(c for c in self.trainer.callbacks if isinstance(c, MultilaneCallback))
        if ours.run_dir is not None:  # rank 0: what a reader of status.json sees meanwhile
            status = json.loads((ours.run_dir / "status.json").read_text())
            with open(self.out / "status_seen.jsonl", "a") as f:
                f.write(json.dumps({"step": self.global_step, "status_step": status["step"]}) + "\n")
        time.sleep(self.sleep_s)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_mae", (self.net(x) - y).abs().mean(), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True) * 0.3 + 0.1 * torch.randn(n, 1, generator=g))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--checkpoint", action="store_true")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--crash", default=None, help="STEP:RANK: that rank raises at that step")
    p.add_argument("--health-every", type=int, default=0, help="health.every (0: the default, -1: health off)")
    p.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp2"], help="with --devices > 1")
    p.add_argument("--dump", type=int, default=0, help="each rank saves its batch and weights at this step")
    a = p.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    strategy = "ddp" if a.devices > 1 else "auto"
    if a.devices > 1 and a.strategy == "fsdp2":  # FSDP2; Lightning's strategy="fsdp" (FSDP1) needs a GPU
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=a.devices, tensor_parallel_size=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=a.devices,
        strategy=strategy,
        max_steps=a.steps,
        accumulate_grad_batches=a.accumulate,
        val_check_interval=4,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=a.checkpoint,
        default_root_dir=str(out / "lightning"),
        logger=False,
        callbacks=[MultilaneCallback(runs_dir=a.runs_dir, name="lit", health=health_section(a.health_every))],
    )
    trainer.fit(
        Regression(
            out, a.sleep, tuple(map(int, a.crash.split(":"))) if a.crash else None, a.dump, a.strategy == "fsdp2"
        ),
        DataLoader(data(256, 0), batch_size=16, shuffle=True),
        DataLoader(data(64, 1), batch_size=32),
    )
    if torch.distributed.is_initialized():  # as docs/integrations.md asks: torch's c10d threads joined
        torch.distributed.destroy_process_group()  # before exit (else, now and then, SIGABRT at teardown)


def health_section(every: int) -> dict | None:
    """The callback's ``health``: ``every`` steps, the default (0) or off (-1: bench/health_overhead.py)."""
    return {"every": every} if every > 0 else {"enabled": False} if every < 0 else None


if __name__ == "__main__":
    main()
