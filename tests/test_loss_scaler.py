"""Loss scaling follows DeepSpeed's fp16 semantics (rule of deepspeed 0.19.8, ``DynamicLossScaler``).

Expected sequences are written by hand from the rule (see ``microspeed.builtin.loss_scaler``): on a
clean step the scale grows when ``stable = cur_iter - last_overflow_iter - 1`` is > 0 and a multiple of
the window; on an overflow it halves only once the hysteresis is down to 1.
"""

from __future__ import annotations

import math
import os
import random
import types

import pytest
import torch

from microspeed.builtin.loss_scaler import (
    BaseLossScaler,
    DynamicLossScaler,
    LossScaler,
    LossScaleUnderflowError,
    has_inf_or_nan,
    make_loss_scaler,
    overflow_across_ranks,
)
from microspeed.errors import ConfigError

T, F = True, False


def run(scaler: BaseLossScaler, pattern: list[bool]) -> list[float]:
    """Feed ``pattern`` and return the scale after each update."""
    out = []
    for overflow in pattern:
        scaler.update_scale(overflow)
        out.append(scaler.loss_scale)
    return out


def dyn(**fp16) -> DynamicLossScaler:
    scaler = make_loss_scaler(fp16)
    assert isinstance(scaler, DynamicLossScaler)
    return scaler


# ----------------------------------------------------------------------------------------- config


def test_defaults_match_deepspeed():
    s = dyn()
    assert s.loss_scale == 2.0**16
    assert (s.scale_window, s.delayed_shift, s.consecutive_hysteresis, s.min_scale) == (1000, 2, False, 1.0)
    assert (s.cur_iter, s.last_overflow_iter, s.cur_hysteresis) == (0, -1, 2)
    assert s.raise_error_at_min_scale and s.dynamic
    assert isinstance(make_loss_scaler(None), DynamicLossScaler)
    # Unrelated keys of the section are ignored.
    section = {"enabled": True, "auto_cast": False, "loss_scale": 0}
    assert isinstance(make_loss_scaler(section), DynamicLossScaler)


def test_from_config_is_the_factory():
    assert isinstance(BaseLossScaler.from_config({"loss_scale": 0}), DynamicLossScaler)
    static = LossScaler.from_config({"loss_scale": 128})
    assert isinstance(static, LossScaler) and not static.dynamic and static.loss_scale == 128.0


