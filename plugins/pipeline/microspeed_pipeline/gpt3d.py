"""A GPT for 3D parallelism: pipeline stages × tensor-parallel layers × data parallelism, tied embeddings.

:func:`gpt3d_layers` lists a GPT-2-style decoder as pipeline layers whose large matrices are
tensor parallel (Megatron's layout): the token embedding is a
:class:`~microspeed_pipeline.tensor_parallel.VocabParallelEmbedding` whose weight is also the output
head (tied across the first and last stage through :class:`~microspeed_pipeline.module.TiedLayerSpec`
under the key ``"embed"``), attention splits its heads (query, key and value are column parallel,
the output projection row parallel) and the MLP splits its hidden features. The head's logits stay
split along the vocabulary and :func:`gpt3d_loss` is :func:`~microspeed_pipeline.cross_entropy.
vocab_parallel_cross_entropy`, so the full vocabulary is never gathered.

**The same model on every topology.** Each layer draws its *full* (dense) weights in float32 from
its own generator, seeded with ``seed`` and the layer's index, and keeps this rank's slice. No
layer reads the global random state, so the initial model is the same function on any number of
pipeline stages, tensor ranks and data-parallel replicas, and with ``tp = 1`` and one stage it is
the plain single-process model: ``gpt3d_pipeline(config, topology)`` on any topology starts from
the weights ``gpt3d_pipeline(config, num_stages=1)`` has in one process. Weights are GPT-2's:
normal(0, 0.02) matrices (residual projections scaled by ``1/sqrt(2 n_layer)``), zero biases, unit
layer norms. ``n_head`` and ``4 * d_model`` must divide by the tensor-parallel size, ``vocab_size``
too.

Example (4 ranks, pp2 × tp2 × dp1)::

    config = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=4, d_model=32)
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
    engine, *_ = microspeed.initialize(model=gpt3d_pipeline(config, topology=topo), config=...)
    loss = engine.train_batch(iter(gpt3d_batches(config, step=0, count=gas, micro=2)))
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from microspeed.models import GPTConfig
from microspeed_pipeline.cross_entropy import vocab_parallel_cross_entropy
from microspeed_pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec
from microspeed_pipeline.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tensor_model_parallel_region,
)

__all__ = ["GPT3DBlock", "GPT3DPositionEmbedding", "gpt3d_batches", "gpt3d_head", "gpt3d_layers", "gpt3d_loss",
           "gpt3d_pipeline"]

DEFAULT_SEED = 1234
"""The seed :func:`gpt3d_layers` draws the weights from unless told otherwise."""


def _generator(seed: int, index: int) -> torch.Generator:
    """The generator of layer ``index``: the same whatever stage builds it."""
    return torch.Generator().manual_seed(seed * 1009 + index)


def _copy_of(full: torch.Tensor) -> Callable[[torch.Tensor], Any]:
    """An ``init_method`` that fills the master weight with ``full``."""
    return lambda master: master.copy_(full)


def _normal(shape: tuple[int, ...], std: float, g: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=g, dtype=torch.float32) * std


class GPT3DEmbedding(VocabParallelEmbedding):
    """The token embedding (vocabulary parallel), whose weight the output head reuses."""

    def __init__(self, config: GPTConfig, seed: int = DEFAULT_SEED) -> None:
        full = _normal((config.vocab_size, config.d_model), 0.02, _generator(seed, 0))
        super().__init__(config.vocab_size, config.d_model, init_method=_copy_of(full))


class GPT3DPositionEmbedding(nn.Module):
    """Adds the learned position embedding (replicated on every tensor rank) to the token embeddings."""

    def __init__(self, config: GPTConfig, seed: int = DEFAULT_SEED, index: int = 1) -> None:
        super().__init__()
        self.weight = nn.Parameter(_normal((config.seq_len, config.d_model), 0.02, _generator(seed, index)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: token embeddings ``(B, T, d_model)``."""
        return x + self.weight[: x.shape[1]].to(x.dtype)


