"""``SparseAttentionUtils``: DeepSpeed's helpers for putting sparse attention into BERT-style models.

Padding a batch to a multiple of the block size (and removing the padding from the output), extending
a pretrained position embedding to longer sequences, and replacing every self-attention layer of a
BERT / RoBERTa model (HuggingFace layout: ``model.bert.encoder.layer[i].attention.self``) by
:class:`~microspeed_sparse_attn.bert_sparse_self_attention.BertSparseSelfAttention` with its weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from microspeed_sparse_attn.bert_sparse_self_attention import BertSparseSelfAttention
from microspeed_sparse_attn.sparsity_config import FixedSparsityConfig, SparsityConfig

_BASES = (("bert", 0), ("roberta", 2))  # (attribute, position offset: RoBERTa keeps 2 positions for padding)


def _base(model: nn.Module, what: str) -> tuple[nn.Module, int]:
    for name, offset in _BASES:
        if hasattr(model, name):
            return getattr(model, name), offset
    raise ValueError(f"SparseAttentionUtils.{what}: only BERT and RoBERTa models (with a .bert or .roberta "
                     f"submodule) are supported, got {type(model).__name__}; for other models replace their "
                     f"attention with SparseSelfAttention directly.")


class SparseAttentionUtils:
    """Static helpers (DeepSpeed's names and arguments); see the module docstring."""

    @staticmethod
    def extend_position_embedding(model: nn.Module, max_position: int) -> nn.Module:
        """Grow the position embedding to ``max_position`` by repeating the trained one; returns ``model``."""
        base, offset = _base(model, "extend_position_embedding")
        emb = base.embeddings.position_embeddings
        original = emb.weight.detach()
        old, size = original.shape
        new = max_position + offset
        if new <= old:
            raise ValueError(f"SparseAttentionUtils.extend_position_embedding(max_position={max_position}): the model "
                             f"already has {old - offset} positions; pass a larger max_position.")
        extended = original.new_empty(new, size)
        extended[:offset] = original[:offset]
        k, period = offset, old - offset
        while k < new:
            n = min(period, new - k)
            extended[k:k + n] = original[offset:offset + n]
            k += n
        base.embeddings.position_embeddings = nn.Embedding(new, size, padding_idx=emb.padding_idx,
                                                           device=original.device, dtype=original.dtype)
        base.embeddings.position_embeddings.weight.data.copy_(extended)
        if isinstance(getattr(base.embeddings, "position_ids", None), torch.Tensor):
            base.embeddings.register_buffer("position_ids", torch.arange(new, device=original.device).expand(1, -1),
                                            persistent=False)
        config = getattr(model, "config", None)
        if config is not None:
            config.max_position_embeddings = new
        return model

    @staticmethod
    def update_tokenizer_model_max_length(tokenizer: Any, max_position: int) -> Any:
        """Let ``tokenizer`` produce sequences up to ``max_position`` tokens; returns it."""
        tokenizer.model_max_length = max_position
        if isinstance(getattr(tokenizer, "init_kwargs", None), dict):
            tokenizer.init_kwargs["model_max_length"] = max_position
        return tokenizer

    @staticmethod
    def replace_model_self_attention_with_sparse_self_attention(
            model: nn.Module, max_position: int, sparsity_config: SparsityConfig | None = None) -> nn.Module:
        """Replace every self-attention layer of a BERT / RoBERTa ``model``; returns ``model``."""
        base, offset = _base(model, "replace_model_self_attention_with_sparse_self_attention")
        sparsity_config = sparsity_config if sparsity_config is not None else FixedSparsityConfig(num_heads=4)
        config = getattr(model, "config", None) or base.config
        config.max_position_embeddings = max_position + offset
        SparseAttentionUtils.replace_self_attention_layer_with_sparse_self_attention_layer(
            config, base.encoder.layer, sparsity_config)
        return model

    @staticmethod
    def replace_self_attention_layer_with_sparse_self_attention_layer(
            config: Any, layers: Any, sparsity_config: SparsityConfig | None = None) -> Any:
        """Give each of ``layers`` (with ``.attention.self``) a :class:`BertSparseSelfAttention` with its weights."""
        sparsity_config = sparsity_config if sparsity_config is not None else FixedSparsityConfig(num_heads=4)
        for layer in layers:
            old = layer.attention.self
            new = BertSparseSelfAttention(config, sparsity_config)
            with torch.no_grad():
                for name in ("query", "key", "value"):
                    getattr(new, name).load_state_dict(getattr(old, name).state_dict())
            new.to(device=old.query.weight.device, dtype=old.query.weight.dtype)
            layer.attention.self = new
        return layers

    @staticmethod
    def pad_to_block_size(block_size: int, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                          token_type_ids: torch.Tensor | None, position_ids: torch.Tensor | None,
                          inputs_embeds: torch.Tensor | None, pad_token_id: int,
                          model_embeddings: Any) -> tuple[int, Any, Any, Any, Any, Any]:
        """Pad the sequence dimension to a multiple of ``block_size``.

        Returns ``(pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)``: ids and
        positions padded with ``pad_token_id``, the attention mask with 0 (padding is not attended to), token
        types with 0, and ``inputs_embeds`` with ``model_embeddings(pad ids)``.
        """
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"pad_to_block_size(block_size={block_size!r}): expected a positive int.")
        if input_ids is None and inputs_embeds is None:
            raise ValueError("pad_to_block_size: give input_ids or inputs_embeds.")
        batch, seq = (input_ids.shape[:2] if input_ids is not None else inputs_embeds.shape[:2])
        pad_len = (block_size - seq % block_size) % block_size
        if pad_len == 0:
            return 0, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds
        if inputs_embeds is not None:
            pad_ids = inputs_embeds.new_full((batch, pad_len), pad_token_id, dtype=torch.long)
            inputs_embeds = torch.cat([inputs_embeds, model_embeddings(pad_ids).to(inputs_embeds.dtype)], dim=1)
        if input_ids is not None:
            input_ids = F.pad(input_ids, (0, pad_len), value=pad_token_id)
        if position_ids is not None:
            position_ids = F.pad(position_ids, (0, pad_len), value=pad_token_id)
        if attention_mask is not None:
            attention_mask = F.pad(attention_mask, (0, pad_len), value=0)
        if token_type_ids is not None:
            token_type_ids = F.pad(token_type_ids, (0, pad_len), value=0)
        return pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds

    @staticmethod
    def unpad_sequence_output(pad_len: int, sequence_output: torch.Tensor) -> torch.Tensor:
        """Drop the last ``pad_len`` positions that :meth:`pad_to_block_size` added."""
        return sequence_output[:, :-pad_len] if pad_len > 0 else sequence_output