@pytest.mark.parametrize(
    "section, key",
    [
        ({"loss_scale": -1}, "fp16.loss_scale"),
        ({"loss_scale": True}, "fp16.loss_scale"),
        ({"loss_scale": float("inf")}, "fp16.loss_scale"),
        ({"loss_scale_window": 0}, "fp16.loss_scale_window"),
        ({"min_loss_scale": 0}, "fp16.min_loss_scale"),
        ({"hysteresis": 0}, "fp16.hysteresis"),
        ({"consecutive_hysteresis": "yes"}, "fp16.consecutive_hysteresis"),
        ({"initial_scale_power": 16.5}, "fp16.initial_scale_power"),
    ],
)
def test_bad_config_names_the_key(section, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        make_loss_scaler(section)


# ------------------------------------------------------------------------------------ (a) growth


def test_window_growth_without_overflow():
    # 2**3 = 8, window 4: cur_iter 0..3 keep 8 (stable 0..3), cur_iter 4 doubles (stable 4), 8 doubles again.
    s = dyn(initial_scale_power=3, loss_scale_window=4)
    assert run(s, [F] * 12) == [8, 8, 8, 8, 16, 16, 16, 16, 32, 32, 32, 32]
    assert s.cur_iter == 12 and s.last_overflow_iter == -1


def test_window_restarts_after_overflow_at_first_iteration():
    # Overflow at iter 0 halves (hysteresis 1); then growth at cur_iter 0 + 1 + 3 = 4, and 4 + 3 = 7.
    s = dyn(initial_scale_power=4, loss_scale_window=3, hysteresis=1)
    assert run(s, [T, F, F, F, F, F, F, F]) == [8, 8, 8, 8, 16, 16, 16, 32]


# -------------------------------------------------------------------------------- (b) hysteresis


def test_hysteresis_delays_the_first_halving():
    s = dyn(initial_scale_power=10, hysteresis=2)
    # 1st overflow: hysteresis 2 -> 1, scale kept; 2nd: halves; 3rd: still exhausted, halves again.
    assert run(s, [T]) == [1024]
    assert s.cur_hysteresis == 1 and s.last_overflow_iter == 0
    assert run(s, [T, T, F]) == [512, 256, 256]
    assert s.cur_hysteresis == 1 and s.last_overflow_iter == 2 and s.cur_iter == 4


def test_hysteresis_three_and_refill_on_growth():
    s = dyn(initial_scale_power=10, hysteresis=3, loss_scale_window=2)
    # T: h 3->2; T: h 2->1; T: halve; F (stable 0); F (stable 1); F (stable 2: grow, refill h=3);
    # T: h 3->2 (kept); T: h 2->1 (kept); T: halve.
    assert run(s, [T, T, T, F, F, F, T, T, T]) == [1024, 1024, 512, 512, 512, 1024, 1024, 1024, 512]


# ------------------------------------------------------------------ (c) consecutive_hysteresis


def test_consecutive_hysteresis_refills_on_every_clean_step():
    pattern = [T, F, T, F, T]
    on = dyn(initial_scale_power=10, hysteresis=2, consecutive_hysteresis=True)
    off = dyn(initial_scale_power=10, hysteresis=2, consecutive_hysteresis=False)
    # On: every clean step refills h to 2, so isolated overflows never halve.
    assert run(on, pattern) == [1024] * 5
    assert on.cur_hysteresis == 1
    # Off: h is only refilled on growth, so the 2nd and 3rd overflows halve.
    assert run(off, pattern) == [1024, 1024, 512, 512, 256]


def test_without_consecutive_hysteresis_growth_refills():
    s = dyn(initial_scale_power=10, hysteresis=2, loss_scale_window=2)
    # T: h->1; F stable 0; F stable 1; F stable 2 -> grow and h=2; T: h->1 kept; T: halve.
    assert run(s, [T, F, F, F, T, T]) == [1024, 1024, 1024, 2048, 2048, 1024]


# ---------------------------------------------------------------------------------- (d) floor


def test_min_loss_scale_floor_without_error():
    s = DynamicLossScaler(init_scale=8, scale_window=1000, min_scale=2, delayed_shift=1,
                          raise_error_at_min_scale=False)
    assert run(s, [T, T, T, T]) == [4, 2, 2, 2]
    s = DynamicLossScaler(init_scale=8, scale_window=1000, min_scale=3, delayed_shift=1,
                          raise_error_at_min_scale=False)
    assert run(s, [T, T, T]) == [4, 3, 3]


def test_overflow_at_min_scale_raises_by_default():
    s = dyn(initial_scale_power=3, min_loss_scale=3, hysteresis=1)
    assert run(s, [T, T]) == [4, 3]
    with pytest.raises(LossScaleUnderflowError, match="minimum"):
        s.update_scale(True)
    # With hysteresis left, an overflow at the floor only uses it up.
    s = dyn(initial_scale_power=0, min_loss_scale=1, hysteresis=2)
    assert run(s, [T]) == [1]
    with pytest.raises(LossScaleUnderflowError):
        s.update_scale(True)


# --------------------------------------------------------------------------------- (e) static


def test_static_scaler_never_changes():
    s = make_loss_scaler({"loss_scale": 128, "loss_scale_window": 1})
    assert isinstance(s, LossScaler) and not s.dynamic
    assert run(s, [T, F, T, T, F, F, F, F]) == [128] * 8
    assert s.state_dict() == {"cur_scale": 128.0}
    other = LossScaler(1.0)
    other.load_state_dict(s.state_dict())
    assert other.loss_scale == 128
    with pytest.raises(ValueError):
        LossScaler(0)


def test_scale_loss_multiplies_and_backpropagates():
    s = make_loss_scaler({"initial_scale_power": 5})
    x = torch.tensor(3.0, requires_grad=True)
    scaled = s.scale_loss(x * 2)
    assert scaled.item() == 6.0 * 32
    scaled.backward()
    assert x.grad.item() == 2.0 * 32
    assert LossScaler(4).scale_loss(torch.tensor(1.5)).item() == 6.0


# -------------------------------------------------------------------------------- (f) state


def test_state_dict_contents():
    s = dyn(initial_scale_power=10, hysteresis=2, loss_scale_window=2)
    run(s, [F, T, F])
    expected = {"cur_scale": 1024.0, "cur_iter": 3, "last_overflow_iter": 1, "cur_hysteresis": 1}
    assert s.state_dict() == expected


def test_state_dict_round_trip_continues_identically():
    cfg = {"initial_scale_power": 12, "loss_scale_window": 3, "hysteresis": 2, "min_loss_scale": 4}
    rng = random.Random(1234)
    head = [rng.random() < 0.3 for _ in range(40)]
    tail = [rng.random() < 0.3 for _ in range(80)]
    a = make_loss_scaler(cfg, raise_error_at_min_scale=False)
    run(a, head)
    saved = a.state_dict()
    b = make_loss_scaler(cfg, raise_error_at_min_scale=False)
    b.load_state_dict(dict(saved))
    assert b.state_dict() == saved
    assert run(b, tail) == run(a, tail)
    assert b.state_dict() == a.state_dict()
    with pytest.raises(KeyError, match="cur_hysteresis"):
        b.load_state_dict({"cur_scale": 1.0, "cur_iter": 0, "last_overflow_iter": -1})


# ------------------------------------------------------------------------- (g) has_inf_or_nan


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_has_inf_or_nan(dtype):
    def grads():
        # Large finite values: a sum of per-tensor maxima would overflow fp16, a max must not.
        return [torch.full((7, 3), 60000.0, dtype=dtype), torch.randn(5, dtype=dtype),
                torch.full((4, 4), -60000.0, dtype=dtype), torch.zeros(2, 2, 2, dtype=dtype)]

    assert has_inf_or_nan(grads()) is False
    for bad in (math.inf, -math.inf, math.nan):
        for i in range(4):
            g = grads()
            g[i].view(-1)[-1] = bad
            assert has_inf_or_nan(g) is True, (bad, i)


def test_has_inf_or_nan_mixed_and_edge_cases():
    finite = [torch.ones(3, dtype=torch.float16), None, torch.empty(0), torch.arange(4),
              torch.ones(2, dtype=torch.bfloat16), torch.ones(2, dtype=torch.float64) * 1e300]
    assert has_inf_or_nan(finite) is False
    assert has_inf_or_nan([]) is False
    assert has_inf_or_nan(finite + [torch.tensor([1.0, math.nan])]) is True
    sparse = torch.sparse_coo_tensor(
        torch.tensor([[0, 2]]), torch.tensor([1.0, math.inf]), (4,), check_invariants=False
    )
    assert has_inf_or_nan([torch.ones(2), sparse]) is True
    assert has_inf_or_nan(iter([torch.ones(2)])) is False  # any iterable, e.g. a generator


def test_has_inf_or_nan_syncs_once_not_per_tensor(monkeypatch):
    calls = {"n": 0}
    real_item, real_bool = torch.Tensor.item, torch.Tensor.__bool__

    def item(self):
        calls["n"] += 1
        return real_item(self)

    def as_bool(self):
        calls["n"] += 1
        return real_bool(self)

    monkeypatch.setattr(torch.Tensor, "item", item)
    monkeypatch.setattr(torch.Tensor, "__bool__", as_bool)
    tensors = [torch.randn(8) for _ in range(50)] + [torch.randn(8, dtype=torch.float16) for _ in range(50)]
    assert has_inf_or_nan(tensors) is False
    assert calls["n"] <= 1


# --------------------------------------------------------------------------------- distributed


def test_overflow_across_ranks_without_process_group():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    assert overflow_across_ranks(True) is True
    assert overflow_across_ranks(False) is False
    assert overflow_across_ranks(torch.tensor(True)) is True


def test_overflow_across_ranks_single_rank_gloo():
    dist = torch.distributed
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("torch.distributed unavailable or already initialised")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert overflow_across_ranks(True) is True
        assert overflow_across_ranks(False) is False
        assert overflow_across_ranks(torch.tensor(False)) is False
        assert overflow_across_ranks(torch.tensor(1)) is True
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ deepspeed parity


@pytest.fixture
def ds_loss_scaler(monkeypatch):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    module = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    # DeepSpeed's update_scale asks deepspeed.comm for the rank to decide whether to log; that needs an
    # initialised DeepSpeed backend, which the update rule itself does not depend on.
    monkeypatch.setattr(module, "dist", types.SimpleNamespace(get_rank=lambda: 0))
    return module


@pytest.mark.parametrize(
    "power, window, hysteresis, consecutive, min_scale, p_overflow, raise_at_min",
    [
        (8, 5, 2, False, 1, 0.2, False),
        (8, 5, 2, True, 1, 0.3, False),
        (6, 3, 1, False, 4, 0.25, False),
        (16, 7, 3, False, 1, 0.4, False),
        (4, 2, 3, True, 2, 0.5, False),
        (10, 4, 2, False, 1, 0.5, True),  # reaches the floor and raises at step 34
    ],
)
def test_parity_with_deepspeed(ds_loss_scaler, power, window, hysteresis, consecutive, min_scale,
                               p_overflow, raise_at_min):
    cfg = {"initial_scale_power": power, "loss_scale_window": window, "hysteresis": hysteresis,
           "consecutive_hysteresis": consecutive, "min_loss_scale": min_scale}
    ours = make_loss_scaler(cfg, raise_error_at_min_scale=raise_at_min)
    theirs = ds_loss_scaler.DynamicLossScaler(init_scale=2**power, scale_window=window, min_scale=min_scale,
                                              delayed_shift=hysteresis, consecutive_hysteresis=consecutive,
                                              raise_error_at_min_scale=raise_at_min)
    rng = random.Random(power * 1000 + window)
    for step in range(200):
        overflow = rng.random() < p_overflow
        try:
            theirs.update_scale(overflow)
        except Exception as exc:  # DeepSpeed raises a bare Exception at the floor
            assert "minimum" in str(exc)
            with pytest.raises(LossScaleUnderflowError):
                ours.update_scale(overflow)
            return
        ours.update_scale(overflow)
        assert ours.loss_scale == theirs.cur_scale, step
        assert (ours.cur_iter, ours.last_overflow_iter, ours.cur_hysteresis) == (
            theirs.cur_iter, theirs.last_overflow_iter, theirs.cur_hysteresis), step
    assert not raise_at_min, "this scenario is meant to reach the floor and raise"