class GPT3DBlock(nn.Module):
    """A pre-norm transformer block with tensor-parallel attention (heads split) and MLP (hidden split)."""

    def __init__(self, config: GPTConfig, seed: int = DEFAULT_SEED, index: int = 2) -> None:
        super().__init__()
        d, g = config.d_model, _generator(seed, index)
        std, residual_std = 0.02, 0.02 / math.sqrt(2 * config.n_layer)
        self.n_head = config.n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v = (ColumnParallelLinear(d, d, gather_output=False,
                                                       init_method=_copy_of(_normal((d, d), std, g)))
                                  for _ in range(3))
        self.attn_proj = RowParallelLinear(d, d, input_is_parallel=True,
                                           init_method=_copy_of(_normal((d, d), residual_std, g)))
        self.fc = ColumnParallelLinear(d, 4 * d, gather_output=False,
                                       init_method=_copy_of(_normal((4 * d, d), std, g)))
        self.mlp_proj = RowParallelLinear(4 * d, d, input_is_parallel=True,
                                          init_method=_copy_of(_normal((d, 4 * d), residual_std, g)))
        tp = self.q.world_size
        if config.n_head % tp:
            raise ValueError(f"GPT3DBlock: n_head={config.n_head} must divide by the tensor-parallel size {tp}.")
        self.local_heads = config.n_head // tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: the residual stream ``(B, T, d_model)``, full on every tensor rank."""
        B, T, _ = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(B, T, self.local_heads, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(B, T, -1))
        return x + self.mlp_proj(F.gelu(self.fc(self.ln2(x))))


def gpt3d_head(embedding: VocabParallelEmbedding, x: torch.Tensor) -> torch.Tensor:
    """Logits of this tensor rank's vocabulary slice, with the tied embedding's weight: ``(B, T, V / tp)``."""
    return F.linear(copy_to_tensor_model_parallel_region(x, embedding.group), embedding.weight)


def gpt3d_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of vocabulary-parallel logits (plain cross-entropy when ``tp = 1``)."""
    return vocab_parallel_cross_entropy(logits, targets).mean()


def gpt3d_layers(config: GPTConfig, seed: int = DEFAULT_SEED) -> list:
    """The GPT as pipeline layers: tied embedding, position embedding, blocks, final norm, tied head."""
    n = config.n_layer
    return [TiedLayerSpec("embed", GPT3DEmbedding, config, seed),
            LayerSpec(GPT3DPositionEmbedding, config, seed, 1),
            *[LayerSpec(GPT3DBlock, config, seed, 2 + i) for i in range(n)],
            LayerSpec(nn.LayerNorm, config.d_model),
            TiedLayerSpec("embed", GPT3DEmbedding, config, seed, forward_fn=gpt3d_head)]


def gpt3d_pipeline(config: GPTConfig, num_stages: int | None = None, topology: Any = None,
                   seed: int = DEFAULT_SEED, **kwargs: Any) -> PipelineModule:
    """A :class:`PipelineModule` of :func:`gpt3d_layers` with :func:`gpt3d_loss` (``kwargs`` go to it).

    Give ``topology`` (e.g. ``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)``) for tensor
    parallelism, or ``num_stages`` for pipeline × data parallelism; the blocks are split evenly
    over the stages.
    """
    if num_stages is None and topology is None:
        num_stages = 1
    kwargs.setdefault("partition_method", "type:GPT3DBlock")
    return PipelineModule(gpt3d_layers(config, seed), num_stages=num_stages, topology=topology, loss_fn=gpt3d_loss,
                          **kwargs)


def gpt3d_batches(config: GPTConfig, step: int, count: int, micro: int,
                  seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` ``(ids, next ids)`` micro-batches of ``micro`` sequences for training step ``step``, in order."""
    g = torch.Generator().manual_seed(seed * 100003 + step)
    out = []
    for _ in range(count):
        ids = torch.randint(0, config.vocab_size, (micro, config.seq_len + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out
