"""The shared GPT (:mod:`microspeed.models`) as a pipeline: layer specs, loss, and a builder.

``gpt_layers(config)`` lists the same computation as :class:`microspeed.models.GPT` as pipeline
layers — token embedding (tied with the output head), position embedding, the transformer blocks,
the final LayerNorm, the head — so any number of stages (and chunks) can run it. Blocks are the
model's own :class:`~microspeed.models.Block`; initialisation is GPT-2's, as the model's.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from microspeed.models import Block, GPTConfig
from microspeed_pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec


class PositionEmbedding(nn.Module):
    """Adds the learned position embedding to the token embeddings, then dropout."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        nn.init.normal_(self.pos_emb.weight, mean=0.0, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: token embeddings ``(B, T, d_model)``."""
        positions = torch.arange(x.shape[1], device=x.device)
        return self.drop(x + self.pos_emb(positions))


class TokenEmbedding(nn.Embedding):
    """The token embedding (its weight is also the output head's), GPT-2 initialised."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config.vocab_size, config.d_model)
        nn.init.normal_(self.weight, mean=0.0, std=0.02)


class GPTBlock(Block):
    """The shared transformer block, GPT-2 initialised (residual projections scaled by depth)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    std = residual_std if getattr(module, "is_residual_projection", False) else 0.02
                    nn.init.normal_(module.weight, mean=0.0, std=std)
                    if module.bias is not None:
                        nn.init.zeros_(module.bias)


def lm_head(embedding: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    """Logits from the residual stream with the (tied) token embedding's weight."""
    return x @ embedding.weight.t()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def gpt_layers(config: GPTConfig) -> list:
    """The GPT as a flat list of pipeline layers (embedding and head tied under the key ``"embed"``)."""
    return [TiedLayerSpec("embed", TokenEmbedding, config),
            LayerSpec(PositionEmbedding, config),
            *[LayerSpec(GPTBlock, config) for _ in range(config.n_layer)],
            LayerSpec(nn.LayerNorm, config.d_model),
            TiedLayerSpec("embed", TokenEmbedding, config, forward_fn=lm_head)]


def gpt_pipeline(config: GPTConfig, num_stages: int = 1, **kwargs) -> PipelineModule:
    """A :class:`PipelineModule` of :func:`gpt_layers` with :func:`lm_loss` (``kwargs`` go to it)."""
    kwargs.setdefault("partition_method", "type:GPTBlock")
    return PipelineModule(gpt_layers(config), num_stages=num_stages, loss_fn=lm_loss, **kwargs)
