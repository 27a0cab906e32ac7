"""The app's task form for ``causal-lm``: a field for each of its settings (the model folder with a folder
picker, the data with a file-or-folder picker that adds to the list, the LoRA settings, the dtype), and the
form's values are the config ``multilane train --task causal-lm --set task.params.…`` builds."""

from __future__ import annotations

import pytest

pytest.importorskip("PySide6")

from multilane.engine.cli.parser import build_parser
from multilane.engine.cli.train import _overrides
from multilane.engine.config import build_config, merge
from multilane.engine.tasks import task_class
from PySide6.QtWidgets import QCheckBox, QComboBox, QFileDialog, QToolButton

FIELDS = {
    "model",
    "tokenizer",
    "data",
    "context",
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "lora_targets",
    "gradient_checkpointing",
    "dtype",
}


def test_the_causal_lm_form_has_its_fields_and_pickers_and_writes_the_config_the_cli_builds(
    qtbot, tmp_path, monkeypatch
):
    from multilane.gui.window.config_form import ConfigForm

    form = ConfigForm()
    qtbot.addWidget(form)
    form.set_task("causal-lm")
    eds = form.param_editors
    assert set(eds) >= FIELDS, set(eds)
    assert isinstance(eds["dtype"].widget, QComboBox) and isinstance(eds["gradient_checkpointing"].widget, QCheckBox)

    model, text, more = tmp_path / "model", tmp_path / "notes.txt", tmp_path / "corpus"
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", staticmethod(lambda *a: str(model)))
    form.findChild(QToolButton, "task.params.model.browse").click()  # the folder picker
    assert eds["model"].get() == str(model)
    data_button = form.findChild(QToolButton, "task.params.data.browse")
    file_item, folder_item = data_button.menu().actions()  # a file or a folder, each added to the list
    monkeypatch.setattr(QFileDialog, "getOpenFileName", staticmethod(lambda *a: (str(text), "")))
    file_item.trigger()
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", staticmethod(lambda *a: str(more)))
    folder_item.trigger()
    assert eds["data"].get() == [str(text), str(more)]

    eds["tokenizer"].widget.setText(str(tmp_path / "tok"))
    eds["context"].widget.setValue(128)
    eds["lora_rank"].widget.setValue(16)
    eds["lora_alpha"].widget.setText("32")
    eds["lora_dropout"].widget.setText("0.05")
    eds["lora_targets"].widget.setText("q_proj, v_proj")
    eds["gradient_checkpointing"].widget.setChecked(True)
    eds["dtype"].widget.setCurrentText("bfloat16")
    eds["prompts"].widget.setText("Once upon a time, there | The end")
    values = form.values()
    assert form.errors(values) == []

    sets = [
        f"task.params.model={model}",
        f"task.params.tokenizer={tmp_path / 'tok'}",
        f'task.params.data=["{text}", "{more}"]',
        "task.params.context=128",
        "task.params.lora_rank=16",
        "task.params.lora_alpha=32",
        "task.params.lora_dropout=0.05",
        'task.params.lora_targets=["q_proj", "v_proj"]',
        "task.params.gradient_checkpointing=true",
        "task.params.dtype=bfloat16",
        'task.params.prompts=["Once upon a time, there", "The end"]',
    ]
    args = build_parser().parse_args(["train", "--task", "causal-lm", *(x for s in sets for x in ("--set", s))])
    cli = build_config(merge({}, _overrides(args)))
    mine = build_config(values)
    assert mine.task.name == cli.task.name == "causal-lm"
    params = task_class("causal-lm").Params
    assert params.model_validate(mine.task.params) == params.model_validate(cli.task.params)
    assert params.model_validate(mine.task.params).lora_targets == ["q_proj", "v_proj"]

    form.set_task("causal-lm", mine.task.params)  # a run's config shown again: the same values come back
    assert form.values()["task"]["params"] == values["task"]["params"]
