import numpy as np
import pytest
from multilane.gui.plots.decimate import PeakPyramid


def test_few_points_are_drawn_as_they_are():
    x = np.arange(100.0)
    y = np.sin(x)
    p = PeakPyramid()
    p.update(y)
    vx, vy = p.view(x, y, 0, 100, 1000)
    assert np.array_equal(vx, x) and np.array_equal(vy, y)


@pytest.mark.parametrize("n", [10_000, 1_000_000, 1_234_567])
def test_a_million_points_become_a_few_per_pixel_and_keep_every_spike(n):
    rng = np.random.default_rng(0)
    x = np.arange(n, dtype=float)
    y = rng.standard_normal(n)
    spikes = rng.choice(n, 5, replace=False)
    y[spikes] = [50, -40, 60, -70, 80]
    p = PeakPyramid()
    p.update(y)
    vx, vy = p.view(x, y, 0, n, 2000)
    assert len(vx) <= 4 * 2000 + 2 * 16384 // 32 + 64
    assert vy.max() == 80 and vy.min() == -70
    for s in spikes:
        assert y[s] in vy
    assert np.all(np.diff(vx) >= 0) and vx[0] == 0 and vx[-1] <= n - 1


def test_growing_data_extends_the_pyramid_like_building_it_at_once():
    rng = np.random.default_rng(1)
    y = rng.standard_normal(300_000)
    grown, once = PeakPyramid(), PeakPyramid()
    for end in (1, 31, 32, 5000, 70_000, 299_999, 300_000):
        grown.update(y[:end])
    once.update(y)
    for a, b in zip(grown.mins + grown.maxs, once.mins + once.maxs, strict=True):
        assert np.array_equal(a.data, b.data)


def test_a_zoomed_view_is_exact_at_its_edges_and_skips_nans():
    n = 200_000
    x = np.arange(n, dtype=float)
    y = np.cos(x / 1000)
    y[1000:3000] = np.nan  # a device that sat out those steps
    p = PeakPyramid()
    p.update(y)
    vx, vy = p.view(x, y, 50_001, 150_003, 500)
    assert vx[0] <= 50_001 and vx[-1] == 150_002
    assert np.isfinite(vy).all()
    vx, vy = p.view(x, y, 0, n, 500)
    assert np.nanmax(vy) == pytest.approx(1.0) and np.nanmin(vy) == pytest.approx(-1.0, abs=1e-6)


def test_the_incremental_ema_equals_the_ema_of_the_whole_column():
    from multilane.gui.plots.decimate import EmaCache, ema

    rng = np.random.default_rng(2)
    y = rng.standard_normal(5000)
    y[100:130] = np.nan
    whole = ema(y, 0.9)
    cache = EmaCache(0.9)
    for end in (0, 1, 99, 120, 131, 4000, 5000):
        part = cache.extend(y[:end])
    np.testing.assert_allclose(part, whole, rtol=1e-12)
    assert np.isnan(whole[100:130]).all() and np.isfinite(whole[130:]).all()
    # by hand: y[n] = (1 - a) x[n] + a y[n-1], seeded with the first value
    manual = [y[0]]
    for v in y[1:50]:
        manual.append(0.1 * v + 0.9 * manual[-1])
    np.testing.assert_allclose(whole[:50], manual, rtol=1e-12)


@pytest.mark.parametrize("alpha", [0.01, 0.3, 0.5, 0.9, 0.99])
def test_the_numpy_ema_equals_the_recurrence_across_its_blocks(alpha):
    from multilane.gui.plots.decimate import ema_filter

    rng = np.random.default_rng(3)
    x = np.abs(rng.standard_normal(3000)) * np.geomspace(1e-3, 1e6, 3000)  # losses of every size
    expected = np.empty_like(x)
    state = 2.5
    for i, v in enumerate(x):
        state = alpha * state + (1 - alpha) * v
        expected[i] = state
    np.testing.assert_allclose(ema_filter(x, alpha, 2.5), expected, rtol=1e-10)
    assert np.isfinite(ema_filter(np.full(5000, 1e30), alpha, 0.0)).all()
