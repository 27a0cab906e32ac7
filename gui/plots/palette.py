"""One palette for the live plots and the exported figures. No Qt here.

Paul Tol's "muted" scheme: nine colours that stay distinct for the common forms of colour blindness
and in greyscale print, enough for eight devices (or several compared runs) without reuse. The
combined loss is black and validation a neutral grey, so neither is mistaken for a device.
"""

from __future__ import annotations

SERIES = [
    "#CC6677",  # rose
    "#117733",  # green
    "#332288",  # indigo
    "#999933",  # olive
    "#AA4499",  # purple
    "#88CCEE",  # cyan
    "#882255",  # wine
    "#44AA99",  # teal
    "#DDCC77",  # sand
]
COMBINED = "#000000"
VALIDATION = "#777777"
NEUTRAL = "#444444"  # single-curve plots (throughput, learning rate, gradient norm)


def series_color(i: int) -> str:
    """The colour of the i-th device (or the i-th run of a comparison)."""
    return SERIES[i % len(SERIES)]


def device_width(i: int, n: int, base: float, step: float, most: int = 4) -> float:
    """The i-th of n device lines' width: the first the widest, each later one (drawn over it)
    narrower, so that lanes with equal values still show every colour at the line's edge."""
    return base + step * min(n - 1 - i, most)


# Compared runs in the utilization and memory plots, where a line's colour is its device's: each run its
# own line style. Patterns in line widths (Qt's setDashPattern and matplotlib's scaled dashes alike);
# None is solid. A dashed run's gaps are painted white, so that over an equal line of the same device
# (an earlier run's, wider) its dashes still show, and the earlier run's colour at their edges.
RUN_DASHES: list[tuple[float, ...] | None] = [None, (4.0, 2.0), (1.0, 1.5), (6.0, 2.0, 1.0, 2.0), (9.0, 3.0)]
RUN_SWATCHES = ["━━", "╍╍", "┉┉", "━╍", "━ ━"]  # the same styles in text, for the key and plot titles
GAP = "#FFFFFF"  # the plots' background, under a dashed run's line


def run_dash(k: int) -> tuple[float, ...] | None:
    """The line style of the k-th compared run in the device-coloured plots (None: solid)."""
    return RUN_DASHES[k % len(RUN_DASHES)]


def run_swatch(k: int) -> str:
    return RUN_SWATCHES[k % len(RUN_SWATCHES)]


def compared_width(k: int, n: int, j: int, m: int, base: float, device_step: float, run_step: float) -> float:
    """The width of device j's line (of m) of the k-th compared run (of n), drawn in that order: each
    device of a run narrower than the one before (as in one run's plots), and a run's line ``run_step``
    narrower than the same device's line of the run before, so that over an equal line it leaves the
    earlier run's colour at both edges (without antialiasing, 1 px apart left none on screen)."""
    return base + device_step * min(m - 1 - j, 3) + run_step * min(n - 1 - k, 2)
