"""A small GPT-style, byte-level, decoder-only transformer in pure PyTorch.

The model that ``microspeed demo``, the benchmarks, the tests and the plugins (the pipeline's layer
specs, MoE's expert blocks, ZeRO's memory estimator) share. It is deliberately plain so that runtime
features (ZeRO partitioning, activation checkpointing, mixed precision, ...) can be exercised on it
without surprises:

* every transformer layer is its own :class:`Block` in ``GPT.blocks`` (an
  :class:`torch.nn.ModuleList`), so per-layer wrappers can be applied by iterating it;
* attention is a separate :class:`CausalSelfAttention` module (``block.attn``) and the
  class used is a constructor argument of :class:`GPT`, so it is easy to swap;
* the LM head shares its weight with the token embedding (``tie_weights=True``);
* :meth:`GPT.forward` accepts either ``(idx, targets)`` or the ``(x, y)`` pair yielded by a
  :class:`torch.utils.data.DataLoader` over :class:`microspeed.demo.data.ByteSequenceDataset`,
  so ``loss = engine(batch)`` works directly;
* it also takes DeepSpeed's progressive-layer-drop keywords (``progressive_layer_drop=True,
  pld_theta=θ``, passed by the ``progressive_layer_drop`` plugin): in training, block ``i`` of
  ``L`` then runs with probability ``keep_i = 1 - (i + 1) / L * (1 - θ)`` (see
  :meth:`GPT.pld_keep_probs`); off by default, and every block always runs in eval.

Example::

    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    x = torch.randint(0, 256, (4, 32))
    loss = model(x[:, :-1], x[:, 1:])       # mean cross-entropy
    logits = model(x)                       # (4, 32, 256)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "CausalSelfAttention", "MLP", "Block", "GPT", "AttentionFactory", "fused_kernels_wanted",
           "layer_norm"]

#: Anything that builds an attention module from a config: a class such as
#: :class:`CausalSelfAttention` or any callable ``(GPTConfig) -> nn.Module``. The module maps
#: ``(B, T, d_model) -> (B, T, d_model)`` and must be causal.
AttentionFactory = Callable[["GPTConfig"], nn.Module]


@dataclass(frozen=True)
class GPTConfig:
    """Hyper-parameters of :class:`GPT`.

    Attributes:
        vocab_size: number of token ids; 256 for byte-level modelling.
        seq_len: maximum sequence length (size of the learned position embedding).
        n_layer: number of transformer blocks.
        n_head: attention heads per block; must divide ``d_model``.
        d_model: width of the residual stream; the MLP hidden size is ``4 * d_model``.
        dropout: dropout probability for embeddings, attention and residual branches.
        tie_weights: share the LM head weight with the token embedding.
    """

    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.0
    tie_weights: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head (``d_model // n_head``)."""
        return self.d_model // self.n_head

    @classmethod
    def tiny(cls) -> GPTConfig:
        """A very small model for unit tests: 2 layers, width 32, sequences of 32 bytes (~34k params)."""
        return cls(seq_len=32, n_layer=2, n_head=2, d_model=32)

    @classmethod
    def demo(cls) -> GPTConfig:
        """The model trained by ``microspeed demo``: 4 layers, width 96, 4 heads, 128-byte sequences.

        484,416 parameters. One fp32 training step (forward, backward, AdamW) with a
        micro-batch of 8 sequences of 128 bytes takes about 0.16 s on one thread of a
        ~33 GFLOP/s CPU core (the default width 128 took about 0.25 s there). Keep the model
        in fp32 on CPU: bf16/fp16 matmuls there are roughly 7-12x slower.
        """
        return cls(seq_len=128, n_layer=4, n_head=4, d_model=96)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention using :func:`torch.nn.functional.scaled_dot_product_attention`.

    It declares itself *replaceable*: a plugin may set :attr:`attention_fn` to compute the attention
    of ``(B, n_head, T, head_dim)`` queries, keys and values instead of SDPA (the ``sparse_attention``
    config section does, with block-sparse attention). The protocol is the attributes ``attention_fn``,
    ``n_head``, ``is_causal``, ``max_seq_len`` and ``dropout``; any module may carry them.

    Attributes:
        n_head: number of heads.
        d_model: input/output width.
        attention_fn: ``None`` (SDPA) or a callable ``(q, k, v) -> y`` that replaces the attention.
        is_causal: whether each position attends only to itself and earlier ones (always here).
        max_seq_len: the longest sequence the model is built for.
        qkv: fused query/key/value projection ``d_model -> 3 * d_model``.
        proj: output projection ``d_model -> d_model`` (a residual projection: its
            initialisation is scaled by ``1/sqrt(2 * n_layer)``).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.d_model = config.d_model
        self.dropout = config.dropout
        self.attention_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.is_causal = True
        self.max_seq_len = config.seq_len
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.proj.is_residual_projection = True
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend causally over ``x`` of shape ``(B, T, d_model)``; returns the same shape."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(self.d_model, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.attention_fn is not None:
            y = self.attention_fn(q, k, v)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
            )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.proj(y))


