"""The device list in Setup, as drawn: every column whole at the window's default size, every row in view,
and the warnings about a host's devices taken from that host's own list (``multilane devices --json``
read over SSH), never from this computer's CUDA or cores. The hosts here are that list as data: the
window, its widgets and the warnings are the real ones, offscreen."""

from __future__ import annotations

import pytest

pytest.importorskip("PySide6")

from multilane.gui.window.device_picker import MODEL, DevicePicker


def gpus(*models: tuple[str, int, int]) -> list[dict]:
    """A GPU host's ``multilane devices --json``: (model, memory in MiB, multiprocessors) per GPU."""
    return [
        {"name": f"cuda:{i}", "kind": "cuda", "model": m, "memory_total_mb": mb, "multiprocessors": sm, "util_pct": 5}
        for i, (m, mb, sm) in enumerate(models)
    ]


def cpu_host(lanes: int, cores: int) -> list[dict]:
    return [{"name": "cpu", "kind": "cpu", "model": "EPYC", "cores": cores, "lanes": lanes, "memory_total_mb": 65536}]


def drawn_whole(picker: DevicePicker) -> bool:
    """Every shown column inside the list's width, and every row (up to eight) inside its height."""
    tree = picker.tree
    header = tree.header()
    width = sum(header.sectionSize(c) for c in range(header.count()) if not header.isSectionHidden(c))
    last = tree.topLevelItem(min(8, tree.topLevelItemCount()) - 1)
    return width <= tree.viewport().width() and tree.visualItemRect(last).bottom() <= tree.viewport().height()


def test_a_gpu_hosts_list_is_judged_by_its_own_gpus_not_this_computers(qtbot):
    picker = DevicePicker()
    qtbot.addWidget(picker)
    picker.show_host("gpubox", gpus(*[("NVIDIA H200", 143771, 132)] * 8))
    assert [d.name for d in picker.selected()] == [f"cuda:{i}" for i in range(8)]
    # this computer has no CUDA: asking it about the host's GPUs said "cannot read its properties"
    assert picker.warning.text() == "" and picker.warning.isHidden()
    assert picker.tree.isColumnHidden(MODEL)  # one model on every row: named in each device's tooltip
    assert picker.items[3][0].toolTip(0) == "cuda:3: NVIDIA H200, 140 GiB"
    picker.show_host("mixed", gpus(("NVIDIA H100", 81920, 132), ("RTX 3090", 24576, 82)))
    assert not picker.tree.isColumnHidden(MODEL) and picker.items[1][0].text(MODEL) == "RTX 3090"
    lines = picker.warning.text().splitlines()
    assert len(lines) == 2 and all("cuda:1 (RTX 3090)" in line for line in lines)  # memory, multiprocessors
    assert "24,576 memory against 81,920" in lines[0]


def test_a_hosts_cpu_lanes_are_counted_against_its_cores(qtbot):
    picker = DevicePicker()
    qtbot.addWidget(picker)
    picker.show_host("big", cpu_host(4, 8))
    picker.set_checked(["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
    assert picker.warning.text() == ""  # 4 lanes on its 8 cores (this computer has 2)
    picker.show_host("small", cpu_host(4, 2))
    picker.set_checked(["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
    assert picker.warning.text().startswith("⚠ 4 CPU lanes on 2 cores")


def test_the_list_is_drawn_whole_in_the_window_at_its_default_size(qtbot, make_window):
    w = make_window()
    w.resize(1400, 900)
    w.show()
    qtbot.waitExposed(w)
    picker = w.devices
    assert [d.name for d in picker.selected()] == ["cpu:0", "cpu:1"]
    qtbot.waitUntil(lambda: drawn_whole(picker), timeout=5_000)
    picker.show_host("gpubox", gpus(*[("NVIDIA H200", 143771, 132)] * 8))
    qtbot.waitUntil(lambda: drawn_whole(picker), timeout=5_000)
    picker.show_host("mixed", gpus(("NVIDIA H100", 81920, 132), ("RTX 3090", 24576, 82)))
    qtbot.waitUntil(lambda: drawn_whole(picker), timeout=5_000)
    model = picker.tree.header().sectionSize(MODEL)
    assert model >= picker.tree.fontMetrics().horizontalAdvance("RTX 3090")  # not cut to "…"
