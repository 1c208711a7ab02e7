"""Sparsity layouts: checked against their definitions, hand-drawn examples and DeepSpeed's classes.

The reference layouts here are written from each pattern's definition, element by element
(``attends(row, col)`` predicates), independently of the implementation. The comparison with
DeepSpeed needs its ``sparsity_config.py``; DeepSpeed 0.19.8 removed sparse attention, so the
module is looked up as an installed ``deepspeed.ops.sparse_attention`` package, then as that
file inside the installed deepspeed, then at the path in ``$MICROSPEED_DS_SPARSITY_CONFIG``
(for example the file from the deepspeed 0.16.9 sdist); without any of them those tests skip.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import random
from pathlib import Path

import pytest
import torch
from microspeed_sparse_attn.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)

#: (seq_len, block): 2 to 32 blocks per row, including lengths that leave a short last window.
GRID = [(64, 16), (128, 16), (256, 16), (512, 16), (128, 32), (256, 32), (512, 32), (96, 16), (160, 32)]
HEADS = (1, 2, 4)
ATTENTIONS = [("bidirectional", False), ("bidirectional", True), ("unidirectional", False)]


@pytest.fixture(autouse=True)
def _keep_global_random_state():
    """Some tests seed Python's global ``random``; give other test modules their state back."""
    state = random.getstate()
    yield
    random.setstate(state)


# ----------------------------------------------------------------------------------------------
# Reference layouts written from the definitions
# ----------------------------------------------------------------------------------------------

def _matrix(n, attends):
    return torch.tensor([[int(attends(r, c)) for c in range(n)] for r in range(n)], dtype=torch.int64)


def _causal(attention, attends):
    """Unidirectional: never a block above the diagonal."""
    return lambda r, c: (attention == "bidirectional" or c <= r) and attends(r, c)


def fixed_reference(n, h, local, glob, patterns, attention, horizontal):
    """Local windows of ``local`` blocks; in each window the ``glob`` blocks ending ``p * glob`` blocks
    before the window's end are global (p = h % patterns); a short last window keeps the offset from
    its start, moved left so the global blocks fit in the sequence."""
    p = h % patterns
    global_blocks = set()
    for w0 in range(0, n, local):
        if w0 + local <= n:
            global_blocks.update(range(w0 + local - (p + 1) * glob, w0 + local - p * glob))
        else:
            first = max(0, min(w0 + local - (p + 1) * glob, n - glob))
            global_blocks.update(range(first, min(first + glob, n)))

    def attends(r, c):
        same_window = r // local == c // local
        return same_window or c in global_blocks or (horizontal and r in global_blocks)

    return _matrix(n, _causal(attention, attends))


def _global_set(n, starts, ends):
    ends = ends if ends is not None else [s + 1 for s in starts]
    return {b for s, e in zip(starts, ends, strict=True) for b in range(s, e) if b < n}


def variable_reference(n, windows, starts, ends, attention, horizontal):
    """Deterministic part of Variable: windows of the listed sizes (the last repeats) plus globals."""
    window_of = []
    k = 0
    while len(window_of) < n:
        window_of += [k] * windows[min(k, len(windows) - 1)]
        k += 1
    global_blocks = _global_set(n, starts, ends)

    def attends(r, c):
        return window_of[r] == window_of[c] or c in global_blocks or (horizontal and r in global_blocks)

    return _matrix(n, _causal(attention, attends))


