"""The search space: ``--param KEY=log:LOW:HIGH | float:LOW:HIGH | int:LOW:HIGH | choice:A,B,C``, checked
against the config schema (any numeric or choice field of a section, or of the task's params), and the
values a trial draws for it through Optuna's ``suggest_*``."""

from __future__ import annotations

import math
import typing
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from multilane.engine.errors import UserError

KINDS = ("log", "float", "int", "choice")
# Keys that say where and how a trial runs, never what it learns: the sweep sets them itself.
NOT_SWEPT = {"devices", "run", "telemetry", "health"}
SYNTAX = "KEY=log:LOW:HIGH, float:LOW:HIGH, int:LOW:HIGH or choice:A,B,C"


@dataclass(frozen=True)
class ParamSpec:
    """One searched key: its kind and its range (low/high) or its choices."""

    key: str
    kind: str
    low: float | None = None
    high: float | None = None
    choices: tuple[Any, ...] = field(default_factory=tuple)
    whole: bool = False  # drawn as whole numbers (an int field, or kind int)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["choices"] = list(self.choices)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ParamSpec:
        return cls(
            d["key"], d["kind"], d.get("low"), d.get("high"), tuple(d.get("choices") or ()), bool(d.get("whole"))
        )

    def text(self) -> str:
        """The spec as typed on the command line."""
        if self.kind == "choice":
            return f"{self.key}=choice:{','.join(map(str, self.choices))}"
        return f"{self.key}={self.kind}:{self.low:g}:{self.high:g}"

    def suggest(self, trial: Any) -> Any:
        """The value ``trial`` draws (or, for a re-queued trial, was given) for this key."""
        if self.kind == "choice":
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.whole:
            return trial.suggest_int(self.key, int(self.low), int(self.high), log=self.kind == "log")
        return trial.suggest_float(self.key, self.low, self.high, log=self.kind == "log")

    def grid(self) -> list[Any]:
        """Every value of this key, for the grid sampler (``float`` and ``log`` ranges have no grid)."""
        if self.kind == "choice":
            return list(self.choices)
        if self.kind == "int" or (self.whole and self.kind == "float"):
            return list(range(int(self.low), int(self.high) + 1))
        raise UserError(f"--sampler grid: --param {self.text()} is a continuous range; give it as int: or choice:")


def parse_param(text: str, task: str = "digits") -> ParamSpec:
    """A ``--param`` spec, checked against the schema of the config (and of ``task``'s params), or one line."""
    key, sep, rest = text.partition("=")
    key = key.strip()
    where = f"--param {_short(text)}"
    if not sep or not key:
        raise UserError(f"{where}: expected {SYNTAX}")
    kind, sep, body = rest.partition(":")
    kind = kind.strip().lower()
    if kind not in KINDS or not sep:
        raise UserError(f"{where}: unknown kind {kind!r}; expected {SYNTAX}")
    ftype = field_type(key, task, where)
    if kind == "choice":
        raw = [c.strip() for c in body.split(",")]
        if not body.strip() or any(not c for c in raw):
            raise UserError(f"{where}: choice needs values separated by commas, e.g. choice:sgd,adam")
        if len(set(raw)) != len(raw):
            raise UserError(f"{where}: a choice is listed twice")
        values = tuple(_convert(c, ftype, where) for c in raw)
        spec = ParamSpec(key, "choice", choices=values)
    else:
        if ftype not in (int, float):
            raise UserError(f"{where}: {key} is not a number; give its values as choice:A,B,C")
        parts = body.split(":")
        if len(parts) != 2:
            raise UserError(f"{where}: {kind} needs LOW:HIGH, e.g. {kind}:{'1:8' if kind == 'int' else '1e-4:1e-1'}")
        low, high = (_number(p, where) for p in parts)
        whole = kind == "int" or ftype is int  # an int field searched as float: whole numbers all the same
        if whole and (low != int(low) or high != int(high)):
            raise UserError(f"{where}: {key} takes whole numbers; give whole bounds")
        if not low < high:
            raise UserError(f"{where}: LOW must be below HIGH ({low:g} is not below {high:g})")
        if kind == "log" and low <= 0:
            raise UserError(f"{where}: a log range needs LOW > 0 (got {low:g})")
        spec = ParamSpec(key, kind, low, high, whole=whole)
    _check_values(spec, task, where)
    return spec


