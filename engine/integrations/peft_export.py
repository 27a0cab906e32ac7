"""``multilane export RUN --adapter DIR`` and ``--merged DIR``: a run's final model as Hugging Face tools
read it. The run's task builds its model again (the frozen base from its source, checked against the
checkpoint's hash), the checkpoint's trainable state goes into it, then:

- ``--adapter DIR``: the PEFT model's ``save_pretrained`` (``adapter_config.json`` and the adapter
  weights), which ``PeftModel.from_pretrained(base, DIR)`` loads;
- ``--merged DIR``: the adapters merged into the base (``merge_and_unload``), or a full fine-tune's model
  as it is, written by ``save_pretrained``; the tokenizer's files beside it when the base folder has them.

Each folder is written whole into a temporary sibling and renamed into place at the end, so a failure
leaves nothing behind. Bad input is one line (``UserError``), before anything is written.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from multilane.engine.config import build_config
from multilane.engine.errors import UserError
from multilane.engine.rundir.runread import CHECKPOINT, TASK_FILE, read_json
from multilane.engine.tensors import frozen
from torch import nn

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
)


def target_problem(flag: str, target: Path) -> str | None:
    """Why ``target`` cannot receive an export (it exists and is not an empty folder), or None."""
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        return f"{flag} {target} exists and is not a folder; name a new or empty folder"
    if target.is_dir() and any(target.iterdir()):
        return f"{flag} {target} exists and is not empty; name a new or empty folder (nothing is overwritten)"
    if not target.parent.is_dir():
        return f"{flag} {target}: its parent folder {target.parent} does not exist"
    return None


def find_peft(model: nn.Module) -> nn.Module | None:
    """The outermost PEFT model inside ``model`` (the task may wrap it), or None."""
    peft = sys.modules.get("peft")
    if peft is None:
        return None
    return next((m for m in model.modules() if isinstance(m, peft.PeftModel)), None)


def find_pretrained(model: nn.Module) -> nn.Module | None:
    """The outermost Hugging Face model (one with ``save_pretrained``) inside ``model``, or None."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    return next((m for m in model.modules() if isinstance(m, transformers.PreTrainedModel)), None)


def final_model(run: Path) -> tuple[nn.Module, Any, dict[str, Any]]:
    """The run's model as its last checkpoint left it, its task and the checkpoint."""
    from multilane.engine.fsdp.sharded import read_model_state
    from multilane.engine.rundir.checkpoint_file import load_checkpoint
    from multilane.engine.tasks import make_task
    from multilane.engine.tasks.loader import check_resume_task_file, is_task_file

    if not (run / CHECKPOINT).is_file():
        raise UserError(f"export: {run} has no checkpoint yet ({CHECKPOINT}): nothing to export")
    ck = load_checkpoint(run / CHECKPOINT)
    config = build_config(ck["config"], "the checkpoint's config")
    try:
        expect = None
        if is_task_file(config.task.name):  # a run folder is data: its task file runs only as recorded
            expect = check_resume_task_file(config.task.name, read_json(run / TASK_FILE))
        task = make_task(config.task.name, config.task.params, expect)
    except UserError as e:
        raise UserError(f"export: {str(e).removeprefix('resume: ')}") from None
    torch.manual_seed(config.train.seed)
    model = task.build_model()
    base = ck.get("frozen_base") if isinstance(ck.get("frozen_base"), dict) else None
    frozen.check_base(model, base, str(run / CHECKPOINT))
    state = read_model_state(run) if ck.get("sharded") else ck["model"]
    try:
        frozen.load_trainable(model, state, base)
    except Exception as e:
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        raise UserError(
            f"export: {run / CHECKPOINT}: its model state does not fit task {task.name}'s model ({reason})"
        ) from None
    return model.eval(), task, ck


def _write_into(target: Path, write: Any) -> None:
    """``write(folder)`` into a temporary sibling of ``target``, then renamed into place."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        write(tmp)
        if target.is_dir():
            target.rmdir()  # empty (checked): replaced by the written folder
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_models(run: Path, adapter: Path | None, merged: Path | None) -> list[Path]:
    """Write the run's adapter and/or merged model; the folders written. ``UserError`` (one line) when
    the run's model cannot give what is asked."""
    for flag, target in (("--adapter", adapter), ("--merged", merged)):
        problem = target_problem(flag, target) if target is not None else None
        if problem:
            raise UserError(f"export: {problem}")
    if adapter is not None and merged is not None and adapter.resolve() == merged.resolve():
        raise UserError("export: --adapter and --merged name the same folder; give each its own")
    model, task, ck = final_model(run)
    peft_model = find_peft(model)
    if adapter is not None and peft_model is None:
        raise UserError(
            f"export: --adapter: {run}'s model (task {task.name}) has no PEFT adapter (a LoRA run has one); "
            "--merged DIR writes a whole model"
        )
    whole = peft_model if peft_model is not None else find_pretrained(model)
    if merged is not None and whole is None:
        raise UserError(
            f"export: --merged: {run}'s model (task {task.name}) is not a Hugging Face model (nothing in it has "
            "save_pretrained)"
        )
    written = []
    if adapter is not None:
        _write_into(adapter, lambda d: peft_model.save_pretrained(str(d)))
        written.append(adapter)
    if merged is not None:
        source = (ck.get("frozen_base") or {}).get("source") or frozen.base_source(task, model)

        def write_merged(d: Path) -> None:
            out = whole.merge_and_unload() if whole is peft_model else whole
            out.save_pretrained(str(d))
            tokenizer = getattr(task, "tokenizer", None)  # the task's own (causal-lm), else the base folder's files
            if callable(getattr(tokenizer, "save_pretrained", None)):
                tokenizer.save_pretrained(str(d))
            else:
                _copy_tokenizer(source, d)

        _write_into(merged, write_merged)
        written.append(merged)
    return written


def _copy_tokenizer(source: str | None, folder: Path) -> None:
    """The tokenizer's files of the base folder, beside the merged model (a folder that loads alone)."""
    if not source or not Path(source).is_dir():
        return
    for name in TOKENIZER_FILES:
        with contextlib.suppress(OSError):
            if (Path(source) / name).is_file():
                shutil.copyfile(Path(source) / name, folder / name)
