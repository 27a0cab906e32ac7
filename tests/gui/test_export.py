"""Exported figures as a paper needs them: the SVG, drawn by an independent renderer (cairosvg), lines up
with the PNG; SVG and PDF text is text; `multilane export` works without Qt."""

import io
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
import zlib

import cairosvg
import numpy as np
import pytest
from helpers import CLI
from multilane.gui.plots.export import export_run
from multilane.gui.plots.figures import FigureOptions, comparison_figure, loss_figure
from multilane.gui.runs.run_data import RunData
from PIL import Image

WIDTH = 1400
TELEMETRY = ["--set", "telemetry.record_s=0.1"]


def synthetic_run(name="demo-run", steps=60, devices=("cpu:0", "cpu:1"), scale=1.0) -> RunData:
    """A run's records as the trainer writes them, made here so the test knows every value."""
    run = RunData(name)
    t0 = 1_700_000_000.0
    for s in range(1, steps + 1):
        base = scale * (2.0 * np.exp(-s / 15) + 0.1)
        run.add(
            {
                "kind": "train",
                "step": s,
                "wall_time": t0 + 0.1 * s,
                "loss": base,
                "device_loss": {d: base * (1 + 0.05 * (i - 0.5)) for i, d in enumerate(devices)},
                "lr": 0.01,
                "samples_per_s": 1000.0,
            }
        )
        if s % 10 == 0:
            run.add({"kind": "eval", "step": s, "wall_time": t0 + 0.1 * s, "val_loss": base * 1.2, "metrics": {}})
    return run


def rgb(path_or_bytes) -> np.ndarray:
    src = io.BytesIO(path_or_bytes) if isinstance(path_or_bytes, bytes) else path_or_bytes
    img = Image.open(src).convert("RGBA")
    white = Image.new("RGBA", img.size, "white")
    return np.asarray(Image.alpha_composite(white, img).convert("RGB")).astype(int)


def svg_as_png(svg_path, width) -> np.ndarray:
    return rgb(cairosvg.svg2png(url=str(svg_path), output_width=width))


def axes_box(fig, dpi) -> tuple[int, int, int, int]:
    """The loss axes in pixels of an image saved at ``dpi``: (left, top, right, bottom)."""
    (x0, y0), (x1, y1) = fig.axes[0].get_window_extent().get_points() * dpi / fig.dpi
    h = fig.get_figheight() * dpi
    return int(x0), int(h - y1), int(x1), int(h - y0)


def last_black_point(img: np.ndarray, box) -> tuple[int, int]:
    """The rightmost pixel of the black (combined) curve inside the axes, and its row."""
    left, top, right, bottom = box
    inner = img[top + 4 : bottom - 4, left + 4 : right - 4]
    black = (inner.max(axis=2) < 60).nonzero()
    assert len(black[1]), "no black curve inside the axes"
    col = black[1].max()
    rows = black[0][black[1] == col]
    return left + 4 + int(col), top + 4 + int(np.median(rows))


def spine_rows_cols(img: np.ndarray) -> tuple[int, int]:
    """The bottom spine's row and the left spine's column: the longest dark lines."""
    dark = img.max(axis=2) < 80
    return int(np.argmax(dark.sum(axis=1))), int(np.argmax(dark.sum(axis=0)))


