"""Property-based: whatever bytes or JSON a run folder holds, its readers answer with data or one line.

What ``multilane export`` and the app's Open run read (metrics.jsonl, status.json, config.json),
what ``--resume`` reads (the checkpoint), and what ``--config`` reads, each fed random bytes and
random JSON. A reader may skip (and count) what it cannot use, or refuse with a one-line
``UserError``; any other exception would reach the user as a traceback.
"""

import io
import json
import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from multilane.engine.config import build_config, read_config_file
from multilane.engine.errors import UserError
from multilane.engine.rundir.checkpoint_file import load_checkpoint
from multilane.engine.rundir.runlog import load_metrics, read_json, record_problem, run_task_name
from multilane.gui.runs.run_data import RunData

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))

json_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
json_value = st.recursive(
    json_scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8,
)
KEYS = [
    "kind",
    "step",
    "wall_time",
    "loss",
    "device_loss",
    "resumed_from_step",
    "event",
    "metrics",
    "val_loss",
    "devices",
    "process",
    "phase_ms",
    "lr",
    "samples_per_s",
]


@st.composite
def record(draw):
    """A record shaped like ours, with any field replaced by any JSON value, or dropped."""
    kind = draw(st.sampled_from(["train", "eval", "event", "telemetry", "other"]))
    rec = {"kind": kind, "step": draw(st.integers(0, 50)), "wall_time": 1000.0 + draw(st.integers(0, 50))}
    if kind == "train":
        rec |= {"loss": 0.5, "device_loss": {"cpu:0": 0.4, "cpu:1": 0.6}, "phase_ms": {"forward": 1.0}}
    elif kind == "eval":
        rec |= {"val_loss": 0.3, "metrics": {"accuracy": 0.9}}
    elif kind == "event":
        rec |= {"event": "started"}
        if draw(st.booleans()):
            rec["resumed_from_step"] = draw(st.integers(0, 50))
    elif kind == "telemetry":
        rec |= {"devices": {"cpu:0": {"busy_pct": 50.0, "mem_used_mb": 10}}, "process": {"rss_mb": 100.0}}
    for key in draw(st.lists(st.sampled_from(KEYS), max_size=3)):
        if draw(st.booleans()):
            rec.pop(key, None)
        else:
            rec[key] = draw(json_value)
    return rec


def _line(rec) -> bytes:
    return json.dumps(rec, allow_nan=False).encode() + b"\n"


def _read_everything_the_app_reads(run):
    data = RunData.from_run_dir(run)
    rows = data.write_csv(run / "out.csv")
    assert rows == data.train.rows
    return data


@FUZZ
@given(st.binary(max_size=400))
def test_random_bytes_as_metrics_never_break_export_or_open_run(tmp_path_factory, raw):
    run = tmp_path_factory.mktemp("run")
    (run / "metrics.jsonl").write_bytes(raw)
    data = _read_everything_the_app_reads(run)
    whole_lines = [ln for ln in raw.split(b"\n") if ln.strip()]
    assert data.skipped <= len(whole_lines)


@FUZZ
@given(st.lists(st.one_of(record(), json_value), max_size=12), st.binary(max_size=20))
def test_records_of_any_shape_are_read_or_skipped_and_counted(tmp_path_factory, records, tail):
    run = tmp_path_factory.mktemp("run")
    (run / "metrics.jsonl").write_bytes(b"".join(_line(r) for r in records) + tail)
    m = load_metrics(run)
    bad = sum(1 for r in records if record_problem(r) is not None)
    tail_lines = [ln for ln in tail.split(b"\n") if ln.strip()]
    assert bad <= m.skipped <= bad + len(tail_lines)
    for rec in m.records:
        assert record_problem(rec) is None
    data = _read_everything_the_app_reads(run)
    steps = data.train.get("step")
    assert all(math.isfinite(s) for s in steps)


@FUZZ
@given(st.one_of(st.binary(max_size=200), json_value.map(lambda v: json.dumps(v).encode())))
def test_status_and_config_files_of_any_content_read_as_an_object_or_none(tmp_path_factory, raw):
    run = tmp_path_factory.mktemp("run")
    for name in ("status.json", "config.json"):
        (run / name).write_bytes(raw)
        got = read_json(run / name)
        assert got is None or isinstance(got, dict)
    name = run_task_name(run)
    assert name is None or isinstance(name, str)


def _one_line_refusal(e: UserError) -> None:
    text = str(e)
    assert "\n" not in text and "weights_only" not in text and len(text) < 400, text


@FUZZ
@given(st.one_of(st.binary(max_size=300), st.binary(max_size=50).map(lambda b: b"\x80\x21" + b)))
def test_random_bytes_as_a_checkpoint_are_refused_in_one_line(tmp_path_factory, raw):
    # b"\x80\x21": a pickle of protocol 33, which torch warns about in several lines
    path = tmp_path_factory.mktemp("ck") / "last.pt"
    path.write_bytes(raw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(UserError) as info:
            load_checkpoint(path)
    _one_line_refusal(info.value)
    assert not caught, [str(w.message)[:80] for w in caught]  # a warning is more lines on the CLI's stderr


tensors = st.builds(lambda n: torch.arange(n, dtype=torch.float32), st.integers(0, 4))
ck_value = st.recursive(
    st.one_of(json_scalar, tensors),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8,
)


@st.composite
def checkpoint(draw):
    ck = {"model": {"w": torch.zeros(2)}, "optimizer": {"state": {}}, "step": 3, "config": {}}
    for key in draw(st.lists(st.sampled_from([*ck, "rng", "scaler", "total_steps"]), max_size=3)):
        if draw(st.booleans()):
            ck.pop(key, None)
        else:
            ck[key] = draw(ck_value)
    return draw(st.one_of(st.just(ck), ck_value))


@FUZZ
@given(checkpoint())
def test_a_checkpoint_of_any_shape_loads_checked_or_is_refused_in_one_line(tmp_path_factory, ck):
    path = tmp_path_factory.mktemp("ck") / "last.pt"
    buf = io.BytesIO()
    torch.save(ck, buf)
    path.write_bytes(buf.getvalue())
    try:
        got = load_checkpoint(path)
    except UserError as e:
        _one_line_refusal(e)
        return
    assert isinstance(got["model"], dict) and isinstance(got["step"], int) and got["step"] >= 0
    assert isinstance(got["config"], dict) and isinstance(got["optimizer"], dict)


@FUZZ
@given(
    st.sampled_from([".json", ".toml"]),
    st.one_of(
        st.binary(max_size=300),
        json_value.map(lambda v: json.dumps(v).encode()),
        st.dictionaries(st.sampled_from(["train", "optim", "devices", "run", "x"]), json_value, max_size=3).map(
            lambda v: json.dumps(v).encode()
        ),
    ),
)
def test_a_config_file_of_any_content_is_a_config_or_one_line(tmp_path_factory, suffix, raw):
    path = tmp_path_factory.mktemp("cfg") / f"c{suffix}"
    path.write_bytes(raw)
    try:
        build_config(read_config_file(path), str(path))
    except UserError as e:
        assert "\n" not in str(e), str(e)
