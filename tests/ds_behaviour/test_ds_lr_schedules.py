"""DeepSpeed 0.19.8 behaviours of the LR schedules that DeepSpeed's own unit tests rely on.

Found by ``benchmarks/deepspeed_unit_tests.py`` (``tests/unit/runtime/test_lr_schedulers.py``); expected values
computed with DeepSpeed 0.19.8's ``deepspeed.runtime.lr_schedules`` on the same inputs.
"""

from __future__ import annotations

import logging

import pytest
import torch

from microspeed.builtin.lr_schedules import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR


def _adam() -> torch.optim.Optimizer:
    return torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=0.1, betas=(0.9, 0.999))


def _sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)


def test_onecycle_get_mom_returns_beta_pairs():
    """DeepSpeed returns one (beta1, beta2) pair per param group (its test indexes get_mom()[0][0])."""
    sched = OneCycle(_adam(), cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4, cycle_momentum=True,
                     cycle_min_mom=0.8, cycle_max_mom=0.9)
    moms = []
    for _ in range(6):
        moms.append(sched.get_mom())
        sched.step()
    # DeepSpeed: [[(0.9, b2)], [(0.875, b2)], [(0.85, b2)], [(0.825, b2)], [(0.8, b2)], [(0.825, b2)]]
    assert all(isinstance(m, list) and len(m) == 1 and isinstance(m[0], tuple) and len(m[0]) == 2 for m in moms)
    assert [m[0][0] for m in moms] == pytest.approx([0.9, 0.875, 0.85, 0.825, 0.8, 0.825])


def _onecycle_betas(opt: torch.optim.Optimizer) -> list[tuple[float, float]]:
    sched = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4, cycle_momentum=True,
                     cycle_min_mom=0.8, cycle_max_mom=0.9)
    betas = [opt.param_groups[0]["betas"]]
    for _ in range(6):
        sched.step()
        betas.append(opt.param_groups[0]["betas"])
    return betas


def test_onecycle_cycles_beta1_like_deepspeed():
    """What already agrees: the beta1 written into Adam follows DeepSpeed's triangle, step by step."""
    betas = _onecycle_betas(_adam())
    assert [b[0] for b in betas] == pytest.approx([0.8, 0.875, 0.85, 0.825, 0.8, 0.825, 0.85])


@pytest.mark.xfail(strict=True, reason="OneCycle keeps the optimizer's beta2 (0.999 here); DeepSpeed's OneCycle "
                   "writes (mom, 0.99) into Adam's betas, so Adam trains with beta2=0.99 there (match it for loss "
                   "parity, or list the difference in the README as deliberate and drop this test)")
def test_onecycle_sets_beta2_like_deepspeed():
    betas = _onecycle_betas(_adam())
    assert [b[1] for b in betas] == pytest.approx([0.99] * 7)


# DeepSpeed's log warmup over 5 steps from 0 to 0.1 (WarmupLR / WarmupCosineLR with base lr 0.1), and
# WarmupDecayLR's (same warmup, scaled by its decay over 20 steps), for steps 1..4.
_LOG_WARMUP = {
    WarmupLR: ({"warmup_max_lr": 0.1}, [0.0, 0.043068, 0.068261, 0.086135]),
    WarmupDecayLR: ({"total_num_steps": 20}, [0.0, 0.000431, 0.000683, 0.000861]),
    WarmupCosineLR: ({"total_num_steps": 20}, [0.0, 0.043068, 0.068261, 0.086135]),
}


@pytest.mark.parametrize("cls", list(_LOG_WARMUP), ids=lambda c: c.__name__)
def test_log_warmup_matches_deepspeed(cls):
    kwargs, expected = _LOG_WARMUP[cls]
    sched = cls(_sgd(), warmup_num_steps=5, warmup_type="log", **kwargs)
    lrs = []
    for _ in range(4):
        sched.step()
        lrs.append(sched.get_lr()[0])
    assert lrs == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("cls", list(_LOG_WARMUP), ids=lambda c: c.__name__)
def test_unknown_warmup_type_falls_back_to_log(cls, caplog):
    """DeepSpeed logs a warning and uses 'log' (its test_warmup_cosine_lr_unknown_warmup_type_falls_back_to_log)."""
    kwargs, expected = _LOG_WARMUP[cls]
    with caplog.at_level(logging.WARNING):
        sched = cls(_sgd(), warmup_num_steps=5, warmup_type="not_a_warmup_type", **kwargs)
    assert sched.warmup_type == "log"
    assert "not_a_warmup_type" in caplog.text
    lrs = []
    for _ in range(4):
        sched.step()
        lrs.append(sched.get_lr()[0])
    assert lrs == pytest.approx(expected, abs=1e-6)