@pytest.mark.slow
def test_the_svg_drawn_by_cairosvg_lines_up_with_the_png(tmp_path):
    run = synthetic_run()
    opts = FigureOptions()
    files = export_run(run, tmp_path, ["png", "svg", "pdf"], WIDTH, options=opts)
    assert {f.name for f in files} >= {"loss.png", "loss.svg", "loss.pdf", "plots.png", "plots.svg", "plots.pdf"}
    png = rgb(tmp_path / "loss.png")
    svg = svg_as_png(tmp_path / "loss.svg", WIDTH)
    assert png.shape == svg.shape and png.shape[1] == WIDTH
    fig = loss_figure(run, opts)
    fig.savefig(io.BytesIO(), format="png", dpi=WIDTH / fig.get_figwidth())  # lays the figure out
    box = axes_box(fig, WIDTH / fig.get_figwidth())
    # where matplotlib says the last combined point is, in image pixels
    ax = fig.axes[0]
    px, py = ax.transData.transform((60, run.train.get("loss")[-1])) * (WIDTH / fig.get_figwidth()) / fig.dpi
    expected = (px, png.shape[0] - py)
    got_png, got_svg = last_black_point(png, box), last_black_point(svg, box)
    assert abs(got_png[0] - expected[0]) <= 4 and abs(got_png[1] - expected[1]) <= 4, (got_png, expected)
    assert abs(got_svg[0] - got_png[0]) <= 3 and abs(got_svg[1] - got_png[1]) <= 3, (got_svg, got_png)
    # the axes themselves: the same spines in both (the old SVG's grid spanned 3/4 of its curves)
    (row_p, col_p), (row_s, col_s) = spine_rows_cols(png), spine_rows_cols(svg)
    assert abs(row_p - row_s) <= 2 and abs(col_p - col_s) <= 2
    assert abs(row_p - box[3]) <= 3 and abs(col_p - box[0]) <= 3
    # and the final point sits above the bottom spine, inside the axes (not under the "0" line)
    assert box[1] < got_svg[1] < row_s and got_svg[0] < box[2]


def test_svg_and_pdf_text_is_real_text_with_a_sans_font(tmp_path):
    run = synthetic_run("my-run-name")
    export_run(run, tmp_path, ["svg", "pdf"], WIDTH, options=FigureOptions(smoothing=0.6))
    root = ET.parse(tmp_path / "loss.svg").getroot()
    texts = [el for el in root.iter() if el.tag.endswith("text")]
    words = " ".join("".join(el.itertext()) for el in texts)
    for expected in ("my-run-name", "step", "loss", "cpu:0", "cpu:1", "combined", "validation", "EMA 0.60"):
        assert expected in words, expected
    assert all("sans-serif" in el.get("style", "") for el in texts)
    assert not [el for el in root.iter() if el.tag.endswith("image")]  # no bitmaps
    pdf = (tmp_path / "loss.pdf").read_bytes()
    assert b"/Type3" not in pdf and b"/CIDFontType2" in pdf and b"/FontFile2" in pdf  # embedded TrueType
    assert b"/ToUnicode" in pdf  # text can be searched and copied
    streams = [zlib.decompress(m) for m in re.findall(rb"stream\r?\n(.*?)\r?\nendstream", pdf, re.S) if m[:1] == b"x"]
    assert any(b"BT" in s and b"TJ" in s for s in streams)  # text-showing operators, not outlines


def test_a_comparison_draws_one_named_curve_per_run(tmp_path):
    runs = [synthetic_run("baseline"), synthetic_run("bigger-lr", scale=0.7), synthetic_run("warmup", scale=0.5)]
    files = export_run(runs[0], tmp_path, ["svg", "png"], 1000, compare=runs[1:])
    assert tmp_path / "compare.svg" in files
    fig = comparison_figure(runs)
    ax = fig.axes[0]
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == [n for r in runs for n in (r.name, f"{r.name} (validation)")]
    colors = {line.get_color() for line in ax.get_lines()}
    assert len(colors) == 3  # one colour per run, its validation in the same
    legend = ax.get_legend()
    (lx0, _), (_, ly1) = legend.get_window_extent().get_points()
    (_, ay0), (ax1, _) = ax.get_window_extent().get_points()
    assert lx0 >= ax1 or ly1 <= ay0  # the legend is outside the axes, right of them or under: it covers no data


