"""Tests of the block-sparse ops: the Triton :class:`MatMul` (sdd/dsd/dds) and :class:`Softmax`, forward and
backward, against the PyTorch references of :mod:`microspeed_sparse_attn.blocksparse_reference` (themselves
checked against explicit loops here), plus sdd -> softmax -> dsd against dense attention on the layout's mask.

Why a child process: ``@triton.jit`` picks the interpreter (the only way to run the kernels on CPU tensors) when it
decorates them, i.e. when ``microspeed_sparse_attn.matmul`` is first imported, and only if ``TRITON_INTERPRET=1``
is in the environment by then. This pytest process may already have imported the kernels (or Triton) without it,
so every Triton case runs in one ``python test_blocksparse_ops.py OUT`` started with ``TRITON_INTERPRET=1`` (see
``_run_triton_cases`` at the bottom), which rebuilds each case's inputs from its seed, runs it forward and backward
and saves the results in ``OUT``; the tests here run the same inputs through the references in float64 and
compare. Argument checks need no kernel and run in this process.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from microspeed_sparse_attn import blocksparse_reference as ref
from microspeed_sparse_attn.matmul import MatMul
from microspeed_sparse_attn.softmax import Softmax

PACKAGE_ROOT = str(Path(ref.__file__).resolve().parents[1])  # the folder holding microspeed_sparse_attn/

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# Each case: op, then its shape and options. op "sdd"/"dsd"/"dds" (MatMul), "softmax", "attention" (sdd ->
# softmax -> dsd). Defaults: dtype fp32, block 16, batch 2, heads 2, seq 64, dim 16, no transposes. Softmax
# options: scale, rpe ("2d", "3d"), kpm / attn ("add", "mul"), causal, dead (batch entry 0 fully masked), grad
# (the additive rpe / masks require grad).
CASES: dict[str, dict[str, Any]] = {
    # sdd: a (B,H,M,K) @ b (B,H,K,N) kept on the layout
    "sdd-qkT": {"op": "sdd", "trans_b": True},
    "sdd-plain": {"op": "sdd", "dim": 24},  # inner size not a power of two: the masked tail
    "sdd-trans-a": {"op": "sdd", "trans_a": True},
    "sdd-trans-ab-b32": {"op": "sdd", "trans_a": True, "trans_b": True, "block": 32, "seq": 128, "heads": 1},
    "sdd-fp16-b32": {"op": "sdd", "trans_b": True, "dtype": F16, "block": 32, "seq": 128, "dim": 32},
    "sdd-bf16": {"op": "sdd", "trans_b": True, "dtype": BF16},
    "sdd-b64": {"op": "sdd", "trans_b": True, "block": 64, "seq": 128, "batch": 1},
    "sdd-b128-fp16": {"op": "sdd", "block": 128, "seq": 128, "batch": 1, "heads": 1, "dtype": F16},
    # dsd: sparse a @ dense b
    "dsd-pv": {"op": "dsd"},
    "dsd-trans-a": {"op": "dsd", "trans_a": True, "dim": 24},
    "dsd-trans-b": {"op": "dsd", "trans_b": True},
    "dsd-trans-ab-b32": {"op": "dsd", "trans_a": True, "trans_b": True, "block": 32, "seq": 128, "heads": 1},
    "dsd-fp16": {"op": "dsd", "dtype": F16, "dim": 32},
    "dsd-bf16-b32": {"op": "dsd", "dtype": BF16, "block": 32, "seq": 128, "batch": 1},
    "dsd-b64-bf16": {"op": "dsd", "block": 64, "seq": 128, "batch": 1, "dtype": BF16},
    "dsd-b128": {"op": "dsd", "block": 128, "seq": 128, "batch": 1, "heads": 1, "trans_a": True},
    # dds: dense a @ sparse b
    "dds-plain": {"op": "dds", "dim": 24},
    "dds-trans-a": {"op": "dds", "trans_a": True},
    "dds-trans-b": {"op": "dds", "trans_b": True},
    "dds-trans-ab-b32": {"op": "dds", "trans_a": True, "trans_b": True, "block": 32, "seq": 128, "heads": 1},
    "dds-fp16-trans-b": {"op": "dds", "dtype": F16, "trans_b": True},
    "dds-bf16": {"op": "dds", "dtype": BF16},
    "dds-b64-fp16": {"op": "dds", "block": 64, "seq": 128, "batch": 1, "dtype": F16},
    "dds-b128": {"op": "dds", "block": 128, "seq": 128, "batch": 1, "heads": 1, "trans_b": True},
    # softmax
    "softmax-plain": {"op": "softmax"},
    "softmax-scale": {"op": "softmax", "scale": 0.37},
    "softmax-rpe-2d": {"op": "softmax", "rpe": "2d", "scale": 0.5},
    "softmax-rpe-3d-grad": {"op": "softmax", "rpe": "3d", "grad": True},
    "softmax-kpm-add": {"op": "softmax", "kpm": "add"},
    "softmax-kpm-mul": {"op": "softmax", "kpm": "mul"},
    "softmax-attn-add-2d": {"op": "softmax", "attn": "add"},
    "softmax-attn-mul-3d": {"op": "softmax", "attn": "mul3d"},
    "softmax-masks-add-grad": {"op": "softmax", "kpm": "add", "attn": "add", "grad": True, "scale": 0.8},
    "softmax-causal": {"op": "softmax", "causal": True},
    "softmax-dead-row": {"op": "softmax", "kpm": "mul", "dead": True, "causal": True},
    "softmax-fp16-all": {"op": "softmax", "dtype": F16, "rpe": "3d", "kpm": "mul", "attn": "add", "causal": True},
    "softmax-bf16-b32": {"op": "softmax", "dtype": BF16, "block": 32, "seq": 128, "scale": 0.25, "rpe": "2d"},
    "softmax-b64": {"op": "softmax", "block": 64, "seq": 128, "batch": 1, "attn": "mul3d"},
    "softmax-b128-causal": {"op": "softmax", "block": 128, "seq": 128, "batch": 1, "heads": 1, "causal": True},
    # end to end
    "attention": {"op": "attention", "scale": 0.25},
    "attention-causal-kpm-dead": {"op": "attention", "causal": True, "kpm": "mul", "dead": True, "dim": 32},
    "attention-fp16-b32": {"op": "attention", "dtype": F16, "block": 32, "seq": 128, "dim": 32, "scale": 0.18,
                           "rpe": "3d", "attn": "add"},
    "attention-bf16": {"op": "attention", "dtype": BF16, "kpm": "add", "scale": 0.25},
    "attention-b64": {"op": "attention", "block": 64, "seq": 128, "batch": 1, "causal": True, "scale": 0.25},
}

TOLERANCE = {F32: 1e-5, F16: 4e-3, BF16: 3e-2}
"""Largest error allowed, relative to ``max(1, max |reference|)``: fp32 sums in another order; half results round
to their own type (an ulp is 1e-3 in fp16 and 8e-3 in bf16 near 1) after fp32 accumulation."""


# -- case inputs -----------------------------------------------------------------------------------------------------


def _spec(name: str) -> dict[str, Any]:
    """A case with its defaults filled in."""
    spec = {"dtype": F32, "block": 16, "batch": 2, "heads": 2, "seq": 64, "dim": 16, "trans_a": False,
            "trans_b": False, "scale": 1.0, "causal": False, "grad": False, "dead": False}
    spec.update(CASES[name])
    return spec


def _layout(heads: int, blocks: int, generator: torch.Generator) -> torch.Tensor:
    """A random layout (about half the tiles) keeping the diagonal, with head 0's block row 1 and block column 2
    empty when there are enough blocks (rows and columns with no tile)."""
    layout = (torch.rand(heads, blocks, blocks, generator=generator) < 0.5).long()
    layout[:, torch.arange(blocks), torch.arange(blocks)] = 1
    if blocks >= 3:
        layout[0, 1, :] = 0
        layout[0, :, 2] = 0
    return layout


@functools.cache
def _inputs(name: str) -> dict[str, Any]:
    """The case's layout, differentiable inputs (by name, in order), mask keyword arguments and upstream gradient,
    all made from one seed so the child process rebuilds exactly the same tensors."""
    spec = _spec(name)
    g = torch.Generator().manual_seed(1000 + list(CASES).index(name))
    dtype, block, batch, heads, seq, dim = (spec[k] for k in ("dtype", "block", "batch", "heads", "seq", "dim"))
    layout = _layout(heads, seq // block, g)
    nnz = int(layout.sum())

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    def dense(rows: int, cols: int, trans: bool) -> torch.Tensor:
        return randn(batch, heads, cols, rows) if trans else randn(batch, heads, rows, cols)

    sparse = randn(batch, nnz, block, block)
    op = spec["op"]
    if op == "sdd":
        tensors = {"a": dense(seq, dim, spec["trans_a"]), "b": dense(dim, seq, spec["trans_b"])}
        upstream = randn(batch, nnz, block, block)
    elif op == "dsd":
        tensors = {"a": sparse, "b": dense(seq, dim, spec["trans_b"])}
        upstream = randn(batch, heads, seq, dim)
    elif op == "dds":
        tensors = {"a": dense(dim, seq, spec["trans_a"]), "b": sparse}
        upstream = randn(batch, heads, dim, seq)
    elif op == "softmax":
        tensors = {"x": sparse * 2}
        upstream = randn(batch, nnz, block, block)
    else:
        tensors = {"q": randn(batch, heads, seq, dim), "k": randn(batch, heads, seq, dim),
                   "v": randn(batch, heads, seq, dim)}
        upstream = randn(batch, heads, seq, dim)
    masks: dict[str, Any] = {}
    if spec.get("rpe"):
        masks["rpe"] = randn(seq, seq) if spec["rpe"] == "2d" else randn(heads, seq, seq)
    if spec.get("kpm") == "add":
        kpm = torch.randn(batch, seq, generator=g)
        kpm[0, seq // 2 + 3:] = float("-inf")  # padded keys, as an additive mask writes them
        masks.update(key_padding_mask=kpm.to(dtype), key_padding_mask_mode="add")
    elif spec.get("kpm") == "mul":
        kpm = torch.rand(batch, seq, generator=g) < 0.8
        if spec["dead"]:
            kpm[0] = False  # batch entry 0: every key excluded, every row dead
        masks.update(key_padding_mask=kpm, key_padding_mask_mode="mul")
    if spec.get("attn") == "add":
        masks.update(attn_mask=torch.randn(seq, seq, generator=g).to(dtype), attn_mask_mode="add")
    elif spec.get("attn") == "mul3d":
        masks.update(attn_mask=(torch.rand(heads, seq, seq, generator=g) < 0.7).to(dtype), attn_mask_mode="mul")
    if spec["grad"]:  # the additive inputs become differentiable inputs too
        for key in ("rpe", "key_padding_mask", "attn_mask"):
            if key in masks and masks[key].is_floating_point():
                tensors[key] = masks.pop(key)
    return {"layout": layout, "tensors": tensors, "masks": masks, "upstream": upstream, "spec": spec}


def _run(name: str, backend: str) -> dict[str, torch.Tensor]:
    """Run case ``name`` forward and backward through the Triton ops (``backend="triton"``) or the references in
    float64 (``"reference"``); returns the output and the gradient of each differentiable input."""
    case = _inputs(name)
    spec, layout, block = case["spec"], case["layout"], case["spec"]["block"]
    wide = backend == "reference"

    def prepare(t: torch.Tensor) -> torch.Tensor:
        return t.double() if wide and t.is_floating_point() else t.clone()

    tensors = {k: prepare(t).requires_grad_() for k, t in case["tensors"].items()}
    masks = {k: prepare(t) if isinstance(t, torch.Tensor) else t for k, t in case["masks"].items()}
    masks.update({k: t for k, t in tensors.items() if k in ("rpe", "key_padding_mask", "attn_mask")})
    flags = {"trans_a": spec["trans_a"], "trans_b": spec["trans_b"]}
    softmax_args = {"scale": spec["scale"], "causal": spec["causal"], **masks}
    op = spec["op"]
    if op in ("sdd", "dsd", "dds"):
        a, b = tensors["a"], tensors["b"]
        if wide:
            out = getattr(ref, f"{op}_reference")(a, b, layout, block, **flags)
        else:
            out = MatMul(layout, block, op, **flags)(a, b)
    elif op == "softmax":
        if wide:
            out = ref.softmax_reference(tensors["x"], layout, block, **softmax_args)
        else:
            out = Softmax(layout, block)(tensors["x"], **softmax_args)
    else:
        q, k, v = tensors["q"], tensors["k"], tensors["v"]
        if wide:
            out = ref.dense_attention_reference(q, k, v, layout, block, **softmax_args)
        else:
            scores = MatMul(layout, block, "sdd", trans_b=True)(q, k)
            probs = Softmax(layout, block)(scores, **softmax_args)
            out = MatMul(layout, block, "dsd")(probs, v)
    grads = torch.autograd.grad(out, list(tensors.values()), prepare(case["upstream"]))
    return {"out": out.detach(), **{f"grad_{k}": g for k, g in zip(tensors, grads, strict=True)}}


# -- the Triton cases (in the interpreted child) ---------------------------------------------------------------------


def _child_env(**extra: str) -> dict[str, str]:
    """This process's environment without TRITON_INTERPRET, the package importable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return {**env, **extra}


