"""What the plot panel draws over the data: the key naming every colour, the pause marks, and the
crosshair with the hover header that names each value under it."""

from __future__ import annotations

import html

import numpy as np
import pyqtgraph as pg
from multilane.gui.plots.items import set_plot_title, swatch
from multilane.gui.plots.palette import COMBINED, VALIDATION, run_swatch, series_color
from multilane.gui.plots.run_view import (
    compare_devices,
    compare_values_at,
    compared_lines,
    differing_settings,
    format_duration,
    rank_places,
    run_breaks,
    settings_text,
    values_at,
    x_values,
)
from multilane.gui.plots.style import PAUSE_BRUSH, PROCESS_MEMORY, STOP_BRUSH
from PySide6.QtCore import Qt

NAN_COLOR = "#d62728"
NAN_LABEL = {"position": 0.9, "color": NAN_COLOR, "movable": False}


class PlotMarks:
    """Mixed into ``PlotPanel`` (before the Qt class, for ``leaveEvent``): uses its ``key``, ``header``,
    ``plots``, ``_lines`` and ``data``; keeps ``_key_state``, ``_hidden``, ``_pause_items`` and
    ``_pause_state``."""

    def _update_key(self) -> None:
        """One key over all plots: what each colour and line style means. Each entry is a link: a
        click hides or shows its curves in every plot (a device, the combined line, validation, a run)."""
        d = self.data
        runs = [d, *(r for r, _ in self.overlays)]
        device_titles = self._compared_device_titles(runs) if len(runs) > 1 else ()
        state = (tuple(d.devices), tuple(r.name for r in runs), bool(d.eval.rows), self.smoothing > 0)
        state += (tuple(sorted(self._hidden)), bool(d.train.rows), device_titles, tuple(self.empty_panels.items()))
        if state == self._key_state:
            return
        self._key_state = state
        if len(runs) > 1:
            # utilization and memory: colour is the device, the line style the run (their titles say so)
            set_plot_title(self.util, device_titles[0])
            set_plot_title(self.memory, device_titles[1])
            self._memory_title = device_titles[1]
            settings = differing_settings(runs)
            parts = []
            for i, (run, differ) in enumerate(zip(runs, settings, strict=True)):
                label = run.name + (f" ({settings_text(differ)})" if differ else "")
                parts.append(self._entry(f"run:{i}", swatch(series_color(i)), label) + style_mark(i))
            parts.append(f"{swatch('#555', dashed=True)} validation (same colour)")
            if device_titles[2]:
                parts.append(device_titles[2])
            parts.append('<span style="color:#888;">(equal lines: the first run widest, each next one on top)</span>')
            # the step time draws one line per run: its own key names the runs, not the phases
            runs_key = " ".join(f"{swatch(series_color(i))}&nbsp;{html.escape(r.name)}" for i, r in enumerate(runs))
            set_plot_title(self.phases, f"Step time (ms), each run's total &nbsp; {runs_key}")
        else:
            set_plot_title(self.phases, self.phase_title)
            set_plot_title(self.util, "Utilization (%)")
            parts = [self._entry(f"dev:{dev}", swatch(self._device_color(dev)), dev) for dev in d.devices]
            if d.train.rows:
                parts.append(self._entry("combined", swatch(COMBINED), "combined"))
            if d.eval.rows:
                parts.append(self._entry("validation", swatch(VALIDATION, dashed=True), "validation"))
        if self.empty_panels:  # where the panel would be, the key says why it is not
            why = "; ".join(f"{name}: {reason}" for name, reason in self.empty_panels.items())
            parts.append(f'<span style="color:#888;">(not shown, no data: {html.escape(why)})</span>')
        if self.smoothing > 0 and parts:
            parts.append("(smoothed; raw faint)")
        if len(parts) > 1:
            parts.append('<span style="color:#888;">(click a name to hide or show it)</span>')
        self.key.setText(" &nbsp; ".join(parts), size="9pt")

    def _compared_device_titles(self, runs: list) -> tuple[str, str, str]:
        """The utilization and memory plots' titles when runs are compared, and the key's entry for their
        colours: each device's colour, with the rank that ran on it (a ddp or fsdp run's device is the
        same device, in the same colour, as a replicate run's). The titles stay one line at 1280 px."""
        devices = compare_devices(runs)
        lines = [compared_lines(r, devices) for r in runs]
        present = {dev for ln in lines for panel in ("util", "memory") for _, dev in ln[panel] if dev is not None}
        ranks = rank_places(runs, devices)
        colours = " ".join(
            f"{swatch(series_color(devices.index(dev)))}&nbsp;{html.escape(dev)}"
            + (f" ({ranks[dev]})" if dev in ranks else "")
            for dev in devices
            if dev in present
        )
        cols = [col for ln in lines for col, _ in ln["memory"]]
        if any(c.startswith("rss/") for c in cols):
            memory = "Each rank's RSS (MiB)"
        elif "rss_mb" in cols:
            memory = PROCESS_MEMORY  # CPU lanes share one process: no memory of their own
        else:
            memory = "Memory used (MiB)"
        key = f"utilization, memory: {colours} (line: the run's, after its name)" if colours else ""
        return "Utilization (%)", memory, key

    def _entry(self, group: str, mark: str, label: str) -> str:
        hidden = group in self._hidden
        style = "color:#aaa; text-decoration:line-through;" if hidden else "color:#333; text-decoration:none;"
        return f'<a href="{html.escape(group)}" style="{style}">{mark if not hidden else ""}{html.escape(label)}</a>'

    def toggle_curve(self, group: str) -> None:
        """Hide or show every curve of a key entry ("dev:cpu:0", "combined", "validation", "run:1")."""
        self._hidden ^= {group}
        self._dirty = True
        self.refresh()

    def _clear_pauses(self) -> None:
        for plot, item in self._pause_items:
            plot.removeItem(item)
        self._pause_items.clear()
        self._pause_state = ()

    def _draw_pauses(self) -> None:
        """Where the run did not train: a pause, or a stop until its resume. On the time axis a band
        (no data there, not a straight trend; the lines break there too); on the step axis a line at
        its step, dotted for a pause, dashed for a stop and resume."""
        spans = run_breaks(self.data)
        origin = self.data.nan_origin
        state = (self.x_mode, tuple((round(a, 1), round(b, 1), w, s) for a, b, w, s in spans), id(origin))
        if state == self._pause_state:
            return
        self._clear_pauses()
        self._pause_state = state
        for a, b, what, step in spans:
            if what == "paused":
                tip = f"paused at step {step} for {format_duration(b - a)}"
                brush, pen = PAUSE_BRUSH, pg.mkPen("#999", style=Qt.DotLine)
            else:
                tip = f"stopped, resumed {format_duration(b - a)} later from step {step}"
                brush, pen = STOP_BRUSH, pg.mkPen("#777", style=Qt.DashLine, width=1.5)
            for p in self.plots:
                if self.x_mode == "time":
                    item = pg.LinearRegionItem((a, b), movable=False, brush=pg.mkBrush(*brush), pen=pg.mkPen(None))
                else:
                    item = pg.InfiniteLine(step, angle=90, movable=False, pen=pen)
                item.setZValue(-10)
                item.setToolTip(tip)
                p.addItem(item, ignoreBounds=True)
                self._pause_items.append((p, item))
        if origin is not None:
            self._draw_nan_origin(origin)

    def _draw_nan_origin(self, origin: dict) -> None:
        """Where a NaN began (engine/health/nan_origin.py): a red line on the loss plot at that step,
        labelled, with the one-line finding as its tooltip."""
        d = self.data
        step = origin.get("origin_step")
        steps = d.train.get("step")
        if not isinstance(step, int) or not len(steps):
            return
        if self.x_mode == "step":
            x = float(step)
        else:
            xs = x_values(d, d.train, self.x_mode)
            after = np.nonzero(steps >= step)[0]
            x = float(xs[after[0]] if len(after) else xs[-1])
        line = pg.InfiniteLine(
            x, angle=90, movable=False, pen=pg.mkPen(NAN_COLOR, width=2), label="NaN began", labelOpts=NAN_LABEL
        )
        line.setToolTip(str(origin.get("message", "")))
        self.plots[0].addItem(line, ignoreBounds=True)
        self._pause_items.append((self.plots[0], line))

    # -- crosshair -------------------------------------------------------------------------------
    def _on_mouse(self, event) -> None:
        pos = event[0]
        for p in self.plots:
            if p.sceneBoundingRect().contains(pos):
                x = p.vb.mapSceneToView(pos).x()
                if x < 0:  # no step or second before the run's start: nothing to name
                    break
                self.show_values_at(x)
                return
        self.clear_values()

    def leaveEvent(self, ev) -> None:
        super().leaveEvent(ev)
        self.clear_values()

    def clear_values(self) -> None:
        """The mouse left the plots: no crosshair, and the header names the run again."""
        if any(line.isVisible() for line in self._lines):
            for line in self._lines:
                line.setVisible(False)
            self.header.setText(self.title_text, size="9pt")

    def show_values_at(self, x: float) -> str:
        """Move every plot's crosshair to ``x`` and show every curve's value there, named, with units."""
        for line in self._lines:
            line.setPos(x)
            line.setVisible(True)
        if self.overlays:  # every run by name, in its colour, with its values
            runs = [self.data, *(r for r, _ in self.overlays)]
            head, *rest = compare_values_at(runs, x, self.x_mode)
            named = [f'<span style="color:{series_color(k)};">{html.escape(p)}</span>' for k, p in enumerate(rest)]
            self.header.setText(" · ".join([head, *named]), size="9pt")
            return " · ".join([head, *rest])
        text = values_at(self.data, x, self.x_mode)
        self.header.setText(self._coloured(text), size="9pt")
        return text

    def _coloured(self, text: str) -> str:
        """The hover line with each device's values in the device's colour (as its curves and key)."""
        devices = sorted(self.data.devices, key=len, reverse=True)  # "cpu:1#1" before "cpu:1"
        parts = []
        for part in text.split(" · "):
            dev = next((d for d in devices if part.startswith(f"{d} ")), None)
            part = html.escape(part)
            if dev is not None:
                part = f'<span style="color:{self._device_color(dev)};">{part}</span>'
            parts.append(part)
        return " · ".join(parts)


def style_mark(k: int) -> str:
    """The k-th compared run's line style in the utilization and memory plots, for the key: grey."""
    return f'&nbsp;<span style="color:#777; font-weight:bold;">{run_swatch(k)}</span>'
