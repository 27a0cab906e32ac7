"""Does the window slow training? samples/s headless vs in the app, in its thread and as a child process.

For each task (digits and mlp, two CPU lanes), each round runs the same config three ways, in a
rotating order so that a busy neighbour on a shared machine hits every mode alike:

- headless: ``multilane train --config`` in a subprocess, no window anywhere;
- thread: the app's window (shown, 1400x900, plotting live with smoothing on, Run > Smooth window on)
  training in its own worker thread;
- child: the same window with "run in a separate process": ``multilane train`` in a child process
  the window follows through the run folder.

Throughput is read the same way for all three, from the run's metrics.jsonl: logged steps over wall
time, after the first ``--warmup`` seconds of training. The ratio of each app mode to the headless
run of the same round is taken per round; the table shows medians and the spread (min-max) of rounds.
"to 1st step" is from Start (or the subprocess launch) to the first logged step: a child pays its
own imports of torch and the task.

    python bench/gui_throughput.py [--rounds 3] [--tasks digits,mlp] [--seconds 8]

Every training process runs in a session of its own, as it would for a user (a terminal's
``multilane train``, the app started from a desktop, the app's child): Linux's autogroup scheduler
shares the CPU between sessions, so on a busy machine a run sharing the benchmark's session would be
slowed by its neighbours more than the others (seen here: headless runs at half the child's rate).
The benchmark re-runs itself in a new session for that.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pyqtgraph as pg
from multilane.engine.config import build_config
from multilane.engine.rundir.runlog import read_metrics
from PySide6.QtCore import QEventLoop, QSettings, QTimer

STEPS_PER_S = {"digits": 90, "mlp": 200}  # a rough headless rate on a quiet 2-core machine: sizes each run
MODES = ("headless", "thread", "child")


def throughput(run_dir: Path, warmup_s: float) -> tuple[float, float]:
    """(samples/s after the warm-up, wall time of the first logged step)."""
    recs = [r for r in read_metrics(run_dir) if r["kind"] == "train" and not r.get("partial")]
    t0 = recs[0]["wall_time"]
    steady = [r for r in recs if r["wall_time"] >= t0 + warmup_s] or recs[-2:]
    a, b = steady[0], steady[-1]
    batch = json.loads((run_dir / "config.json").read_text())["data"]["batch_size"]
    return (b["step"] - a["step"]) * batch / (b["wall_time"] - a["wall_time"]), t0


def window(tmp: str):
    from multilane.gui.window.main_window import MainWindow

    w = MainWindow(QSettings(os.path.join(tmp, "s.ini"), QSettings.IniFormat))
    w.form.editors["run.runs_dir"].widget.setText(os.path.join(tmp, "runs"))
    w.form.editors["train.log_every"].widget.setValue(5)
    w.form.editors["train.eval_every"].widget.setValue(0)
    w.devices.set_checked(["cpu:0", "cpu:1"])
    w.smooth.setValue(50)
    w.resize(1400, 900)
    w.show()
    w.confirm_close = lambda: "stop"
    return w


def run_in_app(w, separate: bool) -> tuple[Path, float]:
    w.separate.setChecked(separate)
    t_start = time.time()
    assert w.start(), w.why.text()
    loop = QEventLoop()
    timer = QTimer()
    timer.timeout.connect(lambda: None if w.is_running() else loop.quit())
    timer.start(50)
    loop.exec()
    timer.stop()
    assert w.last_result["status"] == "finished", w.last_result
    return Path(w.last_result["run_dir"]), t_start


def run_headless(w, tmp: str) -> tuple[Path, float]:
    config = build_config(w.config_dict(), "bench")
    path = Path(tmp) / "headless.json"
    path.write_text(json.dumps(config.to_dict()))
    before = set((Path(tmp) / "runs").glob("*"))
    t_start = time.time()
    subprocess.run(
        [sys.executable, "-m", "multilane.engine.cli", "train", "--config", str(path)],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # like a terminal's own session (the app's child has one too)
    )
    (run_dir,) = set((Path(tmp) / "runs").glob("*")) - before
    return run_dir, t_start


def main() -> None:
    if os.getsid(0) != os.getpid():  # not a session of its own: run again in one (see the docstring)
        sys.exit(subprocess.run([sys.executable, *sys.argv], start_new_session=True).returncode)
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tasks", default="digits,mlp")
    ap.add_argument("--seconds", type=float, default=8.0, help="about how long each run trains")
    ap.add_argument("--warmup", type=float, default=1.5, help="seconds of training left out of the rate")
    args = ap.parse_args()
    pg.mkQApp("bench")
    tmp = tempfile.mkdtemp(prefix="gui-throughput-")
    w = window(tmp)
    rates: dict[tuple[str, str], list[float]] = {}
    ratios: dict[tuple[str, str], list[float]] = {}
    first: dict[tuple[str, str], list[float]] = {}
    for rnd in range(args.rounds):
        for task in args.tasks.split(","):
            w.form.set_task(task)
            w.form.editors["train.steps"].widget.setValue(int(args.seconds * STEPS_PER_S.get(task, 100)))
            order = MODES[rnd % 3 :] + MODES[: rnd % 3]  # rotate: no mode always follows another
            got: dict[str, float] = {}
            for mode in order:
                if mode == "headless":
                    run_dir, t_start = run_headless(w, tmp)
                else:
                    run_dir, t_start = run_in_app(w, separate=mode == "child")
                rate, t_first = throughput(run_dir, args.warmup)
                got[mode] = rate
                rates.setdefault((task, mode), []).append(rate)
                first.setdefault((task, mode), []).append(t_first - t_start)
                print(f"round {rnd + 1} {task:7s} {mode:8s} {rate:10,.0f} samples/s", file=sys.stderr, flush=True)
            for mode in ("thread", "child"):
                ratios.setdefault((task, mode), []).append(got[mode] / got["headless"])
    w.close()
    med = statistics.median
    print(f"\nGUI-monitored vs headless training, cpu:0,cpu:1, {args.rounds} interleaved rounds (medians; min-max)")
    print(
        f"{'task':8s} {'mode':22s} {'samples/s':>10s} {'range':>17s} {'to 1st step':>12s} {'/ headless':>11s} {'range':>13s}"
    )
    label = {"headless": "headless (CLI)", "thread": "app, worker thread", "child": "app, child process"}
    for task in args.tasks.split(","):
        for mode in MODES:
            r = rates[(task, mode)]
            rng = f"{min(r):,.0f}-{max(r):,.0f}"
            ratio = rng_ratio = ""
            if mode != "headless":
                q = ratios[(task, mode)]
                ratio, rng_ratio = f"{med(q):.3f}", f"{min(q):.2f}-{max(q):.2f}"
            print(
                f"{task:8s} {label[mode]:22s} {med(r):10,.0f} {rng:>17s} {med(first[(task, mode)]):11.1f}s "
                f"{ratio:>11s} {rng_ratio:>13s}"
            )
    print("\nside by side (median of per-round ratios, GUI-monitored / headless; goal >= 0.98):")
    for task in args.tasks.split(","):
        t, c = med(ratios[(task, "thread")]), med(ratios[(task, "child")])
        print(f"  {task:8s} worker thread {t:.3f}   child process {c:.3f}")
    load = os.getloadavg()
    print(f"\nload average at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
