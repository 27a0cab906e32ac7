import pytest
from multilane.engine.errors import UserError
from multilane.engine.telemetry.devices import Device, lane_names, parse_devices


def test_cpu_lanes_parse_in_order():
    assert [d.name for d in parse_devices("cpu:0, cpu:1,cpu:2")] == ["cpu:0", "cpu:1", "cpu:2"]
    assert parse_devices("cpu") == [Device("cpu", 0)]


def test_auto_without_gpu_is_two_cpu_lanes():
    assert [d.name for d in parse_devices("auto")] == ["cpu:0", "cpu:1"]


@pytest.mark.parametrize(
    "spec,words",
    [
        ("", "empty"),
        ("gpu:0", "'gpu:0' is not a device"),
        ("cuda:x", "not a device"),
        ("cpu:0,cpu:0", "listed twice"),
        ("cpu:0,cuda:0", "do not mix"),
        ("cuda:0", "no CUDA GPU"),
        ("cuda:0,cuda:0", "no CUDA GPU"),
    ],
)
def test_bad_device_lists_say_what_is_wrong(spec, words):
    with pytest.raises(UserError, match=words):
        parse_devices(spec)


def test_two_replicas_on_one_gpu_get_distinct_lane_names():
    assert lane_names([Device("cuda", 0), Device("cuda", 0), Device("cuda", 1)]) == [
        "cuda:0",
        "cuda:0#1",
        "cuda:1",
    ]


@pytest.mark.parametrize("lanes", [2, 8, 9, 16, 64])
def test_any_count_of_cpu_lanes_up_to_64_is_accepted(lanes):
    # The app lists at most 8 lanes (one per core); a run may ask for up to 64 (a regression once:
    # a second MAX_CPU_LANES = 8 in the module refused 9 to 64).
    from multilane.engine.telemetry.devices import cpu_lane_count

    spec = ",".join(f"cpu:{i}" for i in range(lanes))
    assert [d.name for d in parse_devices(spec)] == spec.split(",")
    assert 2 <= cpu_lane_count() <= 8


def test_65_cpu_lanes_are_refused_in_one_line():
    with pytest.raises(UserError, match=r"^devices: 65 CPU lanes asked for; at most 64$"):
        parse_devices(",".join(f"cpu:{i}" for i in range(65)))
