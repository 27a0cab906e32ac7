"""Telemetry: the sampler on CPU lanes with real psutil; NVML logic through a fake NVML.

CI has no GPU, so the NVML mapping and the unsupported-metric handling are tested against
``FakeNvml`` below — a stand-in for pynvml with the same function names, used only for logic that
cannot run without a GPU.
"""

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from multilane.engine.run.balance import balance_warnings
from multilane.engine.run.trainer import Trainer
from multilane.engine.rundir.runlog import read_metrics
from multilane.engine.telemetry.devices import Device, parse_devices
from multilane.engine.telemetry.nvml import NvmlReader
from multilane.engine.telemetry.sampler import TelemetrySampler, aggregate


def test_sampler_rate_and_record_shape_on_cpu_lanes():
    records = []
    busy = [0.0, 0.0]
    lock = threading.Lock()

    def busy_seconds():
        with lock:
            busy[0] += 0.04  # lane 0 works ~4x as hard as lane 1 between samples of 50 ms
            busy[1] += 0.01
            return list(busy)

    devices = parse_devices("cpu:0,cpu:1")
    s = TelemetrySampler(
        devices,
        ["cpu:0", "cpu:1"],
        records.append,
        rate_hz=20,
        record_s=0.25,
        busy_seconds=busy_seconds,
        warn_after_s=0.5,
    )
    s.start()
    time.sleep(1.3)
    s.stop()
    tele = [r for r in records if r["kind"] == "telemetry"]
    assert 4 <= len(tele) <= 7  # 1.3 s at one record per 0.25 s, plus the final partial one
    full = tele[1]
    assert 3 <= full["samples"] <= 6  # 20 Hz over 0.25 s
    assert set(full["devices"]) == {"cpu:0", "cpu:1"}
    for lane in ("cpu:0", "cpu:1"):
        assert set(full["devices"][lane]["busy_pct"]) == {"mean", "min", "max"}
    assert full["devices"]["cpu:0"]["busy_pct"]["mean"] > 2 * full["devices"]["cpu:1"]["busy_pct"]["mean"]
    assert full["process"]["rss_mb"] > 10 and set(full["process"]["cpu_pct"]) == {"mean", "min", "max"}
    walls = [r["wall_time"] for r in tele]
    assert walls == sorted(walls)
    warnings = [r for r in records if r.get("event") == "warning"]
    assert len(warnings) == 1 and "cpu:1 has been busy" in warnings[0]["message"]  # once, not every record


def _lanes_with_sampler(record_s=0.2, warn_after_s=10.0):
    from multilane.engine.parallel.cpu_lanes import CpuLanesBackend

    devices = parse_devices("cpu:0,cpu:1")
    backend = CpuLanesBackend(devices)
    records: list[dict] = []
    sampler = TelemetrySampler(
        devices,
        backend.lane_names,
        records.append,
        rate_hz=20,
        record_s=record_s,
        busy_seconds=backend.lane_busy_seconds,
        warn_after_s=warn_after_s,
    )
    return backend, sampler, records


def _work(seconds):
    return lambda _x: time.sleep(seconds)  # a lane's work: its busy time is the time its function runs


def test_a_step_longer_than_a_record_shows_its_lanes_busy_while_it_runs():
    """charlm, imagefolder: a step of seconds read 0 % busy in every record it spanned."""
    backend, sampler, records = _lanes_with_sampler(record_s=0.2)
    sampler.start()
    t0 = time.time()
    backend.parallel_apply([_work(1.6), _work(1.6)], [0, 0], None, [0, 1])
    t1 = time.time()
    time.sleep(0.3)
    sampler.stop()
    backend.close()
    inside = [r for r in records if r["kind"] == "telemetry" and t0 + 0.25 < r["wall_time"] < t1 - 0.05]
    assert len(inside) >= 3
    for r in inside:
        for lane in ("cpu:0", "cpu:1"):
            assert r["devices"][lane]["busy_pct"]["mean"] > 80, (lane, r["devices"])