@pytest.fixture(scope="module")
def triton_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run every case through the kernels in one interpreted child process; return the results by case name."""
    pytest.importorskip("triton", reason="triton is not installed: the kernels cannot run")
    outputs = tmp_path_factory.mktemp("triton") / "outputs.pt"
    done = subprocess.run([sys.executable, __file__, str(outputs)], capture_output=True, text=True,
                          env=_child_env(TRITON_INTERPRET="1"), timeout=280)
    assert done.returncode == 0, f"the interpreted Triton run failed:\n{done.stdout}\n{done.stderr}"
    return torch.load(outputs)


@pytest.mark.slow
def test_the_kernels_ran_in_the_interpreter(triton_results: dict[str, Any]) -> None:
    assert triton_results["meta"]["interpreted"] is True
    assert triton_results["meta"]["available_on_cpu"] is True
    assert set(triton_results) == {*CASES, "meta"}


@pytest.mark.parametrize("name", list(CASES))
def test_op_matches_reference(triton_results: dict[str, Any], name: str) -> None:
    """Output and every input gradient equal the float64 reference within the dtype's tolerance."""
    kernels, reference = triton_results[name], _run(name, "reference")
    dtype = _spec(name)["dtype"]
    assert kernels.keys() == reference.keys()
    for key, value in kernels.items():
        expected = reference[key]
        assert value.shape == expected.shape, key
        source = _inputs(name)["tensors"][key.removeprefix("grad_")] if key.startswith("grad_") else None
        assert value.dtype == (dtype if source is None else source.dtype), key
        assert torch.isfinite(value).all(), f"{key}: not finite"
        error = (value.double() - expected).abs().max().item() if value.numel() else 0.0
        bound = TOLERANCE[dtype] * max(1.0, expected.abs().max().item() if value.numel() else 0.0)
        assert error <= bound, f"{key}: max error {error:.3g} > {bound:.3g}"


