"""One colour per device, decided from the device list and the same everywhere: every curve's pen in
the live plots, the key, the hover line and the exported figures, whatever order the record kinds
arrive in and wherever a redraw lands between them (cpu:1's utilization was drawn in
cpu:0's colour for a whole run when a redraw came between the first telemetry and train records)."""

import itertools
import re

import pytest

pytest.importorskip("PySide6")

from multilane.gui.plots.curves import group_of
from multilane.gui.plots.overview import overview_figure
from multilane.gui.plots.palette import series_color
from multilane.gui.runs.run_data import RunData
from PySide6.QtGui import QColor

# lanes in a run's own order, not the names' order: a colour must come from the list, not a sort
LANES = ["cpu:1", "cpu:0"]
RANKS = ["box/rank0/cpu", "box/rank1/cpu"]


def kinds(lanes: list[str], step: int) -> dict[str, list[dict]]:
    """One record of each kind of a run on ``lanes``; ranks report telemetry one record each (ddp)."""
    t = 1000.0 + step
    started = {"kind": "event", "event": "started", "step": 0, "wall_time": 1000.0, "lanes": lanes}
    train = {"kind": "train", "step": step, "wall_time": t, "loss": 1.0, "lr": 0.1}
    train["device_loss"] = {d: 1.0 + 0.1 * i for i, d in enumerate(lanes)}
    ev = {"kind": "eval", "step": step, "wall_time": t, "val_loss": 1.1}
    tele = [
        {"kind": "telemetry", "step": step, "wall_time": t, "devices": {d: {"busy_pct": {"mean": 40.0 + i}}}}
        | {"process": {"rss_mb": 300.0}}
        for i, d in enumerate(lanes)
    ]
    return {"started": [started], "train": [train], "eval": [ev], "telemetry_b": [tele[1]], "telemetry_a": [tele[0]]}


def pens(panel) -> dict[str, str]:
    """Every device curve the panel made (raw faint ones included), by key, with its pen's colour."""
    out = {}
    for store, tag in ((panel._curves, ""), (panel._raw, "raw|")):
        for key, item in store.items():
            if group_of(key).startswith("dev:"):
                out[tag + key] = item.opts["pen"].color().name().upper()
    return out


def key_colours(panel) -> dict[str, str]:
    """The key's swatch colour before each device's name."""
    html = panel.key.text
    found = re.findall(r'color:(#[0-9A-Fa-f]{6}); font-weight:bold;">━━</span>([^<]+)<', html)
    return {name: colour.upper() for colour, name in found if name not in ("combined", "validation")}


KINDS = list(kinds(LANES, 10))
HARD_ORDERS = [
    ("telemetry_b", "telemetry_a", "train", "eval", "started"),  # the list last, the second device first
    ("eval", "telemetry_b", "train", "started", "telemetry_a"),
]


def deliver(panel, lanes, orders):
    """Each order: a fresh run, one record of each kind in that order with a redraw after each, then a
    second step's records; yields the order once drawn."""
    for order in orders:
        panel.reset(RunData("run"))
        for kind in order:
            for rec in kinds(lanes, 10)[kind]:
                panel.add_record(rec)
            panel.refresh()  # a redraw between every two kinds
        for kind in order:
            for rec in kinds(lanes, 20)[kind] if kind != "started" else []:
                panel.add_record(rec)
        panel.refresh()
        yield order


@pytest.fixture
def colour_panel(qtbot):
    from multilane.gui.plots.panel import PlotPanel

    panel = PlotPanel()
    qtbot.addWidget(panel)
    panel.resize(900, 700)
    panel.set_smoothing(0.5)  # the raw faint curves too
    return panel


@pytest.mark.slow
@pytest.mark.parametrize("lanes", [LANES, RANKS], ids=["lanes", "ddp-ranks"])
def test_every_order_of_record_kinds_gives_each_device_its_own_colour(lanes, colour_panel):
    assert check_orders(colour_panel, lanes, itertools.permutations(KINDS)) == 120


@pytest.mark.parametrize("lanes", [LANES, RANKS], ids=["lanes", "ddp-ranks"])
def test_the_hard_orders_keep_each_device_its_colour_everywhere(lanes, colour_panel):
    panel = colour_panel
    check_orders(panel, lanes, HARD_ORDERS)
    want = {d: QColor(series_color(i)).name().upper() for i, d in enumerate(lanes)}
    # the hover names each device in its colour
    panel.show_values_at(20)
    for d in lanes:
        spans = re.findall(r'<span style="color:(#[0-9A-Fa-f]{6});">([^<]+)</span>', panel.header.text)
        named = [c.upper() for c, text in spans if text.startswith(f"{d} ")]
        assert named and set(named) == {want[d]}, (d, panel.header.text)
    # the exported figure: every device's line, in every panel, in the device's colour
    run = RunData("run")
    for kind in HARD_ORDERS[0]:
        for rec in kinds(lanes, 10)[kind] + (kinds(lanes, 20)[kind] if kind != "started" else []):
            run.add(rec)
    fig = overview_figure(run)
    seen = 0
    for ax in fig.axes:
        for line in ax.get_lines():
            if line.get_label() in lanes:
                assert QColor(line.get_color()).name().upper() == want[line.get_label()], (ax.get_title(), line)
                seen += 1
    assert seen >= 2 * len(lanes)  # loss and utilization at least


def check_orders(panel, lanes, orders) -> int:
    """Every device curve's pen and key swatch in the device's colour, for each order; how many orders."""
    want = {d: QColor(series_color(i)).name().upper() for i, d in enumerate(lanes)}
    n = 0
    for order in deliver(panel, lanes, orders):
        drawn = pens(panel)
        assert {group_of(k.removeprefix("raw|"))[4:] for k in drawn} == set(lanes), order
        for key, colour in drawn.items():
            assert colour == want[group_of(key.removeprefix("raw|"))[4:]], (order, key, colour)
        assert key_colours(panel) == want, order
        n += 1
    return n


def test_a_run_folder_without_the_list_takes_it_from_its_config(tmp_path):
    """A run written before ``started`` named its lanes: config.json's device list decides."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({"devices": {"use": "cpu:1,cpu:0"}}))
    recs = kinds(LANES, 10)
    lines = [recs["telemetry_a"][0], recs["telemetry_b"][0], recs["train"][0]]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    run = RunData.from_run_dir(tmp_path)
    assert run.devices == LANES
    assert [run.device_index(d) for d in ("cpu:1", "cpu:0")] == [0, 1]
