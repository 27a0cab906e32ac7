"""The ``multilane`` command line: its options, their checks, and one-line errors for bad input."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # No prefixes: `--epoch 3` must not silently become `--epochs 3`.
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        # One line, exit 2: what is wrong (and the option meant, for a typo), not a usage screen.
        if len(message) > 1000:  # a value of 100,000 characters quoted whole by argparse
            message = f"{message[:480]}…[{len(message) - 960:,} characters cut]…{message[-480:]}"
        # "multilane: error:" from every subcommand too (argparse would say "multilane train: error:"),
        # like the errors found after parsing; the subcommand leads the message, as theirs do ("watch: ...").
        command = self.prog.split(" ", 1)[1] + ": " if " " in self.prog else ""
        self.exit(2, f"multilane: error: {command}{message}{_suggestion(self, message)} (see --help)\n")


class _HelpFormatter(argparse.HelpFormatter):
    """Each option's help ends with its default, where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" not in text and action.default not in (None, False, [], argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


def _suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    """ "; did you mean --epochs?" for an unknown option close to a known one."""
    if "unrecognized arguments:" not in message:
        return ""
    import difflib

    known: list[str] = []
    for action in parser._actions:
        known += action.option_strings
        for sub in (action.choices or {}).values() if isinstance(action, argparse._SubParsersAction) else ():
            for a in sub._actions:
                known += a.option_strings
    for word in message.split(":", 1)[1].split():
        flag = word.split("=", 1)[0]
        if flag.startswith("--"):
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
            if close:
                return f"; did you mean {close[0]}?"
    return ""


MAX_WHOLE = 10**12  # no count of steps, epochs or pixels is larger; int() of 5,000 digits is refused
MIN_WIDTH, MAX_WIDTH = 200, 10_000  # the app's PNG width dialog takes the same range


def short_text(text: str) -> str:
    """A user's value quoted for an error line, cut to 20 characters (a 5,000-digit number stays short)."""
    return repr(text) if len(text) <= 24 else repr(text[:20] + "...")


def _whole(text: str, low: int = 0, high: int = MAX_WHOLE) -> int:
    digits = text.strip().lstrip("+-")
    if digits.isdigit() and len(digits) > 15:
        raise argparse.ArgumentTypeError(f"{short_text(text)} is too large (at most {high:,})")
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{short_text(text)} is not a whole number") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"{v} must be at least {low}")
    if v > high:
        raise argparse.ArgumentTypeError(f"{v} is too large (at most {high:,})")
    return v


def _positive_int(text: str) -> int:
    return _whole(text, 1)


def _nonnegative_int(text: str) -> int:
    return _whole(text, 0, 1_000_000)


def _seed(text: str) -> int:
    return _whole(text, 0, 2**32 - 1)


def _width(text: str) -> int:
    return _whole(text, MIN_WIDTH, MAX_WIDTH)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{short_text(text)} is not a number") from None


def _host_text(text: str) -> str:
    """A ``--host`` value: an empty one is refused (it would otherwise mean this computer, silently)."""
    if not text.strip() or text.split("=", 1)[0].strip() == "":
        raise argparse.ArgumentTypeError("an empty host; name an ssh config alias or [user@]host[:port]")
    return text


def _remote_options(p: argparse.ArgumentParser, host_help: str | None, many: bool = False) -> None:
    """The options of a command that can act on a host over SSH (``many``: ``--host`` may repeat)."""
    if host_help:
        p.add_argument(
            "--host",
            metavar="HOST[=DEVICES]" if many else "HOST",
            action="append" if many else "store",
            type=_host_text,
            help=f"an ssh config alias or [user@]host[:port]: {host_help}",
        )
    p.add_argument("--remote-command", metavar="PATH", help="multilane's command on the host (default: multilane)")
    p.add_argument(
        "--trust-host-key",
        metavar="SHA256:...",
        help="trust the host's key, not yet in known_hosts, when its fingerprint is this one (checked by you)",
    )


def _interval(text: str) -> float:
    v = _number(text)
    if not 0.05 <= v <= 3600:  # NaN fails both comparisons
        raise argparse.ArgumentTypeError(f"{short_text(text)} is outside 0.05 to 3600 seconds")
    return v


def _rdzv_timeout(text: str) -> float:
    v = _number(text)
    if not 1 <= v <= 86400:  # NaN fails both comparisons; torch takes whole seconds
        raise argparse.ArgumentTypeError(f"{short_text(text)} is outside 1 to 86400 seconds")
    return v