@pytest.mark.slow
def test_multilane_export_needs_no_qt_and_makes_every_file(tmp_path):
    # A tiny real run, then `multilane export` in a process that must never import Qt.
    runs = tmp_path / "runs"
    r = subprocess.run(
        [
            *CLI,
            "train",
            "--task",
            "mlp",
            "--steps",
            "60",
            "--devices",
            "cpu:0,cpu:1",
            "--runs-dir",
            str(runs),
            *TELEMETRY,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr
    (run_dir,) = runs.iterdir()
    out = tmp_path / "out"
    code = (
        "import sys; from multilane.engine.cli import main; rc = main(sys.argv[1:]); "
        "assert not [m for m in sys.modules if m.startswith(('PySide6', 'pyqtgraph'))], 'Qt imported'; sys.exit(rc)"
    )
    t = time.monotonic()
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "export",
            str(run_dir),
            "--out",
            str(out),
            "--width",
            "800",
            "--compare",
            str(run_dir),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env={k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")},
    )
    assert r.returncode == 0, r.stderr
    names = {p.name for p in out.iterdir()}
    for stem in ("loss", "plots", "compare"):
        assert {f"{stem}.png", f"{stem}.svg", f"{stem}.pdf"} <= names
    assert "metrics.csv" in names
    assert Image.open(out / "loss.png").size[0] == 800
    header = (out / "metrics.csv").read_text().splitlines()[0].split(",")
    assert any(h.startswith("util/cpu:") for h in header)  # telemetry joined onto each step
    assert time.monotonic() - t < 120
    bad = subprocess.run([*CLI, "export", str(tmp_path), "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "not a run folder" in bad.stderr
    bad = subprocess.run(
        [*CLI, "export", str(run_dir), "--out", str(out), "--format", "gif"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "unknown format 'gif'" in bad.stderr


@pytest.mark.parametrize("x_mode", ["step", "time"])
def test_a_pause_is_marked_on_the_time_axis(x_mode):
    run = synthetic_run()
    t0 = run.t0
    run.add({"kind": "event", "event": "paused", "step": 30, "wall_time": t0 + 3.05})
    run.add({"kind": "event", "event": "resumed", "step": 30, "wall_time": t0 + 13.0})
    fig = loss_figure(run, FigureOptions(x_mode=x_mode))
    spans = [p for p in fig.axes[0].patches if p.get_label() == "paused"]
    assert len(spans) == (1 if x_mode == "time" else 0)
    if spans:
        x0, width = spans[0].get_x(), spans[0].get_width()
        assert x0 == pytest.approx(3.05) and x0 + width == pytest.approx(13.0)
    assert json.dumps(fig.axes[0].get_xlabel()) in ('"step"', '"elapsed time (s)"')


def test_a_single_runs_caption_names_its_strategy(tmp_path):
    from multilane.gui.plots.figures import run_caption

    for strategy, expected in ((None, "replicate on cpu:0,cpu:1"), ("fsdp", "fsdp on cpu:0,cpu:1")):
        devices = {"use": "cpu:0,cpu:1"} | ({"strategy": strategy} if strategy else {})
        config = {"task": {"name": "digits"}, "devices": devices, "data": {"batch_size": 64}}
        (tmp_path / "config.json").write_text(json.dumps(config | {"optim": {"name": "adam", "lr": 0.003}}))
        assert run_caption(tmp_path) == f"task digits · {expected} · batch 64 · adam lr 0.003"


@pytest.mark.slow
def test_the_figure_of_a_run_that_diverged_says_so_under_its_title(tmp_path):
    # status.json's state is shown in the caption under the title: "diverged at step 3", not "stopped".
    from helpers import DIVERGE_TASK, diverge_settings
    from multilane.engine.config import build_config
    from multilane.engine.run.trainer import Trainer
    from multilane.engine.tasks import make_task
    from multilane.gui.plots.export import export_headless
    from multilane.gui.plots.figures import run_caption

    cfg = diverge_settings(tmp_path / "runs", "cpu:0", "replicate", 3, steps=6)
    cfg["train"]["log_every"] = 1
    cfg["health"] = {"nan_replay": False}
    result = Trainer(build_config(cfg), task=make_task(DIVERGE_TASK, cfg["task"]["params"])).run()
    assert result.status == "diverged", result.message
    assert run_caption(result.run_dir).endswith(" · diverged at step 3")
    (svg,) = [p for p in export_headless(result.run_dir, tmp_path / "out", ["svg"]) if p.name == "loss.svg"]
    assert "diverged at step 3" in svg.read_text()
