"""Bad numbers never train silently: each test is the bad input it stops (issue 31).

* a NaN or inf loss (fp32 and bf16, with and without clipping, on one rank or on every ZeRO stage with the
  NaN on one rank only) skips the optimizer step, is counted and logged with the step number, and
  ``max_consecutive_nonfinite_steps`` such steps in a row end the job naming the step.
"""

from __future__ import annotations

import math

import pytest
import torch

import microspeed
from microspeed.errors import NonFiniteError
from microspeed.testing import run_distributed


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _config(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10_000,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, **extra}


# ------------------------------------------------------------------------ non-finite losses


def _step(engine, poison: float | None = None) -> None:
    x = torch.ones(2, 4, dtype=next(engine.module.parameters()).dtype)
    loss = engine(x).float().pow(2).mean()
    if poison is not None:
        loss = loss + poison  # the loss is NaN/inf while its gradients stay finite: only the loss shows it
    engine.backward(loss)
    engine.step()


@pytest.mark.parametrize("poison", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("clip", [0.0, 1.0], ids=["no-clip", "clip"])
@pytest.mark.parametrize("precision", [None, "bf16"], ids=["fp32", "bf16"])
def test_non_finite_loss_skips_the_step_counts_and_logs_it(precision, clip, poison, capfd):
    extra = {"gradient_clipping": clip, **({precision: {"enabled": True}} if precision else {})}
    engine, *_ = microspeed.initialize(model=_model(), config=_config(**extra))
    _step(engine)
    before = [p.detach().clone() for p in engine.module.parameters()]
    _step(engine, poison)
    assert not engine.was_step_applied()
    assert engine.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True))
    assert all(torch.isfinite(p).all() for p in engine.module.parameters())
    err = capfd.readouterr().err
    assert "optimizer step skipped" in err and "step=2" in err, err
    _step(engine)  # a finite step after it trains again
    assert engine.was_step_applied() and engine.skipped_steps == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True))
    assert all(torch.isfinite(p).all() for p in engine.module.parameters())


def test_nan_gradients_skip_the_step_too():
    engine, *_ = microspeed.initialize(model=_model(), config=_config())
    before = [p.detach().clone() for p in engine.module.parameters()]
    loss = engine(torch.ones(2, 4)).pow(2).mean() * math.nan  # loss and every gradient NaN
    engine.backward(loss)
    engine.step()
    assert (engine.was_step_applied(), engine.skipped_steps) == (False, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True))


def test_non_finite_steps_in_a_row_end_the_job_naming_the_step():
    engine, *_ = microspeed.initialize(model=_model(), config=_config(max_consecutive_nonfinite_steps=3))
    _step(engine)
    _step(engine, math.nan)
    _step(engine, math.nan)
    _step(engine)  # a good step resets the count
    _step(engine, math.nan)
    _step(engine, math.nan)
    with pytest.raises(NonFiniteError, match=r"step 7: .*3 optimizer step\(s\) in a row \(steps 5-7\).*"
                                             r"max_consecutive_nonfinite_steps=3"):
        _step(engine, math.inf)
    assert engine.skipped_steps == 5
    assert all(torch.isfinite(p).all() for p in engine.module.parameters())


# ------------------------------------------------------------------------ ZeRO on two ranks


def _zero_nan_on_one_rank() -> list:
    """Stages 1-3 (fp32 and bf16, with and without clipping) and 1-bit Adam past its warm-up (gradients stay
    local): a NaN loss on one rank alone skips the step on both ranks; two in a row end the job on both."""
    import torch.distributed as dist

    from microspeed.zero import GatheredParameters

    def weights(engine):
        params = list(engine.module.parameters())
        with GatheredParameters(params):
            return [p.detach().float().clone() for p in params]

    out = []
    onebit = {"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-2, "freeze_step": 1}}}
    for stage, precision, clip in [(1, None, 0.0), (2, "bf16", 1.0), (3, None, 1.0), (3, "bf16", 0.0), (0, "1-bit", 0)]:
        extra = {"zero_optimization": {"stage": stage}, "gradient_clipping": clip,
                 "max_consecutive_nonfinite_steps": 2, **({precision: {"enabled": True}} if precision else {})}
        if precision == "1-bit":  # no ZeRO; after the first step the gradients stay local (compressed momentum)
            extra = {"max_consecutive_nonfinite_steps": 2, **onebit}
        engine, *_ = microspeed.initialize(model=_model(), config=_config(**extra))
        _step(engine)
        before = weights(engine)
        _step(engine, math.nan if dist.get_rank() == 1 else None)
        after = weights(engine)
        skipped = (engine.was_step_applied(), engine.skipped_steps,
                   all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
                   all(torch.isfinite(w).all() for w in after))
        _step(engine)
        trained = engine.was_step_applied() and any(not torch.equal(a, b) for a, b in
                                                    zip(after, weights(engine), strict=True))
        _step(engine, math.inf if dist.get_rank() == 0 else None)
        try:
            _step(engine, math.nan if dist.get_rank() == 0 else None)
            ended = None
        except NonFiniteError as exc:
            ended = str(exc).split(":")[0]
        out.append((stage, precision, skipped, trained, ended))
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zero_stages_skip_a_nan_on_one_rank_on_every_rank():
    results = run_distributed(_zero_nan_on_one_rank, world_size=2, timeout=280)
    expected = [(stage, precision, (False, 1, True, True), True, "step 5")
                for stage, precision in [(1, None), (2, "bf16"), (3, None), (3, "bf16"), (0, "1-bit")]]
    assert results == [expected, expected]
