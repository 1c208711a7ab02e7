"""Tests for the built-in LAMB optimizer and the ds_config optimizer factory."""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch

from microspeed.builtin.lamb import Lamb
from microspeed.builtin.optimizers import OPTIMIZER_NAMES, build_optimizer
from microspeed.errors import ConfigError

# --------------------------------------------------------------------------------------------------
# LAMB against a per-element reference
# --------------------------------------------------------------------------------------------------


def reference_lamb(
    weights: list[list[float]],
    grad_steps: list[list[list[float]]],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    max_coeff: float,
    min_coeff: float,
    max_grad_norm: float = 0.0,
    eps_inside_sqrt: bool = False,
) -> tuple[list[list[float]], list[float]]:
    """DeepSpeed's FusedLamb written out element by element in Python floats (float64).

    ``weights`` holds each tensor flattened; ``grad_steps[t][i]`` is tensor i's gradient at step t.
    Returns the final weights and the trust ratios of the last step.
    """
    beta1, beta2 = betas
    w = [list(x) for x in weights]
    m = [[0.0] * len(x) for x in weights]
    v = [[0.0] * len(x) for x in weights]
    coeffs: list[float] = []
    for t, grads in enumerate(grad_steps, start=1):
        divisor = 1.0
        if max_grad_norm > 0:
            total = 0.0
            for g_tensor in grads:
                for g in g_tensor:
                    total += g * g
            clip = (math.sqrt(total) + 1e-6) / max_grad_norm
            if clip > 1:
                divisor = clip
        if bias_correction:
            step_size = lr * math.sqrt(1 - beta2**t) / (1 - beta1**t)
        else:
            step_size = lr
        coeffs = []
        for i in range(len(w)):
            update = []
            for j in range(len(w[i])):
                g = grads[i][j] / divisor
                m[i][j] = beta1 * m[i][j] + (1 - beta1) * g
                v[i][j] = beta2 * v[i][j] + (1 - beta2) * g * g
                denom = math.sqrt(v[i][j] + eps) if eps_inside_sqrt else math.sqrt(v[i][j]) + eps
                update.append(m[i][j] / denom + weight_decay * w[i][j])
            w_norm = math.sqrt(sum(x * x for x in w[i]))
            u_norm = math.sqrt(sum(u * u for u in update))
            coeff = 1.0
            if w_norm != 0 and u_norm != 0:
                coeff = min(max(w_norm / u_norm, min_coeff), max_coeff)
            coeffs.append(coeff)
            for j in range(len(w[i])):
                w[i][j] -= step_size * coeff * update[j]
    return w, coeffs


