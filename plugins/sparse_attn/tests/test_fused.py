"""Tests of the fused Triton kernels (:mod:`microspeed_sparse_attn.fused`) against the dense reference, forward and
backward, under the Triton interpreter.

Why a child process: ``@triton.jit`` picks the interpreter (the only way to run the kernels on CPU tensors) when
it decorates the kernels, i.e. when ``microspeed_sparse_attn.fused`` is first imported, and only if
``TRITON_INTERPRET=1`` is in the environment by then. This pytest process may already have imported the kernels
(or Triton) without it, so the kernels run in ``python test_fused.py IN OUT`` started with ``TRITON_INTERPRET=1``
(see :func:`_run_cases`, at the bottom): it runs every case of ``IN`` forward and backward and saves the results
in ``OUT``, which the tests here compare with the dense reference run in float64 on the same values. The
argument checks run in this process.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from microspeed_sparse_attn import fused
from microspeed_sparse_attn.attention_reference import dense_reference_attention
from microspeed_sparse_attn.fused import fused_block_sparse_attention

PACKAGE_ROOT = str(Path(fused.__file__).resolve().parents[1])  # the folder holding microspeed_sparse_attn/

TOLERANCE = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}
"""Largest error allowed, relative to the largest reference value (at least 1), per input dtype."""

Case = dict[str, Any]


def _layout(heads: int, blocks: int, seed: int, kind: str) -> torch.Tensor:
    """A layout of ``kind``: random 0/1 (a different one per head) with the diagonal set, the same with some rows of
    head 0 emptied, random without the diagonal, dense, or all zero."""
    g = torch.Generator().manual_seed(seed)
    layout = (torch.rand(heads, blocks, blocks, generator=g) < 0.4).long()
    if kind in ("random", "empty_rows"):
        layout[:, torch.arange(blocks), torch.arange(blocks)] = 1
    if kind == "empty_rows":
        layout[0, 1] = 0
        layout[0, blocks - 1] = 0
    if kind == "dense":
        layout.fill_(1)
    if kind == "zero":
        layout.fill_(0)
    return layout


def _case(batch: int, heads: int, seq: int, head_dim: int, block: int, dtype: torch.dtype, causal: bool,
          masks: str = "", kind: str = "random", scale: float | None = None, seed: int = 0) -> Case:
    """One case: inputs, an upstream gradient, masks (``masks`` holds 'k' for a key padding mask, 'a' for an
    attention mask, each with fully masked keys or queries) and the call's arguments."""
    g = torch.Generator().manual_seed(seed)
    case: Case = {name: torch.randn(batch, heads, seq, head_dim, generator=g).to(dtype)
                  for name in ("q", "k", "v", "grad")}
    case.update(layout=_layout(heads, seq // block, seed, kind), block=block, causal=causal, scale=scale,
                key_padding_mask=None, attn_mask=None)
    if "k" in masks:
        kpm = torch.randn(batch, seq, generator=g) * 0.5
        kpm[0, seq - seq // 4:] = float("-inf")
        case["key_padding_mask"] = kpm
    if "a" in masks:
        attn = torch.randn(seq, seq, generator=g) * 0.5
        attn[2] = float("-inf")
        attn[:, 7] = float("-inf")
        case["attn_mask"] = attn
    return case


CASES: dict[str, Case] = {
    "fp32_b16": _case(2, 2, 64, 16, 16, torch.float32, causal=False, seed=1),
    "fp32_b16_causal_masks": _case(2, 2, 64, 16, 16, torch.float32, causal=True, masks="ka", seed=2),
    "fp32_b32_heads3_empty_rows": _case(1, 3, 128, 32, 32, torch.float32, causal=True, kind="empty_rows", seed=3),
    "fp32_b32_no_diagonal_kpm": _case(2, 1, 128, 16, 32, torch.float32, causal=False, masks="k", kind="sparse",
                                      seed=4),
    "fp32_b64_d64": _case(1, 2, 128, 64, 64, torch.float32, causal=True, masks="a", seed=5),
    "fp32_b128_dense": _case(1, 1, 128, 16, 128, torch.float32, causal=True, kind="dense", seed=6),
    "fp32_d128_scale": _case(1, 1, 64, 128, 16, torch.float32, causal=False, scale=0.3, seed=7),
    "fp32_zero_layout": _case(1, 2, 64, 16, 16, torch.float32, causal=False, kind="zero", seed=8),
    "fp16_b16_kpm": _case(2, 2, 64, 16, 16, torch.float16, causal=False, masks="k", seed=9),
    "fp16_b32_causal_attn": _case(1, 2, 128, 32, 32, torch.float16, causal=True, masks="a", kind="empty_rows",
                                  seed=10),
    "bf16_b16_causal_masks": _case(2, 2, 64, 16, 16, torch.bfloat16, causal=True, masks="ka", seed=11),
    "bf16_b32": _case(1, 3, 64, 32, 32, torch.bfloat16, causal=False, seed=12),
}


def _run_case(case: Case, fn: Any = fused_block_sparse_attention, dtype: torch.dtype | None = None
              ) -> dict[str, torch.Tensor]:
    """``out``, ``dq``, ``dk``, ``dv`` of ``fn`` on the case (inputs cast to ``dtype`` if given)."""
    q, k, v = (case[name].to(dtype or case[name].dtype).clone().requires_grad_() for name in ("q", "k", "v"))
    out = fn(q, k, v, case["layout"], case["block"], scale=case["scale"], causal=case["causal"],
             key_padding_mask=case["key_padding_mask"], attn_mask=case["attn_mask"])
    out.backward(case["grad"].to(out.dtype))
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@functools.cache
def _interpreted_results(tmp: str) -> dict[str, Any]:
    """Run every case through the kernels in a child process under the interpreter (once per session)."""
    inputs, outputs = os.path.join(tmp, "cases.pt"), os.path.join(tmp, "results.pt")
    torch.save(CASES, inputs)
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, __file__, inputs, outputs], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"the interpreted kernels failed:\n{proc.stdout}\n{proc.stderr}"
    return torch.load(outputs)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The kernels' results per case name, plus ``meta``."""
    return _interpreted_results(str(tmp_path_factory.mktemp("fused")))


@pytest.mark.slow
def test_child_ran_the_interpreter(interpreted: dict[str, Any]) -> None:
    assert interpreted["meta"] == {"interpreted": True, "cases": sorted(CASES)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference(name: str, interpreted: dict[str, Any]) -> None:
    case = CASES[name]
    dtype = case["q"].dtype
    expected = _run_case(case, dense_reference_attention, dtype=torch.float64)
    for key, want in expected.items():
        got = interpreted[name][key]
        assert got.dtype == dtype and got.shape == want.shape, key
        assert not got.isnan().any(), f"{key}: NaN"
        err = (got.double() - want).abs().max().item()
        bound = TOLERANCE[dtype] * max(1.0, want.abs().max().item())
        assert err <= bound, f"{key}: max error {err:.3g} > {bound:.3g}"


def test_rows_without_keys_are_zero(interpreted: dict[str, Any]) -> None:
    zero = interpreted["fp32_zero_layout"]
    assert all(t.abs().max() == 0 for t in zero.values())
    empty = interpreted["fp32_b32_heads3_empty_rows"]  # head 0, query block 1 has no key block
    assert empty["out"][0, 0, 32:64].abs().max() == 0 and empty["dq"][0, 0, 32:64].abs().max() == 0


# -- argument checks (this process) --------------------------------------------------------------------------------


def test_bad_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = torch.ones(2, 4, 4, dtype=torch.long)
    q = torch.randn(1, 2, 64, 16)
    with pytest.raises(ValueError, match="head_dim"):
        x = torch.randn(1, 2, 64, 24)
        fused_block_sparse_attention(x, x, x, layout, 16)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        fused_block_sparse_attention(q.double(), q.double(), q.double(), layout, 16)
    with pytest.raises(ValueError, match="seq_len.*pad_to_block_size"):
        x = q[:, :, :56]
        fused_block_sparse_attention(x, x, x, torch.ones(2, 3, 3, dtype=torch.long), 16)
    with pytest.raises(ValueError, match="layout"):
        fused_block_sparse_attention(q, q, q, layout[:, :2], 16)
    monkeypatch.setattr(fused, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="CUDA tensors.*cpu_block_sparse_attention"):
        fused_block_sparse_attention(q, q, q, layout, 16)


# -- the child process ---------------------------------------------------------------------------------------------


def _run_cases(inputs: str, outputs: str) -> None:
    """Run every case of ``inputs`` through the (interpreted) kernels, save to ``outputs``."""
    assert fused.INTERPRETED, "TRITON_INTERPRET=1 must be set before microspeed_sparse_attn.fused is imported"
    cases = torch.load(inputs)
    results: dict[str, Any] = {name: _run_case(case) for name, case in cases.items()}
    results["meta"] = {"interpreted": fused.INTERPRETED, "cases": sorted(cases)}
    torch.save(results, outputs)


if __name__ == "__main__":
    _run_cases(sys.argv[1], sys.argv[2])
