"""``BertSparseSelfAttention``: a BERT self-attention layer whose attention is :class:`SparseSelfAttention`.

DeepSpeed's drop-in for the self-attention of BERT-style encoders: the same ``query`` / ``key`` / ``value``
projections (so pretrained weights copy over), heads split as BERT does, and the attention mask taken as
a key padding mask — BERT's extended mask ``(batch, 1, 1, seq)`` of 0 / large negative values, added to
the scores.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from microspeed_sparse_attn.sparse_self_attention import SparseSelfAttention
from microspeed_sparse_attn.sparsity_config import FixedSparsityConfig, SparsityConfig


class BertSparseSelfAttention(nn.Module):
    """BERT self-attention with block-sparse attention.

    Args:
        config: the model config; reads ``hidden_size``, ``num_attention_heads`` and, if present,
            ``max_position_embeddings`` (the longest sequence, default 2048).
        sparsity_config: the pattern (default ``FixedSparsityConfig(num_heads=4)``, DeepSpeed's); its
            ``num_heads`` must equal ``config.num_attention_heads``.
    """

    def __init__(self, config: Any, sparsity_config: SparsityConfig | None = None) -> None:
        super().__init__()
        sparsity_config = sparsity_config if sparsity_config is not None else FixedSparsityConfig(num_heads=4)
        hidden, heads = config.hidden_size, config.num_attention_heads
        if hidden % heads:
            raise ValueError(f"BertSparseSelfAttention: hidden_size ({hidden}) is not a multiple of "
                             f"num_attention_heads ({heads}).")
        if sparsity_config.num_heads != heads:
            raise ValueError(f"BertSparseSelfAttention: sparsity_config.num_heads={sparsity_config.num_heads} but the "
                             f"model has num_attention_heads={heads}; build the sparsity config with "
                             f"num_heads={heads}.")
        self.num_attention_heads = heads
        self.attention_head_size = hidden // heads
        self.all_head_size = hidden
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        max_len = int(getattr(config, "max_position_embeddings", 2048) or 2048)
        max_len = max(sparsity_config.block, max_len - max_len % sparsity_config.block)
        self.sparse_self_attention = SparseSelfAttention(sparsity_config, max_seq_length=max_len)

    def transpose_for_scores(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, seq, hidden)`` → ``(batch, heads, seq, head_size)``."""
        b, t, _ = x.shape
        return x.view(b, t, self.num_attention_heads, self.attention_head_size).permute(0, 2, 1, 3)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The context layer ``(batch, seq, hidden)``; ``attention_mask`` is an additive key padding mask."""
        q = self.transpose_for_scores(self.query(hidden_states))
        k = self.transpose_for_scores(self.key(hidden_states))
        v = self.transpose_for_scores(self.value(hidden_states))
        context = self.sparse_self_attention(q, k, v, key_padding_mask=attention_mask)
        b, _, t, _ = context.shape
        return context.permute(0, 2, 1, 3).reshape(b, t, self.all_head_size)
