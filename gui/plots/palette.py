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
