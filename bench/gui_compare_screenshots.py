"""Screenshots of runs compared across strategies, as a user sees them: a real window on an X server.

    Xvfb :99 -screen 0 1920x1080x24 &
    DISPLAY=:99 python bench/gui_compare_screenshots.py RUNS_DIR --size 1280x800 --out /tmp/shots

Opens the runs folder's Runs tab (screenshot), then compares every run in it (screenshot of the plots).
Make the runs first, e.g. digits on cpu:0,cpu:1 under replicate, ddp and fsdp (`multilane train
--strategy ...`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gui_screenshots import open_window, shot, wait
from PySide6.QtWidgets import QApplication


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs_dir")
    ap.add_argument("--size", default="1280x800")
    ap.add_argument("--out", default="/tmp/shots")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    app, window, _ = open_window(args.size, args.runs_dir)
    window.tabs.setCurrentWidget(window.runs_table)
    wait(app, 2.0)
    shot(app, window, out / f"runs-{args.size}.png")
    runs = sorted(str(p) for p in Path(args.runs_dir).iterdir() if (p / "status.json").is_file())
    window.compare_runs(runs)
    wait(app, 2.0)
    shot(app, window, out / f"compare-{args.size}.png")
    window.close()
    QApplication.processEvents()


if __name__ == "__main__":
    main()