@pytest.mark.parametrize("name", ["softmax-dead-row", "attention-causal-kpm-dead"])
def test_fully_masked_rows_give_zeros(triton_results: dict[str, Any], name: str) -> None:
    """Batch entry 0 has every key masked: its output and its input gradients are exactly zero, not NaN."""
    results = triton_results[name]
    for key, value in results.items():  # grad_v = P^T dy is zero too, P being zero
        assert torch.equal(value[0], torch.zeros_like(value[0])), key
    assert results["out"][1].abs().sum() > 0


def test_empty_layout_rows_give_zeros(triton_results: dict[str, Any]) -> None:
    """Head 0's block row 1 keeps no tile: dsd writes zeros there, and its other rows are not zero."""
    layout, block = _inputs("dsd-pv")["layout"], _spec("dsd-pv")["block"]
    assert layout[0, 1].sum() == 0
    out = triton_results["dsd-pv"]["out"]
    assert torch.equal(out[:, 0, block:2 * block], torch.zeros_like(out[:, 0, block:2 * block]))
    assert out[:, 0, :block].abs().min() > 0


# -- references against explicit loops ------------------------------------------------------------------------------


def _loop_layout() -> tuple[torch.Tensor, int]:
    return torch.tensor([[[1, 0, 1], [0, 1, 0], [1, 1, 1]], [[0, 0, 0], [1, 1, 0], [0, 0, 1]]]), 4


