"""The window on a small laptop's screen (1024×700) and a large one: every plot, the key and the hover
header lie inside the window, none cut off at the right, whatever titles the plots carry."""

import pytest

pytest.importorskip("PySide6")

from PySide6.QtCore import QPoint, QRect


def feed_a_run(plots, gpu: bool) -> None:
    """Records as the engine writes them: two devices, validation with a metric, every phase's time,
    and telemetry (a GPU's power and temperature add a plot row)."""
    t0 = 1_700_000_000.0
    devices = ["cuda:0", "cuda:1"] if gpu else ["cpu:0", "cpu:1"]
    phases = ["data", "scatter", "replicate", "forward", "loss", "backward", "reduce", "optimizer"]
    for s in range(1, 41):
        plots.add_record(
            {
                "kind": "train",
                "step": s,
                "wall_time": t0 + s,
                "loss": 2 / s,
                "device_loss": {d: 2 / s + 0.01 * i for i, d in enumerate(devices)},
                "lr": 0.003,
                "samples_per_s": 5000.0 + s,
                "phase_ms": {p: 1.0 + i for i, p in enumerate(phases)},
            }
        )
        if s % 10 == 0:
            plots.add_record(
                {"kind": "eval", "step": s, "wall_time": t0 + s, "val_loss": 2 / s, "metrics": {"accuracy": 0.5}}
            )
        if gpu:
            dev = {
                "util_pct": 90.0,
                "mem_used_mb": 4000.0,
                "torch_allocated_mb": 3000.0,
                "power_w": 250.0,
                "temp_c": 70.0,
            }
            plots.add_record({"kind": "telemetry", "wall_time": t0 + s, "devices": dict.fromkeys(devices, dev)})
        else:
            devs = {d: {"busy_pct": 50.0} for d in devices}
            plots.add_record({"kind": "telemetry", "wall_time": t0 + s, "devices": devs, "process": {"rss_mb": 500.0}})
    plots.refresh()


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu-lanes", "gpus"])
@pytest.mark.parametrize("size", [(1024, 700), (1400, 900)], ids=["1024x700", "1400x900"])
def test_every_plot_lies_inside_the_window(qtbot, window, size, gpu):
    window.resize(*size)
    window.show()
    qtbot.waitExposed(window)
    panel = window.plots
    feed_a_run(panel, gpu)
    qtbot.wait(100)  # the layout settles
    assert window.size().width() == size[0]
    # the panel itself lies inside the window
    top_left = panel.viewport().mapTo(window, QPoint(0, 0))
    shown = QRect(top_left, panel.viewport().size())
    assert window.rect().contains(shown), (shown, window.rect())
    # and every plot, the key and the header lie inside the panel's view (no part scrolled or cut off)
    view = panel.viewport().rect().adjusted(-1, -1, 1, 1)
    items = {**{p.titleLabel.text[:24]: p for p in panel.plots}, "key": panel.key, "header": panel.header}
    assert (panel.power is not None) == gpu and len(panel.plots) == (10 if gpu else 8)
    for name, item in items.items():
        rect = panel.mapFromScene(item.sceneBoundingRect()).boundingRect()
        assert view.contains(rect), f"{name}: {rect} is not inside the plots' view {view} at {size}"
    for p in panel.plots:  # a title wraps where its plot is narrow, rather than widening the plot
        title, plot = p.titleLabel.sceneBoundingRect(), p.sceneBoundingRect()
        assert title.left() >= plot.left() - 1 and title.right() <= plot.right() + 1
        text = p.titleLabel.item.sceneBoundingRect()
        assert text.left() >= plot.left() - 1 and text.right() <= plot.right() + 1, p.titleLabel.text[:24]