def _rdzv_id(text: str) -> str:
    import re

    if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", text):
        raise argparse.ArgumentTypeError(
            f"{short_text(text)} ({len(text):,} characters): use 1 to 64 letters, digits, '.', '_' or '-'"
        )
    return text


def _endpoint(text: str) -> str:
    if len(text) > 300:
        raise argparse.ArgumentTypeError(f"{short_text(text)} ({len(text):,} characters) is not HOST:PORT")
    return text


def build_parser() -> argparse.ArgumentParser:
    from multilane.engine import __version__
    from multilane.engine.config import RunConfig

    d0 = RunConfig()  # the defaults the help shows are the config's own
    p = _Parser(prog="multilane", description="Data-parallel PyTorch training across the GPUs of one machine.")
    p.add_argument("--version", action="version", version=f"multilane {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)

    t = sub.add_parser("train", help="train headless, with a progress bar", description="Train headless.")
    _run_options(t, d0)
    t.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    t.add_argument(
        "--dry-run",
        action="store_true",
        help="measure the memory the run will need on each device (multilane plan) and exit without training",
    )
    dd = t.add_argument_group("ddp launch (multi-node; or run under torchrun --no-python multilane train ...)")
    dd.add_argument("--nnodes", type=_positive_int, default=1, metavar="N", help="machines taking part (default 1)")
    dd.add_argument(
        "--rdzv-endpoint",
        type=_endpoint,
        metavar="HOST:PORT",
        help="the rendezvous (default: a free local port; with several --host: the first host's HostName "
        "and a port free there, or ADDR[:PORT] as the other hosts reach it)",
    )
    dd.add_argument(
        "--rdzv-id", type=_rdzv_id, metavar="ID", help="run id, the same on every node (default: multilane)"
    )
    dd.add_argument(
        "--node-rank",
        type=_nonnegative_int,
        metavar="R",
        help="this node's place, 0 to N-1 (node 0 holds the rendezvous and the run folder); "
        "default: the nodes are ordered by host name",
    )
    dd.add_argument(
        "--rdzv-timeout",
        type=_rdzv_timeout,
        default=60.0,
        metavar="S",
        help="seconds to wait for every node, 1 to 86400 (default 60)",
    )
    _remote_options(
        t,
        "train on this host over SSH, mirroring its run folder here; repeat it for one ddp run across "
        "several hosts, HOST=DEVICES giving a host its own devices (see docs/remote.md)",
        many=True,
    )
    t.add_argument(
        "--remote-runs-dir",
        metavar="DIR",
        action="append",
        help="the host's runs folder (default: runs, in the login's home); once for every host, or once per --host",
    )
    t.add_argument("--detach", action="store_true", help="with --host: start the run and print its folder there")
    pl = sub.add_parser(
        "plan",
        help="will it fit: the memory a run will need on each device, measured by a probe step, without training",
        description="Probe the run's own step (model, batch, precision, strategy, optimizer) at a few small "
        "batches on its devices, and forecast each device's peak memory at the run's batch against its free "
        "memory (CPU lanes: the RAM available). Exit 2 when it will not fit, naming the largest batch that would.",
    )
    _run_options(pl, d0)
    pl.add_argument("--json", action="store_true", help="print the forecast as JSON")
    pl.set_defaults(resume=None)

    e = sub.add_parser(
        "export",
        help="export a run's figures and metrics (no display, no Qt needed)",
        description="Write loss.* (every device, combined, validation), plots.* (every plot), compare.* "
        "(with --compare: one curve per run) as PNG, SVG and PDF with real text, and metrics.csv.",
    )
    e.add_argument("run_dir", metavar="RUN_DIR")
    e.add_argument("--out", metavar="DIR", help="folder to write into")
    e.add_argument(
        "--mlflow",
        metavar="URI",
        help="also (or only) send the run's records so far to this MLflow tracking server: the same MLflow run "
        "on every send, only the points it lacks (needs the mlflow extra; credentials: MLFLOW_TRACKING_* variables)",
    )
    e.add_argument(
        "--adapter",
        metavar="DIR",
        help="write the run's LoRA adapter as a PEFT adapter folder (PeftModel.from_pretrained(base, DIR) loads it)",
    )
    e.add_argument(
        "--merged",
        metavar="DIR",
        help="write the run's model with its adapters merged (merge_and_unload) in save_pretrained layout",
    )
    e.add_argument("--format", default="png,svg,pdf,csv", metavar="LIST", help="any of png,svg,pdf,csv")
    e.add_argument("--width", type=_width, default=1600, metavar="PX", help="PNG width in pixels")
    e.add_argument("--compare", action="append", default=[], metavar="RUN_DIR", help="another run to compare with")
    e.add_argument("--smoothing", type=_number, default=0.0, metavar="A", help="EMA of the train loss, 0 to 0.99")
    e.add_argument("--x", choices=["step", "time"], default="step", help="x axis: optimizer step or elapsed time")
    e.add_argument("--log-y", action="store_true", help="logarithmic loss axis")

    _add_sweep_parsers(sub, d0)

    w = sub.add_parser("watch", help="follow a run another process is writing: its live progress line")
    w.add_argument("run_dir", metavar="RUN_DIR", help="a run folder here, or HOST:RUN_DIR on a host over SSH")
    w.add_argument(
        "--interval", type=_interval, default=0.5, metavar="S", help="seconds between refreshes, 0.05 to 3600"
    )
    _remote_options(w, None)
    w.add_argument("--runs-dir", metavar="DIR", help="for HOST:RUN_DIR: where the local mirror goes (default: ./runs)")

    c = sub.add_parser("control", help="pause, resume or stop a run (also on another machine) via its run folder")
    c.add_argument(
        "run_dir", metavar="RUN_DIR", help="a run folder here, a mirror of a run on a host, or HOST:RUN_DIR over SSH"
    )
    c.add_argument("action", choices=["pause", "resume", "stop"], metavar="pause|resume|stop")
    _remote_options(c, None)

    d = sub.add_parser("devices", help="list the devices this machine offers, with live utilization and memory")
    d.add_argument("--json", action="store_true", help="print JSON")
    d.add_argument("--watch", action="store_true", help="refresh every second until Ctrl+C")
    _remote_options(d, "list the devices of this host over SSH")
    return p


def _run_options(t: argparse.ArgumentParser, d0: Any) -> None:
    """The options that say what a run trains (``train`` and ``plan``)."""
    t.add_argument("--config", metavar="FILE", help="TOML or JSON config; flags below override it")
    t.add_argument(
        "--task",
        metavar="NAME|FILE",
        help=f"digits, linear, mlp, charlm, imagefolder, causal-lm, or a .py file defining a Task (default: {d0.task.name})",
    )
    t.add_argument(
        "--devices",
        metavar="LIST",
        help=f"cuda:0,cuda:1 | cpu:0,cpu:1 | auto: every GPU, else two CPU lanes (default: {d0.devices.use})",
    )
    t.add_argument(
        "--batch-size",
        type=_positive_int,
        metavar="N",
        help=f"global batch, split across the devices (default: {d0.data.batch_size})",
    )
    t.add_argument("--lr", type=_number, metavar="X", help=f"learning rate (default: {d0.optim.lr:g})")
    t.add_argument("--optimizer", metavar="NAME", help=f"sgd, adam or adamw (default: {d0.optim.name})")
    budget = t.add_mutually_exclusive_group()
    budget.add_argument(
        "--epochs", type=_positive_int, metavar="N", help=f"passes over the training data (default: {d0.train.epochs})"
    )
    budget.add_argument("--steps", type=_positive_int, metavar="N", help="optimizer steps, instead of --epochs")
    t.add_argument(
        "--seed", type=_seed, metavar="N", help=f"seed of data order and initial weights (default: {d0.train.seed})"
    )
    t.add_argument("--precision", metavar="P", help=f"fp32, bf16 or fp16 (default: {d0.train.precision})")
    t.add_argument("--runs-dir", metavar="DIR", help=f"where run folders go (default: ./{d0.run.runs_dir})")
    t.add_argument("--name", metavar="NAME", help=f"run name, part of the run folder's name (default: {d0.run.name})")
    t.add_argument(
        "--strategy",
        metavar="S",
        help="replicate (default: one process, the model copied to every device each step, as nn.DataParallel), "
        "persistent (one process, a replica kept per device), ddp (one process per device) or fsdp (one process "
        "per device, the model sharded across them)",
    )
    t.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any config value, e.g. --set train.log_every=5 --set task.params.hidden=128",
    )


