"""Tests of the fused ops of :mod:`microspeed.ops`: layer norm, bias + GELU, scale/mask/softmax and FusedAdam.

* In this process: the PyTorch paths (``MICROSPEED_OPS_BACKEND=torch``) against the references and
  ``torch.nn``/``torch.optim``, the backend choice, and bad arguments.
* In one child process: the Triton kernels, forward and backward, against float64 references (and FusedAdam
  against ``torch.optim.AdamW``/``Adam``). ``@triton.jit`` picks the interpreter (the only way to run the kernels
  on CPU tensors) when it decorates a kernel, i.e. when the op's module is first imported, and only if
  ``TRITON_INTERPRET=1`` is in the environment by then; this pytest process may already have imported the
  modules without it. So ``python test_fused_ops.py IN OUT`` runs every case of ``IN`` with ``TRITON_INTERPRET=1``
  and ``MICROSPEED_OPS_BACKEND=triton`` and saves the results in ``OUT`` (see :func:`_run_triton_cases`, at the
  bottom), and the tests here compare them, after checking that the child really ran the interpreted kernels.
"""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from microspeed.ops import _triton, fused_adam, fused_bias_gelu, fused_layernorm, fused_softmax
from microspeed.ops.fused_adam import FusedAdam
from microspeed.ops.fused_bias_gelu import bias_gelu_reference
from microspeed.ops.fused_layernorm import FusedLayerNorm, fused_layer_norm, layer_norm_reference
from microspeed.ops.fused_softmax import fused_scale_mask_softmax, softmax_reference

MODULES = (fused_layernorm, fused_bias_gelu, fused_softmax, fused_adam)

Case = dict[str, Any]

TOLERANCE = {torch.float32: {"rtol": 2e-5, "atol": 2e-5}, torch.float16: {"rtol": 2e-3, "atol": 2e-3},
             torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2}}
"""Results of each dtype (fp32 arithmetic, rounded once) against float64 references."""


@pytest.fixture
def torch_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Force the PyTorch paths, whatever this process's environment or import state."""
    monkeypatch.setenv(_triton.BACKEND_ENV, "torch")