def fused_kernels_wanted() -> bool:
    """Whether new models of this module use microspeed's fused Triton kernels: when a GPU is present."""
    return torch.cuda.is_available()


def layer_norm(d_model: int) -> nn.LayerNorm:
    """``nn.LayerNorm(d_model)``, or :class:`microspeed.ops.fused_layernorm.FusedLayerNorm` (a subclass with the
    same parameters and state dict) when :func:`fused_kernels_wanted`."""
    if fused_kernels_wanted():
        from microspeed.ops.fused_layernorm import FusedLayerNorm

        return FusedLayerNorm(d_model)
    return nn.LayerNorm(d_model)


class MLP(nn.Module):
    """Position-wise feed-forward network: ``Linear(d, 4d) -> GELU -> Linear(4d, d) -> Dropout``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.act = nn.GELU()
        self.fused = fused_kernels_wanted()  # bias + GELU as one Triton kernel on GPU
        self.proj = nn.Linear(4 * config.d_model, config.d_model)
        self.proj.is_residual_projection = True
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to ``x`` of shape ``(..., d_model)``."""
        if self.fused:
            from microspeed.ops.fused_bias_gelu import fused_bias_gelu

            hidden = fused_bias_gelu(F.linear(x, self.fc.weight), self.fc.bias)
        else:
            hidden = self.act(self.fc(x))
        return self.dropout(self.proj(hidden))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``.

    Args:
        config: model hyper-parameters.
        attention: factory for the attention module (default :class:`CausalSelfAttention`).
    """

    def __init__(self, config: GPTConfig, attention: AttentionFactory | None = None) -> None:
        super().__init__()
        self.ln_1 = layer_norm(config.d_model)
        self.attn = (attention or CausalSelfAttention)(config)
        self.ln_2 = layer_norm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, keep_prob: float = 1.0) -> torch.Tensor:
        """Transform the residual stream ``x`` of shape ``(B, T, d_model)``.

        Args:
            x: the residual stream.
            keep_prob: the probability with which progressive layer drop ran this block; both residual
                branches are divided by it (stochastic depth's rescaling, so that the expected update
                equals the full model's). ``1.0`` (the default) leaves the block unchanged.
        """
        if keep_prob == 1.0:
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))
        x = x + self.attn(self.ln_1(x)) / keep_prob
        return x + self.mlp(self.ln_2(x)) / keep_prob


class GPT(nn.Module):
    """A GPT-2-style decoder-only transformer.

    Layout: token embedding + learned position embedding -> dropout -> ``n_layer`` x
    :class:`Block` (in ``self.blocks``) -> final LayerNorm (``self.ln_f``) -> LM head
    (``self.lm_head``, sharing its weight with ``self.tok_emb`` when ``config.tie_weights``).

    Initialisation is GPT-2's: every Linear/Embedding weight ~ N(0, 0.02), biases zero,
    LayerNorms at (1, 0), and residual projections (modules flagged with
    ``is_residual_projection = True``) ~ N(0, 0.02 / sqrt(2 * n_layer)). It draws only from
    the global torch RNG, so the same ``torch.manual_seed`` gives the same weights.

    Args:
        config: model hyper-parameters (default :class:`GPTConfig` ``()``).
        attention: factory for each block's attention module, e.g. a replacement class with
            the same constructor signature as :class:`CausalSelfAttention`.
    """

    def __init__(self, config: GPTConfig | None = None, attention: AttentionFactory | None = None) -> None:
        super().__init__()
        self.config = config = config or GPTConfig()
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config, attention) for _ in range(config.n_layer)])
        self.ln_f = layer_norm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re-)initialise every parameter with the GPT-2 scheme described in the class docstring."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                std = residual_std if getattr(module, "is_residual_projection", False) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                if module.weight is not None:
                    nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        # A tied embedding/LM-head weight is visited twice (as Embedding and as Linear); both
        # draws are N(0, 0.02), so the result is the same distribution and still deterministic.

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of distinct parameters (a tied weight counts once).

        Args:
            exclude_embeddings: leave out the position embedding (and the token embedding
                when it is not also the LM head).
        """
        n = sum(p.numel() for p in self.parameters())  # parameters() already de-duplicates
        if exclude_embeddings:
            n -= self.pos_emb.weight.numel()
            if not self.config.tie_weights:
                n -= self.tok_emb.weight.numel()
        return n

    def pld_keep_probs(self, theta: float) -> list[float]:
        """Progressive layer drop's per-block keep probabilities for the global keep ratio ``theta``.

        Block ``i`` (0-based) of ``L`` runs with probability ``keep_i = 1 - (i + 1) / L * (1 - theta)``
        (the per-layer rule of DeepSpeed's PLD BERT): the first block is dropped least, the last one
        with probability ``1 - theta``. ``theta = 1`` keeps every block.

        Raises:
            ValueError: ``theta`` is not a number in ``[0, 1]``.
        """
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0.0 <= theta <= 1.0:
            raise ValueError(f"GPT.forward: pld_theta must be a number in [0, 1], got {theta!r}")
        n = len(self.blocks)
        return [1.0 - (i + 1) / n * (1.0 - float(theta)) for i in range(n)]

    def forward(
        self,
        idx: torch.Tensor | Sequence[torch.Tensor],
        targets: torch.Tensor | None = None,
        progressive_layer_drop: bool = False,
        pld_theta: float = 1.0,
    ) -> torch.Tensor:
        """Run the model.

        Args:
            idx: token ids of shape ``(B, T)`` with ``T <= config.seq_len`` (any integer
                dtype). May also be a ``(idx, targets)`` tuple/list - exactly what a
                DataLoader over :class:`~microspeed.demo.data.ByteSequenceDataset` yields - in
                which case ``targets`` must not be passed separately.
            targets: next-token ids of shape ``(B, T)``; entries equal to -100 are ignored.
            progressive_layer_drop: in training mode, skip blocks at random as progressive layer
                drop does: block ``i`` runs with probability ``keep_i`` of :meth:`pld_keep_probs`
                (one uniform draw per block from torch's global CPU generator) and, when it runs,
                its residual branches are divided by ``keep_i``. In eval mode every block runs
                unscaled. ``False`` (the default) runs the plain model.
            pld_theta: the current global keep ratio θ in ``[0, 1]`` (used only with
                ``progressive_layer_drop=True``).

        Returns:
            With targets: the mean cross-entropy loss, a 0-dim tensor. It is computed in
            float32 from the logits whatever the model's dtype, for numerical stability.
            Without targets: logits of shape ``(B, T, vocab_size)`` in the model's dtype.
        """
        if isinstance(idx, (tuple, list)):
            if targets is not None:
                raise TypeError(
                    "GPT.forward: pass either a (idx, targets) batch or idx and targets, not both"
                )
            if len(idx) != 2:
                raise ValueError(f"GPT.forward: a batch must be (idx, targets), got {len(idx)} items")
            idx, targets = idx
        if idx.dim() != 2:
            raise ValueError(f"GPT.forward: idx must have shape (B, T), got {tuple(idx.shape)}")
        B, T = idx.shape
        if T > self.config.seq_len:
            raise ValueError(f"GPT.forward: sequence length {T} exceeds config.seq_len={self.config.seq_len}")
        idx = idx.long()
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        if progressive_layer_drop and self.training:
            keep = self.pld_keep_probs(pld_theta)
            draws = torch.rand(len(keep)).tolist()
            for block, p, u in zip(self.blocks, keep, draws, strict=True):
                if u < p:
                    x = block(x, keep_prob=p)
        else:
            for block in self.blocks:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T).long())

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens after the prompt ``idx`` of shape ``(B, T)``.

        The context is cropped to the last ``config.seq_len`` tokens. ``temperature == 0``
        means greedy decoding. Returns ``(B, T + max_new_tokens)`` int64 token ids.
        """
        idx = idx.long()
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.seq_len :])[:, -1, :].float()
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx
