"""The Health view draws what the run recorded — read back from the pyqtgraph items.

The heatmap's pixels are the records' values (log10 for norms and ratios, a missing value transparent,
not zero); hovering names the layer, the step and the value; the noise-scale curve is the records'
``B_simple`` with the batch as a line; the NaN origin is a line at its step on the loss plot; export
writes health.csv in long form.
"""

import csv
import math

import numpy as np
import pytest

pytest.importorskip("PySide6")

from multilane.gui.health.view import HealthView
from multilane.gui.plots.panel import PlotPanel
from multilane.gui.runs.run_data import RunData

ROWS = ["features.0", "features.2", "head.1"]


def make_run() -> RunData:
    d = RunData("health")
    t = 1000.0
    for k in range(1, 7):
        s = 10 * k
        t += 1
        loss = 1.0 / k if k < 6 else None
        d.add({"kind": "train", "step": s, "wall_time": t, "loss": loss, "device_loss": {"cpu:0": 1.0, "cpu:1": 1.0}})
        ratios = [10.0 ** -(k + i) for i in range(3)]
        ratios[1] = None if k == 3 else ratios[1]  # a gap stays a gap
        d.add(
            {
                "kind": "health",
                "step": s,
                "wall_time": t,
                "rows": ROWS,
                "grad_norm": [float(k), 2.0 * k, 3.0 * k],
                "update_ratio": ratios,
                "act_rows": ["features.1 (ReLU)"],
                "act_zero": [0.1 * k],
            }
        )
    return d


def with_noise(d: RunData) -> RunData:
    for k in range(1, 7):
        d.add(
            {
                "kind": "train",
                "step": 10 * k + 5,
                "wall_time": 2000.0 + k,
                "loss": 0.5,
                "device_loss": {"cpu:0": 0.5},
                "noise": {
                    "g2": 1.0,
                    "trace": 100.0 * k,
                    "b_simple": 100.0 * k,
                    "lo": None if k == 1 else 80.0 * k,  # the first band unbounded
                    "hi": None if k == 1 else 130.0 * k,
                    "steps": 3 * k,
                    "batch": 64,
                    "unit": "samples",
                },
            }
        )
    return d


def test_the_heatmap_is_the_records_values_in_log_colour_with_gaps(qtbot):
    view = HealthView()
    qtbot.addWidget(view)
    view.set_data(make_run())
    view.quantity.setCurrentIndex(view.quantity.findData("update_ratio"))
    img = view.image.image  # (steps, rows) as drawn
    assert img.shape == (6, 3)
    for j, k in enumerate(range(1, 7)):
        for i in range(3):
            if i == 1 and k == 3:
                assert math.isnan(img[j, i])  # no value: transparent, not a colour
            else:
                assert img[j, i] == pytest.approx(-(k + i))
    assert view.image.levels.tolist() == pytest.approx([-8.0, -1.0])
    # placed at its steps: column j spans step 10(j+1) ± 5, row i at y = i
    r = view.image.mapRectToParent(view.image.boundingRect())
    assert (r.left(), r.right(), r.top(), r.bottom()) == pytest.approx((5.0, 65.0, -0.5, 2.5))
    assert view.value_at(40.0, 2.0) == "head.1 · step 40 · update / weight (‖Δw‖/‖w‖) 1e-06"
    assert view.value_at(30.0, 1.0).endswith("no value")
    assert view.value_at(100.0, 1.0) == "" and view.value_at(30.0, 5.0) == ""


def test_a_mean_batch_is_labelled_as_one_not_rounded(qtbot):
    # an epoch's short last batch among the measured steps: the mean batch 63.58, not "64" nor "63"
    d = with_noise(make_run())
    d.add({"kind": "train", "step": 75, "wall_time": 2007.0, "loss": 0.5, "device_loss": {"cpu:0": 0.5},
           "noise": {"g2": 1.0, "trace": 700.0, "b_simple": 700.0, "lo": 560.0, "hi": 910.0, "steps": 21,
                     "batch": 63.58, "unit": "samples"}})  # fmt: skip
    view = HealthView()
    qtbot.addWidget(view)
    view.set_data(d)
    assert view.batch_line.value() == pytest.approx(63.58)
    assert view.batch_label.toPlainText() == "batch 63.6 samples on average"
    assert view.noise_line.text().startswith("batch 63.6 samples on average · noise scale ≈ 700 samples")


