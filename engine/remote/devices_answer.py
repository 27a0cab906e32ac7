"""A host's ``multilane devices --json``, read as data: an answer of the wrong shape or types (a host
that answers garbage, another program under that name) is one line naming the host and what was
wrong, never a traceback; every string in it is made printable (``terminal_text.printable``)."""

from __future__ import annotations

import json
from typing import Any, Literal

from multilane.engine.display.terminal_text import printable
from multilane.engine.remote.connection import Connection, RemoteError
from pydantic import BaseModel, ConfigDict, Field, StrictInt, TypeAdapter, ValidationError

Number = float | None


class DeviceRow(BaseModel):
    """One device of the host, as ``live_readings`` writes it (more keys are kept, unchecked)."""

    model_config = ConfigDict(extra="allow", strict=True)

    kind: Literal["cuda", "cpu"]
    name: str = Field(max_length=200)
    model: str = Field(default="", max_length=500)
    cores: StrictInt | None = Field(default=None, ge=0)
    lanes: StrictInt | None = Field(default=None, ge=0)
    memory_total_mb: Number = Field(default=None, ge=0)
    mem_used_mb: Number = Field(default=None, ge=0)
    util_pct: Number = None
    temp_c: Number = None
    power_w: Number = None


ROWS = TypeAdapter(list[DeviceRow])
MAX_ROWS = 1024


def check_devices(host: str, text: str) -> list[dict[str, Any]]:
    """The rows of a ``devices --json`` answer, checked; ``RemoteError`` names what was wrong."""
    where = f"{printable(host)}: 'multilane devices --json' answered"
    try:
        data = json.loads(text)
    except ValueError as e:
        start = printable(text.strip()[:40])
        raise RemoteError(f"{where} something that is not JSON ({e.msg} at {e.pos}; it began {start!r})") from None
    if not isinstance(data, list):
        kind = {dict: "an object", str: "a string", bool: "a boolean", type(None): "null"}.get(type(data), "a number")
        raise RemoteError(f"{where} {kind}, not a list of devices")
    if len(data) > MAX_ROWS:
        raise RemoteError(f"{where} {len(data):,} devices; more than {MAX_ROWS} is not a real machine")
    try:
        rows = ROWS.validate_python(data)
    except ValidationError as e:
        first = e.errors()[0]
        loc = "device " + ".".join(str(p) for p in first["loc"]).replace(".", ": ", 1)
        got = printable(repr(first.get("input"))[:60])
        msg = "should be an object" if first["type"] in ("model_type", "dict_type") else first["msg"].lower()
        raise RemoteError(f"{where} a wrong device list ({loc}: {msg}, got {got})") from None
    out = []
    for row in rows:
        d = row.model_dump(exclude_unset=True)
        out.append({k: printable(v) if isinstance(v, str) else v for k, v in d.items()})
    return out


def read_devices(conn: Connection) -> list[dict[str, Any]]:
    """The host's devices: its ``multilane`` checked, then ``devices --json`` run and checked."""
    conn.check_multilane()
    code, out, err = conn.multilane("devices --json")
    if code != 0:
        last = (err.strip().splitlines() or [str(code)])[-1]
        raise RemoteError(f"{printable(conn.name)}: 'multilane devices --json' failed there ({printable(last)[:300]})")
    return check_devices(conn.name, out)
