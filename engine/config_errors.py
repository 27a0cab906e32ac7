"""One line for what is wrong in a config: the key, the value and the rule it broke, with "did you mean"
for a key close to a known one (``describe_error``); where a table nests too deep (``too_deep``)."""

from __future__ import annotations

import difflib
import json
import re
from typing import Any

from pydantic import BaseModel, ValidationError


def describe_error(err: ValidationError, prefix: str = "", model: type[BaseModel] | None = None) -> str:
    """One line naming the key, the value and the rule it broke (the first error; the count if more).
    With ``model``, an unknown key close to a known one is answered "did you mean ...?"."""
    e = err.errors()[0]
    key = ".".join(_key_part(p) for p in e["loc"])
    key = f"{prefix}.{key}" if prefix and key else prefix or key
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "extra_forbidden":
        text = f"{key}: unknown key" + _did_you_mean(model, e["loc"], prefix)
    elif e["type"] == "missing":
        text = f"{key}: missing"
    else:
        text = f"{key} = {_short(e.get('input'))}: {msg}"
    more = len(err.errors()) - 1
    return text + (f" (and {more} more problem{'s' if more > 1 else ''})" if more else "")


def _did_you_mean(model: type[BaseModel] | None, loc: tuple[Any, ...], prefix: str = "") -> str:
    """ "; did you mean telemetry.record_s?" for an unknown key close to a known key of its section."""
    for part in loc[:-1]:
        field = model.model_fields.get(part) if model is not None and isinstance(part, str) else None
        model = field.annotation if field is not None else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return ""
    if model is None or not isinstance(loc[-1], str):
        return ""
    close = difflib.get_close_matches(loc[-1], list(model.model_fields), n=1, cutoff=0.6)
    return (
        f"; did you mean {'.'.join([*([prefix] if prefix else []), *map(str, loc[:-1]), close[0]])}?" if close else ""
    )


def _key_part(part: Any) -> str:
    """A key as typed, or quoted when it is empty or holds characters that would break the line."""
    text = str(part)
    if text and text.isprintable() and " " not in text and "." not in text:
        return text
    return _short(text)


def _short(value: Any) -> str:
    if isinstance(value, str):  # a URI's user:password@ is never echoed (terminals and CI logs keep it)
        value = re.sub(r"(://)[^/@\s]*@", r"\1***@", value)
    s = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
    return s if len(s) <= 60 else s[:57] + "..."


def too_deep(data: Any, limit: int, depth: int = 0, path: str = "") -> str | None:
    """The dotted key where ``data`` nests deeper than ``limit`` levels, or None."""
    if depth > limit:
        return path or "config"
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for k, v in items:
        if isinstance(v, (dict, list)):
            found = too_deep(v, limit, depth + 1, f"{path}.{k}" if path else str(k))
            if found:
                return found
    return None
