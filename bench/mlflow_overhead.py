"""What logging to an MLflow server costs the training loop: the median step time of the same run with no
tracking, with ``tracking.mlflow`` on a server that answers, on a closed port, and on a server killed
after its first points and started again on the same port and database.

    python bench/mlflow_overhead.py [--steps 1500] [--repeats 2]

Each run is ``multilane train --task mlp`` on two CPU lanes (a real process, the CLI a user runs); its
step time is the median of the train records' ``step_ms``. The server is a real ``mlflow server`` on
127.0.0.1 with a SQLite database (the tests' ``tests/integrations/mlflow_server.py``). Needs the
``[mlflow]`` extra.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integrations"))
from mlflow_server import MlflowServer, free_port  # noqa: E402

CLI = [sys.executable, "-m", "multilane.engine.cli"]


def run(runs: Path, steps: int, *sets: str, during=None) -> float:
    args = [*CLI, "train", "--task", "mlp", "--steps", str(steps), "--devices", "cpu:0,cpu:1", "--runs-dir", str(runs)]
    for s in ("train.log_every=5", *sets):
        args += ["--set", s]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if during is not None:
        threading.Thread(target=during, daemon=True).start()
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err
    (folder,) = sorted(runs.iterdir())
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    ms = [r["step_ms"] for r in map(json.loads, lines) if r.get("kind") == "train" and "step_ms" in r]
    return statistics.median(ms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = MlflowServer(Path(tmp))
        server.start()

        def restart() -> None:
            time.sleep(3)
            server.kill()
            time.sleep(5)
            server.start()

        cases = {
            "no tracking": ((), None),
            "server answering": ((f"tracking.mlflow={server.uri}",), None),
            "closed port": ((f"tracking.mlflow=http://127.0.0.1:{free_port()}",), None),
            "server killed, restarted": ((f"tracking.mlflow={server.uri}",), restart),
        }
        try:
            print(f"{'case':<26} {'median step ms':>15}  (each of {args.repeats} runs)")
            for name, (sets, during) in cases.items():
                got = [
                    run(Path(tmp) / f"{name}-{i}".replace(" ", "_").replace(",", ""), args.steps, *sets, during=during)
                    for i in range(args.repeats)
                ]
                print(f"{name:<26} {statistics.median(got):>15.3f}  {' '.join(f'{g:.3f}' for g in got)}")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
