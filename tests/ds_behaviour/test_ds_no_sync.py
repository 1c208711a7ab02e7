"""DeepSpeed 0.19.8's ``engine.no_sync()`` rules that DeepSpeed's own unit tests rely on.

Found by ``benchmarks/deepspeed_unit_tests.py`` (``tests/unit/runtime/test_no_sync_ctxt.py``): DeepSpeed asserts
when ``no_sync()`` is entered under ZeRO stage 2 or 3 (``AssertionError: no_sync context manager is incompatible
with gradient partitioning logic of ZeRO stage N``), on entering the block, before any backward.
"""

from __future__ import annotations

import pytest
import torch

import microspeed


def _engine(stage: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    config = {"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage}}
    engine, *_ = microspeed.initialize(model=model, config=config)
    return engine


def _loss(engine) -> torch.Tensor:
    x = torch.randn(2, 8)
    return engine(x).pow(2).mean()


@pytest.mark.parametrize("stage", [0, 1])
def test_no_sync_allowed_without_partitioned_gradients(stage):
    engine = _engine(stage)
    with engine.no_sync():
        engine.backward(_loss(engine))
    assert all(p.grad is not None for p in engine.module.parameters())


@pytest.mark.parametrize("stage", [0, 1])
def test_step_inside_no_sync_is_an_assertion(stage):
    engine = _engine(stage)
    with engine.no_sync():
        engine.backward(_loss(engine))
        with pytest.raises(AssertionError, match="It is illegal to call Engine.step\\(\\) inside no_sync"):
            engine.step()


def test_nested_no_sync_is_an_assertion():
    engine = _engine(0)
    with engine.no_sync():
        with pytest.raises(AssertionError, match="no_sync context manager reentry is unsupported"):
            with engine.no_sync():
                pass


@pytest.mark.parametrize("stage", [2, 3])
def test_no_sync_refused_on_entry_under_partitioned_gradients(stage):
    engine = _engine(stage)
    with pytest.raises(AssertionError, match="no_sync context manager is incompatible"):
        with engine.no_sync():
            pass
