"""The ``sparse_attn`` plugin: the ds_config ``"sparse_attention"`` section, made to act.

DeepSpeed parses the section and leaves it to user code. Here, when the section is present, every
attention module of the model that declares itself *replaceable* runs block-sparse attention with the
configured pattern. A module declares it with the attributes

* ``attention_fn`` — ``None`` or a callable ``(q, k, v) -> y`` on ``(batch, heads, seq, head_dim)``
  tensors, used in place of its dense attention (the demo GPT's ``CausalSelfAttention`` has it);
* ``n_head`` — its number of heads; ``is_causal`` — whether it is a decoder's attention;
* optionally ``max_seq_len`` (default 2048) and ``dropout`` (attention dropout is refused: the sparse
  kernels do not drop probabilities).

The plugin sets ``attention_fn`` to a :class:`SparseAttentionFn`, which pads the sequence to the block
size and runs :class:`~microspeed_sparse_attn.sparse_self_attention.SparseSelfAttention`. A section with
no replaceable module in the model is refused at ``initialize()`` rather than silently ignored. Random
blocks (``variable``, ``bigbird``) use one seed on every rank (drawn on rank 0 when the section gives
none), so data-parallel replicas attend to the same blocks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from microspeed.plugin_api import ConfigError, Feature, Section, hookimpl
from microspeed_sparse_attn.config import parse_sparse_attention_section, sparsity_config_from_section
from microspeed_sparse_attn.sparse_self_attention import SparseSelfAttention

SECTION = "sparse_attention"

FEATURES = (
    Feature("sparse-attention", "block-sparse attention",
            '"sparse_attention" section (mode fixed, variable, bigbird, bslongformer or dense) with replaceable '
            'attention modules in the model'),
)
"""The ``sparse_attn`` plugin's feature for the composition matrix."""


class SparseAttentionFn(nn.Module):
    """``(q, k, v) -> y`` with block-sparse attention, any sequence length (padded to the block inside)."""

    def __init__(self, attention: SparseSelfAttention) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attend; a sequence that is not a multiple of the block gets padding keys that nothing attends to."""
        seq = q.shape[2]
        pad = (-seq) % self.attention.block
        if not pad:
            return self.attention(q, k, v)
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        mask = torch.zeros(q.shape[0], seq + pad, dtype=torch.float32, device=q.device)
        mask[:, seq:] = float("-inf")
        if self.attention.key_padding_mask_mode == "mul":
            mask = (mask == 0).to(torch.float32)
        return self.attention(q, k, v, key_padding_mask=mask)[:, :, :seq]


def replaceable_attention(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of ``model`` that declare themselves replaceable (``attention_fn`` and ``n_head``)."""
    return [(name, m) for name, m in model.named_modules()
            if hasattr(m, "attention_fn") and isinstance(getattr(m, "n_head", None), int)]


class SparseAttentionPlugin:
    """Applies the ``sparse_attention`` section to replaceable attention modules (see the module docstring)."""

    def __init__(self) -> None:
        self.section: dict[str, Any] | None = None
        self.replaced: list[str] = []

    @hookimpl
    def microspeed_config_sections(self) -> dict:
        """``sparse_attention``: DeepSpeed's keys, validated per mode by :mod:`microspeed_sparse_attn.config`."""
        doc = ("block-sparse attention for the model's replaceable attention modules (mode: dense, fixed, variable, "
               "bigbird or bslongformer; see plugins/sparse_attn)")
        return {SECTION: Section(open=True, doc=doc)}

    @hookimpl
    def microspeed_configure(self, config: Any) -> None:
        """Validate the section as soon as the config is read (before any model work)."""
        self.section = parse_sparse_attention_section(config[SECTION]) if config.is_set(SECTION) else None

    @hookimpl
    def microspeed_after_model_ready(self, engine: Any, model: nn.Module) -> None:
        """Give every replaceable attention module a sparse ``attention_fn``."""
        if self.section is None:
            return
        modules = replaceable_attention(model)
        if not modules:
            raise ConfigError(f"{SECTION}: the model has no attention module that declares itself replaceable "
                              f"(attributes attention_fn and n_head, as microspeed.models.CausalSelfAttention "
                              f"has), so the section would do nothing. Remove the section, or use "
                              f"SparseSelfAttention in the model directly.")
        section = dict(self.section)
        if "seed" in section and section["seed"] is None:
            section["seed"] = _shared_seed()
        for name, module in modules:
            if float(getattr(module, "dropout", 0.0) or 0.0) > 0.0:
                raise ConfigError(f"{SECTION}: {name} has attention dropout {module.dropout}; the sparse kernels do "
                                  f"not drop attention probabilities. Set the model's dropout to 0 or remove the "
                                  f"section.")
            sparsity = sparsity_config_from_section(section, module.n_head)
            max_len = int(getattr(module, "max_seq_len", 2048) or 2048)
            max_len += (-max_len) % sparsity.block
            module.attention_fn = SparseAttentionFn(SparseSelfAttention(
                sparsity, max_seq_length=max_len, causal=bool(getattr(module, "is_causal", False))))
            self.replaced.append(name)
        engine.set_plugin_state("sparse_attn", self)

    @hookimpl
    def microspeed_features(self) -> list[Feature]:
        """Sparse attention, for the composition matrix (it refuses no pair)."""
        return list(FEATURES)


def _shared_seed() -> int:
    """A seed drawn on rank 0 and given to every rank (one layout everywhere)."""
    seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from microspeed.plugin_api import comm

        comm.broadcast(seed, src=0)
    return int(seed.item())
