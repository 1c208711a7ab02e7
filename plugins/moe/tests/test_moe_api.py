"""The MoE layer's bad inputs and DeepSpeed's optimizer-group helpers."""

from __future__ import annotations

import pytest
import torch
from microspeed_moe.layer import MoE
from microspeed_moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

import microspeed


def _moe(**kw):
    kw.setdefault("num_experts", 4)
    return MoE(8, torch.nn.Linear(8, 8), **kw)


@pytest.mark.parametrize("kw, match", [
    (dict(k=5), r"k=5 exceeds the number of experts \(4\)"),
    (dict(k=0), r"k must be an int >= 1"),
    (dict(noisy_gate_policy="Foo"), r"noisy_gate_policy must be one of"),
    (dict(num_experts=3, ep_size=2), r"ep_size must divide num_experts"),
    (dict(capacity_factor=0), r"capacity_factor must be a finite number > 0"),
    (dict(min_capacity=-1), r"min_capacity must be an int >= 0"),
    (dict(use_tutel=True), r"use_tutel"),
    (dict(enable_expert_tensor_parallelism=True), r"enable_expert_tensor_parallelism"),
])
def test_bad_arguments_are_refused_with_the_argument_named(kw, match):
    with pytest.raises(ValueError, match=match):
        _moe(**kw)


def test_wrong_hidden_size_names_hidden_size():
    with pytest.raises(ValueError, match=r"hidden_size=8"):
        _moe()(torch.randn(2, 3, 7))


def test_forward_returns_deepspeeds_triple():
    torch.manual_seed(0)
    out, l_aux, counts = _moe(k=2)(torch.randn(2, 8, 8))
    assert out.shape == (2, 8, 8) and l_aux.dim() == 0 and counts.shape == (4,)
    assert int(counts.sum()) == 2 * 8 * 2  # every token counted at each of its k choices, before capacity


def test_split_params_into_moe_groups_keeps_settings_and_separates_experts():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), _moe(num_experts=2))
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "lr": 0.1})
    dense, experts = groups
    assert dense["moe"] is False and experts["moe"] is True and experts["name"] == "ep_size_1"
    assert all(not is_moe_param(p) for p in dense["params"]) and all(is_moe_param(p) for p in experts["params"])
    assert {g["lr"] for g in groups} == {0.1}
    assert len(dense["params"]) + len(experts["params"]) == len(list(model.parameters()))
    cut = split_params_into_different_moe_groups_for_optimizer(list(model.parameters()), max_group_size=72)
    assert len(cut) == 3  # dense, then each expert (weight 64 + bias 8 = 72 elements) in a group of its own


def test_split_groups_train_through_initialize():
    torch.manual_seed(0)
    moe = _moe(num_experts=2)
    params = split_params_into_different_moe_groups_for_optimizer({"params": list(moe.parameters())})
    opt = torch.optim.SGD(params, lr=0.1)
    engine, *_ = microspeed.initialize(model=moe, optimizer=opt, config={"train_batch_size": 1})
    x = torch.randn(4, 8)
    before = [p.detach().clone() for p in moe.parameters()]
    out, l_aux, _ = engine(x)
    engine.backward(out.square().mean() + l_aux)
    engine.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, moe.parameters(), strict=True))


@pytest.mark.parametrize("opt", ["OneBitAdam", "OneBitLamb"])
def test_onebit_with_zero_and_experts_steps_the_expert_slices_as_their_replica_groups(opt):
    """1-bit x MoE x ZeRO (refused until the partitioned exchange ran per replica group): ZeRO attaches the
    optimizer and marks the expert slices with their group (training: ``test_onebit_moe_zero``)."""
    config = {"train_batch_size": 1, "optimizer": {"type": opt, "params": {"lr": 1e-3, "freeze_step": 2}},
              "zero_optimization": {"stage": 1}}
    engine, *_ = microspeed.initialize(model=_moe(num_experts=2), config=config)
    inner = engine.plugin_state("comm").optimizer
    marked = [v for g in inner.param_groups for v in g["params"] if getattr(v, "replica_group", None) is not None]
    assert inner.partitioned and marked
    assert sum(v.numel() for v in marked) == sum(p.numel() for n, p in engine.module.named_parameters()
                                                  if "experts" in n)