def bigbird_reference(n, window, glob, attention):
    """Deterministic part of BigBird: |r - c| <= window // 2, plus the first ``glob`` rows and columns."""
    return _matrix(n, _causal(attention, lambda r, c: abs(r - c) <= window // 2 or r < glob or c < glob))


def longformer_reference(n, window, starts, ends, attention):
    """Sliding window plus global rows and columns."""
    g = _global_set(n, starts, ends)
    return _matrix(n, _causal(attention, lambda r, c: abs(r - c) <= window // 2 or r in g or c in g))


def sliding_reference(n, window, attention):
    """Sliding window only."""
    return _matrix(n, _causal(attention, lambda r, c: abs(r - c) <= window // 2))


def _drawing(text):
    return torch.tensor([[int(ch) for ch in line] for line in text.split()], dtype=torch.int64)


def _assert_layout(layout, heads, n):
    assert layout.shape == (heads, n, n)
    assert layout.dtype == torch.int64
    assert set(layout.unique().tolist()) <= {0, 1}


# ----------------------------------------------------------------------------------------------
# Hand-drawn examples (row = query block, column = key block)
# ----------------------------------------------------------------------------------------------

HAND_DRAWN = [
    (FixedSparsityConfig(1, 16, num_local_blocks=4, num_global_blocks=1), 128, """
        11110001 11110001 11110001 11110001 00011111 00011111 00011111 00011111"""),
    (FixedSparsityConfig(1, 16, num_local_blocks=4, num_global_blocks=1, attention="unidirectional"), 128, """
        10000000 11000000 11100000 11110000 00011000 00011100 00011110 00011111"""),
    (FixedSparsityConfig(1, 16, num_local_blocks=4, num_global_blocks=1, horizontal_global_attention=True), 128, """
        11110001 11110001 11110001 11111111 00011111 00011111 00011111 11111111"""),
    # 6 blocks, windows of 4: the short last window [4, 5] has its global block at offset 3 -> moved to 5.
    (FixedSparsityConfig(1, 16, num_local_blocks=4, num_global_blocks=1), 96, """
        111101 111101 111101 111101 000111 000111"""),
    (BigBirdSparsityConfig(1, 16, num_random_blocks=0, num_sliding_window_blocks=3, num_global_blocks=1), 96, """
        111111 111000 111100 101110 100111 100011"""),
    (BSLongformerSparsityConfig(1, 16, num_sliding_window_blocks=3, global_block_indices=[2]), 96, """
        111000 111000 111111 001110 001111 001011"""),
    (VariableSparsityConfig(1, 16, local_window_blocks=[2, 3], global_block_indices=[0]), 128, """
        11000000 11000000 10111000 10111000 10111000 10000111 10000111 10000111"""),
    (LocalSlidingWindowSparsityConfig(1, 16, num_sliding_window_blocks=3), 80, """
        10000 11000 01100 00110 00011"""),
    (LocalSlidingWindowSparsityConfig(1, 16, num_sliding_window_blocks=3, attention="bidirectional"), 80, """
        11000 11100 01110 00111 00011"""),
]


@pytest.mark.parametrize("config,seq_len,drawing", HAND_DRAWN, ids=[f"{type(c).__name__}-{i}"
                                                                     for i, (c, _, _) in enumerate(HAND_DRAWN)])
def test_hand_drawn_layouts(config, seq_len, drawing):
    assert torch.equal(config.make_layout(seq_len)[0], _drawing(drawing))


# ----------------------------------------------------------------------------------------------
# Layouts against their definitions, over the grid
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seq_len,block", GRID)
def test_dense_is_all_ones(seq_len, block):
    for heads in HEADS:
        layout = DenseSparsityConfig(heads, block).make_layout(seq_len)
        _assert_layout(layout, heads, seq_len // block)
        assert int(layout.sum()) == heads * (seq_len // block) ** 2


@pytest.mark.parametrize("seq_len,block", GRID)
def test_fixed_matches_definition(seq_len, block):
    n = seq_len // block
    for local, glob in [(1, 1), (2, 1), (4, 1), (4, 2), (3, 1), (6, 3)]:
        if glob > n:
            continue
        for attention, horizontal in ATTENTIONS:
            for heads in HEADS:
                per_head_options = [(False, 1)] + [(True, p) for p in range(1, local // glob + 1)]
                for per_head, patterns in per_head_options:
                    cfg = FixedSparsityConfig(heads, block, per_head, local, glob, attention, horizontal, patterns)
                    layout = cfg.make_layout(seq_len)
                    _assert_layout(layout, heads, n)
                    for h in range(heads):
                        expected = fixed_reference(n, h if per_head else 0, local, glob, patterns, attention,
                                                   horizontal)
                        assert torch.equal(layout[h], expected), (cfg, seq_len, h)


def test_fixed_global_pattern_shifts_per_head():
    cfg = FixedSparsityConfig(4, 16, True, num_local_blocks=4, num_global_blocks=1, num_different_global_patterns=4)
    layout = cfg.make_layout(256)
    # Head h's global column in window 0 is block 3 - h: the only column of rows 4..15 that lies in window 0.
    for h in range(4):
        cols = layout[h, 4:, :4].nonzero()[:, 1].unique().tolist()
        assert cols == [3 - h]
    # Two patterns over four heads: heads 0/2 and 1/3 share a layout.
    two = FixedSparsityConfig(4, 16, True, num_local_blocks=4, num_global_blocks=1,
                              num_different_global_patterns=2).make_layout(256)
    assert torch.equal(two[0], two[2]) and torch.equal(two[1], two[3]) and not torch.equal(two[0], two[1])


@pytest.mark.parametrize("seq_len,block", GRID)
def test_variable_deterministic_matches_definition(seq_len, block):
    n = seq_len // block
    for windows in ([4], [1], [2, 3], [1, 2, 5], [3, 1]):
        for starts, ends in [([0], None), ([1, 5], None), ([0, 3], [2, 6]), ([2], [40]), ([], None), ([30], None)]:
            for attention, horizontal in ATTENTIONS:
                cfg = VariableSparsityConfig(2, block, False, 0, windows, starts, ends, attention, horizontal)
                layout = cfg.make_layout(seq_len)
                _assert_layout(layout, 2, n)
                expected = variable_reference(n, windows, starts, ends, attention, horizontal)
                assert torch.equal(layout[0], expected) and torch.equal(layout[1], expected), cfg


@pytest.mark.parametrize("seq_len,block", GRID)
def test_bigbird_deterministic_matches_definition(seq_len, block):
    n = seq_len // block
    for window in (1, 2, 3, 4, 5, 7):
        for glob in (0, 1, 2):
            if window > n or glob > n:
                continue
            for attention in ("bidirectional", "unidirectional"):
                layout = BigBirdSparsityConfig(4, block, False, 0, window, glob, attention).make_layout(seq_len)
                _assert_layout(layout, 4, n)
                expected = bigbird_reference(n, window, glob, attention)
                assert all(torch.equal(layout[h], expected) for h in range(4)), (seq_len, block, window, glob)


@pytest.mark.parametrize("seq_len,block", GRID)
def test_longformer_and_sliding_window_match_definition(seq_len, block):
    n = seq_len // block
    for window in (1, 2, 3, 4, 5):
        if window > n:
            continue
        for attention in ("bidirectional", "unidirectional"):
            for starts, ends in [([0], None), ([1, 5], None), ([0, 3], [2, 6]), ([2], [40]), ([], None)]:
                cfg = BSLongformerSparsityConfig(2, block, False, window, starts, ends, attention)
                layout = cfg.make_layout(seq_len)
                _assert_layout(layout, 2, n)
                expected = longformer_reference(n, window, starts, ends, attention)
                assert torch.equal(layout[0], expected) and torch.equal(layout[1], expected), cfg
            layout = LocalSlidingWindowSparsityConfig(2, block, window, attention).make_layout(seq_len)
            _assert_layout(layout, 2, n)
            assert torch.equal(layout[1], sliding_reference(n, window, attention))


# ----------------------------------------------------------------------------------------------
# Random blocks
# ----------------------------------------------------------------------------------------------

def _random_row_counts_ok(layout_head, num_random, attention):
    """With only the diagonal deterministic, row r holds k random blocks (k = num_random, or
    min(num_random, r + 1) when unidirectional) plus the diagonal unless it was drawn."""
    n = layout_head.shape[0]
    for r in range(n):
        k = num_random if attention == "bidirectional" else min(num_random, r + 1)
        count = int(layout_head[r].sum())
        assert layout_head[r, r] == 1
        assert count in (k, k + 1), (r, count, k)
        if attention == "unidirectional":
            assert int(layout_head[r, r + 1:].sum()) == 0
    return True


@pytest.mark.parametrize("attention", ["bidirectional", "unidirectional"])
def test_bigbird_random_blocks_per_row(attention):
    for seq_len, block in [(256, 16), (512, 16), (512, 32)]:
        for num_random in (1, 2, 3):
            cfg = BigBirdSparsityConfig(2, block, True, num_random, 1, 0, attention, seed=11)
            layout = cfg.make_layout(seq_len)
            for h in range(2):
                assert _random_row_counts_ok(layout[h], num_random, attention)
            # With a window and globals, the random blocks are extra: at most num_random per row.
            cfg = BigBirdSparsityConfig(2, block, False, num_random, 3, 1, attention, seed=5)
            layout = cfg.make_layout(seq_len)
            det = bigbird_reference(seq_len // block, 3, 1, attention)
            assert torch.all(layout[0] >= det)
            extra = (layout[0] - det).sum(dim=1)
            assert int(extra.max()) <= num_random


@pytest.mark.parametrize("attention", ["bidirectional", "unidirectional"])
def test_variable_random_blocks_per_row(attention):
    cfg = VariableSparsityConfig(2, 16, True, 3, [1], [], None, attention, seed=2)
    layout = cfg.make_layout(512)
    for h in range(2):
        assert _random_row_counts_ok(layout[h], 3, attention)
    assert not torch.equal(layout[0], layout[1]), "per-head layouts should draw different random blocks"


def test_random_blocks_cover_all_columns_over_seeds():
    n = 16
    hits = torch.zeros(n)
    for seed in range(200):
        layout = BigBirdSparsityConfig(1, 16, False, 2, 1, 0, seed=seed).make_layout(16 * n)
        hits += (layout[0] - torch.eye(n, dtype=torch.int64)).clamp(min=0).sum(dim=0)
    # 200 * 16 rows draw 2 of 16 columns each: 400 draws per column, minus ~25 that hit the diagonal.
    assert float(hits.min()) > 300 and float(hits.max()) < 450, hits


def test_seeded_layouts_are_reproducible():
    for make in (lambda s: BigBirdSparsityConfig(2, 16, True, 3, seed=s),
                 lambda s: VariableSparsityConfig(2, 16, True, 3, seed=s)):
        cfg = make(123)
        first = cfg.make_layout(512)
        assert torch.equal(first, cfg.make_layout(512)), "same config, same seed: same layout on every call"
        assert torch.equal(first, make(123).make_layout(512))
        assert not torch.equal(first, make(124).make_layout(512))
        assert not torch.equal(first[0], first[1])


def test_unseeded_layouts_follow_global_random():
    cfg = BigBirdSparsityConfig(2, 16, True, 3)
    random.seed(99)
    first = cfg.make_layout(512)
    second = cfg.make_layout(512)
    random.seed(99)
    assert torch.equal(first, cfg.make_layout(512))
    assert not torch.equal(first, second)


def test_shared_layout_propagates_head_zero_with_random_blocks():
    for cfg in (BigBirdSparsityConfig(4, 16, False, 3, seed=1), VariableSparsityConfig(4, 16, False, 3, seed=1)):
        layout = cfg.make_layout(512)
        for h in range(1, 4):
            assert torch.equal(layout[h], layout[0])


def test_check_and_propagate_first_head_layout():
    gen = torch.Generator().manual_seed(0)
    layout = torch.randint(0, 2, (3, 4, 4), generator=gen)
    shared = FixedSparsityConfig(3).check_and_propagate_first_head_layout(layout.clone())
    assert all(torch.equal(shared[h], layout[0]) for h in range(3))
    cfg = FixedSparsityConfig(3, different_layout_per_head=True)
    assert torch.equal(cfg.check_and_propagate_first_head_layout(layout.clone()), layout)
    with pytest.raises(ValueError, match="num_heads=3"):
        FixedSparsityConfig(3).check_and_propagate_first_head_layout(torch.zeros(2, 4, 4, dtype=torch.int64))


def test_setup_layout_and_base_class():
    cfg = SparsityConfig(3, 32)
    layout = cfg.setup_layout(128)
    assert layout.shape == (3, 4, 4) and layout.dtype == torch.int64 and int(layout.sum()) == 0
    assert cfg.num_layout_heads == 1 and SparsityConfig(3, 32, True).num_layout_heads == 3
    with pytest.raises(NotImplementedError, match="FixedSparsityConfig"):
        cfg.make_layout(128)


def test_repr_names_the_arguments():
    text = repr(BigBirdSparsityConfig(2, 32, num_random_blocks=2, seed=7))
    assert text.startswith("BigBirdSparsityConfig(num_heads=2, block=32, ")
    assert "num_random_blocks=2" in text and "seed=7" in text


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------

BAD = [
    (lambda: DenseSparsityConfig(2).make_layout(100), ValueError, r"seq_len \(100\).*block \(16\).*pad_to_block_size"),
    (lambda: DenseSparsityConfig(2, 32).make_layout(16), ValueError, r"seq_len \(16\)"),
    (lambda: DenseSparsityConfig(2).make_layout(0), ValueError, "seq_len"),
    (lambda: DenseSparsityConfig(2).make_layout(64.0), TypeError, "seq_len"),
    (lambda: DenseSparsityConfig(0), ValueError, "num_heads"),
    (lambda: DenseSparsityConfig("2"), TypeError, "num_heads"),
    (lambda: DenseSparsityConfig(2, 24), ValueError, r"block must be one of \(16, 32, 64, 128\)"),
    (lambda: DenseSparsityConfig(2, True), TypeError, "block"),
    (lambda: DenseSparsityConfig(2, 16, 1), TypeError, "different_layout_per_head"),
    (lambda: FixedSparsityConfig(2, num_local_blocks=4, num_global_blocks=3), ValueError,
     r"num_local_blocks \(4\) must be divisible by num_global_blocks \(3\)"),
    (lambda: FixedSparsityConfig(2, num_local_blocks=0), ValueError, "num_local_blocks"),
    (lambda: FixedSparsityConfig(2, num_global_blocks=0), ValueError, "num_global_blocks"),
    (lambda: FixedSparsityConfig(2, num_different_global_patterns=2, num_local_blocks=4), ValueError,
     "needs different_layout_per_head=True"),
    (lambda: FixedSparsityConfig(2, different_layout_per_head=True, num_local_blocks=4, num_global_blocks=2,
                                 num_different_global_patterns=3), ValueError,
     r"num_different_global_patterns \(3\) cannot exceed .* = 2"),
    (lambda: FixedSparsityConfig(2, attention="unidirectional", horizontal_global_attention=True), ValueError,
     "horizontal_global_attention=True needs attention='bidirectional'"),
    (lambda: FixedSparsityConfig(2, attention="causal"), ValueError, "attention must be 'unidirectional'"),
    (lambda: FixedSparsityConfig(2, horizontal_global_attention="yes"), TypeError, "horizontal_global_attention"),
    (lambda: VariableSparsityConfig(2, global_block_indices=[0, 4], global_block_end_indices=[2]), ValueError,
     "global_block_end_indices has 1 entries but global_block_indices has 2"),
    (lambda: VariableSparsityConfig(2, global_block_indices=[3], global_block_end_indices=[3]), ValueError,
     r"global_block_end_indices\[0\] \(3\) must be larger than global_block_indices\[0\] \(3\)"),
    (lambda: VariableSparsityConfig(2, local_window_blocks=[]), ValueError, "local_window_blocks must list"),
    (lambda: VariableSparsityConfig(2, local_window_blocks=[4, 0]), ValueError, r"local_window_blocks\[1\]"),
    (lambda: VariableSparsityConfig(2, local_window_blocks="4"), TypeError, "local_window_blocks"),
    (lambda: VariableSparsityConfig(2, global_block_indices=[-1]), ValueError, r"global_block_indices\[0\]"),
    (lambda: VariableSparsityConfig(2, num_random_blocks=-1), ValueError, "num_random_blocks"),
    (lambda: VariableSparsityConfig(2, attention="unidirectional", horizontal_global_attention=True), ValueError,
     "horizontal_global_attention"),
    (lambda: VariableSparsityConfig(2, attention="bi"), ValueError, "attention"),
    (lambda: VariableSparsityConfig(2, seed="1"), TypeError, "seed"),
    (lambda: VariableSparsityConfig(2, num_random_blocks=5).make_layout(64), ValueError,
     r"num_random_blocks \(5\) is larger than the number of blocks in a row \(4"),
    (lambda: BigBirdSparsityConfig(2, num_random_blocks=5).make_layout(64), ValueError,
     r"num_random_blocks \(5\) is larger.*lower num_random_blocks or use a longer sequence"),
    (lambda: BigBirdSparsityConfig(2, num_sliding_window_blocks=5).make_layout(64), ValueError,
     r"num_sliding_window_blocks \(5\)"),
    (lambda: BigBirdSparsityConfig(2, num_random_blocks=0, num_global_blocks=5).make_layout(64), ValueError,
     r"num_global_blocks \(5\)"),
    (lambda: BigBirdSparsityConfig(2, num_sliding_window_blocks=0), ValueError, "num_sliding_window_blocks"),
    (lambda: BigBirdSparsityConfig(2, num_global_blocks=-1), ValueError, "num_global_blocks"),
    (lambda: BigBirdSparsityConfig(2, attention="forward"), ValueError, "attention"),
    (lambda: BigBirdSparsityConfig(2, seed=1.5), TypeError, "seed"),
    (lambda: BSLongformerSparsityConfig(2, global_block_indices=[0, 1], global_block_end_indices=[1]), ValueError,
     "global_block_end_indices has 1 entries"),
    (lambda: BSLongformerSparsityConfig(2, global_block_indices=[2], global_block_end_indices=[1]), ValueError,
     r"global_block_end_indices\[0\] \(1\)"),
    (lambda: BSLongformerSparsityConfig(2, attention="left"), ValueError, "attention"),
    (lambda: BSLongformerSparsityConfig(2, num_sliding_window_blocks=9).make_layout(128), ValueError,
     r"num_sliding_window_blocks \(9\)"),
    (lambda: LocalSlidingWindowSparsityConfig(2, attention="both"), ValueError, "attention"),
    (lambda: LocalSlidingWindowSparsityConfig(2, num_sliding_window_blocks=0), ValueError,
     "num_sliding_window_blocks"),
    (lambda: LocalSlidingWindowSparsityConfig(2, num_sliding_window_blocks=9).make_layout(128), ValueError,
     r"num_sliding_window_blocks \(9\)"),
]


@pytest.mark.parametrize("make,error,match", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_arguments_raise_clear_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


# ----------------------------------------------------------------------------------------------
# DeepSpeed compatibility: signatures and layouts
# ----------------------------------------------------------------------------------------------

#: DeepSpeed's constructor parameters (deepspeed/ops/sparse_attention/sparsity_config.py, up to 0.16.x).
DS_SIGNATURES = {
    "SparsityConfig": [("num_heads", None), ("block", 16), ("different_layout_per_head", False)],
    "DenseSparsityConfig": [("num_heads", None), ("block", 16), ("different_layout_per_head", False)],
    "FixedSparsityConfig": [("num_heads", None), ("block", 16), ("different_layout_per_head", False),
                            ("num_local_blocks", 4), ("num_global_blocks", 1), ("attention", "bidirectional"),
                            ("horizontal_global_attention", False), ("num_different_global_patterns", 1)],
    "VariableSparsityConfig": [("num_heads", None), ("block", 16), ("different_layout_per_head", False),
                               ("num_random_blocks", 0), ("local_window_blocks", [4]), ("global_block_indices", [0]),
                               ("global_block_end_indices", None), ("attention", "bidirectional"),
                               ("horizontal_global_attention", False)],
    "BigBirdSparsityConfig": [("num_heads", None), ("block", 16), ("different_layout_per_head", False),
                              ("num_random_blocks", 1), ("num_sliding_window_blocks", 3), ("num_global_blocks", 1),
                              ("attention", "bidirectional")],
    "BSLongformerSparsityConfig": [("num_heads", None), ("block", 16), ("different_layout_per_head", False),
                                   ("num_sliding_window_blocks", 3), ("global_block_indices", [0]),
                                   ("global_block_end_indices", None), ("attention", "bidirectional")],
    "LocalSlidingWindowSparsityConfig": [("num_heads", None), ("block", 16), ("num_sliding_window_blocks", 3),
                                         ("attention", "unidirectional")],
}
EXTRA_SEED = {"VariableSparsityConfig", "BigBirdSparsityConfig"}


def _params(cls):
    out = []
    for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        default = None if p.default is inspect.Parameter.empty else p.default
        out.append((p.name, list(default) if isinstance(default, tuple) else default))
    return out


def test_signatures_follow_deepspeed():
    import microspeed_sparse_attn.sparsity_config as ours

    for name, expected in DS_SIGNATURES.items():
        params = _params(getattr(ours, name))
        if name in EXTRA_SEED:
            assert params[-1] == ("seed", None)
            params = params[:-1]
        assert params == expected, name


def _load_deepspeed_sparsity_config():
    """DeepSpeed's sparsity_config module, or None (see the module docstring for where it is looked up)."""
    candidates = []
    spec = importlib.util.find_spec("deepspeed")
    if spec is not None and spec.submodule_search_locations:
        package_dir = Path(next(iter(spec.submodule_search_locations))) / "ops" / "sparse_attention"
        if (package_dir / "__init__.py").is_file():
            try:
                return importlib.import_module("deepspeed.ops.sparse_attention.sparsity_config")
            except Exception:  # its Triton-1.0 kernels may not import; load the file alone below
                pass
        candidates.append(package_dir / "sparsity_config.py")
    if os.environ.get("MICROSPEED_DS_SPARSITY_CONFIG"):
        candidates.append(Path(os.environ["MICROSPEED_DS_SPARSITY_CONFIG"]))
    for path in candidates:
        if path.is_file():
            file_spec = importlib.util.spec_from_file_location("_deepspeed_sparsity_config", path)
            module = importlib.util.module_from_spec(file_spec)
            file_spec.loader.exec_module(module)
            return module
    return None


@pytest.fixture(scope="module")
def ds():
    module = _load_deepspeed_sparsity_config()
    if module is None:
        pytest.skip("DeepSpeed's sparsity_config.py is not available: deepspeed 0.19.8 removed sparse attention "
                    "(deepspeedai/DeepSpeed#8489). Point MICROSPEED_DS_SPARSITY_CONFIG at the file from an "
                    "older release (e.g. deepspeed 0.16.9's deepspeed/ops/sparse_attention/sparsity_config.py); "
                    "test_layouts_equal_recorded_deepspeed_layouts compares with its recorded layouts meanwhile.")
    return module


def _ds_cases(kind):
    """(class name, positional args after num_heads, seq_len, random seed or None) for each compared layout."""
    cases = []
    for seq_len, block in GRID:
        n = seq_len // block
        if kind == "dense":
            cases.append(("DenseSparsityConfig", (block, False), seq_len, None))
        elif kind == "fixed":
            for local, glob in [(1, 1), (2, 1), (4, 1), (4, 2), (3, 1), (6, 2), (8, 4)]:
                if glob > n:  # DeepSpeed's negative-index slicing wraps around there
                    continue
                for attention, horizontal in ATTENTIONS:
                    for per_head, patterns in [(False, 1)] + [(True, p) for p in range(1, local // glob + 1)]:
                        args = (block, per_head, local, glob, attention, horizontal, patterns)
                        cases.append(("FixedSparsityConfig", args, seq_len, None))
        elif kind == "variable":
            for windows in ([4], [1], [2, 3], [1, 2, 5]):
                for starts, ends in [([0], None), ([1, 5], None), ([0, 3], [2, 6]), ([2], [40]), ([30], None)]:
                    for attention, horizontal in ATTENTIONS:
                        for random_blocks in (0, 2):
                            if random_blocks > n or (random_blocks and attention == "unidirectional"):
                                continue  # DeepSpeed draws unidirectional random blocks in the future; we do not
                            args = (block, True, random_blocks, windows, starts, ends, attention, horizontal)
                            cases.append(("VariableSparsityConfig", args, seq_len, 7 if random_blocks else None))
        elif kind == "bigbird":
            for random_blocks, window, glob in [(0, 3, 1), (0, 1, 0), (0, 5, 2), (1, 3, 1), (2, 4, 1), (3, 1, 0)]:
                if max(random_blocks, window, glob) > n:
                    continue
                for attention in ("bidirectional", "unidirectional"):
                    if attention == "unidirectional" and random_blocks > 1:
                        continue  # DeepSpeed's random.sample fails there (row 0 has one visible block)
                    for per_head in (False, True):
                        args = (block, per_head, random_blocks, window, glob, attention)
                        cases.append(("BigBirdSparsityConfig", args, seq_len, 7 if random_blocks else None))
        elif kind == "bslongformer":
            for window in (1, 2, 3, 5):
                if window > n:
                    continue
                for starts, ends in [([0], None), ([1, 5], None), ([0, 3], [2, 6]), ([2], [40]), ([], None)]:
                    for attention in ("bidirectional", "unidirectional"):
                        args = (block, False, window, starts, ends, attention)
                        cases.append(("BSLongformerSparsityConfig", args, seq_len, None))
        elif kind == "local":
            for window in (1, 2, 3, 5):
                if window > n:
                    continue
                for attention in ("bidirectional", "unidirectional"):
                    cases.append(("LocalSlidingWindowSparsityConfig", (block, window, attention), seq_len, None))
    return cases


@pytest.mark.parametrize("kind", ["dense", "fixed", "variable", "bigbird", "bslongformer", "local"])
def test_layouts_equal_deepspeed(ds, kind):
    """Every deterministic layout equals DeepSpeed's (unidirectional: with its few future blocks removed); random
    ones with ``seed=None`` draw exactly as DeepSpeed does from the same global ``random`` state."""
    import microspeed_sparse_attn.sparsity_config as ours

    cases = _ds_cases(kind)
    assert cases
    for name, args, seq_len, seed in cases:
        for heads in HEADS:
            if seed is not None:
                random.seed(seed)
            mine = getattr(ours, name)(heads, *args).make_layout(seq_len)
            if seed is not None:
                random.seed(seed)
            theirs = getattr(ds, name)(heads, *args).make_layout(seq_len)
            if "unidirectional" in args:
                theirs = torch.tril(theirs)
            assert torch.equal(mine, theirs), (name, heads, args, seq_len)


DIGESTS = Path(__file__).with_name("deepspeed_0_16_9_layouts.json")
"""DeepSpeed 0.16.9's layouts for every case of :func:`_ds_cases`, as digests (its last release with sparse
attention; 0.19.8, the reference installed here, has none). Written by ``python <this file> --record`` with
``MICROSPEED_DS_SPARSITY_CONFIG`` pointing at 0.16.9's ``sparsity_config.py``."""


def _layout_digests(module) -> dict[str, list[str]]:
    """``{kind: [digest of each case's layouts for every head count, in _ds_cases order]}`` made by ``module``."""
    import hashlib

    out: dict[str, list[str]] = {}
    for kind in ("dense", "fixed", "variable", "bigbird", "bslongformer", "local"):
        for name, args, seq_len, seed in _ds_cases(kind):
            h = hashlib.sha1()
            for heads in HEADS:
                if seed is not None:
                    random.seed(seed)
                layout = getattr(module, name)(heads, *args).make_layout(seq_len)
                if "unidirectional" in args:
                    layout = torch.tril(layout)
                h.update(layout.to(torch.int64).contiguous().numpy().tobytes())
            out.setdefault(kind, []).append(h.hexdigest()[:8])
    return out


def test_layouts_equal_recorded_deepspeed_layouts():
    """Runs everywhere: the same comparison as :func:`test_layouts_equal_deepspeed`, against DeepSpeed's recorded
    layouts (unidirectional ones with its few future blocks removed)."""
    import json

    import microspeed_sparse_attn.sparsity_config as ours

    recorded = json.loads(DIGESTS.read_text())
    state = random.getstate()
    try:
        mine = _layout_digests(ours)
    finally:
        random.setstate(state)
    assert set(mine) == set(recorded) and sum(map(len, recorded.values())) > 1000
    for kind, digests in recorded.items():
        cases = _ds_cases(kind)
        assert len(digests) == len(cases), kind
        different = [cases[i][:3] for i, (a, b) in enumerate(zip(mine[kind], digests, strict=True)) if a != b]
        assert not different, f"{len(different)} {kind} layouts differ from DeepSpeed's, e.g. {different[:3]}"


def test_signatures_equal_deepspeed_module(ds):
    import microspeed_sparse_attn.sparsity_config as ours

    for name in DS_SIGNATURES:
        params = _params(getattr(ours, name))
        if name in EXTRA_SEED:
            params = params[:-1]
        assert params == _params(getattr(ds, name)), name


if __name__ == "__main__":
    import json
    import sys

    if sys.argv[1:] != ["--record"]:
        raise SystemExit("usage: MICROSPEED_DS_SPARSITY_CONFIG=<0.16.9 sparsity_config.py> python "
                         "test_sparsity_config.py --record")
    module = _load_deepspeed_sparsity_config()
    if module is None:
        raise SystemExit("set MICROSPEED_DS_SPARSITY_CONFIG to DeepSpeed 0.16.9's sparsity_config.py")
    DIGESTS.write_text(json.dumps(_layout_digests(module), sort_keys=True) + "\n")
    print(f"wrote {DIGESTS}")