@pytest.fixture
def auto_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the tensors choose the backend."""
    monkeypatch.delenv(_triton.BACKEND_ENV, raising=False)


# -- running and checking the differentiable ops (shared by this process and the child) -----------------------------


def _grads(out: torch.Tensor, inputs: dict[str, torch.Tensor | None], dy: torch.Tensor) -> dict[str, torch.Tensor]:
    """``out`` and the gradients of ``out`` (against upstream ``dy``) for the inputs that require grad."""
    wanted = {k: v for k, v in inputs.items() if v is not None and v.requires_grad}
    grads = torch.autograd.grad(out, list(wanted.values()), dy)
    return {"out": out.detach(), **{f"grad_{k}": g for k, g in zip(wanted, grads, strict=True)}}


def _leaf(t: torch.Tensor | None, grad: bool = True, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """A fresh leaf copy of ``t`` (in ``dtype``), requiring grad when asked."""
    return None if t is None else t.detach().to(dtype or t.dtype).clone().requires_grad_(grad)


def _run_op(case: Case, reference: bool = False) -> dict[str, torch.Tensor]:
    """Run one layer-norm / bias-GELU / softmax case through the public op (or, with ``reference``, through the
    module's reference in float64), forward and backward against the case's upstream gradient."""
    dtype = torch.float64 if reference else None
    op = case["op"]
    if op == "layer_norm":
        x, w, b = _leaf(case["x"], dtype=dtype), _leaf(case["w"], dtype=dtype), _leaf(case["b"], dtype=dtype)
        if reference:
            out = layer_norm_reference(x, w, b, case["eps"], case["shape"])
        elif case.get("module"):
            layer = FusedLayerNorm(case["shape"], eps=case["eps"], dtype=x.dtype)
            with torch.no_grad():
                layer.weight.copy_(w)
                layer.bias.copy_(b)
            out = layer(x)
            assert layer.backend == fused_layernorm.backend_for(x)
            w, b = layer.weight, layer.bias
        else:
            out = fused_layer_norm(x, w, b, case["eps"], case["shape"])
        inputs = {"x": x, "w": w, "b": b}
    elif op == "bias_gelu":
        x, b = _leaf(case["x"], dtype=dtype), _leaf(case["b"], grad=case["bias_grad"], dtype=dtype)
        fn = bias_gelu_reference if reference else fused_bias_gelu.fused_bias_gelu
        out = fn(x, b, case["approximate"])
        inputs = {"x": x, "b": b}
    else:
        x = _leaf(case["x"], dtype=dtype)
        mask = _leaf(case["mask"], grad=case["mask_grad"], dtype=dtype)
        fn = softmax_reference if reference else fused_scale_mask_softmax
        out = fn(x, case["scale"], mask, case["causal"])
        inputs = {"x": x, "mask": mask}
    return _grads(out, inputs, case["dy"].to(dtype or case["dy"].dtype))


def _assert_matches(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """The same results, each with its input's dtype and within ``dtype``'s tolerance of the float64 ones."""
    assert actual.keys() == expected.keys()
    for name, value in actual.items():
        assert value.shape == expected[name].shape, name
        assert not value.isnan().any(), f"{name}: NaN"
        torch.testing.assert_close(value.double(), expected[name].double(), **TOLERANCE[dtype], msg=name)


# -- FusedAdam cases -----------------------------------------------------------------------------------------------


def _adam_case(seed: int, shapes: list[tuple[int, ...]], steps: int, dtype: torch.dtype = torch.float32,
               adam_w_mode: bool = True, drop: tuple[tuple[int, int], ...] = (), transposed: tuple[int, ...] = ()
               ) -> Case:
    """Parameters, per-step gradients (``None`` for the ``(step, param)`` pairs in ``drop``) and two groups with
    different lr / weight decay; params in ``transposed`` are non-contiguous views."""
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    grads = [[None if (k, i) in drop else torch.randn(s, generator=g).to(dtype) for i, s in enumerate(shapes)]
             for k in range(steps)]
    half = len(shapes) // 2
    groups = [{"idx": list(range(half)), "lr": 1e-2, "weight_decay": 0.1},
              {"idx": list(range(half, len(shapes))), "lr": 3e-3, "weight_decay": 0.02, "betas": (0.8, 0.99)}]
    return {"op": "adam", "init": init, "grads": grads, "groups": groups, "adam_w_mode": adam_w_mode,
            "transposed": transposed}


def _adam_params(case: Case) -> list[torch.Tensor]:
    """Fresh leaf parameters of ``case`` (non-contiguous where asked: stored transposed)."""
    params = []
    for i, t in enumerate(case["init"]):
        p = t.t().contiguous().t() if i in case["transposed"] else t.clone()
        params.append(torch.nn.Parameter(p))
    return params


def _adam_groups(case: Case, params: list[torch.Tensor]) -> list[dict[str, Any]]:
    """The case's parameter groups over ``params``."""
    return [{**{k: v for k, v in spec.items() if k != "idx"}, "params": [params[i] for i in spec["idx"]]}
            for spec in case["groups"]]


def _run_adam(case: Case, make: Any) -> dict[str, Any]:
    """Run ``make(groups)``'s optimizer for the case's steps; the final params and states (and backends used)."""
    params = _adam_params(case)
    opt = make(_adam_groups(case, params))
    backends = set()
    for grads in case["grads"]:
        for p, grad in zip(params, grads, strict=True):
            p.grad = None if grad is None else grad.clone()
        opt.step()
        backends |= getattr(opt, "backend", set())
    states = [opt.state[p] for p in params]
    return {"params": [p.detach() for p in params], "exp_avg": [s["exp_avg"] for s in states],
            "exp_avg_sq": [s["exp_avg_sq"] for s in states], "backends": backends}


def _fused_adam(case: Case, **options: Any) -> Any:
    """A FusedAdam factory for :func:`_run_adam` with the case's mode."""
    return lambda groups: FusedAdam(groups, adam_w_mode=case["adam_w_mode"], **options)


def _torch_adam(case: Case) -> Any:
    """``torch.optim.AdamW`` (or ``Adam`` with L2 decay), single-tensor, for :func:`_run_adam`."""
    cls = torch.optim.AdamW if case["adam_w_mode"] else torch.optim.Adam
    return lambda groups: cls(groups, foreach=False)


def _simulated_adam(case: Case) -> dict[str, Any]:
    """The kernel's arithmetic in fp32 on fp16/bf16 tensors, rounding to their dtype after every step."""
    params = _adam_params(case)
    group_of = {i: spec for spec in case["groups"] for i in spec["idx"]}
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    steps = [0] * len(params)
    for grads in case["grads"]:
        for i, grad in enumerate(grads):
            if grad is None:
                continue
            steps[i] += 1
            spec = group_of[i]
            lr, wd = spec["lr"], spec["weight_decay"]
            beta1, beta2 = spec.get("betas", (0.9, 0.999))
            p32, g32, m32, v32 = params[i].detach().float(), grad.float(), m[i].float(), v[i].float()
            if case["adam_w_mode"]:
                p32 = p32 * (1 - lr * wd)
            else:
                g32 = g32 + wd * p32
            m32 = m32 + (1 - beta1) * (g32 - m32)
            v32 = v32 * beta2 + (1 - beta2) * g32 * g32
            denom = v32.sqrt() / math.sqrt(1 - beta2 ** steps[i]) + 1e-8
            p32 = p32 - lr / (1 - beta1 ** steps[i]) * (m32 / denom)
            with torch.no_grad():
                params[i].copy_(p32)
            m[i], v[i] = m32.to(m[i].dtype), v32.to(v[i].dtype)
    return {"params": [p.detach() for p in params], "exp_avg": m, "exp_avg_sq": v}


def _assert_adam_matches(actual: dict[str, Any], expected: dict[str, Any], rtol: float) -> None:
    """Every param and state agrees within ``rtol`` of the tensor's largest magnitude (and elementwise)."""
    for key in ("params", "exp_avg", "exp_avg_sq"):
        for i, (a, e) in enumerate(zip(actual[key], expected[key], strict=True)):
            assert a.dtype == e.dtype and a.shape == e.shape, (key, i)
            scale = e.double().abs().max().item()
            torch.testing.assert_close(a.double(), e.double(), rtol=rtol, atol=rtol * scale, msg=f"{key}[{i}]")


# -- in this process: the PyTorch paths ----------------------------------------------------------------------------


def test_backend_follows_the_tensor_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_triton.BACKEND_ENV, raising=False)
    for module in MODULES:
        assert module.backend_for(torch.zeros(1)) == ("triton" if module.INTERPRETED else "torch")
    monkeypatch.setenv(_triton.BACKEND_ENV, "torch")
    assert {m.backend_for(torch.zeros(1)) for m in MODULES} == {"torch"}
    monkeypatch.setenv(_triton.BACKEND_ENV, "Triton ")
    for module in MODULES:
        if module.INTERPRETED:
            assert module.backend_for(torch.zeros(1)) == "triton"
        else:
            with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
                module.backend_for(torch.zeros(1))
    monkeypatch.setenv(_triton.BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match=_triton.BACKEND_ENV):
        fused_layernorm.backend_for(torch.zeros(1))