def test_a_linear_quantity_and_the_activation_rows(qtbot):
    view = HealthView()
    qtbot.addWidget(view)
    view.set_data(make_run())
    view.quantity.setCurrentIndex(view.quantity.findData("act_zero"))
    assert view.image.image[:, 0].tolist() == pytest.approx([0.1 * k for k in range(1, 7)])
    assert view.value_at(60.0, 0.0).startswith("features.1 (ReLU) · step 60")


def test_the_noise_curve_and_the_batch_line(qtbot):
    view = HealthView()
    qtbot.addWidget(view)
    view.set_data(with_noise(make_run()))
    x, y = view.noise_curve.getData()
    assert x.tolist() == [15, 25, 35, 45, 55, 65] and y.tolist() == [100, 200, 300, 400, 500, 600]
    assert view.batch_line.isVisible() and view.batch_line.value() == 64
    assert view.noise_line.text().startswith("batch 64 samples · noise scale ≈ 600 samples (95 % band 480–780)")
    assert view.noise_line.text().endswith("a larger batch, or more GPUs, would still help")
    # the band is drawn: the fill between its two edges, each edge the records' lo / hi where bounded
    assert view.band.curves == [view.band_lo, view.band_hi] and view.band in view.noise.items
    for edge, per in ((view.band_lo, 80.0), (view.band_hi, 130.0)):
        ex, ey = edge.getData()
        assert ex.tolist() == [25, 35, 45, 55, 65] and ey.tolist() == [per * k for k in range(2, 7)]
    path = view.band.path().boundingRect()  # the fill's own shape spans the band
    assert (path.left(), path.right(), path.top(), path.bottom()) == pytest.approx((25, 65, 160, 780))
    lo, hi = view.noise.vb.viewRange()[1]
    assert lo <= 64 and hi >= 780  # batch and band in view


def test_one_device_says_why_there_is_no_noise_scale(qtbot):
    d = RunData("one")
    d.add({"kind": "train", "step": 10, "wall_time": 1.0, "loss": 1.0, "device_loss": {"cpu:0": 1.0}})
    d.add({"kind": "health", "step": 10, "wall_time": 1.0, "rows": ["a"], "grad_norm": [1.0]})
    view = HealthView()
    qtbot.addWidget(view)
    view.set_data(d)
    assert "two or more devices" in view.noise_line.text()


def test_the_nan_origin_is_a_line_at_its_step_on_the_loss_plot(qtbot):
    d = make_run()
    msg = "loss became nan at step 42: first non-finite output in head.1 on cpu:1, from samples 7"
    d.add(
        {
            "kind": "event",
            "event": "nonfinite_origin",
            "step": 60,
            "wall_time": 1010.0,
            "message": msg,
            "origin_step": 42,
        }
    )
    panel = PlotPanel()
    qtbot.addWidget(panel)
    panel.reset(d)
    panel.refresh()
    lines = [item for p, item in panel._pause_items if p is panel.plots[0] and item.toolTip() == msg]
    assert len(lines) == 1 and lines[0].value() == 42


def test_export_writes_health_in_long_form(tmp_path):
    d = with_noise(make_run())
    n = d.write_health_csv(tmp_path / "health.csv")
    rows = list(csv.DictReader((tmp_path / "health.csv").read_text().splitlines()))
    assert len(rows) == n == 6 * (3 + 3 + 1) + 6 * 7  # the noise: value, band, batch, g2, trace, steps
    got = {(r["step"], r["quantity"], r["layer"]): r["value"] for r in rows}
    assert float(got[("40", "update_ratio", "head.1")]) == pytest.approx(1e-6)
    assert got[("30", "update_ratio", "features.2")] == ""
    assert float(got[("65", "noise_b_simple", "")]) == 600
    assert float(got[("65", "noise_lo", "")]) == 480 and float(got[("65", "noise_hi", "")]) == 780
    assert got[("15", "noise_hi", "")] == ""  # unbounded: no number
    assert d.noise_summary() == "noise scale ≈ 600 samples (95 % band 480–780)"  # the export's caption
    assert np.isfinite(float(got[("10", "grad_norm", "features.0")]))


