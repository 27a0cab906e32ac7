"""The plots' shared look: pyqtgraph's options, the tick font, the grid colour, the step-time phases'
colours and the pause band."""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtGui import QFont

PHASES = ["data", "scatter", "replicate", "forward", "loss", "backward", "reduce", "optimizer"]
# Okabe–Ito's colours (colour-blind safe), apart from the device palette: a phase is not a device;
# waiting for data in a neutral grey.
PHASE_COLORS = ["#999999", "#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#CC79A7", "#D55E00"]
PAUSE_BRUSH = (150, 150, 150, 50)
STOP_BRUSH = (120, 120, 120, 80)  # a stop, until the resume: darker than a pause

GRID_COLOR = "#e8e8e8"

pg.setConfigOptions(antialias=False, background="w", foreground="#333")
TICK_FONT = QFont()
TICK_FONT.setPointSize(8)

# The process's resident memory (everything the OS counts: Python, torch's libraries, caches), not the
# tensors that the summary's "peak tensor memory" and the memory forecast count: both are labelled so.
PROCESS_MEMORY = "Process RSS (MiB)"