def test_tile_order_and_round_trip() -> None:
    layout, block = _loop_layout()
    dense = torch.randn(2, 2, 12, 12)
    sparse = ref.from_dense(dense, layout, block)
    assert sparse.shape == (2, int(layout.sum()), block, block)
    for n, (h, i, j) in enumerate(layout.nonzero().tolist()):  # head, row, col order
        assert torch.equal(sparse[:, n], dense[:, h, i * block:(i + 1) * block, j * block:(j + 1) * block])
    back = ref.to_dense(sparse, layout, block)
    mask = ref.layout_to_mask(layout, block)
    assert torch.equal(back, dense * mask) and torch.equal(ref.from_dense(back, layout, block), sparse)


def test_matmul_references_against_loops() -> None:
    layout, block = _loop_layout()
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(2, 2, 12, 8, generator=g), torch.randn(2, 2, 8, 12, generator=g)
    sdd = ref.sdd_reference(a, b.mT.contiguous(), layout, block, trans_b=True)
    s = torch.randn(2, int(layout.sum()), block, block, generator=g)
    d = torch.randn(2, 2, 12, 5, generator=g)
    dsd = ref.dsd_reference(s, d, layout, block)
    dsd_t = ref.dsd_reference(s, d, layout, block, trans_a=True)
    dds = ref.dds_reference(d.mT, s, layout, block)
    expect_dsd, expect_dsd_t, expect_dds = torch.zeros(2, 2, 12, 5), torch.zeros(2, 2, 12, 5), torch.zeros(2, 2, 5, 12)
    for n, (h, i, j) in enumerate(layout.nonzero().tolist()):
        rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
        torch.testing.assert_close(sdd[:, n], a[:, h, rows] @ b[:, h, :, cols])
        expect_dsd[:, h, rows] += s[:, n] @ d[:, h, cols]
        expect_dsd_t[:, h, cols] += s[:, n].mT @ d[:, h, rows]
        expect_dds[:, h, :, cols] += d[:, h, rows].mT @ s[:, n]
    torch.testing.assert_close(dsd, expect_dsd)
    torch.testing.assert_close(dsd_t, expect_dsd_t)
    torch.testing.assert_close(dds, expect_dds)


