"""The 1,797 8×8 handwritten digits that ship inside scikit-learn, read from its data file.

``sklearn.datasets.load_digits`` imports scikit-learn and SciPy first (about 1.5 s on a quiet 2-core
machine, in every run and every ddp rank); the data is one small CSV file in scikit-learn's package
folder, read here with numpy alone. The same arrays as ``load_digits()`` (tests/engine/data/test_tasks.py).
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np
from multilane.engine.errors import UserError

DIGITS_FILE = Path("datasets", "data", "digits.csv.gz")


def digits_path() -> Path:
    """Where scikit-learn keeps the digits, found without importing it."""
    spec = importlib.util.find_spec("sklearn")
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = Path(folder) / DIGITS_FILE
        if path.is_file():
            return path
    raise UserError("task digits needs scikit-learn, which ships its data: pip install scikit-learn")


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The images (1797, 8, 8) in 0..16 as float64 and their labels (1797,) as int."""
    with gzip.open(digits_path(), "rt", encoding="ascii") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)
