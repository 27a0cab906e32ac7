"""Every model kind on every strategy with every instrument on (tests/engine/conformance/matrix.py):
equal in float64 to a plain one-device loop, or refused before step 1 in one line naming the model
feature and a strategy that trains it.

The fast tier runs the matrix's diagonal (``DIAGONAL``: in-process, a second or two each); the full suite
every cell, one run (or one launch) per cell.
"""

from __future__ import annotations

import pytest
from cells import check_exact, check_refused, run_cell
from matrix import DIAGONAL, EXPECTED, STRATEGIES, Expect, cells

pytestmark = pytest.mark.timeout(300)


def _param(kind: str, strategy: str):
    marks = [] if (kind, strategy) in DIAGONAL else [pytest.mark.slow]
    expect = EXPECTED.get((kind, strategy), Expect())
    if expect.xfail:
        marks.append(pytest.mark.xfail(strict=True, reason=expect.xfail))
    return pytest.param(kind, strategy, marks=marks, id=f"{kind}-{strategy}")


@pytest.mark.parametrize(("kind", "strategy"), [_param(k, s) for k, s in cells()])
def test_a_cell_is_exact_or_refused_in_one_line(tmp_path, kind, strategy):
    out = run_cell(kind, strategy, tmp_path)
    expect = EXPECTED.get((kind, strategy), Expect())
    if expect.refused:
        check_refused(out, expect.refused, f"{kind} / {strategy}")
    else:
        check_exact(out, kind, strategy, tmp_path)


def test_the_matrix_names_only_its_own_cells():
    """A cell in EXPECTED that the matrix no longer has (a renamed kind) would silently expect nothing."""
    assert set(EXPECTED) <= set(cells())
    assert set(DIAGONAL) <= set(cells())
    assert all(not STRATEGIES[s].launch for _, s in DIAGONAL)  # the fast tier starts no process
    assert all(e.refused or e.xfail for e in EXPECTED.values())
