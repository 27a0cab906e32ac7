"""A config file read into a plain dict (TOML or JSON, size- and depth-checked, one line for what is wrong),
a config written back, and ``--set``'s dotted overrides merged into a dict. ``config.py`` validates the
dict and offers these under its own names."""

from __future__ import annotations

import copy
import json
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tomli_w
from multilane.engine.errors import UserError
from multilane.engine.rundir.readfile import describe_os_error, read_regular_file, user_path

if TYPE_CHECKING:
    from multilane.engine.config import RunConfig

MAX_FILE_BYTES = 1 << 20  # a config is a few KiB


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML or JSON config file into a dict, or raise UserError naming the file and the problem."""
    p = user_path(path, "config file")
    try:
        raw = read_regular_file(p, MAX_FILE_BYTES)
    except FileNotFoundError:
        raise UserError(f"{p}: no such config file") from None
    except OSError as e:
        raise UserError(f"{p}: cannot read it as a config file ({describe_os_error(e)})") from None
    except ValueError as e:  # an embedded NUL in the path
        raise UserError(f"{path!r}: not a usable path ({e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{p}: not UTF-8 text (byte {e.start})") from None
    if not text.strip():
        raise UserError(f"{p}: the file is empty")
    suffix = p.suffix.lower()
    if suffix not in (".json", ".toml"):
        raise UserError(f"{p}: unknown config format {p.suffix!r}; use .toml or .json")
    try:
        data = json.loads(text) if suffix == ".json" else tomllib.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{p}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{p}: not valid TOML: {e}") from None
    except RecursionError:
        raise UserError(f"{p}: nested too deeply to be a config") from None
    except ValueError as e:  # an integer of thousands of digits
        raise UserError(f"{p}: {str(e).split(';')[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"{p}: expected a table of sections at the top, got {type(data).__name__}")
    return data


def save_config(config: RunConfig, path: str | Path) -> None:
    """Save as TOML or JSON, by the file's suffix (unset optional values are left out of TOML)."""
    p = Path(path)
    data = config.to_dict()
    text = json.dumps(data, indent=2) + "\n" if p.suffix.lower() == ".json" else tomli_w.dumps(_drop_none(data))
    p.write_text(text, encoding="utf-8")


def _drop_none(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _drop_none(v) for k, v in d.items() if v is not None}
    return d


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Apply dotted-key overrides (``{"optim.lr": 0.1}``) to a nested config dict, returning a copy."""
    out = copy.deepcopy(base)
    for dotted, value in overrides.items():
        node = out
        *parents, leaf = dotted.split(".")
        for k in parents:
            child = node.get(k)
            if child is None:
                child = node[k] = {}
            elif not isinstance(child, dict):
                break  # junk where a section belongs: kept, so that validation names it
            node = child
        else:
            node[leaf] = value
    return out
