"""What ZeRO tells other plugins, typed: GradientPartitioning, its roles, and the loss scaler it borrows."""

from __future__ import annotations

import pytest
import torch

import microspeed
from microspeed.plugin_api import GradientPartitioning, LossScaling, Role


def _engine(stage: int, **extra):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    config = {"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage}, **extra}
    engine, *_ = microspeed.initialize(model=model, config=config)
    return engine


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_states_gradient_partitioning_and_claims_typed_roles(stage):
    engine = _engine(stage)
    assert engine.capabilities.get(GradientPartitioning) == GradientPartitioning(
        stage=stage, keeps_replica_groups=True, config_key="zero_optimization.stage",
        disable_hint="set zero_optimization.stage to 0", sums_marked_gradients=True, honours_norm_rules=True)
    assert engine.capabilities.provider(GradientPartitioning) == "zero"
    assert engine.owner(Role.GRADIENT_REDUCTION) == "zero" and engine.owner(Role.OPTIMIZER_STEP) == "zero"
    assert not hasattr(engine.plugin_state("zero"), "supports_replica_groups")  # no attribute coordination


def test_stage_0_states_nothing_and_claims_nothing():
    engine = _engine(0)
    assert engine.capabilities.get(GradientPartitioning) is None
    assert engine.owner(Role.GRADIENT_REDUCTION) is None and engine.owner(Role.OPTIMIZER_STEP) is None
    assert engine.plugin_state("zero") is None


def test_the_loss_scaler_is_the_one_the_loss_scaling_capability_states():
    engine = _engine(2, fp16={"enabled": True, "initial_scale_power": 8})
    scaling = engine.capabilities.get(LossScaling)
    rt = engine.plugin_state("zero")
    assert scaling is not None and scaling.scaler is not None and rt.scaler is scaling.scaler
    assert rt.accumulate_fp32 is False
    x = torch.randn(2, 8).half()
    engine.backward(engine(x).float().square().mean())
    engine.step()
    assert scaling.scaler.cur_iter == 1  # ZeRO's step updated the stated scaler, the one the loss was scaled with
    assert engine.metrics["loss_scale"] == scaling.scaler.loss_scale == 2.0 ** 8


def test_fp32_accumulation_is_read_from_the_capability():
    engine = _engine(1, bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    assert engine.capabilities.get(LossScaling).accumulate_fp32 is True
    rt = engine.plugin_state("zero")
    assert rt.accumulate_fp32 is True and all(a.dtype == torch.float32 for a in rt.acc.values())
