"""``SparseSelfAttention``: DeepSpeed's block-sparse attention module, on today's torch and Triton.

``SparseSelfAttention(sparsity_config, key_padding_mask_mode='add', attn_mask_mode='mul',
max_seq_length=2048)(query, key, value, rpe=None, key_padding_mask=None, attn_mask=None)`` attends
``(batch, heads, seq, head_dim)`` queries to keys restricted to the blocks of the configured layout,
scaled by ``head_dim ** -0.5``, as DeepSpeed's module does. The layout is made once for
``max_seq_length`` and its top-left corner used for shorter sequences (DeepSpeed's rule).

Where it runs — one of four backends, picked per call and logged the first time each is used:

* ``fused`` (CUDA with Triton): one Triton kernel per pass with an online softmax
  (:mod:`microspeed_sparse_attn.fused`); the score blocks are never stored;
* ``triton`` (CUDA with Triton, when a relative position bias or a per-head mask is given): DeepSpeed's
  three kernels, ``Q·Kᵀ`` into sparse blocks, the sparse softmax and ``P·V``
  (:mod:`microspeed_sparse_attn.matmul`, :mod:`microspeed_sparse_attn.softmax`);
* ``cpu`` (anywhere else): batched PyTorch over each query row's non-zero blocks, chunked so memory
  stays linear in the sequence (:mod:`microspeed_sparse_attn.cpu_attention`);
* ``reference`` (CPU with a per-head ``rpe`` or ``attn_mask``): dense masked attention, memory quadratic.

``MICROSPEED_SPARSE_ATTN_BACKEND=fused|triton|cpu|reference`` forces one (the Triton ones run on CPU
tensors under ``TRITON_INTERPRET=1``). ``causal=True`` (an extension) also hides keys after each query
inside the diagonal blocks; DeepSpeed leaves that to an ``attn_mask``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from microspeed_sparse_attn.sparsity_config import SparsityConfig

BACKEND_ENV = "MICROSPEED_SPARSE_ATTN_BACKEND"
BACKENDS = ("fused", "triton", "cpu", "reference")
MASK_MODES = ("add", "mul")

_announced: set[str] = set()


def _log_backend(backend: str, why: str) -> None:
    """Say which backend runs, once per backend per process."""
    if backend in _announced:
        return
    _announced.add(backend)
    from microspeed.plugin_api import get_logger

    get_logger("microspeed.sparse_attn").info("sparse_attn: backend chosen", backend=backend, why=why)


def _key_padding_2d(mask: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` from DeepSpeed's accepted ``(B, 1, 1, T)`` / ``(B, 1, T)`` key padding masks."""
    if mask.dim() > 2:
        if any(d != 1 for d in mask.shape[1:-1]):
            raise ValueError(f"SparseSelfAttention: key_padding_mask must be (batch, seq) or (batch, 1, 1, seq), "
                             f"got {tuple(mask.shape)}.")
        mask = mask.reshape(mask.shape[0], mask.shape[-1])
    return mask


def _attn_mask_2d(mask: torch.Tensor) -> torch.Tensor:
    """``(T, T)`` (or per-head ``(H, T, T)``) from DeepSpeed's accepted ``(1, 1, T, T)`` attention masks."""
    while mask.dim() > 2 and mask.shape[0] == 1:
        mask = mask.squeeze(0)
    return mask


def additive(mask: torch.Tensor, mode: str, dtype: torch.dtype) -> torch.Tensor:
    """A mask in ``mode`` (``'add'`` values, or ``'mul'`` 0 = hidden) as an additive float mask."""
    if mode == "add":
        return mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask == 0, float("-inf"))


