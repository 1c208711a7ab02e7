"""``engine.train_batch`` / ``eval_batch`` without a pipeline: the built-in micro-batch loop."""

from __future__ import annotations

import pytest
import torch

import microspeed


class Regressor(torch.nn.Module):
    """A linear model with DeepSpeed's ``loss_fn`` attribute (inputs, labels) convention."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 1)
        self.loss_fn = torch.nn.MSELoss()

    def forward(self, x):
        return self.lin(x)


def _batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 4, generator=g), torch.randn(2, 1, generator=g)) for _ in range(n)]


def _engine(gas=2):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    return microspeed.initialize(model=Regressor(), config=cfg)[0]


def test_train_batch_equals_the_hand_written_loop():
    batches = _batches(6)
    a, b = _engine(), _engine()
    losses = [a.train_batch(iter(batches[i:i + 2])) for i in range(0, 6, 2)]
    manual = []
    for x, y in batches:
        loss = b.module.loss_fn(b(x), y)
        b.backward(loss)
        b.step()
        manual.append(loss.detach())
    assert a.global_steps == b.global_steps == 3 and a.micro_steps == b.micro_steps == 6
    for la, i in zip(losses, range(0, 6, 2), strict=True):
        torch.testing.assert_close(la, torch.stack(manual[i:i + 2]).mean())
    for pa, pb in zip(a.module.parameters(), b.module.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


def test_eval_batch_takes_no_step_and_can_return_outputs():
    e = _engine()
    before = [p.detach().clone() for p in e.module.parameters()]
    batches = _batches(2)
    loss, outs = e.eval_batch(iter(batches), return_logits=True)
    expected = torch.stack([e.module.loss_fn(e.module(x), y) for x, y in batches]).mean()
    torch.testing.assert_close(loss, expected)
    assert len(outs) == 2 and outs[0].shape == (2, 1)
    assert e.eval_batch(iter(batches), reduce_output=None)[1].shape == ()
    assert e.global_steps == 0 and all(torch.equal(p, q) for p, q in zip(e.module.parameters(), before, strict=True))


def test_train_batch_uses_set_dataiterator_and_reports_exhaustion():
    e = _engine()
    with pytest.raises(ValueError, match="no data_iter given"):
        e.train_batch()
    e.set_dataiterator(iter(_batches(3)))
    e.train_batch()
    with pytest.raises(RuntimeError, match="ran out at micro-batch 2 of 2"):
        e.train_batch()


def test_train_batch_refuses_a_non_scalar_model_output():
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    e = microspeed.initialize(model=torch.nn.Linear(4, 1), config=cfg)[0]
    with pytest.raises(TypeError, match="must return a scalar loss"):
        e.train_batch(iter([torch.randn(2, 4)]))
