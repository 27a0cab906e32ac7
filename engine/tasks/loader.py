"""Finding a task by name, or loading the user's own from a Python file."""

from __future__ import annotations

import hashlib
import inspect
import sys
import traceback
import types
from pathlib import Path
from typing import Any

from multilane.engine.config import check_task_file, describe_error, is_task_file
from multilane.engine.errors import UserError
from multilane.engine.rundir.readfile import describe_os_error, read_regular_file, user_path
from multilane.engine.tasks.base import Task
from multilane.engine.tasks.builtin import BUILTIN_TASKS
from pydantic import BaseModel, ValidationError

MAX_TASK_FILE_BYTES = 16 << 20


def task_class(name: str) -> type[Task]:
    """The Task class for a built-in name or a .py file path; UserError (one line) if there is none."""
    if is_task_file(name):
        return load_task_file(name)
    try:
        return BUILTIN_TASKS[name]
    except KeyError:
        known = ", ".join(sorted(BUILTIN_TASKS))
        raise UserError(f"task: unknown task {name!r}; built-in tasks are {known}, or give a .py file") from None


def make_task(name: str, params: dict[str, Any] | None = None, expect_sha256: str | None = None) -> Task:
    """Build a task with its hyperparameters validated against the task's own schema.

    ``expect_sha256``: for a task file, the content hash it must still have (a resume)."""
    cls = load_task_file(name, expect_sha256) if is_task_file(name) else task_class(name)
    try:
        p = cls.Params.model_validate(params or {})
    except ValidationError as e:
        raise UserError(f"task {cls.name}: {describe_error(e, 'task.params', cls.Params)}") from None
    except Exception as e:  # a validator of the user's own that raised something else
        raise UserError(f"task {cls.name}: {type(e).__name__} while checking its params: {_first_line(e)}") from None
    try:
        return cls(p)
    except UserError:  # the task's own refusal is already its one line
        raise
    except (Exception, SystemExit) as e:
        where = _user_line(e, Path(inspect.getfile(cls))) if _is_user_class(cls) else ""
        raise UserError(f"task {cls.name}: {type(e).__name__} while creating it{where}: {_first_line(e)}") from None


def file_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def task_file_record(cls: type[Task]) -> dict[str, str] | None:
    """``{"path", "sha256"}`` of the file a task class was loaded from (None for a built-in task):
    what a run folder records, so that a resume runs that same file or says that it changed."""
    module = sys.modules.get(cls.__module__)
    source = getattr(module, "__multilane_source__", None)
    return dict(source) if isinstance(source, dict) else None


class TaskFileChanged(UserError):
    """A resume's task file moved or changed since the run started; it is not run without consent."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path


def check_resume_task_file(name: str, record: dict[str, Any] | None) -> str:
    """Before a resume imports anything: the sha256 the task file ``name`` must have, or
    ``TaskFileChanged`` when the run folder does not vouch for the file as it is now."""
    path = str(user_path(name, "task file").resolve())
    recorded = record.get("path") if isinstance(record, dict) else None
    sha = record.get("sha256") if isinstance(record, dict) else None
    hint = "; to run it anyway, give it with --task (the app asks)"
    if not isinstance(recorded, str) or not isinstance(sha, str):
        raise TaskFileChanged(f"resume: the run does not record its task file's hash ({path}){hint}", path)
    if recorded != path:
        raise TaskFileChanged(f"resume: the run's task file was {recorded}, its config now names {path}{hint}", path)
    try:
        now = file_sha256(Path(path).read_bytes())
    except OSError as e:
        raise TaskFileChanged(
            f"resume: the run's task file {path} is gone or unreadable ({e.strerror or e}); it moved?{hint}", path
        ) from None
    if now != sha:
        raise TaskFileChanged(
            f"resume: the run's task file {path} changed since the run started "
            f"(sha256 {sha[:12]}… then, {now[:12]}… now){hint}",
            path,
        )
    return sha


def load_task_file(path: str | Path, expect_sha256: str | None = None) -> type[Task]:
    """Import a user's task file and return the one Task subclass it defines.

    The bytes hashed (and checked against ``expect_sha256``, when given) are the bytes that run."""
    p = check_task_file(path)
    try:
        source = read_regular_file(p, MAX_TASK_FILE_BYTES)
    except OSError as e:
        raise UserError(f"task file {p}: cannot read it ({describe_os_error(e)})") from None
    full = p.resolve()
    sha = file_sha256(source)
    if expect_sha256 is not None and sha != expect_sha256:
        raise TaskFileChanged(f"task file {full}: changed while it was being checked", str(full))
    try:
        code = compile(source, str(p), "exec")
    except SyntaxError as e:
        raise UserError(f"task file {p}: syntax error at line {e.lineno}: {e.msg}") from None
    except ValueError as e:  # NUL bytes in the source
        raise UserError(f"task file {p}: not Python source ({e})") from None
    # A module name unique to the file, so that two task files never shadow each other.
    mod_name = f"multilane_user_task_{hashlib.sha1(str(full).encode()).hexdigest()[:12]}"
    module = types.ModuleType(mod_name)
    module.__file__ = str(p)
    module.__multilane_source__ = {"path": str(full), "sha256": sha}  # type: ignore[attr-defined]
    sys.modules[mod_name] = module
    try:
        exec(code, module.__dict__)
    except (Exception, SystemExit) as e:  # sys.exit() at import is an error, not the CLI's exit
        sys.modules.pop(mod_name, None)
        line = _user_line(e, p)
        raise UserError(f"task file {p}: {type(e).__name__} while importing it{line}: {_first_line(e)}") from None
    explicit = getattr(module, "TASK", None)
    if explicit is not None:
        if inspect.isclass(explicit) and issubclass(explicit, Task):
            return _checked(explicit, p)
        raise UserError(f"task file {p}: TASK must be a subclass of multilane.engine.tasks.Task")
    mine = [o for o in vars(module).values() if inspect.isclass(o) and issubclass(o, Task) and o.__module__ == mod_name]
    found = [obj for obj in mine if not inspect.isabstract(obj)]
    if not found and mine:  # a Task subclass that misses a method: name it, not "no task"
        cls = mine[-1]
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise UserError(f"task file {p}: {cls.__name__} does not define {missing} (see examples/custom_task.py)")
    if not found:
        raise UserError(
            f"task file {p}: defines no task; subclass multilane.engine.tasks.Task (see examples/custom_task.py)"
        )
    if len(found) > 1:
        names = ", ".join(c.__name__ for c in found)
        raise UserError(f"task file {p}: defines several tasks ({names}); set TASK = <the one to train>")
    return _checked(found[0], p)


def _checked(cls: type[Task], path: Path) -> type[Task]:
    """The class attributes the engine relies on, checked before it relies on them."""
    params = getattr(cls, "Params", None)
    if not (inspect.isclass(params) and issubclass(params, BaseModel)):
        got = params.__name__ if inspect.isclass(params) else type(params).__name__
        raise UserError(f"task file {path}: {cls.__name__}.Params must be a pydantic BaseModel subclass (it is {got})")
    if not isinstance(getattr(cls, "name", None), str) or not cls.name:
        raise UserError(f"task file {path}: {cls.__name__}.name must be a non-empty string")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise UserError(f"task file {path}: {cls.__name__} does not define {missing}")
    return cls


def _is_user_class(cls: type) -> bool:
    return cls.__module__.startswith("multilane_user_task_")


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:300] if lines else "(no message)"


def _user_line(e: BaseException, path: Path) -> str:
    frames = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename) == path]
    return f" (line {frames[-1].lineno})" if frames else ""
