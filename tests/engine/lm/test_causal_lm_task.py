"""The causal-lm task as a fine-tuner meets it: text packed with EOS between documents, the loss only where
it is due, the tokenized text cached beside the data, and each bad input refused in one line, nothing written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from lm_tiny import tiny_tokenizer
from multilane.engine.config import build_config
from multilane.engine.errors import UserError
from multilane.engine.lm.data import CACHE, IGNORE
from multilane.engine.plan.shards import shard_bytes
from multilane.engine.run.trainer import Trainer
from multilane.engine.tasks import make_task


def params(model, data, **more):
    return {"model": str(model), "data": [str(data)], "context": 16, "lora_rank": 2, **more}


def test_documents_are_packed_with_eos_between_and_loss_only_on_completions(tiny_gpt2, lm_text, tmp_path):
    (lm_text / "notes.txt").unlink()
    task = make_task("causal-lm", params(tiny_gpt2, lm_text, context=8))
    tok = task.tokenizer
    ds = task.data()
    stream = torch.cat([ds[i][0]["input_ids"][ds[i][0]["attention_mask"].bool()] for i in range(len(ds))])
    targets = torch.cat([ds[i][1] for i in range(len(ds))])
    text_ids = tok("the cat sat on the mat.")["input_ids"]
    prompt, answer = tok("one two three")["input_ids"], tok(" four five six.", add_special_tokens=False)["input_ids"]
    eos = tok.eos_token_id
    one_pair = [*text_ids, eos, *prompt, *answer, eos]
    assert stream.tolist() == (one_pair * 4)[: stream.numel()] and stream.numel() == len(one_pair) * 4 - 1
    # The target of position t is token t+1 where its loss is due: never a prompt's token.
    trained = [*([True] * (len(text_ids) + 1)), *([False] * len(prompt)), *([True] * (len(answer) + 1))] * 4
    want = [tid if ok else IGNORE for tid, ok in zip((one_pair * 4)[1:], trained[1:], strict=True)]
    assert targets[: len(want)].tolist() == want
    # Only the last sample is short: padded, its padding out of attention and out of the loss.
    inputs, target = ds[len(ds) - 1]
    real = int(inputs["attention_mask"].sum())
    assert 0 < real <= 8 and (target[real:] == IGNORE).all() and inputs["attention_mask"][:real].all()
    assert all(int(ds[i][0]["attention_mask"].sum()) == 8 for i in range(len(ds) - 1))
    assert int(task.loss_weight(None, target)) == int((target != IGNORE).sum())
    # The loss is the mean over trained tokens; perplexity and tokens/s come with the records.
    logits = torch.randn(1, 8, 200)
    assert torch.isclose(
        task.loss(logits, target[None]),
        torch.nn.functional.cross_entropy(logits[0][:real], target[:real], ignore_index=IGNORE),
    )
    assert task.loss_unit == "tokens" and task.tokens_per_sample() == 8


def test_tokenized_text_is_cached_beside_the_data_keyed_by_tokenizer_and_files(tiny_gpt2, lm_text, tmp_path):
    first = make_task("causal-lm", params(tiny_gpt2, lm_text)).data()
    (cached,) = (lm_text / CACHE).iterdir()
    saved = torch.load(cached, weights_only=True)
    assert torch.equal(saved["ids"], first.ids)
    # The same tokenizer and files, another context: the cache is read (a marked copy proves it).
    torch.save({"ids": saved["ids"].flip(0), "loss": saved["loss"]}, cached)
    again = make_task("causal-lm", params(tiny_gpt2, lm_text, context=12)).data()
    assert torch.equal(again.ids, first.ids.flip(0)) and again.context == 12
    # A file changed, or another tokenizer: tokenized again, under another key.
    with open(lm_text / "notes.txt", "a") as f:
        f.write("more text.\n")
    changed = make_task("causal-lm", params(tiny_gpt2, lm_text)).data()
    assert changed.ids.numel() > first.ids.numel() and len(list((lm_text / CACHE).iterdir())) == 2
    other = tiny_tokenizer(tmp_path / "other-tokenizer", vocab=120)
    make_task("causal-lm", params(tiny_gpt2, lm_text, tokenizer=str(other))).data()
    assert len(list((lm_text / CACHE).iterdir())) == 3


def test_frozen_weights_have_no_gradients_nor_optimizer_state_in_the_forecast(tiny_llama, lm_text):
    # fsdp's per-rank forecast (engine/plan/shards.py) of the task's own model, LoRA against full.
    lora = make_task("causal-lm", params(tiny_llama, lm_text, lora_rank=4)).build_model()
    full = make_task("causal-lm", params(tiny_llama, lm_text, lora_rank=0)).build_model()
    trainable = [q for q in lora.parameters() if q.requires_grad]
    assert trainable and all("lora_" in n for n, q in lora.named_parameters() if q.requires_grad)
    with_lora, whole = shard_bytes(lora.parameters(), 2, 0, "adam"), shard_bytes(full.parameters(), 2, 0, "adam")
    adapters = shard_bytes(trainable, 2, 0, "adam")
    assert with_lora.grads == adapters.grads and with_lora.optimizer == adapters.optimizer
    assert with_lora.params > whole.params and with_lora.grads < whole.grads / 10
    assert whole.grads == whole.params  # every weight trained: a gradient each


def _config(tmp_path, p):
    return build_config(
        {
            "run": {"runs_dir": str(tmp_path / "runs"), "name": "lm"},
            "task": {"name": "causal-lm", "params": p},
            "devices": {"use": "cpu:0"},
            "data": {"batch_size": 4, "workers": 0},
            "train": {"steps": 1},
            "telemetry": {"enabled": False},
        }
    )


def _refused(tmp_path, p) -> str:
    with pytest.raises(UserError) as e:
        Trainer(_config(tmp_path, p)).run()
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    line = str(e.value)
    assert "\n" not in line and line.startswith("task causal-lm: ") and line.count("task causal-lm") == 1, line
    return line


def test_each_bad_input_is_one_line_and_nothing_is_written(tiny_gpt2, lm_text, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    line = _refused(tmp_path, params(empty, lm_text))
    assert "config.json" in line and str(empty) in line
    big = tiny_tokenizer(tmp_path / "big-tokenizer", extra=201)
    line = _refused(tmp_path, params(tiny_gpt2, lm_text, tokenizer=str(big)))
    assert "more than the 200 embeddings" in line
    line = _refused(tmp_path, params(tiny_gpt2, lm_text, context=65))
    assert "context = 65" in line and "64 positions" in line
    weights_only = tmp_path / "no-tokenizer"
    weights_only.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(tiny_gpt2 / f, weights_only / f)
    line = _refused(tmp_path, params(weights_only, lm_text))
    assert "holds no tokenizer" in line and "task.params.tokenizer" in line
    (weights_only / "model.safetensors").write_bytes(b"not safetensors")
    line = _refused(tmp_path, params(weights_only, lm_text, tokenizer=str(tiny_gpt2)))
    assert "cannot load it" in line
    line = _refused(tmp_path, params(tiny_gpt2, lm_text, lora_targets=["q_proj"]))
    assert "'q_proj'" in line and "c_attn" in line
    shutil.rmtree(lm_text / CACHE, ignore_errors=True)  # the good text's, tokenized before the weights failed
    with open(lm_text / "pairs.jsonl", "a") as f:
        f.write(json.dumps({"prompt": "no completion"}) + "\n")
    line = _refused(tmp_path, params(tiny_gpt2, lm_text))
    assert f"{lm_text / 'pairs.jsonl'}:9:" in line and '"text"' in line
    assert not (lm_text / CACHE).exists()  # nothing tokenized was kept


@pytest.mark.slow
def test_the_cli_refuses_bad_input_with_exit_2_and_one_line(tiny_gpt2, lm_text, tmp_path):
    empty = tmp_path / "no-model"
    empty.mkdir()
    runs = tmp_path / "runs"
    for bad, words in ((f"task.params.model={empty}", "config.json"), ("task.params.context=1000", "positions")):
        cmd = [sys.executable, "-m", "multilane.engine.cli", "train", "--task", "causal-lm", "--runs-dir", str(runs)]
        cmd += ["--set", f"task.params.model={tiny_gpt2}", "--set", f"task.params.data={lm_text}", "--set", bad]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, p.stderr
        err = p.stderr.strip()
        assert len(err.splitlines()) == 1 and words in err and "Traceback" not in err, err
        assert not runs.exists() or not any(runs.iterdir())


def test_list_fields_take_a_list_or_one_string_as_a_command_line_or_a_form_gives_it():
    from multilane.engine.tasks.causal_lm import CausalLMParams

    assert CausalLMParams(data="notes.txt").data == ["notes.txt"]
    assert CausalLMParams(data='["a.txt", "b"]').data == ["a.txt", "b"]
    assert CausalLMParams(lora_targets="q_proj, v_proj").lora_targets == ["q_proj", "v_proj"]
    assert CausalLMParams(prompts="Once, upon a time").prompts == ["Once, upon a time"]
    assert CausalLMParams(lora_targets="").lora_targets == [] and CausalLMParams(data="").data == []