def test_exact_zeros_are_drawn_at_the_bottom_of_the_colour_bar_not_blank(qtbot):
    # a dead layer's gradient is exactly 0: on the log scale it is the sickest row, so it must show
    d = make_run()
    for rec in d.health:
        rec["grad_norm"][0] = 0.0
    view = HealthView()
    qtbot.addWidget(view)
    view.set_data(d)
    img = view.image.image  # as drawn: (steps, rows)
    smallest = math.log10(2.0)  # features.2 at step 10
    assert img[:, 0].tolist() == pytest.approx([smallest - 1.0] * 6)  # a decade under the smallest value
    assert view.image.levels[0] == pytest.approx(smallest - 1.0)  # the bottom of the bar: its colour
    assert "exact 0 at the bar's bottom" in view.heat.titleLabel.text
    assert view.value_at(10.0, 0.0) == "features.0 · step 10 · gradient norm 0 (exact zero)"


def test_the_noise_plot_shows_the_batch_line_even_above_the_curve(qtbot):
    d = make_run()
    for k in range(1, 4):
        noise = {"g2": 1.0, "trace": 5.0 * k, "b_simple": 5.0 * k, "batch": 256, "unit": "samples"}
        d.add({"kind": "train", "step": 10 * k, "wall_time": 3000.0 + k, "loss": 0.5, "noise": noise})
    view = HealthView()
    qtbot.addWidget(view)
    view.set_data(d)
    lo, hi = view.noise.vb.viewRange()[1]
    assert lo <= 5.0 and hi >= 256.0, (lo, hi)


def test_a_run_that_went_nan_before_any_health_says_why_the_heatmap_is_empty(qtbot):
    d = RunData("nan")
    d.add({"kind": "train", "step": 5, "wall_time": 1.0, "loss": None, "device_loss": {"cpu:0": None}})
    message = "loss became nan at step 3: non-finite values in the input data on cpu:0, from samples 12"
    d.add({"kind": "event", "event": "nonfinite_origin", "step": 5, "wall_time": 2.0, "message": message})
    view = HealthView()
    qtbot.addWidget(view)
    view.set_data(d)
    assert "no health sampled before the loss went non-finite" in view.heat.titleLabel.text
    assert "from samples 12" in view.heat.titleLabel.text
    assert [view.diagnosis.item(i).text() for i in range(view.diagnosis.count())] == [message]


def test_the_diagnosis_lists_the_sick_layers_and_a_click_shows_the_row(qtbot):
    d = make_run()  # grad norms grow 1..6 per layer: no explosion; update ratios 1e-1 .. 1e-8
    last = d.health[-1]
    last["grad_norm"][2] = 400.0  # head.1: 100x its usual: exploding
    last["act_zero"] = [0.96]  # the ReLU: dead
    view = HealthView()
    qtbot.addWidget(view)
    view.set_data(d)
    texts = [view.diagnosis.item(i).text() for i in range(view.diagnosis.count())]
    assert view.diagnosis.isVisibleTo(view)
    assert texts[0] == "features.1 (ReLU): 96% of its outputs are exact zeros (dead units)", texts
    assert any(t.startswith("features.2: update/weight 1.0e-07") and "barely moves" in t for t in texts), texts
    assert not any(t.startswith("features.0") for t in texts), texts  # 1e-6 and growing norms: healthy
    assert any(t.startswith("head.1: gradient norm 4.00e+02") and "(exploding)" in t for t in texts), texts
    k = next(i for i, t in enumerate(texts) if t.startswith("head.1: gradient norm"))
    view.select_finding(k)
    assert view.quantity.currentData() == "grad_norm"
    assert view.selected.isVisible() and view.selected.getRegion() == pytest.approx((1.5, 2.5))
    for rec in d.health:  # every layer's update ratio near the usual 1e-3, the ReLU alive, no spike
        rec["update_ratio"] = [1e-3, 2e-3, 5e-4]
    last["act_zero"], last["grad_norm"][2] = [0.3], 18.0
    view.set_data(d)
    assert view.diagnosis.count() == 0 and not view.diagnosis.isVisibleTo(view)
