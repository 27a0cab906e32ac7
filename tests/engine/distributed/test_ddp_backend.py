"""Which library a ddp run's process group uses (``devices.ddp_backend``): NCCL on distinct GPUs, Gloo on
CPU lanes and where two ranks share one GPU (NCCL refuses that: "Duplicate GPU detected")."""

from __future__ import annotations

import subprocess

import pytest
from helpers import CLI
from multilane.engine.config import build_config
from multilane.engine.distributed.rank import process_group_backend
from multilane.engine.errors import UserError
from multilane.engine.telemetry.devices import Device


@pytest.mark.parametrize(
    ("choice", "spec", "device", "expected"),
    [
        ("auto", "cuda:0,cuda:1", Device("cuda", 1), "nccl"),
        ("auto", "cuda:0,cuda:0", Device("cuda", 0), "gloo"),  # two ranks on one GPU
        ("auto", "cuda:0,cuda:1,cuda:1", Device("cuda", 0), "gloo"),  # one repeat is enough
        ("auto", "cpu:0,cpu:1", Device("cpu", 0), "gloo"),
        ("auto", "auto", Device("cuda", 0), "nccl"),  # auto devices: one rank per GPU
        ("nccl", "cuda:0,cuda:0", Device("cuda", 0), "nccl"),  # asked for: tried as asked
        ("gloo", "cuda:0,cuda:1", Device("cuda", 0), "gloo"),
    ],
)
def test_the_process_group_library_follows_the_devices(choice, spec, device, expected):
    assert process_group_backend(choice, spec, device) == expected


def test_nccl_on_cpu_lanes_is_refused_in_one_line():
    with pytest.raises(UserError, match="ddp_backend nccl needs GPUs") as e:
        build_config({"devices": {"use": "cpu:0,cpu:1", "strategy": "ddp", "ddp_backend": "nccl"}})
    assert "\n" not in str(e.value)
    assert build_config({"devices": {"ddp_backend": "gloo"}}).devices.ddp_backend == "gloo"


def test_the_cli_names_the_bad_backend_and_exits_2(tmp_path):
    r = subprocess.run(
        [
            *CLI,
            "train",
            "--strategy",
            "ddp",
            "--devices",
            "cpu:0,cpu:1",
            "--runs-dir",
            str(tmp_path),
            "--set",
            "devices.ddp_backend=nccl",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("multilane: error:") and "ddp_backend" in lines[0], r.stderr
    assert not list(tmp_path.iterdir())  # refused before anything is written
