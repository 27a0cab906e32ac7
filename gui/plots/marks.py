"""What the plot panel draws over the data: the key naming every colour, the pause marks, and the
crosshair with the hover header that names each value under it."""

from __future__ import annotations

import pyqtgraph as pg
from multilane.gui.plots.items import swatch
from multilane.gui.plots.palette import COMBINED, VALIDATION, series_color
from multilane.gui.plots.run_view import pause_spans, values_at
from multilane.gui.plots.style import PAUSE_BRUSH
from PySide6.QtCore import Qt


class PlotMarks:
    """Mixed into ``PlotPanel`` (before the Qt class, for ``leaveEvent``): uses its ``key``, ``header``,
    ``plots``, ``_lines`` and ``data``; keeps ``_key_state``, ``_pause_items`` and ``_pause_state``."""

    def _update_key(self) -> None:
        """One key over all plots: what each colour and line style means."""
        d = self.data
        runs = tuple(r.name for r, _ in self.overlays)
        state = (tuple(d.devices), runs, d.name, bool(d.eval.rows), self.smoothing > 0)
        if state == self._key_state:
            return
        self._key_state = state
        if runs:
            parts = [f"{swatch(series_color(i))} {name}" for i, name in enumerate((d.name, *runs))]
            parts.append(f"{swatch('#555', dashed=True)} validation (same colour)")
        else:
            parts = [f"{swatch(self._device_color(dev))} {dev}" for dev in d.devices]
            if d.train.rows:
                parts.append(f"{swatch(COMBINED)} combined")
            if d.eval.rows:
                parts.append(f"{swatch(VALIDATION, dashed=True)} validation")
        if self.smoothing > 0 and parts:
            parts.append("(smoothed; raw faint)")
        self.key.setText(" &nbsp; ".join(parts), size="9pt")

    def _clear_pauses(self) -> None:
        for plot, item in self._pause_items:
            plot.removeItem(item)
        self._pause_items.clear()
        self._pause_state = ()

    def _draw_pauses(self) -> None:
        """A pause is a grey band on the time axis (no data there is not a straight trend) and a
        dotted line at its step on the step axis."""
        spans = pause_spans(self.data)
        state = (self.x_mode, tuple((round(a, 1), round(b, 1), s) for a, b, s in spans))
        if state == self._pause_state:
            return
        self._clear_pauses()
        self._pause_state = state
        for a, b, step in spans:
            for p in self.plots:
                if self.x_mode == "time":
                    item = pg.LinearRegionItem(
                        (a, b), movable=False, brush=pg.mkBrush(*PAUSE_BRUSH), pen=pg.mkPen(None)
                    )
                else:
                    item = pg.InfiniteLine(step, angle=90, movable=False, pen=pg.mkPen("#999", style=Qt.DotLine))
                item.setZValue(-10)
                item.setToolTip(f"paused at step {step} for {b - a:.1f} s")
                p.addItem(item, ignoreBounds=True)
                self._pause_items.append((p, item))

    # -- crosshair -------------------------------------------------------------------------------
    def _on_mouse(self, event) -> None:
        pos = event[0]
        for p in self.plots:
            if p.sceneBoundingRect().contains(pos):
                x = p.vb.mapSceneToView(pos).x()
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
        text = values_at(self.data, x, self.x_mode)
        self.header.setText(text, size="9pt")
        return text
