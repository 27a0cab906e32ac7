"""Small pyqtgraph pieces of the plot panel: a curve with the app's pen, a label that wraps, a plot
title that wraps, a colour swatch for the key."""

from __future__ import annotations

from collections.abc import Sequence

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QTextOption


def make_curve(
    plot: pg.PlotItem,
    color: str,
    name: str | None = None,
    width: float = 1.5,
    style=Qt.SolidLine,
    alpha: int = 255,
    dash: Sequence[float] | None = None,
) -> pg.PlotDataItem:
    """A curve on ``plot`` with the app's pen; ``dash``: a dash pattern in line widths (a compared run's)."""
    c = pg.mkColor(color)
    c.setAlpha(alpha)
    # Wider pens cost Qt's raster engine more (2 px about twice 1 px); devices get 1.5 px, the
    # combined loss 2.5 px, so that neither vanishes under the other (docs/app.md).
    pen = pg.mkPen(c, width=width, style=style)
    if dash is not None:
        pen.setDashPattern(list(dash))  # Qt.CustomDashLine, in units of the pen's width
    item = plot.plot([], [], pen=pen, name=name, connect="finite")
    return item


class SparseLogAxis(pg.AxisItem):
    """A y axis whose log mode labels only ticks with room between them: pyqtgraph labels every
    minor tick of a decade, and on a short plot "0.1", "0.09", "0.08", "0.07" were drawn over each
    other. Decades are labelled first, then the other ticks wherever a label's height fits."""

    GAP_PX = 4

    def tickStrings(self, values, scale, spacing):
        strings = super().tickStrings(values, scale, spacing)
        if not self.logMode or len(values) < 2:
            return strings
        lo, hi = self.range
        height = self.size().height() if self.orientation in ("left", "right") else self.size().width()
        if hi <= lo or height <= 0:
            return strings
        px = [(v - lo) / (hi - lo) * height for v in values]
        room = self.fontMetrics().height() + self.GAP_PX
        kept: list[float] = [q for q, s in zip(px, strings, strict=True) if s and self._is_decade(q, lo, hi, height)]
        for q in px:
            if all(abs(q - k) >= room for k in kept):
                kept.append(q)
        return [s if any(abs(q - k) < 1e-9 for k in kept) else "" for q, s in zip(px, strings, strict=True)]

    @staticmethod
    def _is_decade(q: float, lo: float, hi: float, height: float) -> bool:
        v = lo + q / height * (hi - lo)
        return abs(v - round(v)) < 1e-6

    def fontMetrics(self):
        from PySide6.QtGui import QFontMetrics

        return QFontMetrics(self.style.get("tickFont") or self.font())


class WrappingLabel(pg.LabelItem):
    """A label that wraps at the panel's width. pyqtgraph's own takes its text's full width as its
    minimum, so a long hover line widened the whole layout and pushed the right-hand plots out of view."""

    min_lines = 1

    def updateMin(self) -> None:
        # at least ``min_lines`` lines high, so the plots do not jump as the hover text comes and goes;
        # one line's height, not the first paragraph's: a hover line wrapped onto five lines made the
        # header twice their height (10 lines' room) and left the plots of a 1024×700 window none
        block = self.item.document().begin()
        layout = block.layout()
        if layout is not None and layout.lineCount():
            line = layout.lineAt(0).height()
        else:
            line = self.item.document().documentLayout().blockBoundingRect(block).height()
        h = max(self.itemRect().height(), self.min_lines * line if self.text else 0)
        self.setMinimumWidth(10)
        self.setMinimumHeight(h)
        self._sizeHint = {
            Qt.SizeHint.MinimumSize: (10, h),
            Qt.SizeHint.PreferredSize: (10, h),
            Qt.SizeHint.MaximumSize: (-1, -1),
            Qt.SizeHint.MinimumDescent: (0, 0),
        }
        self.updateGeometry()

    def resizeEvent(self, ev) -> None:
        width = max(10.0, self.width())
        if abs(self.item.textWidth() - width) > 0.5:
            self.item.setTextWidth(width)
        super().resizeEvent(ev)


class KeyLabel(WrappingLabel):
    """The plots' key: its entries are links; a click on one calls ``on_entry`` with the link."""

    def __init__(self, on_entry) -> None:
        super().__init__("", justify="left")
        self.on_entry = on_entry
        self._pressed: str | None = None

    def _href_at(self, pos) -> str:
        return self.item.document().documentLayout().anchorAt(self.item.mapFromParent(pos))

    def mousePressEvent(self, ev) -> None:
        self._pressed = self._href_at(ev.pos()) or None
        ev.setAccepted(self._pressed is not None)  # elsewhere the plots' own handling goes on

    def mouseReleaseEvent(self, ev) -> None:
        href, self._pressed = self._pressed, None
        if href and self._href_at(ev.pos()) == href:
            self.on_entry(href)
        ev.accept()


class PlotTitle(WrappingLabel):
    """A plot's title, centred, that wraps onto another line where the plot is narrower than its text.
    pyqtgraph's title takes its text's width as the plot's minimum: at 1024×700 the step-time title
    (with its phase key) and the right-hand column's titles made the plot grid wider than its room,
    and the grid was cut off at the right."""

    def __init__(self, parent: pg.PlotItem) -> None:
        super().__init__("", size="11pt", parent=parent)
        option = QTextOption(Qt.AlignmentFlag.AlignHCenter)
        option.setWrapMode(QTextOption.WrapMode.WrapAtWordBoundaryOrAnywhere)
        self.item.document().setDefaultTextOption(option)

    def resizeEvent(self, ev) -> None:
        # One line where it fits; wrapped only once the layout has given the title a real width (at
        # width 0, before the first layout, a wrap at every word made the panel's first layout
        # thousands of pixels tall, and the view kept that height).
        width = self.width()
        if self.item.textWidth() >= 0:
            self.item.setTextWidth(-1)
        if width >= 40 and self.item.boundingRect().width() > width:
            self.item.setTextWidth(width)
        pg.LabelItem.resizeEvent(self, ev)


TITLE_ROW_PX = 30  # pyqtgraph's title row: one line; a wrapped title gets the lines it needs


def wrap_title(plot: pg.PlotItem) -> None:
    """Give ``plot`` a ``PlotTitle`` in place of pyqtgraph's title label."""
    old = plot.titleLabel
    plot.layout.removeItem(old)
    old.setParentItem(None)
    if old.scene() is not None:
        old.scene().removeItem(old)
    plot.titleLabel = PlotTitle(plot)
    plot.layout.addItem(plot.titleLabel, 0, 1)


def set_plot_title(plot: pg.PlotItem, text: str) -> None:
    """Set a plot's title (9 pt); its row grows to fit a wrapped title instead of cutting it off."""
    plot.setTitle(text, size="9pt")
    plot.titleLabel.setMaximumHeight(10_000)  # setTitle fixes the row at 30 px
    plot.layout.setRowMaximumHeight(0, 10_000)
    plot.layout.setRowMinimumHeight(0, TITLE_ROW_PX)


def swatch(color: str, dashed: bool = False) -> str:
    return f'<span style="color:{color}; font-weight:bold;">{"╍╍" if dashed else "━━"}</span>'
