"""Sparsity configurations: which key blocks each query block attends to, DeepSpeed-compatible.

A *layout* is an int64 0/1 tensor of shape ``(num_heads, seq_len // block, seq_len // block)``;
``layout[h, r, c] == 1`` means that, in head ``h``, the queries of block ``r`` attend to the keys
of block ``c``. The classes, their constructor arguments (names, order, defaults) and their
layouts follow DeepSpeed's ``deepspeed.ops.sparse_attention.sparsity_config``:

* :class:`DenseSparsityConfig` — every block (for comparison).
* :class:`FixedSparsityConfig` — local windows plus per-window global "summary" blocks
  (Sparse Transformers, https://arxiv.org/abs/1904.10509).
* :class:`VariableSparsityConfig` — local windows of listed sizes, random blocks, global blocks.
* :class:`BigBirdSparsityConfig` — sliding window, random blocks, leading global blocks
  (https://arxiv.org/abs/2007.14062).
* :class:`BSLongformerSparsityConfig` — sliding window plus global blocks (block-sparse
  Longformer, https://arxiv.org/abs/2004.05150).
* :class:`LocalSlidingWindowSparsityConfig` — a sliding window only.

Deliberate differences from DeepSpeed (all stricter or safer, none changes a valid
bidirectional layout):

* A ``'unidirectional'`` layout never has a block above the diagonal. DeepSpeed's Fixed (with
  ``num_global_blocks > 1``) and Variable (with ``global_block_end_indices``, or random blocks)
  layouts could mark a few future blocks; ours are exactly DeepSpeed's layout with those removed.
* Random blocks of a unidirectional layout are drawn among the blocks a row may see; a row ``r``
  that sees fewer than ``num_random_blocks`` blocks gets all ``r + 1`` of them (DeepSpeed's
  BigBird raised an opaque ``random.sample`` error there).
* Arguments are validated up front, with messages that name the argument and the fix, and
  wrong types raise :class:`TypeError`. An unknown ``attention`` raises :class:`ValueError`
  (DeepSpeed raised ``NotImplementedError``; BSLongformer and LocalSlidingWindow did not check).
* ``block`` must be one of :data:`SUPPORTED_BLOCK_SIZES` (what the block-sparse kernels run).
* The configs that draw random blocks take an extra keyword ``seed`` (last). With ``seed=None``
  the draws come from Python's global :mod:`random` exactly as DeepSpeed draws them (so
  ``random.seed(s)`` reproduces DeepSpeed's layout); with an integer seed every
  :meth:`~SparsityConfig.make_layout` call uses a fresh ``random.Random(seed)``, so the layout
  is a pure function of the config and ``seq_len`` — the same on every call and every rank.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "SUPPORTED_BLOCK_SIZES",
    "SparsityConfig",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "VariableSparsityConfig",
    "BigBirdSparsityConfig",
    "BSLongformerSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
]

#: Block sizes the block-sparse kernels support.
SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)

_ATTENTION_TYPES = ("unidirectional", "bidirectional")


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer >= {minimum}, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}.")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__}).")
    return value


def _check_attention(value: Any) -> str:
    if value not in _ATTENTION_TYPES:
        raise ValueError(
            f"attention must be 'unidirectional' (each block attends only to itself and earlier blocks, "
            f"e.g. GPT) or 'bidirectional' (e.g. BERT), got {value!r}."
        )
    return value


def _check_int_list(name: str, value: Any, minimum: int, allow_empty: bool) -> list[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list of integers >= {minimum}, got {value!r} ({type(value).__name__}).")
    items = list(value)
    if not items and not allow_empty:
        raise ValueError(f"{name} must list at least one integer >= {minimum}, got an empty list.")
    for i, item in enumerate(items):
        _check_int(f"{name}[{i}]", item, minimum)
    return items


def _check_global_ranges(starts: list[int], ends: Any) -> list[int] | None:
    if ends is None:
        return None
    ends = _check_int_list("global_block_end_indices", ends, 1, allow_empty=True)
    if len(ends) != len(starts):
        raise ValueError(
            f"global_block_end_indices has {len(ends)} entries but global_block_indices has {len(starts)}; "
            "give one (exclusive) end per start, or pass global_block_end_indices=None for single global blocks."
        )
    for i, (start, end) in enumerate(zip(starts, ends, strict=True)):
        if end <= start:
            raise ValueError(
                f"global_block_end_indices[{i}] ({end}) must be larger than global_block_indices[{i}] ({start}): "
                "the range [start, end) of global blocks would be empty."
            )
    return ends


def _check_seed(seed: Any) -> int | None:
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an integer or None, got {seed!r} ({type(seed).__name__}).")
    return seed


def _check_fits(name: str, value: int, num_blocks: int, seq_len_hint: str) -> None:
    if num_blocks < value:
        raise ValueError(
            f"{name} ({value}) is larger than the number of blocks in a row ({num_blocks}, {seq_len_hint}); "
            f"lower {name} or use a longer sequence."
        )


def _band(num_blocks: int, half_width: int) -> torch.Tensor:
    """Boolean ``(n, n)`` mask of the blocks within ``half_width`` of the diagonal."""
    idx = torch.arange(num_blocks)
    return (idx[:, None] - idx[None, :]).abs() <= half_width


def _draw_random_blocks(head: torch.Tensor, num_random_blocks: int, unidirectional: bool, rng: Any) -> None:
    """Mark ``num_random_blocks`` distinct random key blocks in every row of ``head``.

    Bidirectional rows draw among all blocks; unidirectional rows among blocks ``0..row``
    (all of them when there are fewer than ``num_random_blocks``).
    """
    num_blocks = head.shape[0]
    for row in range(num_blocks):
        pool = range(0, row + 1) if unidirectional else range(0, num_blocks)
        cols = rng.sample(pool, min(num_random_blocks, len(pool)))
        head[row, cols] = 1


class SparsityConfig:
    """Base class of all sparsity configurations: number of heads, block size, shared or per-head layout.

    Subclasses define the pattern of one head; :meth:`make_layout` builds all heads, copies head
    0 to every head unless ``different_layout_per_head`` is set, and removes blocks above the
    diagonal for ``attention='unidirectional'``.

    Arguments:
        num_heads: number of attention heads of the layer (>= 1).
        block: block size in tokens; the layout has one entry per ``block x block`` tile. One of
            :data:`SUPPORTED_BLOCK_SIZES`.
        different_layout_per_head: give each head its own layout (where the pattern has
            per-head variation: random blocks, Fixed's global patterns); otherwise every head uses
            head 0's layout.
    """

    def __init__(self, num_heads, block=16, different_layout_per_head=False):
        self.num_heads = _check_int("num_heads", num_heads, 1)
        if isinstance(block, bool) or not isinstance(block, int):
            raise TypeError(f"block must be an integer, one of {SUPPORTED_BLOCK_SIZES}; got {block!r}.")
        if block not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(
                f"block must be one of {SUPPORTED_BLOCK_SIZES} (the block sizes the sparse kernels support), "
                f"got {block}."
            )
        self.block = block
        self.different_layout_per_head = _check_bool("different_layout_per_head", different_layout_per_head)
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def __repr__(self) -> str:
        names = [p for p in inspect.signature(type(self).__init__).parameters if p != "self"]
        args = ", ".join(f"{name}={getattr(self, name)!r}" for name in names)
        return f"{type(self).__name__}({args})"

    def setup_layout(self, seq_len):
        """Return an all-zero layout ``(num_heads, seq_len // block, seq_len // block)`` of dtype int64.

        Raises :class:`ValueError` when ``seq_len`` is not a positive multiple of ``block``.
        """
        if isinstance(seq_len, bool) or not isinstance(seq_len, int):
            raise TypeError(f"seq_len must be an integer, got {seq_len!r} ({type(seq_len).__name__}).")
        if seq_len <= 0 or seq_len % self.block != 0:
            raise ValueError(
                f"seq_len ({seq_len}) must be a positive multiple of block ({self.block}); pad the sequence with "
                "SparseAttentionUtils.pad_to_block_size, or choose a block that divides seq_len."
            )
        num_blocks = seq_len // self.block
        return torch.zeros((self.num_heads, num_blocks, num_blocks), dtype=torch.int64)

    def check_and_propagate_first_head_layout(self, layout):
        """Copy head 0's layout into every head when ``different_layout_per_head`` is False; return ``layout``.

        ``layout`` (``(num_heads, n, n)``) is modified in place.
        """
        if not isinstance(layout, torch.Tensor) or layout.dim() != 3 or layout.shape[0] != self.num_heads:
            shape = tuple(layout.shape) if isinstance(layout, torch.Tensor) else type(layout).__name__
            raise ValueError(f"layout must be a tensor of shape (num_heads={self.num_heads}, n, n), got {shape}.")
        if not self.different_layout_per_head:
            layout[1:] = layout[0]
        return layout

    def make_layout(self, seq_len):
        """Return the layout ``(num_heads, seq_len // block, seq_len // block)`` (int64, 0/1) for ``seq_len``."""
        layout = self.setup_layout(seq_len)
        seed = getattr(self, "seed", None)
        rng = random if seed is None else random.Random(seed)
        for h in range(self.num_layout_heads):
            self._fill_head(h, layout[h], rng)
        if getattr(self, "attention", None) == "unidirectional":
            layout = torch.tril(layout)
        return self.check_and_propagate_first_head_layout(layout)

    def _fill_head(self, h: int, head: torch.Tensor, rng: Any) -> None:
        """Set head ``h``'s blocks in ``head`` (a ``(n, n)`` view), drawing random blocks from ``rng``."""
        raise NotImplementedError(
            f"{type(self).__name__} defines no pattern; use one of DenseSparsityConfig, FixedSparsityConfig, "
            "VariableSparsityConfig, BigBirdSparsityConfig, BSLongformerSparsityConfig or "
            "LocalSlidingWindowSparsityConfig, or implement _fill_head in your subclass."
        )


class DenseSparsityConfig(SparsityConfig):
    """Every query block attends to every key block (not sparse; a baseline for comparison).

    Arguments: as :class:`SparsityConfig`; ``different_layout_per_head`` has no effect.
    """

    def __init__(self, num_heads, block=16, different_layout_per_head=False):
        super().__init__(num_heads, block, different_layout_per_head)

    def _fill_head(self, h: int, head: torch.Tensor, rng: Any) -> None:
        head.fill_(1)


class FixedSparsityConfig(SparsityConfig):
    """`Fixed` pattern of Sparse Transformers (https://arxiv.org/abs/1904.10509), as customised by DeepSpeed.

    The blocks are cut into consecutive local windows of ``num_local_blocks`` blocks (the last one
    may be shorter); every block attends to the blocks of its own window. In each full window the
    ``num_global_blocks`` consecutive blocks that end ``p * num_global_blocks`` blocks before the
    window's end (``p = h % num_different_global_patterns``; ``p = 0``: the last blocks) are
    *global*: every block attends to them. In a shorter last window the global blocks sit at the
    same offset from the window's start, moved left to fit inside the sequence.

    Arguments:
        num_heads, block, different_layout_per_head: see :class:`SparsityConfig`.
        num_local_blocks: blocks per local window (>= 1).
        num_global_blocks: global blocks per window (>= 1); must divide ``num_local_blocks``.
        attention: ``'bidirectional'`` or ``'unidirectional'`` (no block above the diagonal).
        horizontal_global_attention: global blocks also attend to every block (bidirectional only).
        num_different_global_patterns: how many heads use different global positions within the
            window (head ``h`` uses pattern ``h % num_different_global_patterns``); at most
            ``num_local_blocks // num_global_blocks``, and > 1 only with ``different_layout_per_head``.
    """

    def __init__(self,
                 num_heads,
                 block=16,
                 different_layout_per_head=False,
                 num_local_blocks=4,
                 num_global_blocks=1,
                 attention="bidirectional",
                 horizontal_global_attention=False,
                 num_different_global_patterns=1):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_local_blocks = _check_int("num_local_blocks", num_local_blocks, 1)
        self.num_global_blocks = _check_int("num_global_blocks", num_global_blocks, 1)
        if num_local_blocks % num_global_blocks != 0:
            raise ValueError(
                f"num_local_blocks ({num_local_blocks}) must be divisible by num_global_blocks ({num_global_blocks}); "
                "choose num_global_blocks among the divisors of num_local_blocks."
            )
        self.attention = _check_attention(attention)
        self.horizontal_global_attention = _check_bool("horizontal_global_attention", horizontal_global_attention)
        if horizontal_global_attention and attention != "bidirectional":
            raise ValueError(
                "horizontal_global_attention=True needs attention='bidirectional' (a global row would attend to "
                "future blocks); set horizontal_global_attention=False or use bidirectional attention."
            )
        self.num_different_global_patterns = _check_int(
            "num_different_global_patterns", num_different_global_patterns, 1)
        if num_different_global_patterns > 1 and not different_layout_per_head:
            raise ValueError(
                f"num_different_global_patterns={num_different_global_patterns} needs different_layout_per_head=True "
                "(with one layout for all heads there is only one pattern); set different_layout_per_head=True "
                "or num_different_global_patterns=1."
            )
        max_patterns = num_local_blocks // num_global_blocks
        if num_different_global_patterns > max_patterns:
            raise ValueError(
                f"num_different_global_patterns ({num_different_global_patterns}) cannot exceed num_local_blocks // "
                f"num_global_blocks = {num_local_blocks} // {num_global_blocks} = {max_patterns} (the number of "
                "distinct global positions in a window); lower it to at most that."
            )

    def _global_starts(self, h: int, num_blocks: int) -> list[int]:
        """First block of each global run of head ``h``."""
        local, glob = self.num_local_blocks, self.num_global_blocks
        offset = local - (1 + h % self.num_different_global_patterns) * glob
        full = num_blocks - num_blocks % local
        starts = list(range(offset, full, local))
        if full < num_blocks:
            starts.append(max(0, min(full + offset, num_blocks - glob)))
        return starts

    def _fill_head(self, h: int, head: torch.Tensor, rng: Any) -> None:
        num_blocks = head.shape[0]
        window = torch.arange(num_blocks) // self.num_local_blocks
        head[window[:, None] == window[None, :]] = 1
        for start in self._global_starts(h, num_blocks):
            end = min(start + self.num_global_blocks, num_blocks)
            head[:, start:end] = 1
            if self.horizontal_global_attention:
                head[start:end, :] = 1


class VariableSparsityConfig(SparsityConfig):
    """Fixed-like pattern with local windows of listed sizes, random blocks and listed global blocks.

    * Local windows: consecutive windows of ``local_window_blocks[0]``, ``local_window_blocks[1]``, …
      blocks; the last size repeats until the sequence is covered. A block attends to its window.
    * Random: every row attends to ``num_random_blocks`` distinct random blocks.
    * Global: the blocks ``global_block_indices`` (or, with ``global_block_end_indices``, the
      ranges ``[global_block_indices[i], global_block_end_indices[i])``) are attended by every
      block; with ``horizontal_global_attention`` they also attend to every block. Indices past
      the sequence are ignored.

    Arguments:
        num_heads, block, different_layout_per_head: see :class:`SparsityConfig` (per-head layouts
            differ only in their random blocks).
        num_random_blocks: random blocks per row (>= 0).
        local_window_blocks: non-empty list of window sizes in blocks (each >= 1).
        global_block_indices: list of global block indices (each >= 0), or starts of global ranges.
        global_block_end_indices: None, or one exclusive end per entry of ``global_block_indices``.
        attention: ``'bidirectional'`` or ``'unidirectional'`` (no block above the diagonal).
        horizontal_global_attention: global blocks also attend to every block (bidirectional only).
        seed: None (draw from Python's global :mod:`random`, like DeepSpeed) or an integer (the
            layout is then the same on every call and rank). Not a DeepSpeed argument.
    """

    def __init__(self,
                 num_heads,
                 block=16,
                 different_layout_per_head=False,
                 num_random_blocks=0,
                 local_window_blocks=(4,),
                 global_block_indices=(0,),
                 global_block_end_indices=None,
                 attention="bidirectional",
                 horizontal_global_attention=False,
                 seed=None):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_random_blocks = _check_int("num_random_blocks", num_random_blocks, 0)
        self.local_window_blocks = _check_int_list("local_window_blocks", local_window_blocks, 1, allow_empty=False)
        self.global_block_indices = _check_int_list("global_block_indices", global_block_indices, 0,
                                                    allow_empty=True)
        self.global_block_end_indices = _check_global_ranges(self.global_block_indices, global_block_end_indices)
        self.attention = _check_attention(attention)
        self.horizontal_global_attention = _check_bool("horizontal_global_attention", horizontal_global_attention)
        if horizontal_global_attention and attention != "bidirectional":
            raise ValueError(
                "horizontal_global_attention=True needs attention='bidirectional' (a global row would attend to "
                "future blocks); set horizontal_global_attention=False or use bidirectional attention."
            )
        self.seed = _check_seed(seed)

    def _fill_head(self, h: int, head: torch.Tensor, rng: Any) -> None:
        num_blocks = head.shape[0]
        if self.num_random_blocks:
            _check_fits("num_random_blocks", self.num_random_blocks, num_blocks,
                        f"seq_len // block = {num_blocks} with block={self.block}")
            _draw_random_blocks(head, self.num_random_blocks, self.attention == "unidirectional", rng)
        start, k = 0, 0
        while start < num_blocks:
            size = self.local_window_blocks[min(k, len(self.local_window_blocks) - 1)]
            end = min(start + size, num_blocks)
            head[start:end, start:end] = 1
            start, k = start + size, k + 1
        ends = self.global_block_end_indices or [i + 1 for i in self.global_block_indices]
        for first, last in zip(self.global_block_indices, ends, strict=True):
            if first >= num_blocks:
                continue
            last = min(last, num_blocks)
            head[:, first:last] = 1
            if self.horizontal_global_attention:
                head[first:last, :] = 1


class BigBirdSparsityConfig(SparsityConfig):
    """BigBird pattern (https://arxiv.org/abs/2007.14062): sliding window, random and global blocks.

    * Sliding window: row ``r`` attends to blocks ``r - w .. r + w`` with
      ``w = num_sliding_window_blocks // 2`` (clipped at the edges).
    * Random: every row attends to ``num_random_blocks`` distinct random blocks.
    * Global: the first ``num_global_blocks`` blocks attend to, and are attended by, every block.

    Arguments:
        num_heads, block, different_layout_per_head: see :class:`SparsityConfig` (per-head layouts
            differ only in their random blocks).
        num_random_blocks: random blocks per row (>= 0); at most ``seq_len // block``.
        num_sliding_window_blocks: sliding window width in blocks (>= 1); at most ``seq_len // block``.
        num_global_blocks: leading global blocks (>= 0); at most ``seq_len // block``.
        attention: ``'bidirectional'`` or ``'unidirectional'`` (no block above the diagonal).
        seed: None (draw from Python's global :mod:`random`, like DeepSpeed) or an integer (the
            layout is then the same on every call and rank). Not a DeepSpeed argument.
    """

    def __init__(self,
                 num_heads,
                 block=16,
                 different_layout_per_head=False,
                 num_random_blocks=1,
                 num_sliding_window_blocks=3,
                 num_global_blocks=1,
                 attention="bidirectional",
                 seed=None):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_random_blocks = _check_int("num_random_blocks", num_random_blocks, 0)
        self.num_sliding_window_blocks = _check_int("num_sliding_window_blocks", num_sliding_window_blocks, 1)
        self.num_global_blocks = _check_int("num_global_blocks", num_global_blocks, 0)
        self.attention = _check_attention(attention)
        self.seed = _check_seed(seed)

    def _fill_head(self, h: int, head: torch.Tensor, rng: Any) -> None:
        num_blocks = head.shape[0]
        hint = f"seq_len // block = {num_blocks} with block={self.block}"
        _check_fits("num_random_blocks", self.num_random_blocks, num_blocks, hint)
        _check_fits("num_sliding_window_blocks", self.num_sliding_window_blocks, num_blocks, hint)
        _check_fits("num_global_blocks", self.num_global_blocks, num_blocks, hint)
        if self.num_random_blocks:
            _draw_random_blocks(head, self.num_random_blocks, self.attention == "unidirectional", rng)
        head[_band(num_blocks, self.num_sliding_window_blocks // 2)] = 1
        head[:self.num_global_blocks, :] = 1
        head[:, :self.num_global_blocks] = 1


class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse Longformer (https://arxiv.org/abs/2004.05150): sliding window plus global blocks.

    * Sliding window: row ``r`` attends to blocks ``r - w .. r + w`` with
      ``w = num_sliding_window_blocks // 2`` (clipped at the edges).
    * Global: the blocks ``global_block_indices`` (or, with ``global_block_end_indices``, the
      ranges ``[global_block_indices[i], global_block_end_indices[i])``) attend to, and are
      attended by, every block. Indices past the sequence are ignored.

    Arguments:
        num_heads, block, different_layout_per_head: see :class:`SparsityConfig` (the pattern is
            the same for every head).
        num_sliding_window_blocks: sliding window width in blocks (>= 1); at most ``seq_len // block``.
        global_block_indices: list of global block indices (each >= 0), or starts of global ranges.
        global_block_end_indices: None, or one exclusive end per entry of ``global_block_indices``.
        attention: ``'bidirectional'`` or ``'unidirectional'`` (no block above the diagonal).
    """

    def __init__(self,
                 num_heads,
                 block=16,
                 different_layout_per_head=False,
                 num_sliding_window_blocks=3,
                 global_block_indices=(0,),
                 global_block_end_indices=None,
                 attention="bidirectional"):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_sliding_window_blocks = _check_int("num_sliding_window_blocks", num_sliding_window_blocks, 1)
        self.global_block_indices = _check_int_list("global_block_indices", global_block_indices, 0,
                                                    allow_empty=True)
        self.global_block_end_indices = _check_global_ranges(self.global_block_indices, global_block_end_indices)
        self.attention = _check_attention(attention)

    def _fill_head(self, h: int, head: torch.Tensor, rng: Any) -> None:
        num_blocks = head.shape[0]
        _check_fits("num_sliding_window_blocks", self.num_sliding_window_blocks, num_blocks,
                    f"seq_len // block = {num_blocks} with block={self.block}")
        head[_band(num_blocks, self.num_sliding_window_blocks // 2)] = 1
        ends = self.global_block_end_indices or [i + 1 for i in self.global_block_indices]
        for first, last in zip(self.global_block_indices, ends, strict=True):
            if first >= num_blocks:
                continue
            last = min(last, num_blocks)
            head[first:last, :] = 1
            head[:, first:last] = 1


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """A purely local sliding window: row ``r`` attends to blocks ``r - w .. r + w`` (unidirectional: ``.. r``).

    ``w = num_sliding_window_blocks // 2``, clipped at the edges. Every head has the same layout.

    Arguments:
        num_heads, block: see :class:`SparsityConfig`.
        num_sliding_window_blocks: window width in blocks (>= 1); at most ``seq_len // block``.
        attention: ``'unidirectional'`` (default, no block above the diagonal) or ``'bidirectional'``.
    """

    def __init__(self, num_heads, block=16, num_sliding_window_blocks=3, attention="unidirectional"):
        super().__init__(num_heads, block)
        self.num_sliding_window_blocks = _check_int("num_sliding_window_blocks", num_sliding_window_blocks, 1)
        self.attention = _check_attention(attention)

    def _fill_head(self, h: int, head: torch.Tensor, rng: Any) -> None:
        num_blocks = head.shape[0]
        _check_fits("num_sliding_window_blocks", self.num_sliding_window_blocks, num_blocks,
                    f"seq_len // block = {num_blocks} with block={self.block}")
        head[_band(num_blocks, self.num_sliding_window_blocks // 2)] = 1
