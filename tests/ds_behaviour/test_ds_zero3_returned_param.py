"""DeepSpeed 0.19.8's ZeRO-3 handling of a parameter a sub-module returns from its forward.

Found by ``benchmarks/deepspeed_unit_tests.py`` (``tests/unit/runtime/zero/test_zero_context_return.py``):
a module that returns its own parameter (``return out, self.bias``) hands the caller a parameter DeepSpeed
keeps ``AVAILABLE`` (whole) while the caller uses it, from the very first forward (DeepSpeed registers it as
an external parameter of the caller when the forward returns it). One process, stage 3.
"""

from __future__ import annotations

import pytest
import torch
from microspeed_zero import ZeroParamStatus

import microspeed


class _ReturnsBias(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x), self.bias


class _Caller(torch.nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.linear1 = torch.nn.Linear(dim, dim)
        self.inner = _ReturnsBias(dim, dim)
        self.seen: list[tuple[object, int]] = []

    def forward(self, x):
        out, bias = self.inner(self.linear1(x))
        self.seen.append((getattr(bias, "ds_status", None), bias.numel()))
        return (out + bias).pow(2).mean()


def _train(stage: int, steps: int = 3) -> tuple[list[float], _Caller]:
    torch.manual_seed(0)
    model = _Caller()
    config = {"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1}}
    engine, *_ = microspeed.initialize(model=model, config=config)
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        loss = engine(torch.rand(16))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, model


def test_returned_param_trains_like_stage0():
    """What already agrees: the caller's use of the returned bias gives the same losses as without ZeRO."""
    reference, _ = _train(0)
    losses, _ = _train(3)
    assert losses == pytest.approx(reference, rel=1e-5)


@pytest.mark.xfail(strict=True, reason="in the first forward the returned bias is already released (numel 0, "
                   "NOT_AVAILABLE) when the caller gets it, and only gathered again on use; DeepSpeed keeps it "
                   "AVAILABLE for the caller from the first forward (its test asserts ds_status == AVAILABLE there)")
def test_returned_param_available_in_caller_from_first_forward():
    _, model = _train(3)
    assert model.seen == [(ZeroParamStatus.AVAILABLE, 16)] * 3
