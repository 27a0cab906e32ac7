"""Tasks: what is trained. Built-ins (digits, linear, mlp, charlm, imagefolder, causal-lm) and the user's own Python files."""

from multilane.engine.tasks.base import ArrayData, NoParams, Task, add_token_fields, loss_weight_fn
from multilane.engine.tasks.builtin import BUILTIN_TASKS
from multilane.engine.tasks.loader import load_task_file, make_task, task_class

__all__ = [
    "BUILTIN_TASKS",
    "ArrayData",
    "NoParams",
    "Task",
    "add_token_fields",
    "load_task_file",
    "loss_weight_fn",
    "make_task",
    "task_class",
]
