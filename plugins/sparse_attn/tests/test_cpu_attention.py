"""Tests of the chunked PyTorch path (:mod:`microspeed_sparse_attn.cpu_attention`) against the dense reference
(:mod:`microspeed_sparse_attn.attention_reference`), forward and backward, and of the shared pieces: the argument
checks, :func:`expand_layout` and the cached layout index tables."""

from __future__ import annotations

import pytest
import torch
from microspeed_sparse_attn import cpu_attention
from microspeed_sparse_attn.attention_reference import (
    check_attention_args,
    dense_reference_attention,
    expand_layout,
    layout_index,
)
from microspeed_sparse_attn.cpu_attention import DEFAULT_CHUNK_BYTES, cpu_block_sparse_attention

TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
"""Largest error allowed, relative to the largest reference value (at least 1), per input dtype."""


# -- helpers -------------------------------------------------------------------------------------------------------


def random_layout(heads: int, blocks: int, seed: int, density: float = 0.35, diagonal: bool = True,
                  empty_rows: int = 0) -> torch.Tensor:
    """A random 0/1 layout, a different one per head, optionally with the diagonal set and with ``empty_rows``
    rows of head 0 cleared."""
    g = torch.Generator().manual_seed(seed)
    layout = (torch.rand(heads, blocks, blocks, generator=g) < density).long()
    if diagonal:
        layout[:, torch.arange(blocks), torch.arange(blocks)] = 1
    for row in range(min(empty_rows, blocks)):
        layout[0, (row * 3 + 1) % blocks] = 0
    return layout


