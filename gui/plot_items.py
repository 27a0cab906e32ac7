"""Small pyqtgraph pieces of the plot panel: a curve with the app's pen, a label that wraps, a colour
swatch for the key."""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import Qt


def make_curve(
    plot: pg.PlotItem, color: str, name: str | None = None, width: float = 1.5, style=Qt.SolidLine, alpha: int = 255
) -> pg.PlotDataItem:
    c = pg.mkColor(color)
    c.setAlpha(alpha)
    # Wider pens cost Qt's raster engine more (2 px about twice 1 px); devices get 1.5 px, the
    # combined loss 2.5 px, so that neither vanishes under the other (docs/app.md).
    item = plot.plot([], [], pen=pg.mkPen(c, width=width, style=style), name=name, connect="finite")
    return item


class WrappingLabel(pg.LabelItem):
    """A label that wraps at the panel's width. pyqtgraph's own takes its text's full width as its
    minimum, so a long hover line widened the whole layout and pushed the right-hand plots out of view."""

    min_lines = 1

    def updateMin(self) -> None:
        # at least ``min_lines`` lines high, so the plots do not jump as the hover text comes and goes
        line = self.item.document().documentLayout().blockBoundingRect(self.item.document().begin()).height()
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


def swatch(color: str, dashed: bool = False) -> str:
    return f'<span style="color:{color}; font-weight:bold;">{"╍╍" if dashed else "━━"}</span>'