def _add_sweep_parsers(sub: Any, d0: Any) -> None:
    """``multilane sweep`` and ``multilane sweep-worker`` (engine/sweep/, on Optuna)."""
    s = sub.add_parser(
        "sweep",
        help="a hyperparameter sweep on Optuna: trials in parallel, one per slot of devices, pruned early",
        description="Run a hyperparameter sweep: each trial is an ordinary run folder inside the sweep folder; "
        "the study is Optuna's (study.journal, or --storage), so optuna.load_study and optuna-dashboard open it.",
    )
    s.add_argument("--resume", metavar="SWEEP_DIR", help="carry on a sweep to its asked count (or --trials)")
    s.add_argument("--task", metavar="NAME|FILE", help=f"as for train (default: {d0.task.name})")
    s.add_argument("--config", metavar="FILE", help="TOML or JSON config every trial starts from")
    s.add_argument("--devices", metavar="LIST", help="the devices to split into slots (default: auto)")
    s.add_argument("--trials", type=_positive_int, metavar="N", help="trials to finish (default 10)")
    s.add_argument("--param", action="append", default=[], metavar="KEY=SPEC",
                   help="a searched key: KEY=log:LOW:HIGH, float:LOW:HIGH, int:LOW:HIGH or choice:A,B,C "
                   "(e.g. optim.lr=log:1e-4:1e-1, task.params.hidden=int:16:256); repeat for more")  # fmt: skip
    s.add_argument("--per-trial", type=_positive_int, metavar="K", help="devices per trial (default 1)")
    s.add_argument("--objective", metavar="M:min|max", help="a logged metric and its direction (default val_loss:min)")
    s.add_argument("--sampler", choices=["tpe", "random", "grid"], help="Optuna sampler (default tpe)")
    s.add_argument("--pruner", choices=["median", "halving", "none"], help="Optuna pruner (default median)")
    s.add_argument("--seed", type=_seed, metavar="S", help="the sampler's seed: the same seed proposes the same params")
    s.add_argument("--sweeps-dir", metavar="DIR", help="where sweep folders go (default: ./sweeps)")
    s.add_argument("--name", metavar="NAME", help="the sweep's (and study's) name (default: sweep)")
    s.add_argument(
        "--storage",
        metavar="URL",
        help="an Optuna RDB storage (postgresql://...) that workers share; "
        "- reads it from standard input (no password on the command line)",
    )
    budget = s.add_mutually_exclusive_group()
    budget.add_argument("--epochs", type=_positive_int, metavar="N", help="each trial's epochs")
    budget.add_argument("--steps", type=_positive_int, metavar="N", help="each trial's optimizer steps")
    s.add_argument("--batch-size", type=_positive_int, metavar="N", help="each trial's global batch")
    s.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="any config value every trial shares"
    )
    s.add_argument("--no-table", action="store_true", help="no live table: one line per finished trial")
    s.add_argument("--trial-timeout", type=_positive_int, metavar="S",
                   help="stop a trial after S seconds and record it failed (default: no limit)")  # fmt: skip

    w = sub.add_parser(
        "sweep-worker",
        help="add this machine's slots to a sweep whose study is in a shared --storage",
        description="Run trials of a study another `multilane sweep --storage` made, on this machine's devices.",
    )
    w.add_argument("--storage", metavar="URL", help="the study's Optuna RDB storage; - reads it from standard input")
    w.add_argument("--study", metavar="NAME", help="the study's name (the sweep's --name)")
    w.add_argument("--devices", metavar="LIST", help="this machine's devices to split into slots (default: auto)")
    w.add_argument("--per-trial", type=_positive_int, metavar="K", help="devices per trial (default: the sweep's)")
    w.add_argument("--sweeps-dir", metavar="DIR", help="where this worker's trial run folders go (default: ./sweeps)")
    w.add_argument("--no-table", action="store_true", help="no live table: one line per finished trial")
    w.add_argument(
        "--wait",
        type=_nonnegative_int,
        default=300,
        metavar="S",
        help="wait up to S seconds for what may still appear (a database file, a first study: a worker started with its sweep); default 300",
    )
    w.add_argument("--worker-name", metavar="NAME", help="the name its trials record as their host (default: hostname)")
    _remote_options(w, "start the worker on this host over SSH, in its own session there (see docs/sweeps.md)")
    w.add_argument("--detach", action="store_true", help="with --host: start it, print its pid and log, return")
    w.add_argument("--stop", type=_positive_int, metavar="PID", help="with --host: stop the worker of this pid there")