def fixed_layout(heads: int, blocks: int, local: int = 4) -> torch.Tensor:
    """A unidirectional Fixed-style layout: causal local windows of ``local`` blocks, and the last block of every
    window visible to all the rows after it."""
    layout = torch.zeros(heads, blocks, blocks, dtype=torch.long)
    for i in range(blocks):
        start = (i // local) * local
        layout[:, i, start:i + 1] = 1
        layout[:, i, local - 1:start:local] = 1
    return layout


def make_inputs(batch: int, heads: int, seq: int, head_dim: int, dtype: torch.dtype, seed: int,
                masks: bool = False) -> dict[str, torch.Tensor | None]:
    """q, k, v, an upstream gradient and (optionally) additive masks with some fully masked keys and queries."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor | None] = {
        name: torch.randn(batch, heads, seq, head_dim, generator=g).to(dtype) for name in ("q", "k", "v", "grad")}
    out["key_padding_mask"] = out["attn_mask"] = None
    if masks:
        kpm = torch.randn(batch, seq, generator=g) * 0.5
        kpm[0, seq - seq // 4:] = float("-inf")  # padded keys at the end of sequence 0
        attn = torch.randn(seq, seq, generator=g) * 0.5
        attn[3] = float("-inf")  # query 3 sees nothing at all
        attn[:, 5] = float("-inf")
        out["key_padding_mask"], out["attn_mask"] = kpm, attn
    return out


def run(fn, inputs: dict[str, torch.Tensor | None], layout: torch.Tensor, block: int, dtype: torch.dtype | None = None,
        **kwargs) -> tuple[torch.Tensor, ...]:
    """``(out, dq, dk, dv)`` of ``fn`` on ``inputs`` (cast to ``dtype`` if given)."""
    q, k, v = (inputs[name].to(dtype or inputs[name].dtype).clone().requires_grad_() for name in ("q", "k", "v"))
    out = fn(q, k, v, layout, block, key_padding_mask=inputs["key_padding_mask"], attn_mask=inputs["attn_mask"],
             **kwargs)
    out.backward(inputs["grad"].to(out.dtype))
    return out.detach(), q.grad, k.grad, v.grad


def assert_matches(actual: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...], dtype: torch.dtype) -> None:
    """Each of ``(out, dq, dk, dv)`` has ``dtype``, no NaN, and matches the float64 reference within tolerance."""
    for name, a, e in zip(("out", "dq", "dk", "dv"), actual, expected, strict=True):
        assert a.dtype == dtype, name
        assert a.shape == e.shape, name
        assert not a.isnan().any(), f"{name}: NaN"
        err = (a.double() - e.double()).abs().max().item()
        bound = TOLERANCE[dtype] * max(1.0, e.abs().max().item())
        assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"


def check_against_reference(batch: int, heads: int, seq: int, head_dim: int, block: int, layout: torch.Tensor,
                            dtype: torch.dtype, causal: bool, masks: bool, seed: int, **kwargs) -> None:
    """The CPU path on ``dtype`` inputs matches the dense reference run in float64 on the same values."""
    inputs = make_inputs(batch, heads, seq, head_dim, dtype, seed, masks)
    actual = run(cpu_block_sparse_attention, inputs, layout, block, causal=causal, **kwargs)
    expected = run(dense_reference_attention, inputs, layout, block, dtype=torch.float64, causal=causal)
    assert_matches(actual, expected, dtype)


# -- the CPU path against the dense reference ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masks", [False, True])
def test_matches_reference(dtype: torch.dtype, block: int, causal: bool, masks: bool) -> None:
    seq = 4 * block
    layout = random_layout(3, seq // block, seed=block + causal, empty_rows=1)
    check_against_reference(2, 3, seq, 16, block, layout, dtype, causal, masks, seed=7 * block + 3 * causal + masks)


@pytest.mark.parametrize("block", [64, 128])
def test_large_blocks(block: int) -> None:
    layout = random_layout(2, 3, seed=block, density=0.5)
    check_against_reference(1, 2, 3 * block, 32, block, layout, torch.float32, causal=True, masks=True, seed=block)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_other_dtypes(dtype: torch.dtype) -> None:
    layout = random_layout(2, 4, seed=5)
    check_against_reference(1, 2, 64, 16, 16, layout, dtype, causal=True, masks=True, seed=11)


@pytest.mark.parametrize("kind", ["no_diagonal", "empty_rows", "sparse", "dense", "all_zero"])
def test_layouts(kind: str) -> None:
    blocks = 6
    layout = {
        "no_diagonal": random_layout(2, blocks, seed=1, diagonal=False),
        "empty_rows": random_layout(2, blocks, seed=2, empty_rows=3),
        "sparse": random_layout(2, blocks, seed=3, density=0.1, diagonal=False),
        "dense": torch.ones(2, blocks, blocks, dtype=torch.long),
        "all_zero": torch.zeros(2, blocks, blocks, dtype=torch.long),
    }[kind]
    for causal in (False, True):
        check_against_reference(2, 2, blocks * 16, 16, 16, layout, torch.float32, causal, masks=False, seed=4)


def test_empty_rows_give_zero_output_and_gradients() -> None:
    layout = random_layout(1, 4, seed=0)
    layout[0, 1] = 0
    inputs = make_inputs(1, 1, 64, 16, torch.float32, seed=0)
    out, dq, _, _ = run(cpu_block_sparse_attention, inputs, layout, 16)
    assert out[0, 0, 16:32].abs().max() == 0
    assert dq[0, 0, 16:32].abs().max() == 0
    assert out[0, 0, :16].abs().max() > 0


def test_larger_sequence_with_chunking() -> None:
    """seq 1024, block 64, a Fixed-style layout: matches the reference, and a tiny budget (one row per chunk)
    gives the same result as the default budget."""
    seq, block = 1024, 64
    layout = fixed_layout(2, seq // block)
    inputs = make_inputs(1, 2, seq, 32, torch.float32, seed=3, masks=True)
    expected = run(dense_reference_attention, inputs, layout, block, dtype=torch.float64, causal=True)
    default = run(cpu_block_sparse_attention, inputs, layout, block, causal=True)
    assert_matches(default, expected, torch.float32)
    tiny = run(cpu_block_sparse_attention, inputs, layout, block, causal=True, chunk_bytes=1)
    for a, b in zip(tiny, default, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("workers", [1, 3])
def test_chunks_respect_the_budget(workers: int) -> None:
    """Every chunk's score buffer fits ``chunk_bytes`` (or holds a single row), rows are covered exactly once,
    the parts touch disjoint (batch, head) pairs, and a smaller budget makes more chunks."""
    block, batch, heads, blocks = 32, 2, 3, 16
    layout = random_layout(heads, blocks, seed=9, empty_rows=2)
    index = layout_index(layout, causal=True)
    budget = 64 * 1024
    plan = cpu_attention._plan(index, batch, block, budget, 4, workers)
    assert len(plan.parts) == workers
    rows = torch.cat([ch.own_flat for ch in plan.chunks] + [plan.empty_flat])
    assert sorted(rows.tolist()) == list(range(batch * heads * blocks))
    pairs = [{int(p) for ch in part for p in ch.own_flat // blocks} for part in plan.parts]
    assert sum(len(p) for p in pairs) == len(set().union(*pairs)) == batch * heads
    for part, own in zip(plan.parts, pairs, strict=True):
        assert {int(p) for ch in part for p in ch.other_flat // blocks} == own  # keys of the same pairs only
    for ch in plan.chunks:
        r, w = ch.other.shape
        assert r == 1 or r * w * block * block * 4 <= budget
    coarse = cpu_attention._plan(index, batch, block, DEFAULT_CHUNK_BYTES, 4, workers)
    assert len(plan.chunks) > len(coarse.chunks) >= workers


def test_worker_threads_give_the_same_result() -> None:
    """Two worker threads (one per part) give bit-for-bit what one thread gives, and leave the caller's thread
    count as it was."""
    layout = random_layout(3, 8, seed=12, empty_rows=1)
    inputs = make_inputs(2, 3, 128, 16, torch.float32, seed=12, masks=True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run(cpu_block_sparse_attention, inputs, layout, 16, causal=True, chunk_bytes=8192)
        torch.set_num_threads(2)
        threaded = run(cpu_block_sparse_attention, inputs, layout, 16, causal=True, chunk_bytes=8192)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    for a, b in zip(single, threaded, strict=True):
        assert torch.equal(a, b)
    index = layout_index(layout, causal=True)
    assert any(len(plan.parts) == 2 for key, plan in index.plans.items() if key[0] == "cpu_chunks")


def test_gradcheck() -> None:
    """Finite differences in float64 agree with the hand-written backward (masks and causal included)."""
    layout = random_layout(2, 3, seed=6, empty_rows=1)
    inputs = make_inputs(1, 2, 48, 8, torch.float64, seed=6, masks=True)
    q, k, v = (inputs[name].clone().requires_grad_() for name in ("q", "k", "v"))

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return cpu_block_sparse_attention(q, k, v, layout, 16, causal=True, chunk_bytes=4096,
                                          key_padding_mask=inputs["key_padding_mask"], attn_mask=inputs["attn_mask"])

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-6, fast_mode=True)


def test_deterministic_and_scale() -> None:
    layout = random_layout(2, 4, seed=8)
    inputs = make_inputs(2, 2, 64, 16, torch.float32, seed=8)
    first = run(cpu_block_sparse_attention, inputs, layout, 16, scale=0.3)
    second = run(cpu_block_sparse_attention, inputs, layout, 16, scale=0.3)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    expected = run(dense_reference_attention, inputs, layout, 16, dtype=torch.float64, scale=0.3)
    assert_matches(first, expected, torch.float32)
    default_scale = run(cpu_block_sparse_attention, inputs, layout, 16)
    assert not torch.allclose(default_scale[0], first[0])


def test_noncontiguous_inputs() -> None:
    layout = random_layout(2, 4, seed=10)
    inputs = make_inputs(1, 2, 64, 16, torch.float32, seed=10)
    for name in ("q", "k", "v"):
        inputs[name] = inputs[name].transpose(1, 2).contiguous().transpose(1, 2)
    expected = run(dense_reference_attention, inputs, layout, 16, dtype=torch.float64)
    assert_matches(run(cpu_block_sparse_attention, inputs, layout, 16), expected, torch.float32)


# -- the shared pieces ---------------------------------------------------------------------------------------------


def test_expand_layout() -> None:
    layout = torch.tensor([[[1, 0], [1, 1]]])
    mask = expand_layout(layout, 2)
    assert mask.shape == (1, 4, 4) and mask.dtype == torch.bool
    assert mask[0].long().tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]


def test_reference_rows_without_keys_are_zero_not_nan() -> None:
    layout = torch.tensor([[[0, 1], [0, 1]]])
    inputs = make_inputs(1, 1, 32, 8, torch.float64, seed=1)
    out, dq, dk, dv = run(dense_reference_attention, inputs, layout, 16, causal=True)
    assert out[0, 0, :16].abs().max() == 0  # query block 0 sees only key block 1, all in its future
    assert not any(t.isnan().any() for t in (out, dq, dk, dv))


def test_layout_index_tables_and_cache() -> None:
    layout = torch.tensor([[[1, 0, 1], [0, 0, 0], [1, 1, 1]]])
    index = layout_index(layout)
    assert index.row_ptr.tolist() == [0, 2, 2, 5]
    assert index.col_idx.tolist() == [0, 2, 0, 1, 2]
    assert index.col_ptr.tolist() == [0, 2, 3, 5]
    assert index.row_idx.tolist() == [0, 2, 2, 0, 2]
    assert index.counts.tolist() == [2, 0, 3] and index.max_row_blocks == 3 and index.nnz == 5
    causal = layout_index(layout, causal=True)
    assert causal.col_idx.tolist() == [0, 0, 1, 2] and causal.diag_pos.tolist() == [0, -1, 2]
    assert layout_index(layout) is index  # cached
    layout[0, 1, 1] = 1  # an in-place edit bumps the version: new tables
    rebuilt = layout_index(layout)
    assert rebuilt is not index and rebuilt.counts.tolist() == [2, 1, 3]
    assert layout_index(layout.clone()) is not rebuilt  # another tensor, even with equal values


def test_bad_arguments() -> None:
    q = torch.randn(1, 2, 64, 16)
    layout = torch.ones(2, 4, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="seq_len.*pad_to_block_size"):
        cpu_block_sparse_attention(q[:, :, :60], q[:, :, :60], q[:, :, :60], layout, 16)
    with pytest.raises(ValueError, match="block"):
        cpu_block_sparse_attention(q, q, q, layout, 24)
    with pytest.raises(ValueError, match="layout"):
        cpu_block_sparse_attention(q, q, q, layout[:1], 16)
    with pytest.raises(ValueError, match="layout"):
        cpu_block_sparse_attention(q, q, q, layout.float(), 16)
    with pytest.raises(ValueError, match="k: expected the shape"):
        cpu_block_sparse_attention(q, q[:, :1], q, layout, 16)
    with pytest.raises(ValueError, match="v: expected dtype"):
        cpu_block_sparse_attention(q, q, q.double(), layout, 16)
    with pytest.raises(ValueError, match="key_padding_mask"):
        cpu_block_sparse_attention(q, q, q, layout, 16, key_padding_mask=torch.zeros(2, 64))
    with pytest.raises(ValueError, match="attn_mask.*additive"):
        cpu_block_sparse_attention(q, q, q, layout, 16, attn_mask=torch.ones(64, 64, dtype=torch.bool))
    with pytest.raises(ValueError, match="chunk_bytes"):
        cpu_block_sparse_attention(q, q, q, layout, 16, chunk_bytes=0)
    with pytest.raises(TypeError, match="q"):
        cpu_block_sparse_attention(q.numpy(), q, q, layout, 16)
    assert check_attention_args(q, q, q, layout, 16) == (1, 2, 64, 16)
