"""Finding a task by name, or loading the user's own from a Python file."""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
import traceback
from pathlib import Path
from typing import Any

from multilane.engine.config import describe_error
from multilane.engine.errors import UserError
from multilane.engine.tasks.base import Task
from multilane.engine.tasks.builtin import BUILTIN_TASKS
from pydantic import ValidationError


def is_task_file(name: str) -> bool:
    return name.endswith(".py") or "/" in name or "\\" in name


def task_class(name: str) -> type[Task]:
    """The Task class for a built-in name or a .py file path; UserError (one line) if there is none."""
    if is_task_file(name):
        return load_task_file(name)
    try:
        return BUILTIN_TASKS[name]
    except KeyError:
        known = ", ".join(sorted(BUILTIN_TASKS))
        raise UserError(f"task: unknown task {name!r}; built-in tasks are {known}, or give a .py file") from None


def make_task(name: str, params: dict[str, Any] | None = None) -> Task:
    """Build a task with its hyperparameters validated against the task's own schema."""
    cls = task_class(name)
    try:
        p = cls.Params.model_validate(params or {})
    except ValidationError as e:
        raise UserError(f"task {cls.name}: {describe_error(e, 'task.params')}") from None
    return cls(p)


def load_task_file(path: str | Path) -> type[Task]:
    """Import a user's task file and return the one Task subclass it defines."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"task file {p}: no such file")
    if not p.is_file():
        raise UserError(f"task file {p}: not a file")
    try:
        source = p.read_bytes()
    except OSError as e:
        raise UserError(f"task file {p}: cannot read it ({e.strerror or e})") from None
    try:
        compile(source, str(p), "exec")
    except SyntaxError as e:
        raise UserError(f"task file {p}: syntax error at line {e.lineno}: {e.msg}") from None
    # A module name unique to the file, so that two task files never shadow each other.
    mod_name = f"multilane_user_task_{hashlib.sha1(str(p.resolve()).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(mod_name, p)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(mod_name, None)
        line = _user_line(e, p)
        raise UserError(f"task file {p}: {type(e).__name__} while importing it{line}: {e}") from None
    explicit = getattr(module, "TASK", None)
    if explicit is not None:
        if inspect.isclass(explicit) and issubclass(explicit, Task):
            return explicit
        raise UserError(f"task file {p}: TASK must be a subclass of multilane.engine.tasks.Task")
    found = [
        obj
        for obj in vars(module).values()
        if inspect.isclass(obj) and issubclass(obj, Task) and obj.__module__ == mod_name and not inspect.isabstract(obj)
    ]
    if not found:
        raise UserError(
            f"task file {p}: defines no task; subclass multilane.engine.tasks.Task (see examples/custom_task.py)"
        )
    if len(found) > 1:
        names = ", ".join(c.__name__ for c in found)
        raise UserError(f"task file {p}: defines several tasks ({names}); set TASK = <the one to train>")
    return found[0]


def _user_line(e: BaseException, path: Path) -> str:
    frames = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename) == path]
    return f" (line {frames[-1].lineno})" if frames else ""
