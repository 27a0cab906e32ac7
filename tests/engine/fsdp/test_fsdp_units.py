"""Which modules become FSDP units (engine/fsdp/units.py, docs/fsdp.md)."""

from __future__ import annotations

import pytest
from multilane.engine.config import build_config
from multilane.engine.errors import UserError
from multilane.engine.fsdp.units import choose_units, default_units, mixed_precision
from multilane.engine.tasks.builtin import DigitsNet, mlp
from multilane.engine.tasks.charlm import ByteGPT, CharLMParams
from torch import nn


def names(model: nn.Module, units: list[nn.Module]) -> list[str]:
    where = {id(m): n for n, m in model.named_modules()}
    return [where[id(u)] for u in units]


def test_containers_are_opened_and_each_module_holding_parameters_is_a_unit():
    m = mlp(4, 8, 2, 3)
    assert names(m, default_units(m)) == ["0", "2", "4"]  # GELUs hold nothing
    d = DigitsNet(4, 16)
    assert names(d, default_units(d)) == ["features.0", "features.2", "head.1", "head.3"]


def test_each_transformer_block_is_a_unit_also_inside_a_wrapper():
    g = ByteGPT(CharLMParams(context=16, layers=3, heads=2, width=8))
    assert names(g, default_units(g)) == ["tok", "pos", "blocks.0", "blocks.1", "blocks.2", "ln", "head"]

    class Wrapper(nn.Module):  # as Hugging Face's: a model holding the decoder that holds the layers
        def __init__(self):
            super().__init__()
            self.model, self.score = g, nn.Linear(8, 2)

    w = Wrapper()
    assert names(w, default_units(w))[2:5] == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]
    assert names(w, default_units(w))[-1] == "score"


def test_a_module_sharing_a_parameter_with_another_stays_in_the_root():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(7, 4)
            self.body = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
            self.head = nn.Linear(4, 7)
            self.head.weight = self.emb.weight

    t = Tied()
    assert names(t, default_units(t)) == ["body.0", "body.1"]
    # A module whose parameters are all its own is one unit (no stack of blocks inside to open).
    outer = nn.Sequential(t)
    assert names(outer, default_units(outer)) == ["0"]
    holder = nn.ModuleDict({"pair": nn.Module()})
    holder.pair.a, holder.pair.b = nn.Linear(2, 2), nn.Linear(2, 2)
    holder.pair.b.weight = holder.pair.a.weight
    assert names(holder, default_units(holder)) == ["pair"]


class _Task:
    name = "custom"

    def __init__(self, pick):
        self.fsdp_units = pick


def test_a_task_chooses_its_units_and_a_wrong_choice_is_one_line():
    m = mlp(4, 8, 2, 3)
    assert choose_units(_Task(lambda model: [model[0]]), m) == [m[0]]
    with pytest.raises(UserError, match="fsdp_units must return submodules of the model"):
        choose_units(_Task(lambda model: [model]), m)
    with pytest.raises(UserError, match="got Linear"):
        choose_units(_Task(lambda model: [nn.Linear(2, 2)]), m)


def test_precision_maps_to_fsdps_mixed_precision_and_fp16_is_refused_in_one_line():
    import torch

    assert mixed_precision("fp32").param_dtype is None
    bf16 = mixed_precision("bf16")
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    with pytest.raises(UserError, match="fp16's loss scaling over sharded gradients is not supported"):
        mixed_precision("fp16")


def test_fsdp_is_a_strategy_of_the_config_and_the_cli():
    assert build_config({"devices": {"strategy": "fsdp"}}).devices.strategy == "fsdp"
    from multilane.engine.cli.parser import build_parser
    from multilane.engine.cli.train import _overrides

    args = build_parser().parse_args(["train", "--strategy", "fsdp"])
    assert _overrides(args)["devices.strategy"] == "fsdp"