@pytest.mark.usefixtures("torch_backend")
def test_layer_norm_torch_path_is_a_drop_in_for_nn_layer_norm() -> None:
    torch.manual_seed(0)
    ours, theirs = FusedLayerNorm((4, 6), eps=1e-6), torch.nn.LayerNorm((4, 6), eps=1e-6)
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.bias.normal_()
    ours.load_state_dict(theirs.state_dict())
    assert isinstance(ours, torch.nn.LayerNorm) and ours.backend is None
    x = torch.randn(3, 4, 6, requires_grad=True)
    y_ours, y_theirs = ours(x), theirs(x)
    assert ours.backend == "torch"
    torch.testing.assert_close(y_ours, y_theirs)
    dy = torch.randn_like(y_ours)
    torch.testing.assert_close(torch.autograd.grad(y_ours, [x, ours.weight, ours.bias], dy),
                               torch.autograd.grad(y_theirs, [x, theirs.weight, theirs.bias], dy))
    no_affine = FusedLayerNorm(6, elementwise_affine=False)
    torch.testing.assert_close(no_affine(x), F.layer_norm(x, (6,)))


@pytest.mark.usefixtures("torch_backend")
@pytest.mark.parametrize("name", ["ln-fp32", "ln-bf16-no-bias", "gelu-none-fp32", "gelu-tanh-fp16",
                                  "softmax-padding-causal-fp32", "softmax-2d-mask-bf16", "softmax-causal-fp32",
                                  "softmax-per-sample-fp32-mask-grad", "softmax-2d-mask-3d-x-fp32"])