@pytest.mark.slow
def test_equal_lanes_raise_no_imbalance_warning_and_an_uneven_split_does():
    # Equal work that lands in different records (each lane in turn): no lane is idle over the run.
    backend, sampler, records = _lanes_with_sampler(record_s=0.2, warn_after_s=2.0)
    sampler.start()
    end = time.monotonic() + 3.5
    while time.monotonic() < end:
        for lane in (0, 1):
            backend.parallel_apply([_work(0.2)], [0], None, [lane])
    sampler.stop()
    backend.close()
    tele = [r for r in records if r["kind"] == "telemetry"]
    assert any(r["devices"]["cpu:0"]["busy_pct"]["mean"] > 90 for r in tele)  # one record did hold one lane
    assert [r for r in records if r.get("event") == "warning"] == []
    # Lane 1 with a third of lane 0's work, step after step: a real imbalance, named.
    backend, sampler, records = _lanes_with_sampler(record_s=0.2, warn_after_s=1.0)
    sampler.start()
    end = time.monotonic() + 2.5
    while time.monotonic() < end:
        backend.parallel_apply([_work(0.3), _work(0.1)], [0, 0], None, [0, 1])
    sampler.stop()
    backend.close()
    warnings = [r["message"] for r in records if r.get("event") == "warning"]
    assert len(warnings) == 1 and warnings[0].startswith("cpu:1 has been busy"), warnings


def test_aggregate_keeps_mean_min_max_for_rates_and_the_last_level():
    rec = aggregate(
        [
            {"cuda:0": {"util_pct": 10.0, "mem_used_mb": 100.0}},
            {"cuda:0": {"util_pct": 30.0, "mem_used_mb": 120.0}},
        ]
    )
    assert rec["devices"]["cuda:0"]["util_pct"] == {"mean": 20.0, "min": 10.0, "max": 30.0}
    assert rec["devices"]["cuda:0"]["mem_used_mb"] == 120.0


def test_lane_busy_rises_with_the_lanes_share_of_work(make_config):
    torch.set_num_threads(1)  # lanes compete for 2 cores anyway; keep intra-op threads out of it
    cfg = make_config(
        task__name="mlp",
        task__params={"samples": 4096, "width": 512},
        train__steps=40,
        devices__weights=[6, 1],
        data__batch_size=512,
        train__log_every=40,
    )
    result = Trainer(cfg).run()
    train = [r for r in read_metrics(result.run_dir) if r["kind"] == "train"][-1]
    assert train["lane_busy_s"]["cpu:0"] > 1.5 * train["lane_busy_s"]["cpu:1"]


def test_telemetry_lines_parse_and_share_the_training_clock(make_config):
    cfg = make_config(
        task__name="mlp",
        task__params={"samples": 4096, "width": 512},
        train__steps=80,
        telemetry__rate_hz=20,
        telemetry__record_s=0.2,
        train__log_every=10,
    )
    result = Trainer(cfg).run()
    records = read_metrics(result.run_dir)
    tele = [r for r in records if r["kind"] == "telemetry"]
    train = [r for r in records if r["kind"] == "train"]
    assert tele, "a run of over a second writes telemetry"
    started = next(r for r in records if r.get("event") == "started")["wall_time"]
    ended = records[-1]["wall_time"]
    for r in tele:
        assert started <= r["wall_time"] <= ended + 1.0
        assert set(r["devices"]) == {"cpu:0", "cpu:1"}
    # the same clock: telemetry records fall between and among the training records
    assert min(t["wall_time"] for t in tele) < max(t["wall_time"] for t in train)


def test_telemetry_can_be_turned_off(make_config):
    result = Trainer(make_config(task__name="linear", train__steps=5, telemetry__enabled=False)).run()
    assert not [r for r in read_metrics(result.run_dir) if r["kind"] == "telemetry"]


# -- NVML, through a fake -------------------------------------------------------------------------