def _random_problem(seed: int, steps: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Initial float64 weights of mixed shapes and magnitudes, and gradients for each step."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7,), (3, 5), (2, 3, 4), (1,)]
    weights = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    weights.append(torch.zeros(4, dtype=torch.float64))  # ||w|| == 0: trust ratio 1
    weights.append(100.0 * torch.randn(6, generator=gen, dtype=torch.float64))  # hits max_coeff
    weights.append(1e-4 * torch.randn(5, generator=gen, dtype=torch.float64))  # hits min_coeff
    grads = [
        [torch.randn(w.shape, generator=gen, dtype=torch.float64) for w in weights] for _ in range(steps)
    ]
    return weights, grads


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "options",
    [
        dict(weight_decay=0.0, bias_correction=True),
        dict(weight_decay=0.01, bias_correction=True),
        dict(weight_decay=0.1, bias_correction=False),
        dict(weight_decay=0.01, bias_correction=True, max_grad_norm=1.0),
        dict(weight_decay=0.01, bias_correction=True, eps_inside_sqrt=True, eps=1e-6),
        dict(weight_decay=0.0, bias_correction=False, max_coeff=0.5, min_coeff=0.1),
    ],
    ids=["plain", "wd", "wd-nobias", "clip", "eps-inside", "tight-clamp"],
)
def test_lamb_matches_reference(options: dict, dtype: torch.dtype) -> None:
    """Lamb equals the element-wise reference over several steps, in float64 and float32."""
    steps = 4
    weights, grads = _random_problem(seed=1, steps=steps)
    if options.get("max_grad_norm"):
        grads = [[5.0 * g for g in step] for step in grads]  # make sure clipping engages
    hyper = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, max_coeff=10.0, min_coeff=0.01) | options

    params = [torch.nn.Parameter(w.to(dtype, copy=True)) for w in weights]
    opt = Lamb(params, **hyper)
    first_coeffs: list[float] = []
    for step in grads:
        for p, g in zip(params, step, strict=True):
            p.grad = g.to(dtype)
        opt.step()
        first_coeffs = first_coeffs or opt.get_lamb_coeffs()

    expected_w, expected_coeffs = reference_lamb(
        [w.flatten().tolist() for w in weights],
        [[g.to(dtype).double().flatten().tolist() for g in step] for step in grads],
        **hyper,
    )
    tol = dict(atol=1e-10, rtol=1e-10) if dtype == torch.float64 else dict(atol=1e-6, rtol=1e-6)
    for p, w in zip(params, expected_w, strict=True):
        torch.testing.assert_close(p.detach().double().flatten(), torch.tensor(w, dtype=torch.float64), **tol)
    assert opt.get_lamb_coeffs() == pytest.approx(expected_coeffs, rel=1e-5)
    if hyper["max_coeff"] == 10.0 and hyper["weight_decay"] <= 0.01:  # (a decay wd bounds it by 1/wd)
        assert first_coeffs[4] == 1.0  # zero weights
        assert first_coeffs[5] == pytest.approx(10.0)
        assert first_coeffs[6] == pytest.approx(0.01)