def parse_params(texts: list[str], task: str) -> list[ParamSpec]:
    """Every ``--param``; a key given twice is one line."""
    specs = [parse_param(t, task) for t in texts]
    seen: set[str] = set()
    for s in specs:
        if s.key in seen:
            raise UserError(f"--param {s.key}: given twice; give each key once")
        seen.add(s.key)
    return specs


def field_type(key: str, task: str, where: str) -> Any:
    """int, float, bool, str or a tuple of allowed values (a Literal) for a config key; one line if it is not a key."""
    from multilane.engine.config import RunConfig

    parts = key.split(".")
    if len(parts) < 2 or not all(parts):
        raise UserError(f"{where}: {key!r} is not a config key; keys are section.name, e.g. optim.lr")
    if parts[0] in NOT_SWEPT:
        raise UserError(f"{where}: {parts[0]}.* says where a trial runs, not what it learns; it is not searched")
    model: Any = RunConfig
    if parts[0] == "task":
        if len(parts) != 3 or parts[1] != "params":
            raise UserError(f"{where}: a task's own hyperparameters are task.params.NAME")
        model = _task_params(task, where)
        parts = parts[2:]
    else:
        if len(parts) != 2 or parts[0] not in RunConfig.model_fields:
            raise UserError(f"{where}: {key!r} is not a config key ({_sections()})")
        model = RunConfig.model_fields[parts[0]].annotation
        parts = parts[1:]
    info = model.model_fields.get(parts[0])
    if info is None:
        import difflib

        close = difflib.get_close_matches(parts[0], list(model.model_fields), n=1, cutoff=0.6)
        hint = f"; did you mean {key.rsplit('.', 1)[0]}.{close[0]}?" if close else ""
        raise UserError(f"{where}: {key!r} is not a config key{hint}")
    return _plain_type(info.annotation, key, where)


def _plain_type(annotation: Any, key: str, where: str) -> Any:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is Literal:
        return tuple(typing.get_args(annotation))
    if annotation in (int, float, bool, str):
        return annotation
    if len(args) == 1 and args[0] in (int, float, bool, str):  # int | None
        return args[0]
    raise UserError(f"{where}: {key} is not a number or a choice; it cannot be searched")


def _task_params(task: str, where: str) -> Any:
    from multilane.engine.tasks.loader import task_class

    try:
        return task_class(task).Params
    except UserError as e:
        raise UserError(f"{where}: {e}") from None


def _sections() -> str:
    from multilane.engine.config import RunConfig

    return "sections: " + ", ".join(k for k in RunConfig.model_fields if k not in NOT_SWEPT)


def _convert(text: str, ftype: Any, where: str) -> Any:
    if isinstance(ftype, tuple):
        if text not in ftype:
            raise UserError(f"{where}: {text!r} is not one of {', '.join(map(str, ftype))}")
        return text
    if ftype is bool:
        if text.lower() not in ("true", "false"):
            raise UserError(f"{where}: {text!r} is not true or false")
        return text.lower() == "true"
    if ftype is int:
        v = _number(text, where)
        if v != int(v):
            raise UserError(f"{where}: {text!r} is not a whole number")
        return int(v)
    if ftype is float:
        return _number(text, where)
    return text


def _number(text: str, where: str) -> float:
    if len(text.strip()) > 40:
        raise UserError(f"{where}: {_short(text)} is not a number")
    try:
        v = float(text)
    except ValueError:
        raise UserError(f"{where}: {_short(text.strip())} is not a number") from None
    if not math.isfinite(v):
        raise UserError(f"{where}: {text.strip()} is not a finite number")
    return v


def _check_values(spec: ParamSpec, task: str, where: str) -> None:
    """The bounds (or each choice) must be values the config accepts: checked by the schema itself."""
    from multilane.engine.config import RunConfig, describe_error, merge
    from pydantic import ValidationError

    values = list(spec.choices) if spec.kind == "choice" else [spec.low, spec.high]
    for v in values:
        if spec.whole and v is not None:
            v = int(v)
        if spec.key.startswith("task.params."):
            try:
                _task_params(task, where).model_validate({spec.key.split(".", 2)[2]: v})
            except ValidationError as e:
                raise UserError(f"{where}: {describe_error(e, 'task.params')}") from None
            continue
        try:
            RunConfig.model_validate(merge({}, {spec.key: v}))
        except ValidationError as e:
            raise UserError(f"{where}: {describe_error(e)}") from None


def _short(text: str) -> str:
    return repr(text) if len(text) <= 60 else repr(text[:56] + "...")
