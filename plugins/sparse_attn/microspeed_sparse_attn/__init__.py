"""microspeed-sparse-attn: block-sparse attention with DeepSpeed's sparsity configurations.

``import microspeed as deepspeed`` scripts reach it as ``deepspeed.ops.sparse_attention``
(``SparseSelfAttention``, ``BertSparseSelfAttention``, ``SparseAttentionUtils``, the ``*SparsityConfig``
classes). Kernels: Triton on GPU (fused, or DeepSpeed's three kernels), a chunked PyTorch path on CPU;
see :mod:`microspeed_sparse_attn.sparse_self_attention`.
"""

from microspeed_sparse_attn.bert_sparse_self_attention import BertSparseSelfAttention
from microspeed_sparse_attn.sparse_attention_utils import SparseAttentionUtils
from microspeed_sparse_attn.sparse_self_attention import SparseSelfAttention
from microspeed_sparse_attn.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)

__all__ = ["BSLongformerSparsityConfig", "BertSparseSelfAttention", "BigBirdSparsityConfig", "DenseSparsityConfig",
           "FixedSparsityConfig", "LocalSlidingWindowSparsityConfig", "SparseAttentionUtils", "SparseSelfAttention",
           "SparsityConfig", "VariableSparsityConfig"]