def test_lamb_loss_scale_and_given_grad_norm() -> None:
    """Gradients still multiplied by the loss scale, with DeepSpeed's scale and grad_norms arguments."""
    weights, grads = _random_problem(seed=2, steps=3)
    hyper = dict(lr=1e-2, weight_decay=0.01, max_grad_norm=0.5)
    loss_scale = 128.0
    computed = [torch.nn.Parameter(w.clone()) for w in weights]
    given = [torch.nn.Parameter(w.clone()) for w in weights]
    opt_computed, opt_given = Lamb(computed, **hyper), Lamb(given, **hyper)
    for step in grads:
        for p, q, g in zip(computed, given, step, strict=True):
            p.grad = loss_scale * g
            q.grad = loss_scale * g
        opt_computed.step(scale=loss_scale)
        norm = math.sqrt(sum(float(g.square().sum()) for g in step)) * loss_scale
        opt_given.step(scale=loss_scale, grad_norms=[norm])
    expected_w, _ = reference_lamb(
        [w.flatten().tolist() for w in weights],
        [[g.flatten().tolist() for g in step] for step in grads],
        betas=(0.9, 0.999),
        eps=1e-8,
        bias_correction=True,
        max_coeff=10.0,
        min_coeff=0.01,
        **hyper,
    )
    for p, q, w in zip(computed, given, expected_w, strict=True):
        expected = torch.tensor(w, dtype=torch.float64)
        torch.testing.assert_close(p.detach().flatten(), expected, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(q.detach().flatten(), expected, atol=1e-10, rtol=1e-10)


def test_lamb_skips_params_without_grad_and_mixed_groups() -> None:
    """Parameters without a gradient are untouched; groups and dtypes can be mixed."""
    a = torch.nn.Parameter(torch.randn(3, 3))
    b = torch.nn.Parameter(torch.randn(4))
    c = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    opt = Lamb([{"params": [a, b]}, {"params": [c], "lr": 0.1}], lr=1e-2)
    a.grad, c.grad = torch.randn(3, 3), torch.randn(5, dtype=torch.float64)
    b_before = b.detach().clone()
    opt.step()
    assert len(opt.get_lamb_coeffs()) == 2
    assert b not in opt.state and torch.equal(b, b_before)
    assert opt.state[a]["step"] == 1 and opt.state[c]["exp_avg"].dtype == torch.float64


def test_lamb_state_dict_round_trip() -> None:
    """A Lamb restored from a state dict continues exactly like the original."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(6))
    q = torch.nn.Parameter(p.detach().clone())
    opt = Lamb([p], lr=1e-2, weight_decay=0.01)
    p.grad = torch.randn(6)
    opt.step()
    resumed = Lamb([q], lr=1e-2, weight_decay=0.01)
    q.data.copy_(p.detach())
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    grad = torch.randn(6)
    p.grad, q.grad = grad, grad.clone()
    opt.step()
    resumed.step()
    torch.testing.assert_close(p, q, atol=0, rtol=0)


def test_lamb_rejects_amsgrad_and_bad_values() -> None:
    """amsgrad=True and out-of-range values raise ValueError, as in DeepSpeed."""
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="AMSGrad"):
        Lamb(p, amsgrad=True)
    with pytest.raises(ValueError, match="learning rate"):
        Lamb(p, lr=-1.0)
    with pytest.raises(ValueError, match="min_coeff"):
        Lamb(p, min_coeff=2.0, max_coeff=1.0)


def _load_deepspeed_fused_lamb(monkeypatch: pytest.MonkeyPatch) -> tuple[type, type]:
    """DeepSpeed's FusedLamb and a pure-torch (CPU-runnable) kernel for it, or skip the test."""
    if "DS_ACCELERATOR" not in os.environ:
        monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed.ops.lamb.fused_lamb as fused_lamb
        from deepspeed.ops.op_builder.npu.fused_lamb import NPUFusedLamb
    except Exception as err:  # not installed, mid-install, or without a torch-only LAMB kernel
        pytest.skip(f"DeepSpeed's FusedLamb with a CPU-runnable kernel is not importable: {err}")
    return fused_lamb, NPUFusedLamb


@pytest.mark.parametrize("clip", [False, True])
def test_lamb_matches_deepspeed_fused_lamb(monkeypatch: pytest.MonkeyPatch, clip: bool) -> None:
    """Our Lamb against DeepSpeed's own FusedLamb driver running its pure-torch (NPU) kernel on CPU."""
    fused_lamb, kernel = _load_deepspeed_fused_lamb(monkeypatch)

    class _TorchKernelBuilder:
        def load(self) -> type:
            return kernel

    monkeypatch.setattr(fused_lamb, "FusedLambBuilder", _TorchKernelBuilder)
    weights, grads = _random_problem(seed=3, steps=4)
    weights = [w.float() for w in weights]
    hyper = dict(lr=1e-2, weight_decay=0.01, bias_correction=True, max_coeff=10.0, min_coeff=0.01)
    if clip:
        hyper["max_grad_norm"] = 1.0
    ours = [torch.nn.Parameter(w.clone()) for w in weights]
    theirs = [torch.nn.Parameter(w.clone()) for w in weights]
    opt, ref = Lamb(ours, **hyper), fused_lamb.FusedLamb(theirs, **hyper)
    for step in grads:
        for p, q, g in zip(ours, theirs, step, strict=True):
            p.grad = 4.0 * g.float()
            q.grad = 4.0 * g.float()
        if clip:
            norm = float(torch.linalg.vector_norm(torch.cat([q.grad.flatten() for q in theirs])))
            opt.step(scale=2.0, grad_norms=[norm])
            # DeepSpeed pairs grad_norms with parameters: give every parameter its group's norm.
            ref.step(scale=2.0, grad_norms=[[norm] * len(theirs)])
        else:
            opt.step(scale=2.0)
            ref.step(scale=2.0)
    for p, q in zip(ours, theirs, strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6)
    assert opt.get_lamb_coeffs() == pytest.approx(ref.get_lamb_coeffs(), rel=1e-5)


# --------------------------------------------------------------------------------------------------
# build_optimizer
# --------------------------------------------------------------------------------------------------


def _params() -> list[torch.nn.Parameter]:
    """The parameters of a small, deterministically initialised linear layer."""
    torch.manual_seed(0)
    return list(torch.nn.Linear(8, 4).parameters())


@pytest.mark.parametrize(
    ("section", "cls", "expected"),
    [
        ({"type": "Adam"}, torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999))),
        (
            {"type": "adam", "params": {"lr": 2e-3, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.01}},
            torch.optim.AdamW,
            dict(lr=2e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01),
        ),
        ({"type": "ADAMW", "params": {"lr": 1e-4}}, torch.optim.AdamW, dict(lr=1e-4, weight_decay=0.0)),
        ({"type": "Adam", "params": {"adam_w_mode": False}}, torch.optim.Adam, dict(weight_decay=0.0)),
        ({"type": "AdamW", "params": {"adam_w_mode": False}}, torch.optim.AdamW, dict(weight_decay=0.0)),
        (
            {"type": "Adam", "params": {"torch_adam": True, "bias_correction": True, "set_grad_none": True}},
            torch.optim.AdamW,
            dict(weight_decay=0.01),  # torch_adam: torch's own default, as in DeepSpeed
        ),
        (
            {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}},
            torch.optim.SGD,
            dict(lr=0.1, momentum=0.9, nesterov=True),
        ),
        ({"type": "Adagrad", "params": {"lr": 0.05, "eps": 1e-10}}, torch.optim.Adagrad, dict(lr=0.05)),
        (
            {
                "type": "LAMB",
                "params": {"lr": 1e-3, "bias_correction": False, "max_coeff": 0.3, "min_coeff": 0},
            },
            Lamb,
            dict(lr=1e-3, bias_correction=False, max_coeff=0.3, min_coeff=0, betas=(0.9, 0.999)),
        ),
        ({"type": "rmsprop", "params": {"lr": 0.01, "alpha": 0.9}}, torch.optim.RMSprop, dict(alpha=0.9)),
        ({"type": "NAdam", "params": {"betas": [0.9, 0.99]}}, torch.optim.NAdam, dict(betas=(0.9, 0.99))),
        ({"type": "radam", "params": {"lr": 0.01}}, torch.optim.RAdam, dict(lr=0.01)),
        ({"type": "Adamax", "params": {"eps": 1e-7}}, torch.optim.Adamax, dict(eps=1e-7)),
    ],
)
def test_build_optimizer_classes_and_hyperparameters(section: dict, cls: type, expected: dict) -> None:
    """Each name builds the expected class with the configured hyperparameters."""
    original = copy.deepcopy(section)
    opt = build_optimizer(_params(), section)
    assert type(opt) is cls
    for key, value in expected.items():
        assert opt.defaults[key] == value, key
        assert opt.param_groups[0][key] == value, key
    assert section == original  # the config is not modified


