"""The three optimizers against plain per-tensor references written from the papers' (and DeepSpeed's) rules.

On one process the compressed all-reduce is the identity, so the references below are the
algorithms themselves: which moments update when, frozen variances, 0/1 Adam's schedules, 1-bit
LAMB's ratios. The multi-rank behaviour is tested in test_comm_engine.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from microspeed_comm import OneBitAdam, OneBitLamb, ZeroOneAdam


def _problem(seed=0):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    grads = [[torch.randn_like(p) for p in params] for _ in range(12)]
    return params, grads


def _run(opt_cls, steps, **kw):
    params, grads = _problem()
    opt = opt_cls(params, **kw)
    for t in range(steps):
        for p, g in zip(params, grads[t], strict=True):
            p.grad = g.clone()
        opt.step()
    return [p.detach().clone() for p in params], opt


def test_onebit_adam_matches_reference():
    lr, b1, b2, eps, wd, freeze = 0.01, 0.9, 0.99, 1e-8, 0.1, 4
    got, opt = _run(OneBitAdam, 10, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, freeze_step=freeze)
    params, grads = _problem()
    ps = [p.detach().clone() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    for t in range(1, 11):
        for p, m, v, g in zip(ps, ms, vs, grads[t - 1], strict=True):
            m.mul_(b1).add_((1 - b1) * g)
            if t <= freeze:  # warm-up: the variance learns; after it, frozen
                v.mul_(b2).add_((1 - b2) * g * g)
            p.sub_(lr * (m / (v.sqrt() + eps) + wd * p))
    for a, b in zip(got, ps, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert opt.global_step() == 10 and not opt.full_precision_gradients_next()


def test_onebit_adam_phase_switch():
    params, _ = _problem()
    opt = OneBitAdam(params, freeze_step=3)
    seen = []
    for _ in range(5):
        seen.append(opt.full_precision_gradients_next())
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    assert seen == [True, True, True, False, False]  # steps 1..freeze_step are the warm-up


def test_eps_inside_sqrt():
    got, _ = _run(OneBitAdam, 1, lr=0.1, eps=0.25, eps_inside_sqrt=True, freeze_step=5, betas=(0.5, 0.5))
    params, grads = _problem()
    for p, g, out in zip(params, grads[0], got, strict=True):
        m, v = 0.5 * g, 0.5 * g * g
        torch.testing.assert_close(out, p.detach() - 0.1 * m / (v + 0.25).sqrt())


def _zero_one_reference(steps, lr, b1, b2, eps, var_freeze_step, var_update_scaler, local_step_scaler,
                        local_step_clipper):
    """0/1 Adam on one process, written from the paper's Algorithm 1 with DeepSpeed's schedules."""
    params, grads = _problem()
    ps = [p.detach().clone() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    var_interval, var_counter, local_interval, local_counter, lrs = 1, 0, 1, 0, 0.0
    anchor = None
    full_steps = []
    for t in range(1, steps + 1):
        g = grads[t - 1]
        if t - 1 <= var_freeze_step:  # variance phase
            full = t % var_interval == 0
            full_steps.append(full)
            for p, m, v, gi in zip(ps, ms, vs, g, strict=True):
                if full:
                    v.mul_(b2).add_((1 - b2) * gi * gi)
                m.mul_(b1).add_((1 - b1) * gi)
                p.sub_(lr * m / (v.sqrt() + eps))
            if full:
                var_counter += 1
                if var_counter == var_update_scaler:
                    var_counter, var_interval = 0, var_interval * 2
        else:  # local steps, synchronised every local_interval steps
            if anchor is None:
                anchor = [p.clone() for p in ps]
            for p, m, v, gi in zip(ps, ms, vs, g, strict=True):
                m.mul_(b1).add_((1 - b1) * gi)
                p.sub_(lr * m / (v.sqrt() + eps))
            lrs += lr
            if t % local_interval == 0:
                for i, (p, m, v) in enumerate(zip(ps, ms, vs, strict=True)):
                    u = (p - anchor[i]) * (v.sqrt() + eps)  # averaged over one rank: itself
                    m.copy_(-u / lrs)
                    p.copy_(anchor[i] + u / (v.sqrt() + eps))
                    anchor[i] = p.clone()
                lrs = 0.0
            local_counter += 1
            if local_counter == local_step_scaler:
                local_counter, local_interval = 0, min(local_step_clipper, local_interval * 2)
    return ps, full_steps


def test_zero_one_adam_matches_reference():
    kw = {"lr": 0.01, "betas": (0.9, 0.99), "eps": 1e-8}
    sched = {"var_freeze_step": 6, "var_update_scaler": 2, "local_step_scaler": 2, "local_step_clipper": 4}
    params, grads = _problem()
    opt = ZeroOneAdam(params, **kw, **sched)
    full_seen = []
    for t in range(12):
        full_seen.append(opt.full_precision_gradients_next())
        for p, g in zip(params, grads[t], strict=True):
            p.grad = g.clone()
        opt.step()
    ref, full_steps = _zero_one_reference(12, kw["lr"], *kw["betas"], kw["eps"], **sched)
    for a, b in zip(params, ref, strict=True):
        torch.testing.assert_close(a.detach(), b, rtol=1e-5, atol=1e-6)
    # variance steps: 1, 2 (interval 1), then 4, 6 (interval 2); frozen from step 8 on
    assert full_steps == [True, True, False, True, False, True, False]
    assert full_seen == full_steps + [False] * 5
    st = opt.state[params[0]]
    assert st["local_step_interval"] == 4 and st["var_interval"] == 4


def _lamb_reference(steps, lr, b1, b2, eps, wd, freeze, max_coeff, min_coeff, coeff_beta, fmax, fmin, fth):
    params, grads = _problem()
    ps = [p.detach().clone() for p in params]
    st = [{"m": torch.zeros_like(p), "v": torch.zeros_like(p), "fresh": torch.zeros_like(p), "freeze": 0.0,
           "last": 1.0} for p in ps]
    for t in range(1, steps + 1):
        if t == freeze + 1:
            rms = [float(s["m"].norm()) / math.sqrt(p.numel()) for s, p in zip(st, ps, strict=True)]
            united = sum(rms) / len(rms)
            for s, r in zip(st, rms, strict=True):
                s["sc"] = united / r
        for p, s, g in zip(ps, st, grads[t - 1], strict=True):
            if t <= freeze:
                s["m"] = b1 * s["m"] + (1 - b1) * g
                s["v"] = b2 * s["v"] + (1 - b2) * g * g
                if t == freeze:
                    s["fresh"] = s["v"].clone()
                u = s["m"] / (s["v"].sqrt() + eps) + wd * p
                c = min(max(float(p.norm() / u.norm()), min_coeff), max_coeff)
                s["freeze"] = coeff_beta * s["freeze"] + (1 - coeff_beta) * c
                p.sub_(lr * c * u)
            else:
                last = s["m"].clone()
                s["m"] = ((b1 * s["m"] + (1 - b1) * g) * s["sc"]) / s["sc"]  # one rank: the average is itself
                ge = (s["m"] - b1 * last) / (1 - b1)
                s["fresh"] = b2 * s["fresh"] + (1 - b2) * ge * ge
                denom = s["v"].sqrt() + eps
                pre = s["m"] / denom
                u = pre + wd * p
                f = float((denom / (s["fresh"].sqrt() + eps)).max())
                ratio = min(1.0, float(pre.norm() / u.norm()))
                f = f * ratio + (1 - ratio)
                f = min(max(f, fmin), fmax)
                f = min(max(f, s["last"] * (1 - fth)), s["last"] * (1 + fth))
                s["last"] = f
                p.sub_(lr * s["freeze"] * f * u)
    return ps


def test_onebit_lamb_matches_reference():
    kw = {"lr": 0.01, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.01, "freeze_step": 5,
          "max_coeff": 0.3, "min_coeff": 0.01, "coeff_beta": 0.9, "factor_max": 4.0, "factor_min": 0.5,
          "factor_threshold": 0.1}
    got, opt = _run(OneBitLamb, 10, **kw)
    ref = _lamb_reference(10, kw["lr"], *kw["betas"], kw["eps"], kw["weight_decay"], kw["freeze_step"],
                          kw["max_coeff"], kw["min_coeff"], kw["coeff_beta"], kw["factor_max"], kw["factor_min"],
                          kw["factor_threshold"])
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert len(opt.get_lamb_coeffs()) == 2


@pytest.mark.parametrize("cls,kwargs,match", [
    (OneBitAdam, {"freeze_step": 0}, "freeze_step: must be >= 1"),
    (OneBitAdam, {"amsgrad": True}, "amsgrad"),
    (OneBitAdam, {"max_grad_norm": 1.0}, "gradient_clipping"),
    (OneBitAdam, {"comm_backend_name": "tcp"}, "comm_backend_name"),
    (OneBitAdam, {"betas": (0.9, 1.5)}, "betas"),
    (OneBitAdam, {"lr": -1.0}, "lr: must be >= 0"),
    (ZeroOneAdam, {"local_step_clipper": 0}, "local_step_clipper"),
    (ZeroOneAdam, {"var_update_scaler": 1.5}, "var_update_scaler: expected an integer"),
    (OneBitLamb, {"min_coeff": 0.5, "max_coeff": 0.1}, "max_coeff: must be >= 0.5"),
    (OneBitLamb, {"factor_min": 0.0}, "factor_min"),
])
def test_bad_arguments_name_the_argument(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_low_precision_parameters_are_refused_clearly():
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    p.grad = torch.ones_like(p)
    with pytest.raises(TypeError, match="fp32 parameters.*fp16 or bf16 section"):
        OneBitAdam([p]).step()
