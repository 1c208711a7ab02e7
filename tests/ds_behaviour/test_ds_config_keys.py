"""DeepSpeed 0.19.8 config keys whose handling DeepSpeed's own unit tests pin.

Found by ``benchmarks/deepspeed_unit_tests.py`` (``tests/unit/runtime/test_ds_config_dict.py``):

* ``"bfloat16"`` is DeepSpeed's older name of the ``"bf16"`` section: ``{"bfloat16": {"enabled": true}}`` trains in
  bf16 under DeepSpeed (``get_bfloat16_config`` reads either name).
* ``gradient_allreduce_op``: ``"mean"`` (default) or ``"sum"``; anything else is refused naming the key
  ("Invalid gradient_allreduce_op. Supported operations: ['mean', 'sum']").
"""

from __future__ import annotations

import pytest
import torch

import microspeed


def _init(**extra):
    torch.manual_seed(0)
    config = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **extra}
    engine, *_ = microspeed.initialize(model=torch.nn.Linear(4, 2), config=config)
    return engine


def test_bf16_section_enables_bf16():
    assert _init(bf16={"enabled": True}).bfloat16_enabled() is True


def test_legacy_bfloat16_section_enables_bf16():
    assert _init(bfloat16={"enabled": True}).bfloat16_enabled() is True


def test_gradient_allreduce_op_mean_accepted():
    assert _init(gradient_allreduce_op="mean") is not None


@pytest.mark.xfail(strict=True, reason="gradient_allreduce_op 'sum' is refused (gradients are always averaged); "
                   "DeepSpeed 0.19.8 sums gradients across data-parallel ranks with it (refused only with ZeRO-3, "
                   "DeepCompile, ZenFlow)")
def test_gradient_allreduce_op_sum_accepted():
    assert _init(gradient_allreduce_op="sum") is not None


@pytest.mark.xfail(strict=True, reason="an invalid value is refused like any value other than 'mean' (as an "
                   "unsupported key, without naming the value or the valid choices); DeepSpeed: 'Invalid "
                   "gradient_allreduce_op. Supported operations: [mean, sum]'")
def test_gradient_allreduce_op_invalid_value_names_key_value_and_choices():
    with pytest.raises(ValueError) as info:
        _init(gradient_allreduce_op="max")
    text = str(info.value)
    assert all(word in text for word in ("gradient_allreduce_op", "max", "mean", "sum"))


@pytest.mark.xfail(strict=True, reason="zero_optimization.offload_param below stage 3 is refused (ConfigError); "
                   "DeepSpeed 0.19.8 initializes (its test_ds_initialize TestNoOptim[0] passes offload_param with "
                   "stage 0): accept it with a one-line notice that it has no effect below stage 3")
def test_offload_param_below_stage3_is_not_an_error():
    engine = _init(zero_optimization={"stage": 0, "offload_param": {"device": "cpu"}})
    assert engine is not None


def test_bf16_wins_over_the_legacy_bfloat16_section():
    """As DeepSpeed: the old name is read only when ``bf16`` is absent; then it is a notice."""
    engine = _init(bf16={"enabled": False}, bfloat16={"enabled": True})
    assert engine.bfloat16_enabled() is False
    assert any(n.startswith("bfloat16: accepted, no effect here") for n in engine.config.notices)