class SparseSelfAttention(nn.Module):
    """Block-sparse scaled dot-product attention (see the module docstring).

    Args:
        sparsity_config: which blocks each head attends to (any :class:`SparsityConfig`; default
            ``FixedSparsityConfig(num_heads=4)``).
        key_padding_mask_mode / attn_mask_mode: ``'add'`` (the mask is added to the scaled scores) or
            ``'mul'`` (0 hides a key, anything else keeps it).
        max_seq_length: the longest sequence; the layout is made for it once.
        causal: hide keys after each query inside blocks too (for decoders).
    """

    def __init__(self, sparsity_config: SparsityConfig | None = None, key_padding_mask_mode: str = "add",
                 attn_mask_mode: str = "mul", max_seq_length: int = 2048, causal: bool = False) -> None:
        super().__init__()
        from microspeed_sparse_attn.sparsity_config import SparsityConfig as Base

        sparsity_config = sparsity_config if sparsity_config is not None else _default_config()
        if not isinstance(sparsity_config, Base):
            raise TypeError(f"SparseSelfAttention(sparsity_config=...): expected a SparsityConfig such as "
                            f"FixedSparsityConfig(num_heads=4), got {type(sparsity_config).__name__}.")
        for name, mode in (("key_padding_mask_mode", key_padding_mask_mode), ("attn_mask_mode", attn_mask_mode)):
            if mode not in MASK_MODES:
                raise ValueError(f"SparseSelfAttention({name}={mode!r}): expected one of {MASK_MODES}.")
        if not isinstance(max_seq_length, int) or max_seq_length < sparsity_config.block:
            raise ValueError(f"SparseSelfAttention(max_seq_length={max_seq_length!r}): expected an int of at least "
                             f"the block size {sparsity_config.block}.")
        self.sparsity_config = sparsity_config
        self.key_padding_mask_mode, self.attn_mask_mode = key_padding_mask_mode, attn_mask_mode
        self.max_seq_length = max_seq_length
        self.causal = bool(causal)
        self.master_layout = sparsity_config.make_layout(max_seq_length - max_seq_length % sparsity_config.block)
        self.last_backend: str | None = None
        self._ops: dict[tuple[int, str], Any] = {}

    @property
    def block(self) -> int:
        """The layout's block size."""
        return self.sparsity_config.block

    def get_layout(self, seq_len: int) -> torch.Tensor:
        """The layout for ``seq_len`` (a multiple of the block, at most ``max_seq_length``): the master's corner."""
        if seq_len % self.block:
            raise ValueError(f"SparseSelfAttention: sequence length {seq_len} is not a multiple of the block size "
                             f"{self.block}; pad it with SparseAttentionUtils.pad_to_block_size.")
        if seq_len > self.max_seq_length:
            raise ValueError(f"SparseSelfAttention: sequence length {seq_len} exceeds max_seq_length="
                             f"{self.max_seq_length}; build the module with a larger max_seq_length.")
        n = seq_len // self.block
        return self.master_layout[:, :n, :n]

    def choose_backend(self, query: torch.Tensor, rpe: bool = False, per_head: bool = False) -> tuple[str, str]:
        """``(backend, why)`` for a call on ``query``'s device, with or without an ``rpe`` / a per-head mask."""
        forced = os.environ.get(BACKEND_ENV, "").strip()
        if forced:
            if forced not in BACKENDS:
                raise ValueError(f"{BACKEND_ENV}={forced!r}: expected one of {', '.join(BACKENDS)}.")
            return forced, f"{BACKEND_ENV}={forced}"
        from microspeed_sparse_attn.matmul import triton_available

        if query.is_cuda and triton_available(query.device):
            if rpe or per_head:
                return "triton", "CUDA with Triton; rpe or a per-head mask needs the three-kernel path"
            return "fused", "CUDA with Triton"
        if per_head:
            return "reference", "no GPU, and a per-head rpe/attn_mask is not supported by the CPU path"
        return "cpu", "no GPU with Triton: the chunked PyTorch path"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rpe: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attend ``query`` to ``key``/``value`` (all ``(batch, heads, seq, head_dim)``); same shape as ``query``."""
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"SparseSelfAttention: {name} must be a (batch, heads, seq, head_dim) tensor, got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}.")
        if query.shape != key.shape or key.shape != value.shape:
            raise ValueError(f"SparseSelfAttention: query, key and value must have one shape (self-attention), got "
                             f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}.")
        batch, heads, seq, head_dim = query.shape
        if heads != self.sparsity_config.num_heads:
            raise ValueError(f"SparseSelfAttention: the input has {heads} heads but the sparsity config was built "
                             f"for num_heads={self.sparsity_config.num_heads}.")
        layout = self.get_layout(seq)
        scale = float(head_dim) ** -0.5
        if key_padding_mask is not None:
            key_padding_mask = _key_padding_2d(key_padding_mask)
        if attn_mask is not None:
            attn_mask = _attn_mask_2d(attn_mask)
        per_head = (rpe is not None and rpe.dim() == 3) or (attn_mask is not None and attn_mask.dim() == 3)
        backend, why = self.choose_backend(query, rpe is not None, per_head)
        self.last_backend = backend
        _log_backend(backend, why)
        if backend == "triton":
            return self._three_kernels(query, key, value, layout, scale, rpe, key_padding_mask, attn_mask)
        dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
        kpm = None if key_padding_mask is None else additive(key_padding_mask, self.key_padding_mask_mode, dtype)
        am = None if attn_mask is None else additive(attn_mask, self.attn_mask_mode, dtype)
        if rpe is not None:
            am = rpe.to(dtype) if am is None else am + rpe.to(dtype)
        if backend == "reference":
            from microspeed_sparse_attn.attention_reference import dense_reference_attention

            if am is not None and am.dim() == 3:  # per-head: the reference takes (T, T); run head by head
                outs = [dense_reference_attention(query[:, h:h + 1], key[:, h:h + 1], value[:, h:h + 1],
                                                  layout[h:h + 1], self.block, scale, self.causal, kpm, am[h])
                        for h in range(heads)]
                return torch.cat(outs, dim=1)
            return dense_reference_attention(query, key, value, layout, self.block, scale, self.causal, kpm, am)
        if backend == "fused":
            from microspeed_sparse_attn.fused import fused_block_sparse_attention as attend
        else:
            from microspeed_sparse_attn.cpu_attention import cpu_block_sparse_attention as attend
        kpm = None if kpm is None else kpm.to(query.dtype if backend == "fused" else dtype)
        am = None if am is None else am.to(query.dtype if backend == "fused" else dtype)
        return attend(query, key, value, layout, self.block, scale, self.causal, kpm, am)

    def _three_kernels(self, q, k, v, layout, scale, rpe, kpm, am) -> torch.Tensor:
        """DeepSpeed's design: sparse ``Q·Kᵀ``, sparse softmax, ``P·V`` (Triton)."""
        from microspeed_sparse_attn.matmul import MatMul
        from microspeed_sparse_attn.softmax import Softmax

        n = layout.shape[-1]
        ops = self._ops.get((n, str(q.device)))
        if ops is None:
            ops = (MatMul(layout, self.block, "sdd", trans_b=True), Softmax(layout, self.block),
                   MatMul(layout, self.block, "dsd"))
            self._ops[(n, str(q.device))] = ops
        sdd, softmax, dsd = ops
        scores = sdd(q, k)
        probs = softmax(scores, scale=scale, rpe=rpe, key_padding_mask=kpm, attn_mask=am,
                        key_padding_mask_mode=self.key_padding_mask_mode, attn_mask_mode=self.attn_mask_mode,
                        causal=self.causal)
        return dsd(probs, v)


def _default_config() -> SparsityConfig:
    from microspeed_sparse_attn.sparsity_config import FixedSparsityConfig

    # DeepSpeed's default is the abstract base class with 4 heads, which has no pattern and fails when a layout is
    # made; the Fixed pattern with 4 heads is the one its tutorials use.
    return FixedSparsityConfig(num_heads=4)
