"""Every call into the GPU driver is bounded in time, and a GPU CUDA cannot read is one line.

No GPU here: the driver is faked (a pynvml stand-in whose calls hang or raise; torch's CUDA count and
properties replaced by functions that hang or raise). That is logic that cannot run without a GPU's
driver; what is real is the bound (threads, clocks), the CLI (``main`` in-process), the sampler and
the app's device list. The bound is shortened from 5 s to 0.3 s so that each case costs a fraction of
a second.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from multilane.engine.cli.main import main
from multilane.engine.telemetry import devices, driver
from multilane.engine.telemetry.devices import Device
from multilane.engine.telemetry.driver import DriverNotAnswering, bounded
from multilane.engine.telemetry.nvml import NvmlReader, open_nvml
from multilane.engine.telemetry.sampler import TelemetrySampler, live_readings

BOUND = 0.3


@pytest.fixture(autouse=True)
def short_bound(monkeypatch):
    """A 0.3 s bound, a driver not yet taken as wedged (restored after), and every hung call released."""
    monkeypatch.setattr(driver, "TIMEOUT_S", BOUND)
    monkeypatch.setattr(driver, "_wedged", None)
    yield
    HANG.set()  # the daemon threads left waiting in a "driver" end with the test
    HANG.clear()


HANG = threading.Event()


def never_answers(*args, **kwargs):
    HANG.wait(60)
    raise RuntimeError("released")


class FakeNvml:
    """pynvml's surface as NvmlReader uses it: one GPU; ``hang`` or ``fail`` names the call that
    never returns or raises."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1

    def __init__(self, hang: str | None = None, fail: str | None = None):
        self.hang, self.fail = hang, fail

    def __getattr__(self, name):
        def call(*args):
            if name == self.hang:
                never_answers()
            if name == self.fail:
                raise RuntimeError(f"{name} failed: GPU is lost")
            return {
                "nvmlDeviceGetCount": 1,
                "nvmlDeviceGetHandleByIndex": "h0",
                "nvmlDeviceGetPciInfo": SimpleNamespace(domain=0, bus=1, device=0),
                "nvmlDeviceGetUUID": b"GPU-a",
                "nvmlDeviceGetUtilizationRates": SimpleNamespace(gpu=50),
                "nvmlDeviceGetMemoryInfo": SimpleNamespace(used=2**30, total=2**34),
            }.get(name, 1)

        return call


def reader(nvml) -> NvmlReader:
    return NvmlReader([0], nvml=nvml, pci_of=lambda i: (0, 1, 0), uuid_of=lambda i: "a")


def test_the_bound_returns_a_value_raises_what_the_call_raises_and_gives_up_on_a_hang():
    assert bounded(lambda a: a + 1, 1) == 2
    with pytest.raises(ZeroDivisionError):
        bounded(lambda: 1 / 0)
    t0 = time.monotonic()
    with pytest.raises(DriverNotAnswering, match=r"^the NVIDIA driver did not answer in 0.3 s$"):
        bounded(never_answers)
    assert time.monotonic() - t0 < BOUND + 1.0
    t0 = time.monotonic()  # wedged from now on: the next call fails at once, no second thread waits
    with pytest.raises(DriverNotAnswering):
        bounded(lambda: 1)
    assert time.monotonic() - t0 < 0.05
    assert driver.driver_problem() == "the NVIDIA driver did not answer in 0.3 s"


@pytest.mark.parametrize("call", ["nvmlInit", "nvmlDeviceGetCount", "nvmlDeviceGetPciInfo"])
def test_an_nvml_init_that_never_answers_costs_the_bound_and_no_reader(call):
    t0 = time.monotonic()
    with pytest.raises(DriverNotAnswering):
        reader(FakeNvml(hang=call))
    assert time.monotonic() - t0 < BOUND + 1.0


@pytest.mark.parametrize("fail", ["nvmlInit", "nvmlDeviceGetUtilizationRates"])
def test_an_nvml_that_raises_leaves_readings_out_and_says_why(fail):
    if fail == "nvmlInit":
        with pytest.raises(RuntimeError):
            reader(FakeNvml(fail=fail))
        return
    r = reader(FakeNvml(fail=fail))
    assert r.read(0) == {}  # not a half reading, not a traceback
    assert "GPU is lost" in r.problem


def test_a_driver_that_stops_answering_mid_run_ends_the_readings_not_the_run():
    nvml = FakeNvml()
    r = reader(nvml)
    assert r.read(0)["util_pct"] == 50.0
    nvml.hang = "nvmlDeviceGetMemoryInfo"
    t0 = time.monotonic()
    assert r.read(0) == {}
    assert r.read(0) == {}  # the second read asks nothing: at once
    assert time.monotonic() - t0 < BOUND + 1.0
    assert r.problem == "the NVIDIA driver did not answer in 0.3 s"
    r.close()  # asks nothing of a driver that does not answer