def test_softmax_reference_against_loops() -> None:
    layout, block = _loop_layout()
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1, int(layout.sum()), block, block, generator=g, dtype=torch.float64)
    kpm = torch.ones(1, 12, dtype=torch.bool)
    kpm[0, 5] = False
    rpe = torch.randn(12, 12, generator=g, dtype=torch.float64)
    y = ref.to_dense(ref.softmax_reference(x, layout, block, scale=0.5, rpe=rpe, key_padding_mask=kpm,
                                           key_padding_mask_mode="mul", causal=True), layout, block)
    scores = ref.to_dense(x, layout, block)
    mask = ref.layout_to_mask(layout, block)
    for h in range(2):
        for q in range(12):
            keys = [k for k in range(12) if mask[h, q, k] and kpm[0, k] and k <= q]
            expect = torch.zeros(12, dtype=torch.float64)
            if keys:
                expect[keys] = torch.softmax(scores[0, h, q, keys] * 0.5 + rpe[q, keys], dim=0)
            torch.testing.assert_close(y[0, h, q], expect)


# -- argument checks (no kernel runs) --------------------------------------------------------------------------------

_LAYOUT = torch.tensor([[[1, 0], [1, 1]]])
_NNZ = 3

BAD_CALLS = {
    "mode": (lambda: MatMul(_LAYOUT, 16, "sss"), ValueError, "mode"),
    "block": (lambda: MatMul(_LAYOUT, 24, "sdd"), ValueError, "block"),
    "layout float": (lambda: MatMul(_LAYOUT.float(), 16, "sdd"), TypeError, "layout"),
    "layout values": (lambda: Softmax(_LAYOUT * 2, 16), ValueError, "layout"),
    "layout 2-D": (lambda: Softmax(_LAYOUT[0], 16), ValueError, "layout"),
    "trans flag": (lambda: MatMul(_LAYOUT, 16, "sdd", trans_a=1), TypeError, "trans_a"),
    "seq not a multiple": (lambda: MatMul(_LAYOUT, 16, "sdd", trans_b=True)(torch.zeros(1, 1, 30, 8),
                                                                            torch.zeros(1, 1, 30, 8)),
                           ValueError, "pad_to_block_size"),
    "heads": (lambda: MatMul(_LAYOUT, 16, "dsd")(torch.zeros(1, _NNZ, 16, 16), torch.zeros(1, 2, 32, 8)),
              ValueError, "heads"),
    "sparse nnz": (lambda: MatMul(_LAYOUT, 16, "dsd")(torch.zeros(1, 4, 16, 16), torch.zeros(1, 1, 32, 8)),
                   ValueError, "nnz=3"),
    "dtype mismatch": (lambda: MatMul(_LAYOUT, 16, "dds")(torch.zeros(1, 1, 8, 32), torch.zeros(1, _NNZ, 16, 16,
                                                                                               dtype=torch.float16)),
                       TypeError, "same dtype"),
    "dtype int": (lambda: MatMul(_LAYOUT, 16, "sdd")(torch.zeros(1, 1, 32, 8, dtype=torch.long),
                                                     torch.zeros(1, 1, 8, 32, dtype=torch.long)), TypeError,
                  "a has dtype"),
    "batch": (lambda: MatMul(_LAYOUT, 16, "sdd")(torch.zeros(2, 1, 32, 8), torch.zeros(1, 1, 8, 32)), ValueError,
              "batch"),
    "softmax x": (lambda: Softmax(_LAYOUT, 16)(torch.zeros(1, 2, 16, 16)), ValueError, "x must have shape"),
    "mask mode": (lambda: Softmax(_LAYOUT, 16)(torch.zeros(1, _NNZ, 16, 16), attn_mask_mode="max"), ValueError,
                  "attn_mask_mode"),
    "bool add mask": (lambda: Softmax(_LAYOUT, 16)(torch.zeros(1, _NNZ, 16, 16),
                                                   key_padding_mask=torch.ones(1, 32, dtype=torch.bool)),
                      TypeError, "'mul'"),
    "rpe shape": (lambda: Softmax(_LAYOUT, 16)(torch.zeros(1, _NNZ, 16, 16), rpe=torch.zeros(2, 32, 32)),
                  ValueError, "rpe"),
    "mask device": (lambda: Softmax(_LAYOUT, 16)(torch.zeros(1, _NNZ, 16, 16),
                                                 attn_mask=torch.zeros(32, 32, device="meta")), ValueError,
                    "attn_mask"),
    "scale": (lambda: Softmax(_LAYOUT, 16)(torch.zeros(1, _NNZ, 16, 16), scale="0.5"), TypeError, "scale"),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_arguments_raise_clear_errors(name: str) -> None:
    call, error, words = BAD_CALLS[name]
    with pytest.raises(error, match=words.replace("(", r"\(")):
        call()


def test_lookup_tables_are_built_once_per_device() -> None:
    op = MatMul(_LAYOUT, 16, "dsd")
    first = op.tables.on(torch.device("cpu"))
    assert op.tables.on(torch.device("cpu")) is first
    offsets, lut = first["rows"]
    assert offsets.tolist() == [0, 1, 3] and lut.tolist() == [0, 0, 1, 0, 2, 1]  # (tile, block column) pairs
    offsets, lut = first["cols"]
    assert offsets.tolist() == [0, 2, 3] and lut.tolist() == [0, 0, 1, 1, 2, 1]  # (tile, block row) pairs


@pytest.mark.slow
def test_cpu_without_the_interpreter_raises_a_clear_error() -> None:
    """In a fresh process without TRITON_INTERPRET (and then without Triton at all), CPU tensors are refused with a
    RuntimeError that says what to do, and triton_available says so beforehand."""
    script = textwrap.dedent("""
        import importlib, sys, torch
        from microspeed_sparse_attn import matmul, softmax
        layout = torch.ones(1, 2, 2, dtype=torch.long)
        assert not matmul.INTERPRETED and not matmul.triton_available("cpu")
        for call in (lambda: matmul.MatMul(layout, 16, "sdd")(torch.zeros(1, 1, 32, 8), torch.zeros(1, 1, 8, 32)),
                     lambda: softmax.Softmax(layout, 16)(torch.zeros(1, 4, 16, 16))):
            try:
                call()
            except RuntimeError as exc:
                assert "TRITON_INTERPRET=1" in str(exc) and "CUDA" in str(exc), exc
            else:
                raise AssertionError("CPU tensors should be refused")
        sys.modules["triton"] = None  # as if Triton were not installed
        sys.modules.pop("triton.language", None)
        importlib.reload(matmul)
        assert not matmul.triton_available("cpu") and not matmul.triton_available("cuda")
        try:
            matmul.MatMul(layout, 16, "sdd")(torch.zeros(1, 1, 32, 8), torch.zeros(1, 1, 8, 32))
        except RuntimeError as exc:
            assert "not installed" in str(exc), exc
        else:
            raise AssertionError("without Triton the op should be refused")
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], env=_child_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def _run_triton_cases(outputs: str) -> None:
    """The child process: run every case through the (interpreted) kernels, save the results to ``outputs``."""
    from microspeed_sparse_attn import matmul

    assert matmul.INTERPRETED, "TRITON_INTERPRET=1 must be set before microspeed_sparse_attn.matmul is imported"
    start = time.perf_counter()
    results: dict[str, Any] = {name: _run(name, "triton") for name in CASES}
    results["meta"] = {"interpreted": matmul.INTERPRETED, "available_on_cpu": matmul.triton_available("cpu"),
                       "seconds": time.perf_counter() - start}
    torch.save(results, outputs)


if __name__ == "__main__":
    _run_triton_cases(sys.argv[1])
