"""Choosing the devices: every GPU (or CPU lanes), its memory and live utilization, the output device,
and an optional share of each batch per device (uneven split)."""

from __future__ import annotations

from typing import Any

import psutil
from multilane.engine.plan.forecast import USABLE
from multilane.engine.plan.forecast import gib as fmt_bytes
from multilane.engine.run.balance import balance_warnings
from multilane.engine.telemetry.devices import Device, cpu_lane_count, describe_devices
from multilane.engine.telemetry.nvml import open_nvml
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QBrush, QColor
from PySide6.QtWidgets import (
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QHeaderView,
    QLabel,
    QTreeWidget,
    QTreeWidgetItem,
    QVBoxLayout,
    QWidget,
)

COLS = ["device", "model", "memory", "util", "needs", "share"]
MODEL, NEEDS, SHARE = 1, 4, 5  # the model's column, the forecast's (fit_forecast.py), the share's
HEADER_TIPS = [
    "Check the devices to train on; one replica of the model runs on each",
    "The GPU's model (shown when the devices differ; else in each device's tooltip)",
    "Memory: total, or used/total while a run reports it",
    "Utilization: a GPU's, or a CPU lane's busy % during a run",
    "Will it fit?: the forecast peak on the device · its share of the free memory",
    "This device's share of each batch, relative to the others (uneven split)",
]
MAX_ROWS = 8  # rows shown before the list scrolls


