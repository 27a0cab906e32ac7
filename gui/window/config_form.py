"""The hyperparameter form, built from the engine's config schema — not laid out by hand per field.

Each field's widget follows its type (bool → checkbox, Literal → combo box, int → spin box with the
schema's bounds, float/str → line edit); its tooltip is the field's description. ``errors()``
validates the whole config and names the fields that break a rule.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from multilane.engine.config import RunConfig, describe_error
from multilane.engine.errors import UserError
from multilane.engine.tasks import BUILTIN_TASKS, task_class
from multilane.engine.tasks.loader import is_task_file
from multilane.gui.window.field_editor import INVALID_STYLE, FieldEditor
from pydantic import ValidationError
from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QVBoxLayout,
    QWidget,
)

CUSTOM = "Custom task file…"
HIDDEN = {("task", "params"), ("task", "name"), ("devices", "use"), ("devices", "weights"), ("devices", "output")}
# Sections in the order a user fills them in: how long to train first, housekeeping last.
ORDER = ["train", "data", "optim", "schedule", "run", "telemetry", "health", "tracking"]
# Fields that only some choices use: (field, the field that decides, the values it applies to).
APPLIES = {
    "optim.momentum": ("optim.name", {"sgd"}),
    "optim.nesterov": ("optim.name", {"sgd"}),
    "optim.beta1": ("optim.name", {"adam", "adamw"}),
    "optim.beta2": ("optim.name", {"adam", "adamw"}),
    "schedule.min_lr_ratio": ("schedule.kind", {"cosine"}),
    "schedule.step_size": ("schedule.kind", {"step"}),
    "schedule.gamma": ("schedule.kind", {"step"}),
    "devices.fsdp_activation_checkpointing": ("devices.strategy", {"fsdp"}),
    "devices.fsdp_cpu_offload": ("devices.strategy", {"fsdp"}),
}
# Labels shorter than the field's name, where the name would widen the whole form (its tooltip says all).
LABELS = {"devices.fsdp_activation_checkpointing": "fsdp recompute", "devices.fsdp_cpu_offload": "fsdp CPU offload"}
TITLES = {
    "devices": "Parallel strategy",
    "data": "Data",
    "optim": "Optimizer",
    "schedule": "Learning-rate schedule",
    "train": "Training",
    "telemetry": "Telemetry",
    "health": "Run health",
    "tracking": "Tracking server",
    "run": "Run",
}


_MISSING = object()


def _task_word(task: str) -> str:
    """A task as a run name says it: a task file by its stem (``/x/my_task.py`` -> ``my_task``)."""
    return Path(task).stem if is_task_file(task) else task


def follow_task_name(run_name: str, old_task: str, new_task: str) -> str:
    """The run name after the task changed: ``digits-b`` becomes ``charlm-b`` when digits gives way
    to charlm; a name that does not name the old task (``run``, ``lr-sweep``) stays as it is."""
    if not old_task or not new_task:
        return run_name
    parts = re.split(r"([-_.])", run_name)
    if old_task not in parts:
        return run_name
    candidate = "".join(new_task if p == old_task else p for p in parts)
    return candidate if re.fullmatch(r"[A-Za-z0-9._-]{1,80}", candidate) else run_name


class ConfigForm(QWidget):
    """Every section of RunConfig, plus the task; of devices only what the device picker does not own."""

    changed = Signal()

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.editors: dict[str, FieldEditor] = {}
        self.param_editors: dict[str, FieldEditor] = {}
        self.sections: dict[str, QFormLayout] = {}
        self._loading = False
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)

        task_box = QGroupBox("Task")
        self.task_form = QFormLayout(task_box)
        self.task_combo = QComboBox()
        self.task_combo.setObjectName("task.name")
        self.task_combo.addItems(list(BUILTIN_TASKS))
        self.task_combo.addItem(CUSTOM)
        self.task_combo.setToolTip(RunConfig.model_fields["task"].annotation.model_fields["name"].description)
        self.task_combo.activated.connect(self._task_chosen)
        self.task_form.addRow("task", self.task_combo)
        self.task_error = ""
        self.task_deferred = False  # a task file named by a loaded config, not imported yet
        layout.addWidget(task_box)

        sections = RunConfig.model_fields
        for section in [*ORDER, *(k for k in sections if k not in ORDER)]:
            if section == "task" or section not in sections:
                continue
            sfield = sections[section]
            box = QGroupBox(TITLES.get(section, section))
            form = QFormLayout(box)
            self.sections[section] = form
            form.setFieldGrowthPolicy(QFormLayout.AllNonFixedFieldsGrow)
            for name, field in sfield.annotation.model_fields.items():
                if (section, name) in HIDDEN:
                    continue
                ed = FieldEditor(f"{section}.{name}", field, self._changed)
                self.editors[ed.key] = ed
                form.addRow(LABELS.get(ed.key, name.replace("_", " ")), ed.row)
            layout.addWidget(box)
        layout.addStretch(1)
        self._task_name = "digits"
        self._task_params: dict[str, Any] = {}
        self.set_config(RunConfig())

    def add_row(self, section: str, label: str, widget: QWidget) -> None:
        """A field of the app's own (not the run's config) in a section's box."""
        self.sections[section].addRow(label, widget)

    # -- task ------------------------------------------------------------------------------------
    def _task_chosen(self, index: int) -> None:
        if self.task_combo.itemText(index) == CUSTOM:
            path, _ = QFileDialog.getOpenFileName(self, "Custom task file", "", "Python files (*.py)")
            if not path:
                self.task_combo.setCurrentText(self._task_name)
                return
            self.set_task(path)
        else:
            self.set_task(self.task_combo.itemText(index))
        self._changed()

    def set_task(self, name: str, params: dict[str, Any] | None = None, load: bool = True) -> None:
        """Choose a task (see ``_set_task``); a run name that names the old task follows the new one."""
        old = self._task_name
        self._set_task(name, params, load)
        ed = self.editors.get("run.name")
        if ed is not None and not self._loading and old != name:
            renamed = follow_task_name(ed.get(), _task_word(old), _task_word(name))
            if renamed != ed.get():
                ed.set(renamed)

    def _set_task(self, name: str, params: dict[str, Any] | None = None, load: bool = True) -> None:
        """Choose a task and rebuild its own hyperparameter fields from its schema.

        ``load=False`` (a preset, the remembered last config): a task *file* is not imported — that
        would run its code before the user asked for a run. Its params are kept as they are and its
        fields appear once the file is picked again; Start runs it, naming it first."""
        if self.task_combo.findText(name) < 0:
            self.task_combo.insertItem(self.task_combo.count() - 1, name)
        self.task_combo.setCurrentText(name)
        self._task_name = name
        self._task_params = dict(params or {})
        for ed in self.param_editors.values():
            self.task_form.removeRow(ed.row)
        self.param_editors.clear()
        self.task_error = ""
        self.task_deferred = not load and is_task_file(name)
        if self.task_deferred:
            self._mark_task()
            return
        try:
            cls = task_class(name)
        except UserError as e:
            self.task_error = str(e)
            self._mark_task()
            return
        self._mark_task()
        defaults = cls.Params().model_dump()
        for pname, field in cls.Params.model_fields.items():
            ed = FieldEditor(f"task.params.{pname}", field, self._changed)
            ed.set(self._task_params.get(pname, defaults.get(pname)))
            self.param_editors[pname] = ed
            self.task_form.addRow(pname.replace("_", " "), ed.row)

    def _mark_task(self) -> None:
        self.task_combo.setStyleSheet(INVALID_STYLE if self.task_error else "")
        tip = self.task_error or "Built-in task or a .py file defining a Task"
        if self.task_deferred:
            tip = f'Task file {self._task_name}: not loaded yet (it runs when you press Start); its own fields show when you pick it from this list\'s "{CUSTOM}"'
        self.task_combo.setToolTip(tip)

    # -- values ----------------------------------------------------------------------------------
    def _changed(self, *_: Any) -> None:
        self._update_applicable()
        if not self._loading:
            self.changed.emit()

    def _update_applicable(self) -> None:
        """Grey out what the chosen optimizer, schedule or budget does not use."""
        for key, (decider, values) in APPLIES.items():
            ed, choice = self.editors.get(key), self.editors.get(decider)
            if ed is not None and choice is not None:
                on = choice.get() in values
                ed.widget.setEnabled(on)
                ed.widget.setToolTip(ed.description + ("" if on else f" (not used with {decider} = {choice.get()})"))
        epochs, steps = self.editors.get("train.epochs"), self.editors.get("train.steps")
        if epochs is not None and steps is not None:
            on = steps.get() is None
            epochs.widget.setEnabled(on)
            epochs.widget.setToolTip(epochs.description + ("" if on else " (not used: steps is set)"))

    def set_config(self, cfg: RunConfig) -> None:
        self._loading = True
        try:
            data = cfg.to_dict()
            for key, ed in self.editors.items():
                section, name = key.split(".")
                ed.set(data[section][name])
            self._set_task(cfg.task.name, cfg.task.params, load=False)  # a config is data: no task file runs
        finally:
            self._loading = False
        self._update_applicable()
        self.changed.emit()

    def set_values(self, data: dict[str, Any]) -> None:
        """The form as it was (a dict from ``values()``), valid or not: what the user left in it is
        what comes back; a field that cannot take its value keeps its default."""
        self._loading = True
        try:
            for key, ed in self.editors.items():
                section, name = key.split(".")
                value = (data.get(section) or {}).get(name, _MISSING)
                if value is _MISSING:
                    continue
                try:
                    ed.set(value)
                except (TypeError, ValueError, OverflowError):
                    pass
            task = data.get("task") or {}
            if isinstance(task.get("name"), str) and task["name"]:
                params = task.get("params") if isinstance(task.get("params"), dict) else {}
                self._set_task(task["name"], params, load=False)
        finally:
            self._loading = False
        self._update_applicable()
        self.changed.emit()

    def values(self) -> dict[str, Any]:
        """The form as a nested config dict (devices.use, weights and output left to the device picker)."""
        out: dict[str, Any] = {}
        for key, ed in self.editors.items():
            section, name = key.split(".")
            out.setdefault(section, {})[name] = ed.get()
        params = {k: ed.get() for k, ed in self.param_editors.items()} if self.param_editors else self._task_params
        out["task"] = {"name": self._task_name, "params": params}
        return out

    def errors(self, full: dict[str, Any]) -> list[str]:
        """Validate a whole config dict; mark offending fields; return one line per problem."""
        for ed in [*self.editors.values(), *self.param_editors.values()]:
            ed.mark(None)
        problems = []
        if self.task_error:
            problems.append(self.task_error)
        try:
            RunConfig.model_validate(full)
        except ValidationError as e:
            for err in e.errors():
                key = ".".join(str(p) for p in err["loc"])
                one = describe_error(ValidationError.from_exception_data(e.title, [err]))  # type: ignore[arg-type]
                ed = self.editors.get(key)
                if ed is not None:
                    ed.mark(one)
                problems.append(one)
        if not self.task_error and self.param_editors:
            cls = task_class(self._task_name)
            try:
                cls.Params.model_validate(full["task"]["params"])
            except ValidationError as e:
                for err in e.errors():
                    key = str(err["loc"][0]) if err["loc"] else ""
                    one = describe_error(ValidationError.from_exception_data(e.title, [err]), "task.params")  # type: ignore[arg-type]
                    if key in self.param_editors:
                        self.param_editors[key].mark(one)
                    problems.append(one)
        return problems