class FakeNvml:
    """A stand-in for pynvml: three GPUs whose NVML order differs from CUDA's."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1

    def __init__(self, gpus):
        self.gpus = gpus  # NVML order: dicts with bus, uuid, util, ... (None = not supported)
        self.calls = {}

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, k):
        return self.gpus[k]

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(domain=0, bus=h["bus"], device=0)

    def nvmlDeviceGetUUID(self, h):
        return h["uuid"].encode()

    def _value(self, h, key):
        self.calls[(h["uuid"], key)] = self.calls.get((h["uuid"], key), 0) + 1
        if h.get(key) is None:
            raise self.NVMLError_NotSupported()
        return h[key]

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=self._value(h, "util"))

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=self._value(h, "used"), total=h["total"])

    def nvmlDeviceGetTemperature(self, h, kind):
        return self._value(h, "temp")

    def nvmlDeviceGetPowerUsage(self, h):
        return self._value(h, "power_mw")

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return self._value(h, "limit_mw")

    def nvmlDeviceGetClockInfo(self, h, kind):
        return self._value(h, "sm")


def gpu(bus, uuid, util, power_mw=250_000):
    return {
        "bus": bus,
        "uuid": f"GPU-{uuid}",
        "util": util,
        "used": 2**30,
        "total": 2**34,
        "temp": 60,
        "power_mw": power_mw,
        "limit_mw": 700_000,
        "sm": 1980,
    }


def test_cuda_ordinals_are_matched_to_nvml_by_pci_bus_id():
    # NVML lists buses 0x3B, 0x1A, 0x86; CUDA (fastest first, or CUDA_VISIBLE_DEVICES=2,0) sees
    # cuda:0 on bus 0x86 and cuda:1 on bus 0x1A.
    nvml = FakeNvml([gpu(0x3B, "a", 11), gpu(0x1A, "b", 22), gpu(0x86, "c", 33)])
    cuda_bus = {0: 0x86, 1: 0x1A}
    r = NvmlReader([0, 1], nvml=nvml, pci_of=lambda i: (0, cuda_bus[i], 0), uuid_of=lambda i: None)
    assert r.read(0)["util_pct"] == 33 and r.read(1)["util_pct"] == 22


def test_uuid_is_the_fallback_where_torch_gives_no_pci_id():
    nvml = FakeNvml([gpu(0x3B, "a", 11), gpu(0x1A, "b", 22)])
    r = NvmlReader([0], nvml=nvml, pci_of=lambda i: None, uuid_of=lambda i: "b")
    assert r.read(0)["util_pct"] == 22


def test_an_unsupported_metric_is_absent_not_zero_and_not_asked_again():
    g = gpu(0x1A, "a", 50)
    g["power_mw"] = None  # e.g. a laptop GPU without power readings
    g["temp"] = None
    nvml = FakeNvml([g])
    r = NvmlReader([0], nvml=nvml, pci_of=lambda i: (0, 0x1A, 0), uuid_of=lambda i: None)
    first, second = r.read(0), r.read(0)
    assert "power_w" not in first and "temp_c" not in first
    assert first["util_pct"] == 50 and first["mem_total_mb"] == 16384 and first["sm_clock_mhz"] == 1980
    assert second == first
    assert nvml.calls[("GPU-a", "power_mw")] == 1  # not retried after NotSupported


def test_an_unmatched_gpu_reads_as_empty():
    nvml = FakeNvml([gpu(0x1A, "a", 50)])
    r = NvmlReader([0], nvml=nvml, pci_of=lambda i: (0, 0x99, 0), uuid_of=lambda i: "zzz")
    assert r.read(0) == {}


def test_balance_warns_before_a_run_like_dataparallel():
    devices = [Device("cuda", 0), Device("cuda", 1)]
    props = {
        0: {"memory_total_mb": 81920, "multiprocessors": 132, "model": "H100"},
        1: {"memory_total_mb": 24576, "multiprocessors": 82, "model": "RTX 3090"},
    }
    warnings = balance_warnings(devices, props)
    assert len(warnings) == 2 and all("cuda:1 (RTX 3090)" in w for w in warnings)
    props[1] = dict(props[0])
    assert balance_warnings(devices, props) == []


def test_output_device_memory_running_ahead_is_flagged_once():
    s = TelemetrySampler([Device("cpu", 0), Device("cpu", 1)], ["cpu:0", "cpu:1"], lambda r: None)
    rec = {"devices": {"cuda:0": {"mem_used_mb": 40_000.0}, "cuda:1": {"mem_used_mb": 8_000.0}}}
    s.output_name = "cuda:0"
    assert any("uses 40,000 MiB" in w for w in s.imbalance(rec))
    assert s.imbalance(rec) == []


@pytest.mark.parametrize("power", [250_000, None])
def test_energy_integrates_power_where_known(power, monkeypatch):
    import torch

    nvml = FakeNvml([gpu(0x1A, "a", 50, power_mw=power)])
    reader = NvmlReader([0], nvml=nvml, pci_of=lambda i: (0, 0x1A, 0), uuid_of=lambda i: None)
    s = TelemetrySampler([Device("cpu", 0)], ["cpu:0"], lambda r: None, nvml=reader)
    s.cuda_indices = [0]  # as if the run used cuda:0
    # torch's own memory counters need a real GPU; only the NVML side is under test here.
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda i: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda i: 0)
    s._last_t -= 1.0  # one second since the last sample
    reading = s.sample()
    assert reading["cuda:0"]["util_pct"] == 50
    if power is None:
        assert s.energy_j() is None and "power_w" not in reading["cuda:0"]
    else:
        assert s.energy_j() == pytest.approx(250.0, rel=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("devices", ["cpu:0", "cpu:0,cpu:1"])
def test_busy_is_measured_on_one_lane_as_on_several(devices, make_config):
    """One lane's work runs in the calling thread, not parallel_apply: it read 0 % busy for the whole run
    before 2026-12-02, in the records, the CLI's line, the plot and the hover. Every path counts it now."""
    from multilane.engine.display.device_line import format_telemetry
    from multilane.gui.plots.run_view import values_at
    from multilane.gui.runs.run_data import RunData

    torch.set_num_threads(1)
    cfg = make_config(
        task__name="mlp",
        task__params={"samples": 4096, "width": 256},
        devices__use=devices,
        train__steps=150,  # over a second of training (60 steps took 0.2 s at times: no record fell within it)
        telemetry__rate_hz=20,
        telemetry__record_s=0.2,
        train__log_every=10,
    )
    result = Trainer(cfg).run()
    records = read_metrics(result.run_dir)
    lanes = devices.split(",")
    assert next(r for r in records if r.get("event") == "started")["lanes"] == lanes
    # the records written while it trained: one written after its last step (the final evaluation, the
    # checkpoint) is a true 0 % on a machine that finished the steps quickly
    trained_until = max(r["wall_time"] for r in records if r["kind"] == "train")
    tele = [r for r in records if r["kind"] == "telemetry" and r["wall_time"] <= trained_until]
    assert tele, "a run of over a second writes telemetry"
    # training all along: busy. One lane does all the step's work (forward, loss, backward); several
    # lanes' busy time is their forward, loss and share of the one backward (test_backward_busy.py), and
    # the step's other parts (scatter, the gradient sum, the optimizer) are no lane's: on a loaded
    # machine a record can be a true 0.
    share = 0.8 if len(lanes) == 1 else 0.2
    for lane in lanes:
        busy = [r["devices"][lane]["busy_pct"]["mean"] for r in tele]
        assert sum(b > 0 for b in busy) >= share * len(busy), (lane, busy)
    for r in tele:  # the CLI's line: "<1%" for a share under half a percent, never a "0%" that is not 0
        line = format_telemetry(r)
        for lane in lanes:
            assert f"{lane} " in line and (f"{lane} 0%" not in line or r["devices"][lane]["busy_pct"]["mean"] == 0)
    train = [r for r in records if r["kind"] == "train"]
    assert all(train[-1]["lane_busy_s"][lane] > 0 for lane in lanes)
    run = RunData.from_run_dir(result.run_dir)
    util = run.telemetry.get(f"util/{lanes[0]}")
    # what the plot draws (the last record: the seconds after the last step, when nothing trained)
    assert np.isfinite(util).all() and (util[:-1] > 0).mean() >= share
    steps = run.telemetry.get("step")
    alone = [i for i, s in enumerate(steps) if (steps == s).sum() == 1 and util[i] > 0]
    assert alone, steps  # a record while it trained, the only one at its step
    hover = values_at(run, float(steps[alone[0]]), "step")
    assert f"{lanes[0]} utilization " in hover and f"{lanes[0]} utilization 0%" not in hover, hover