def test_telemetry_goes_on_after_the_driver_stops_answering_and_says_so_once():
    nvml = FakeNvml()
    records = []
    s = TelemetrySampler([Device("cuda", 0)], ["cuda:0"], records.append, nvml=reader(nvml))
    s._samples.append(s.sample())
    s._emit()
    nvml.hang = "nvmlDeviceGetUtilizationRates"
    for _ in range(3):
        s._samples.append(s.sample())
        s._emit()
    warnings = [r for r in records if r.get("event") == "warning"]
    assert len(warnings) == 1 and "did not answer in 0.3 s" in warnings[0]["message"]
    tele = [r for r in records if r["kind"] == "telemetry"]
    assert tele[0]["devices"]["cuda:0"]["util_pct"]["mean"] == 50.0
    assert "util_pct" not in tele[-1]["devices"]["cuda:0"]  # absent, never a stale or zero reading
    assert tele[-1]["process"]["rss_mb"] > 0  # the rest of the record goes on
    s.stop()


def test_open_nvml_is_none_where_the_driver_hangs():
    import pynvml

    with pytest.MonkeyPatch.context() as m:
        m.setattr(pynvml, "nvmlInit", never_answers)
        t0 = time.monotonic()
        assert open_nvml([0]) is None
        assert time.monotonic() - t0 < BOUND + 1.0


def fake_cuda(monkeypatch, count=None, props=None):
    """torch's CUDA as the engine asks it: ``count`` (a number or a function) and ``props`` (a function)."""
    monkeypatch.setattr(devices, "_cuda_count", count if callable(count) else (lambda: count))
    if props is not None:
        monkeypatch.setattr(torch.cuda, "get_device_properties", props)


@pytest.mark.parametrize("args", [["devices"], ["devices", "--json"]])
def test_devices_with_a_driver_that_never_answers_lists_the_cpu_and_says_so_in_one_line(monkeypatch, capsys, args):
    fake_cuda(monkeypatch, count=never_answers)
    t0 = time.monotonic()
    assert main(args) == 1
    assert time.monotonic() - t0 < BOUND + 3.0  # the bound, plus psutil's 0.5 s CPU reading
    out, err = capsys.readouterr()
    assert "cpu" in out and "Traceback" not in err
    assert err.splitlines() == ["multilane: warning: the NVIDIA driver (CUDA) did not answer in 0.3 s"]


def test_gpus_whose_properties_cuda_cannot_read_are_one_line_each(monkeypatch, capsys):
    def unreadable(i):
        raise RuntimeError("CUDA error: unspecified launch failure\nCUDA kernel errors might be asynchronous")

    fake_cuda(monkeypatch, count=2, props=unreadable)
    assert main(["devices"]) == 1
    out, err = capsys.readouterr()
    assert "cpu" in out and "Traceback" not in err
    assert err.splitlines() == [
        f"multilane: warning: cuda:{i}: CUDA lists this GPU but cannot read its properties "
        "(CUDA error: unspecified launch failure CUDA kernel errors might be asynchronous)"
        for i in (0, 1)
    ]
    problems: list[str] = []
    assert [r["kind"] for r in live_readings(0.01, problems)] == ["cpu"]
    assert len(problems) == 2


def test_a_run_on_gpus_with_a_driver_that_never_answers_is_one_line_exit_2(monkeypatch, capsys, tmp_path):
    fake_cuda(monkeypatch, count=never_answers)
    code = main(["train", "--task", "linear", "--devices", "cuda:0", "--steps", "1", "--runs-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.splitlines() == ["multilane: error: the NVIDIA driver (CUDA) did not answer in 0.3 s"]
    assert list(tmp_path.iterdir()) == []


def test_balance_warnings_say_the_driver_problem_instead_of_raising(monkeypatch):
    from multilane.engine.run.balance import balance_warnings

    fake_cuda(monkeypatch, count=2, props=never_answers)
    assert balance_warnings([Device("cuda", 0), Device("cuda", 1)]) == [
        "the NVIDIA driver (CUDA) did not answer in 0.3 s"
    ]


def test_the_environment_record_survives_a_driver_that_never_answers(monkeypatch):
    from multilane.engine.telemetry.envinfo import environment

    fake_cuda(monkeypatch, count=never_answers)
    env = environment()
    assert env["cuda_available"] is False and env["devices"][-1]["kind"] == "cpu"
