"""The app's device list survives a GPU driver that never answers (CUDA's count faked to
hang: no GPU here; the window's widget is real, offscreen)."""

from __future__ import annotations

import threading
import time

import pytest
from multilane.engine.telemetry import devices, driver

HANG = threading.Event()


def never_answers(*args, **kwargs):
    HANG.wait(60)
    raise RuntimeError("released")


@pytest.fixture(autouse=True)
def short_bound(monkeypatch):
    monkeypatch.setattr(driver, "TIMEOUT_S", 0.3)
    monkeypatch.setattr(driver, "_wedged", None)
    yield
    HANG.set()
    HANG.clear()


def test_the_apps_device_list_survives_a_driver_that_never_answers(monkeypatch, qtbot):
    from multilane.gui.window.device_picker import DevicePicker

    monkeypatch.setattr(devices, "_cuda_count", never_answers)
    t0 = time.monotonic()
    picker = DevicePicker()
    qtbot.addWidget(picker)
    assert time.monotonic() - t0 < 0.3 + 2.0
    assert [d.name for _, _, d in picker.items][:2] == ["cpu:0", "cpu:1"]  # the CPU lanes, as without a GPU
    assert "did not answer in 0.3 s" in picker.warning.text()