def test_torch_paths_match_the_float64_references(name: str) -> None:
    case = _op_cases()[name]
    _assert_matches(_run_op(case), _run_op(case, reference=True), case["x"].dtype)


@pytest.mark.usefixtures("torch_backend")
def test_softmax_fully_masked_rows_give_zeros_and_zero_gradients() -> None:
    x = torch.randn(2, 1, 3, 5, requires_grad=True)
    mask = torch.zeros(2, 1, 1, 5)
    mask[1] = float("-inf")
    y = fused_scale_mask_softmax(x, 0.5, mask)
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    torch.testing.assert_close(y[0].sum(-1), torch.ones(1, 3))
    (grad,) = torch.autograd.grad(y, x, torch.randn_like(y))
    assert not grad.isnan().any() and torch.equal(grad[1], torch.zeros_like(grad[1]))


@pytest.mark.usefixtures("torch_backend")
def test_softmax_causal_matches_scaled_dot_product_attention() -> None:
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    probs = fused_scale_mask_softmax(q @ k.transpose(-1, -2), 8**-0.5, causal=True)
    torch.testing.assert_close(probs @ v, F.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.usefixtures("torch_backend")
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_foreach_path_matches_torch(adam_w_mode: bool) -> None:
    case = _adam_case(5, [(17,), (6, 40), (9000,), (3, 4)], steps=4, adam_w_mode=adam_w_mode, drop=((1, 0),),
                      transposed=(1,))
    ours = _run_adam(case, _fused_adam(case))
    assert ours["backends"] == {"torch"}
    _assert_adam_matches(ours, _run_adam(case, _torch_adam(case)), rtol=1e-6)


@pytest.mark.usefixtures("torch_backend")
def test_fused_adam_without_bias_correction_takes_the_raw_moments() -> None:
    """Step 1 without bias correction: m = 0.1 g, v = 0.001 g^2, so p -= lr * 0.1 / sqrt(0.001) * sign(g)."""
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    p.grad = torch.tensor([0.5, -4.0, 2.0])
    FusedAdam([p], lr=0.01, bias_correction=False, eps=0.0).step()
    expected = torch.tensor([1.0, -2.0, 3.0]) - 0.01 * 0.1 / math.sqrt(0.001) * torch.tensor([1.0, -1.0, 1.0])
    torch.testing.assert_close(p.detach(), expected)


def test_fused_adam_zero_grad_and_closure() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = FusedAdam([p], set_grad_none=False)
    loss = opt.step(lambda: (p * 2).sum().backward() or torch.tensor(1.5))
    assert loss.item() == 1.5 and opt.state[p]["step"] == 1 and (p < 1).all()
    opt.zero_grad()
    assert p.grad is not None and not p.grad.any()
    FusedAdam([p]).zero_grad()
    assert p.grad is None


# -- bad arguments ---------------------------------------------------------------------------------------------------

_X = torch.zeros(2, 3, 4)
BAD_CALLS: dict[str, tuple[Any, type[Exception], str]] = {
    "ln x integer": (lambda: fused_layer_norm(_X.long(), torch.ones(4)), ValueError, "x"),
    "ln x not a tensor": (lambda: fused_layer_norm([1.0], None), TypeError, "x"),
    "ln x float64": (lambda: fused_layer_norm(_X.double(), None), ValueError, "x"),
    "ln weight shape": (lambda: fused_layer_norm(_X, torch.ones(3)), ValueError, "x"),
    "ln bias shape": (lambda: fused_layer_norm(_X, torch.ones(4), torch.ones(5)), ValueError, "bias"),
    "ln eps": (lambda: fused_layer_norm(_X, None, None, eps=0.0), ValueError, "eps"),
    "ln normalized_shape": (lambda: fused_layer_norm(_X, None, None, 1e-5, (0,)), ValueError, "normalized_shape"),
    "ln module input": (lambda: FusedLayerNorm(5)(_X), ValueError, "x"),
    "gelu bias 2-D": (lambda: fused_bias_gelu.fused_bias_gelu(_X, torch.zeros(1, 4)), ValueError, "bias"),
    "gelu bias size": (lambda: fused_bias_gelu.fused_bias_gelu(_X, torch.zeros(3)), ValueError, "bias"),
    "gelu approximate": (lambda: fused_bias_gelu.fused_bias_gelu(_X, torch.zeros(4), "erf"), ValueError,
                         "approximate"),
    "gelu x integer": (lambda: fused_bias_gelu.fused_bias_gelu(_X.int(), torch.zeros(4)), ValueError, "x"),
    "softmax x 1-D": (lambda: fused_scale_mask_softmax(torch.zeros(4)), ValueError, "x"),
    "softmax bool mask": (lambda: fused_scale_mask_softmax(_X, 1.0, torch.zeros(3, 4, dtype=torch.bool)),
                          ValueError, "mask"),
    "softmax 4-D mask on 3-D x": (lambda: fused_scale_mask_softmax(_X, 1.0, torch.zeros(2, 1, 3, 4)), ValueError,
                                  "mask"),
    "softmax mask shape": (lambda: fused_scale_mask_softmax(_X[None], 1.0, torch.zeros(2, 1, 1, 4)), ValueError,
                           "mask"),
    "softmax 3-D mask": (lambda: fused_scale_mask_softmax(_X[None], 1.0, torch.zeros(1, 3, 4)), ValueError, "mask"),
    "softmax scale nan": (lambda: fused_scale_mask_softmax(_X, float("nan")), ValueError, "scale"),
    "softmax causal": (lambda: fused_scale_mask_softmax(_X, 1.0, None, "yes"), ValueError, "causal"),
    "adam amsgrad": (lambda: FusedAdam([torch.nn.Parameter(torch.ones(1))], amsgrad=True), ValueError, "amsgrad"),
    "adam lr": (lambda: FusedAdam([torch.nn.Parameter(torch.ones(1))], lr=-1.0), ValueError, "lr"),
    "adam betas": (lambda: FusedAdam([torch.nn.Parameter(torch.ones(1))], betas=(0.9, 1.0)), ValueError, "betas"),
    "adam eps": (lambda: FusedAdam([torch.nn.Parameter(torch.ones(1))], eps=-1e-8), ValueError, "eps"),
    "adam weight_decay": (lambda: FusedAdam([torch.nn.Parameter(torch.ones(1))], weight_decay=-0.1), ValueError,
                          "weight_decay"),
    "adam float64 param": (lambda: FusedAdam([torch.nn.Parameter(torch.ones(1, dtype=torch.float64))]), ValueError,
                           "params"),
}


@pytest.mark.usefixtures("auto_backend")
@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_arguments_raise_errors_naming_the_argument(name: str) -> None:
    call, error, argument = BAD_CALLS[name]
    with pytest.raises(error, match=rf"^{argument}:"):
        call()


def test_fused_adam_refuses_sparse_gradients() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        FusedAdam([p]).step()


# -- the Triton kernels, interpreted, in a child process -------------------------------------------------------------


def _ln_case(seed: int, shape: tuple[int, ...], normalized: tuple[int, ...], dtype: torch.dtype,
             weight: bool = True, bias: bool = True, module: bool = False) -> Case:
    """A layer-norm case (inputs with a nonzero mean, to exercise the centering)."""
    g = torch.Generator().manual_seed(seed)
    return {"op": "layer_norm", "x": (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype),
            "w": torch.randn(normalized, generator=g).to(dtype) if weight else None,
            "b": torch.randn(normalized, generator=g).to(dtype) if bias else None,
            "eps": 1e-5, "shape": normalized, "module": module, "dy": torch.randn(shape, generator=g).to(dtype)}


def _gelu_case(seed: int, shape: tuple[int, ...], dtype: torch.dtype, approximate: str, bias_grad: bool = True
               ) -> Case:
    """A bias-GELU case, with inputs spread over GELU's curved part and both tails."""
    g = torch.Generator().manual_seed(seed)
    return {"op": "bias_gelu", "x": (torch.randn(shape, generator=g) * 3).to(dtype),
            "b": torch.randn(shape[-1], generator=g).to(dtype), "approximate": approximate, "bias_grad": bias_grad,
            "dy": torch.randn(shape, generator=g).to(dtype)}


def _softmax_case(seed: int, shape: tuple[int, ...], dtype: torch.dtype, mask: str | None, causal: bool,
                  mask_grad: bool = False, mask_dtype: torch.dtype | None = None) -> Case:
    """A softmax case; ``mask`` is None, ``'2d'`` (T_q, T_k), ``'padding'`` (B, 1, 1, T_k; sample 0 has a fully
    masked row set, sample 1 keeps its first keys) or ``'per-sample'`` (B, 1, T_q, T_k)."""
    g = torch.Generator().manual_seed(seed)
    tq, tk = shape[-2], shape[-1]
    m = None
    if mask == "2d":
        m = torch.randn(tq, tk, generator=g)
    elif mask == "padding":
        m = torch.zeros(shape[0], 1, 1, tk)
        m[0] = float("-inf")
        m[1:, ..., tk // 2:] = float("-inf")
    elif mask == "per-sample":
        m = torch.randn(shape[0], 1, tq, tk, generator=g)
        m[..., 3:] = m[..., 3:].masked_fill(torch.rand(m[..., 3:].shape, generator=g) < 0.3, -10000.0)
    return {"op": "softmax", "x": (torch.randn(shape, generator=g) * 2).to(dtype), "scale": 0.7,
            "mask": None if m is None else m.to(mask_dtype or dtype), "mask_grad": mask_grad, "causal": causal,
            "dy": torch.randn(shape, generator=g).to(dtype)}


@functools.cache
def _op_cases() -> dict[str, Case]:
    """Every layer-norm / bias-GELU / softmax case, deterministic (the parent recomputes the references)."""
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    return {
        "ln-fp32": _ln_case(1, (3, 7, 48), (48,), f32),
        "ln-fp32-N100-many-rows": _ln_case(2, (37, 100), (100,), f32),
        "ln-fp16": _ln_case(3, (5, 64), (64,), f16),
        "ln-bf16-no-bias": _ln_case(4, (6, 40), (40,), bf16, bias=False),
        "ln-fp32-no-affine": _ln_case(5, (4, 33), (33,), f32, weight=False, bias=False),
        "ln-fp32-2d-normalized-shape-module": _ln_case(6, (3, 4, 10), (4, 10), f32, module=True),
        "gelu-none-fp32": _gelu_case(7, (3, 50, 40), f32, "none"),
        "gelu-tanh-fp32": _gelu_case(8, (300, 24), f32, "tanh"),
        "gelu-none-bf16": _gelu_case(9, (2, 70, 136), bf16, "none"),
        "gelu-tanh-fp16": _gelu_case(10, (5, 48), f16, "tanh"),
        "gelu-fp32-no-bias-grad": _gelu_case(11, (9, 20), f32, "none", bias_grad=False),
        "softmax-plain-fp32": _softmax_case(12, (2, 2, 16, 16), f32, None, False),
        "softmax-causal-fp32": _softmax_case(13, (1, 2, 24, 24), f32, None, True),
        "softmax-padding-causal-fp32": _softmax_case(14, (2, 2, 16, 20), f32, "padding", True),
        "softmax-per-sample-fp32-mask-grad": _softmax_case(15, (2, 2, 12, 24), f32, "per-sample", False,
                                                           mask_grad=True),
        "softmax-2d-mask-3d-x-fp32": _softmax_case(16, (3, 16, 20), f32, "2d", True, mask_grad=True),
        "softmax-padding-fp16-fp32-mask": _softmax_case(17, (2, 1, 16, 32), f16, "padding", False,
                                                        mask_dtype=f32),
        "softmax-2d-mask-bf16": _softmax_case(18, (2, 2, 8, 24), bf16, "2d", True),
    }


@functools.cache
def _adam_cases() -> dict[str, Case]:
    """The FusedAdam cases: fp32 against torch (several groups, a tensor over two chunks, a skipped gradient, a
    non-contiguous parameter), and fp16/bf16 parameters against the simulated fp32 arithmetic."""
    shapes = [(33,), (7, 30), (9000,), (4, 5)]
    return {
        "adamw-fp32": _adam_case(20, shapes, steps=3, drop=((1, 3),), transposed=(1,)),
        "adam-l2-fp32": _adam_case(21, shapes, steps=3, adam_w_mode=False),
        "adamw-bf16": _adam_case(22, [(40,), (3, 50)], steps=3, dtype=torch.bfloat16),
        "adamw-fp16": _adam_case(23, [(40,), (3, 50)], steps=3, dtype=torch.float16),
    }


def _child_env(**extra: str) -> dict[str, str]:
    """This process's environment without the backend settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", _triton.BACKEND_ENV)}
    return {**env, **extra}


@pytest.fixture(scope="module")
def triton_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run every Triton case in one interpreted child process; its results by case name."""
    pytest.importorskip("triton", reason="triton is not installed: the kernels cannot be compared")
    folder = tmp_path_factory.mktemp("fused_ops")
    inputs, outputs = folder / "inputs.pt", folder / "outputs.pt"
    torch.save({"ops": _op_cases(), "adam": _adam_cases()}, inputs)
    done = subprocess.run([sys.executable, __file__, str(inputs), str(outputs)], capture_output=True, text=True,
                          env=_child_env(TRITON_INTERPRET="1", **{_triton.BACKEND_ENV: "triton"}), timeout=600)
    assert done.returncode == 0, f"the interpreted Triton run failed:\n{done.stdout}\n{done.stderr}"
    return torch.load(outputs, weights_only=False)


@pytest.mark.slow
def test_the_child_ran_the_interpreted_triton_kernels(triton_results: dict[str, Any]) -> None:
    assert triton_results["meta"] == {m.__name__: ("triton", True) for m in MODULES}
    assert all(triton_results["adam"][name]["backends"] == {"triton", "torch"} if case["transposed"]
               else triton_results["adam"][name]["backends"] == {"triton"}
               for name, case in _adam_cases().items())


@pytest.mark.parametrize("name", list(_op_cases()))
def test_triton_kernels_match_the_references(triton_results: dict[str, Any], name: str) -> None:
    case = _op_cases()[name]
    _assert_matches(triton_results["ops"][name], _run_op(case, reference=True), case["x"].dtype)


@pytest.mark.parametrize("name", list(_adam_cases()))
def test_triton_fused_adam_matches(triton_results: dict[str, Any], name: str) -> None:
    case = _adam_cases()[name]
    dtype = case["init"][0].dtype
    if dtype == torch.float32:  # the same fp32 arithmetic as torch's, up to rounding
        _assert_adam_matches(triton_results["adam"][name], _run_adam(case, _torch_adam(case)), rtol=1e-6)
    else:  # fp16/bf16 storage, fp32 arithmetic: one rounding per step, which may land one ulp apart
        _assert_adam_matches(triton_results["adam"][name], _simulated_adam(case),
                             rtol={torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype])


def _run_triton_cases(inputs: str, outputs: str) -> None:
    """The child process: run every case of ``inputs`` through the (interpreted) kernels, save to ``outputs``."""
    assert all(m.INTERPRETED for m in MODULES), "TRITON_INTERPRET=1 must be set before the ops are imported"
    cases = torch.load(inputs, weights_only=False)
    results: dict[str, Any] = {
        "ops": {name: _run_op(case) for name, case in cases["ops"].items()},
        "adam": {name: _run_adam(case, _fused_adam(case)) for name, case in cases["adam"].items()},
        "meta": {m.__name__: (m.backend_for(torch.zeros(1)), m.INTERPRETED) for m in MODULES},
    }
    torch.save(results, outputs)


if __name__ == "__main__":
    _run_triton_cases(sys.argv[1], sys.argv[2])