class DevicePicker(QWidget):
    changed = Signal()

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.cpu_pct = 0.0  # the whole CPU's load, between runs (update_idle)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.tree = QTreeWidget()
        self.tree.setObjectName("devices")
        self.tree.setHeaderLabels(COLS)
        for col, tip in enumerate(HEADER_TIPS):
            self.tree.headerItem().setToolTip(col, tip)
        self.tree.setRootIsDecorated(False)
        layout.addWidget(self.tree)
        form = QFormLayout()
        self.output = QComboBox()
        self.output.setObjectName("devices.output")
        self.output.setToolTip(
            "The device that gathers the losses (and holds the original model: it needs the most memory)"
        )
        form.addRow("output device", self.output)
        layout.addLayout(form)
        self.warning = QLabel()
        self.warning.setWordWrap(True)
        self.warning.setStyleSheet("color: #a05a00;")
        layout.addWidget(self.warning)

        self.host: str | None = None  # None: this computer; else the host the list was read from
        self.host_info: list[dict[str, Any]] = []  # the host's ``multilane devices --json``
        self.items: list[tuple[QTreeWidgetItem, QDoubleSpinBox, Device]] = []
        self.problems: list[str] = []  # GPUs that could not be read, a driver that did not answer
        self._fill(describe_devices(self.problems))  # each driver call bounded (telemetry/driver.py)
        header = self.tree.header()
        header.setStretchLastSection(False)
        header.setSectionResizeMode(QHeaderView.ResizeToContents)
        header.setSectionResizeMode(1, QHeaderView.Stretch)  # the model name gives way first
        # A tick is a change of the choice; a cell's text (util, memory, needs) is only news about a device.
        self.tree.itemChanged.connect(lambda _item, column: self._changed() if column == 0 else None)
        self.output.currentIndexChanged.connect(lambda _: self.changed.emit())
        self._nvml = open_nvml([d.index for _, _, d in self.items if d.is_cuda])
        self._refresh_outputs()

    def _fill(self, info: list[dict[str, Any]]) -> None:
        """One row per GPU of ``info`` (``multilane devices --json``), or CPU lanes where it has none."""
        self.gpus = [d for d in info if d.get("kind") == "cuda"]
        if self.gpus:
            for d in self.gpus:
                dev = Device("cuda", int(d["name"].split(":")[1]))
                self._add(dev, d.get("model", ""), f"{(d.get('memory_total_mb') or 0) / 1024:.0f} GiB", True)
        else:
            cpu = next((d for d in info if d.get("kind") == "cpu"), {})
            for i in range(cpu.get("lanes") or cpu_lane_count()):  # as `multilane devices` lists them
                memory = f"{(cpu.get('memory_total_mb') or 0) / 1024:.0f} GiB" if i == 0 else "shared"
                self._add(Device("cpu", i), "CPU lane", memory, i < 2)
        # One model everywhere (CPU lanes, a box of one GPU kind): the column would repeat it on every
        # row in a narrow panel; each device's tooltip names it instead. Mixed GPUs: the column shows.
        models = {item.text(MODEL) for item, _, _ in self.items}
        self.tree.setColumnHidden(MODEL, len(models) <= 1)
        self._fit_height()

    def _fit_height(self) -> None:
        """The list as tall as its rows (up to ``MAX_ROWS``, then it scrolls): no empty rows below."""
        rows = max(1, min(MAX_ROWS, len(self.items)))
        row = self.tree.sizeHintForRow(0) if self.items else 22
        frame = 2 * self.tree.frameWidth() + self.tree.header().sizeHint().height()
        scrollbar = self.tree.horizontalScrollBar().sizeHint().height()  # room for it, should it show
        self.tree.setFixedHeight(rows * max(row, 22) + frame + scrollbar + 2)

    def show_host(self, host: str | None, info: list[dict[str, Any]] | None = None) -> None:
        """List ``host``'s devices (its ``multilane devices --json``), or this computer's (None)."""
        self.tree.blockSignals(True)
        self.tree.clear()
        self.items = []
        self.host = host
        self.host_info = list(info or []) if host is not None else []
        self.problems = []
        self._fill(describe_devices(self.problems) if host is None else info or [])
        for item, _, d in self.items:  # live readings taken there, at the time the list was read
            r = next((x for x in info or [] if x.get("name") == d.name), None)
            if host is not None and r and r.get("util_pct") is not None:
                item.setText(3, f"{r['util_pct']:.0f}%")
        self.tree.blockSignals(False)
        self._refresh_outputs()
        self.changed.emit()

    def _add(self, dev: Device, model: str, memory: str, checked: bool) -> None:
        item = QTreeWidgetItem([dev.name, model, memory, "-", "", ""])
        item.setFlags(item.flags() | Qt.ItemIsUserCheckable)
        item.setCheckState(0, Qt.Checked if checked else Qt.Unchecked)
        item.setToolTip(0, f"{dev.name}: {model}, {memory}" if model else dev.name)
        self.tree.addTopLevelItem(item)
        share = QDoubleSpinBox()
        share.setDecimals(2)
        share.setMaximumWidth(share.fontMetrics().horizontalAdvance("100.00") + 30)
        share.setRange(0.0, 100.0)
        share.setSingleStep(0.5)
        share.setValue(1.0)
        share.setToolTip("This device's share of each batch, relative to the others (uneven split)")
        share.valueChanged.connect(self._changed)
        self.tree.setItemWidget(item, SHARE, share)
        self.items.append((item, share, dev))

    def _changed(self, *_: Any) -> None:
        self._refresh_outputs()
        self.changed.emit()

    def _refresh_outputs(self) -> None:
        chosen = self.selected()
        current = self.output.currentText()
        self.output.blockSignals(True)
        self.output.clear()
        self.output.addItems([d.name for d in chosen])
        if current in [d.name for d in chosen]:
            self.output.setCurrentText(current)
        self.output.blockSignals(False)
        warnings = [*dict.fromkeys(self.problems), *(self._balance(chosen) if chosen else [])]
        self.warning.setText("\n".join(f"⚠ {w}" for w in warnings))
        self.warning.setVisible(bool(warnings))

    def _balance(self, chosen: list[Device]) -> list[str]:
        """The warnings about the chosen devices, from the machine that has them: this one's own, or
        the host's list (never this computer's CUDA or cores for another machine's devices)."""
        if self.host is None:
            return balance_warnings(chosen)
        props = {int(d["name"].split(":")[1]): d for d in self.host_info if d.get("kind") == "cuda"}
        cpu = next((d for d in self.host_info if d.get("kind") == "cpu"), {})
        return balance_warnings(chosen, props, cpu.get("cores") or len(chosen))

    # -- values ----------------------------------------------------------------------------------
    def selected(self) -> list[Device]:
        return [d for item, _, d in self.items if item.checkState(0) == Qt.Checked]

    def values(self) -> dict[str, Any]:
        """The ``devices`` section of the config."""
        chosen = [(d, s.value()) for item, s, d in self.items if item.checkState(0) == Qt.Checked]
        weights = [w for _, w in chosen]
        uneven = len(set(weights)) > 1 or any(w == 0 for w in weights)
        return {
            "use": ",".join(d.name for d, _ in chosen),
            "output": max(0, self.output.currentIndex()),
            "weights": weights if uneven else [],
        }

    def set_values(self, devices: dict[str, Any]) -> None:
        names = [s.strip() for s in str(devices.get("use", "")).split(",") if s.strip()]
        if names == ["auto"]:
            names = [d.name for _, _, d in self.items][: len(self.gpus) or 2]
        weights = list(devices.get("weights") or [])
        self.tree.blockSignals(True)
        for item, share, d in self.items:
            on = d.name in names
            item.setCheckState(0, Qt.Checked if on else Qt.Unchecked)
            share.blockSignals(True)
            share.setValue(weights[names.index(d.name)] if on and len(weights) == len(names) else 1.0)
            share.blockSignals(False)
        self.tree.blockSignals(False)
        self._refresh_outputs()
        out = int(devices.get("output", 0))
        if 0 <= out < self.output.count():
            self.output.setCurrentIndex(out)
        self.changed.emit()

    def set_checked(self, names: list[str]) -> None:
        self.set_values({"use": ",".join(names)})

    # -- live utilization ------------------------------------------------------------------------
    def update_idle(self) -> None:
        """Refresh the util column from the machine (between runs).

        A CPU lane is busy only during a run, so between runs its cell is empty; the whole CPU's load
        (``cpu_pct``) is shown once, by the window, not repeated on every lane."""
        per_cpu = psutil.cpu_percent(None)
        self.cpu_pct = per_cpu
        if self.host is not None:  # another machine's devices: read when the host was picked
            return
        for item, _, d in self.items:
            if d.is_cuda and self._nvml is not None:
                r = self._nvml.read(d.index)
                if "util_pct" in r:
                    used = f"{r.get('mem_used_mb', 0) / 1024:.1f}/{r.get('mem_total_mb', 0) / 1024:.0f} GiB"
                    item.setText(3, f"{r['util_pct']:.0f}%")
                    item.setText(2, used)
            elif not d.is_cuda:
                item.setText(3, "–")
                item.setToolTip(3, "a CPU lane's busy %, during a run")

    def update_from_telemetry(self, rec: dict[str, Any]) -> None:
        """During a run: each device's utilization, or a CPU lane's busy %; "–" on devices not in the run."""
        devs = rec.get("devices", {})
        for item, _, d in self.items:
            r = devs.get(d.name)
            if not r:
                item.setText(3, "–")
                continue
            rate = r.get("util_pct") or r.get("busy_pct")
            if rate:
                item.setText(3, f"{rate['mean']:.0f}%")
            if "mem_used_mb" in r:
                item.setText(2, f"{r['mem_used_mb'] / 1024:.1f}/{r.get('mem_total_mb', 0) / 1024:.0f} GiB")

    # -- will it fit (gui/window/fit_forecast.py) ------------------------------------------------------
    def show_needs(self, forecast: dict[str, Any] | None) -> None:
        """Each chosen device's forecast peak against its free memory (``multilane plan --json``); CPU
        lanes share one RAM: its need is on the first chosen lane, "shared" on the others. None clears."""
        needs = {n["name"]: n for n in (forecast or {}).get("needs", [])}
        first_cpu = True
        for item, _, d in self.items:
            n = needs.get(d.name if d.is_cuda else "cpu") if item.checkState(0) == Qt.Checked else None
            text, tip, bad = "", "", False
            if n is not None and not d.is_cuda and not first_cpu:
                text, tip = "shared", "CPU lanes share one memory: the need of them all is on the first lane"
            elif n is not None:
                free = "?" if n["free"] is None else fmt_bytes(n["free"])
                where = "RAM available" if n["name"] == "cpu" else "free"
                bad = n["free"] is not None and n["need"] > USABLE * n["free"]
                text = f"{fmt_bytes(n['need'])} · {share_of(n['need'], n['free'])}"
                tip = f"forecast peak at batch {forecast['batch']:,}: {fmt_bytes(n['need'])}; {free} {where}" + (
                    " — will not fit" if bad else ""
                )
                if n.get("per_rank") is not None:  # ddp/fsdp on CPU lanes: one process per lane in this RAM
                    tip += f"\n{n.get('ranks')} processes, each up to {fmt_bytes(n['per_rank'])}"
                if n.get("shards"):  # fsdp: what each device keeps of the model
                    tip += f"\nshards per device {fmt_bytes(n['shards'][0])} (whole: {fmt_bytes(n['shards'][1])})"
                first_cpu = first_cpu and d.is_cuda
            item.setText(NEEDS, text)
            item.setToolTip(NEEDS, tip or 'Press "Will it fit?" to measure what the run needs on each device')
            item.setForeground(NEEDS, QBrush(QColor("#b00020" if bad else "#000000")))


def share_of(need: int, free: int | None) -> str:
    """The need as a share of the free memory: "42%", "<1%", "?" when the free memory is unknown."""
    if not free:
        return "?"
    pct = 100 * need / free
    return "<1%" if pct < 1 else f"{pct:,.0f}%"