def test_build_optimizer_adam_uses_fused_kernel_unless_chosen() -> None:
    """Adam defaults to torch's fused kernel, but a user's kernel choice is kept."""
    assert build_optimizer(_params(), {"type": "Adam"}).defaults["fused"] is True
    chosen = build_optimizer(_params(), {"type": "Adam", "params": {"foreach": True}})
    assert chosen.defaults["fused"] is None and chosen.defaults["foreach"] is True


def test_build_optimizer_accepts_groups_and_generators() -> None:
    """Parameter groups keep their own settings; generators of parameters work."""
    model = torch.nn.Linear(3, 2)
    groups = [{"params": [model.weight], "lr": 0.5}, {"params": model.bias}]
    opt = build_optimizer(groups, {"type": "SGD", "params": {"lr": 0.1}})
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.1]
    opt = build_optimizer(model.parameters(), {"type": "Lamb"})
    assert len(opt.param_groups[0]["params"]) == 2
    known = {name.lower() for name in OPTIMIZER_NAMES}
    assert {"adam", "adamw", "sgd", "adagrad", "lamb", "rmsprop"} <= known
    assert "onebitadam" not in known


def _two_steps(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
    """Two optimizer steps with fixed random gradients."""
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


@pytest.mark.parametrize(
    ("adam_w_mode", "reference_cls", "other_cls"),
    [(None, torch.optim.AdamW, torch.optim.Adam), (False, torch.optim.Adam, torch.optim.AdamW)],
)
def test_adam_w_mode_matches_torch(adam_w_mode: bool | None, reference_cls: type, other_cls: type) -> None:
    """Type Adam is AdamW by default and L2-decay Adam with adam_w_mode=False."""
    hyper = {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.1}
    section_params = dict(hyper) if adam_w_mode is None else dict(hyper, adam_w_mode=adam_w_mode)
    kwargs = dict(hyper, betas=(0.9, 0.99), foreach=False)
    ours, ref, other = _params(), _params(), _params()
    _two_steps(build_optimizer(ours, {"type": "Adam", "params": section_params}), ours)
    _two_steps(reference_cls(ref, **kwargs), ref)
    _two_steps(other_cls(other, **kwargs), other)
    for p, q, r in zip(ours, ref, other, strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6)
        assert not torch.allclose(p, r, atol=1e-6, rtol=0)  # the two decay modes are distinguishable


@pytest.mark.parametrize(
    ("section", "fragments"),
    [
        ({"type": "Adamw2"}, ["optimizer.type", "'Adamw2'", "did you mean 'AdamW'?", "SGD", "Lamb"]),
        ({"type": "lamb_"}, ["optimizer.type", "did you mean 'Lamb'?"]),
        ({"type": "OneBitAdam"}, ["optimizer.type", "'OneBitAdam'", "microspeed-comm"]),
        ({"type": "zerooneadam"}, ["optimizer.type", "microspeed-comm"]),
        ({"type": "OneBitLamb"}, ["microspeed-comm"]),
        ({}, ["optimizer.type", "AdamW"]),
        ({"type": "Adam", "parms": {}}, ["optimizer.parms", "did you mean 'params'?"]),
        (
            {"type": "Adam", "params": {"weight_decy": 0.1}},
            ["optimizer.params.weight_decy", "did you mean 'weight_decay'?", "adam_w_mode"],
        ),
        (
            {"type": "Lamb", "params": {"max_coef": 5}},
            ["optimizer.params.max_coef", "did you mean 'max_coeff'?"],
        ),
        ({"type": "SGD", "params": {"betas": [0.9, 0.9]}}, ["optimizer.params.betas", "momentum"]),
        ({"type": "Adam", "params": {"lr": -0.1}}, ["optimizer.params.lr", "-0.1", ">= 0"]),
        ({"type": "Adam", "params": {"lr": "fast"}}, ["optimizer.params.lr", "'fast'", "a number"]),
        ({"type": "Adam", "params": {"betas": [0.9, 1.5]}}, ["optimizer.params.betas", "1.5", "[0, 1)"]),
        ({"type": "Adam", "params": {"betas": 0.9}}, ["optimizer.params.betas", "a list of 2"]),
        (
            {"type": "Adam", "params": {"adam_w_mode": "yes"}},
            ["optimizer.params.adam_w_mode", "true or false"],
        ),
        ({"type": "Adam", "params": {"bias_correction": False}}, ["optimizer.params.bias_correction"]),
        (
            {"type": "Lamb", "params": {"max_grad_norm": 1.0}},
            ["optimizer.params.max_grad_norm", "gradient_clipping"],
        ),
        ({"type": "Lamb", "params": {"amsgrad": True}}, ["optimizer.params.amsgrad", "True", "AMSGrad"]),
        ({"type": "RMSprop", "params": {"alpha": -1.0}}, ["optimizer.params.alpha", "-1.0", "Invalid alpha"]),
        ({"type": "SGD", "params": {"nesterov": True}}, ["optimizer.params.nesterov", "momentum"]),
        ({"type": "Adam", "params": {"fused": True, "foreach": True}}, ["optimizer.params.f"]),
    ],
)
def test_build_optimizer_errors_name_key_and_fix(section: dict, fragments: list[str]) -> None:
    """Each mistake raises ConfigError naming the key path, the value and the fix."""
    with pytest.raises(ConfigError) as info:
        build_optimizer(_params(), section)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_build_optimizer_rejects_non_mapping_section() -> None:
    """A section or params value of the wrong shape is a ConfigError."""
    with pytest.raises(ConfigError, match="optimizer"):
        build_optimizer(_params(), "Adam")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="optimizer.params"):
        build_optimizer(_params(), {"type": "Adam", "params": [1e-3]})
