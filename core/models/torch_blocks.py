"""Models built from torch's own layers, for checking that engines handle code they do not control.

* :class:`TorchBlocksGPT`: a decoder of ``nn.TransformerEncoderLayer`` blocks (causal mask), whose attention
  is ``nn.MultiheadAttention``: its forward reads ``in_proj_weight`` and ``out_proj.weight`` directly and
  calls ``F.multi_head_attention_forward``, so ``out_proj`` is never called as a module.
* :class:`WideMLP`: an embedding, ``n_layer`` square ``Linear`` + GELU layers of width ``width``, a head.

Both take ``(idx, targets)`` and return the mean cross-entropy loss (logits without targets), like
:class:`microspeed.models.GPT`, and draw their weights from the global torch RNG only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _loss_or_logits(logits: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
    """The mean cross-entropy of ``logits`` against ``targets`` in float32, or the logits when no targets."""
    if targets is None:
        return logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


class TorchBlocksGPT(nn.Module):
    """Token + position embedding, ``n_layer`` causal ``nn.TransformerEncoderLayer`` (pre-norm, GELU,
    dropout 0), a final LayerNorm and an untied LM head.

    Args:
        vocab_size: tokens; d_model: width; n_layer: blocks; n_head: attention heads; seq_len: longest input.
    """

    def __init__(self, vocab_size: int = 256, d_model: int = 64, n_layer: int = 2, n_head: int = 4,
                 seq_len: int = 16) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList([
            nn.TransformerEncoderLayer(d_model, n_head, 4 * d_model, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Loss of ``idx`` ``(B, T)`` against ``targets`` (logits ``(B, T, vocab)`` without targets)."""
        t = idx.shape[1]
        h = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device, dtype=h.dtype)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return _loss_or_logits(self.lm_head(self.ln_f(h)), targets)


class WideMLP(nn.Module):
    """Embedding, ``n_layer`` x (``Linear(width, width)`` + GELU), LM head: few large matrices.

    Args:
        vocab_size: tokens; width: hidden size; n_layer: hidden layers.
    """

    def __init__(self, vocab_size: int = 256, width: int = 64, n_layer: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, width)
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(n_layer)])
        self.head = nn.Linear(width, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Loss of ``idx`` ``(B, T)`` against ``targets`` (logits without targets)."""
        h = self.emb(idx)
        for layer in self.layers:
            h = F.gelu(layer(h))
        return _loss_or_logits(self.head(h), targets)
