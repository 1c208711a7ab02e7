"""The composition matrix's tiny GPT-like model, as one module or as a :class:`PipelineModule` with equal weights.

Layout (``N_BLOCKS + 2`` layers): :class:`Embed` (token + position embedding), ``N_BLOCKS`` x :class:`Block`
(pre-LayerNorm; attention is the shared :class:`microspeed.models.CausalSelfAttention`, which the sparse-attention
plugin can switch to block-sparse attention; the MLP is dense, tensor-parallel (column then row parallel, cut from
the same dense weights) or a :class:`microspeed_moe.layer.MoE` layer), :class:`Head` (final LayerNorm + output
projection). Layer ``i`` is built right after ``torch.manual_seed(BASE_SEED + i)``, in both forms, so the single
module (:func:`build_stack`) and the pipeline (:func:`build_pipeline`, whose ``seed_layers`` does the same) start
from identical weights, whatever the stage split, the tensor-parallel size or the expert-parallel size.

Randomness that the features draw inside a forward (progressive layer drop's block draws, random-LTD's token
choice) comes from torch's global generator, which the model reseeds at the start of each forward from the
micro-batch's first token (:func:`data_seed`). :func:`micro_batch` makes that token depend on the step and on the
micro-batch's position within a data-parallel rank's share (``index % 2``: the shares are 2 micro-batches, or all
4 in one process), so every data-parallel rank draws the same numbers at the same time, as ranks seeded alike do
(DeepSpeed scripts seed every rank the same), and the single-process reference draws them for the same
micro-batches. Rank-synchronous draws matter: ranks that drop different blocks (progressive layer drop) would
enter different collectives under ZeRO-3 or expert parallelism and hang. In the pipeline form only the first
stage sees the ids: layers of later stages draw from their stage's generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from microspeed.models import CausalSelfAttention, GPTConfig

VOCAB, SEQ, WIDTH, HEADS, N_BLOCKS = 32, 32, 16, 2, 2
"""Vocabulary, sequence length, model width, attention heads and transformer blocks of the matrix model."""

MICRO, N_MICRO = 2, 4
"""Sequences per micro-batch, and micro-batches per global batch (split over the data-parallel ranks)."""

EXPERTS = 2
"""Experts of an MoE layer (expert parallelism up to 2)."""

BASE_SEED = 4321
"""Layer ``i`` is initialised after ``torch.manual_seed(BASE_SEED + i)``."""

GPT_CONFIG = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=N_BLOCKS, n_head=HEADS, d_model=WIDTH, dropout=0.0)


@dataclass(frozen=True)
class ModelSpec:
    """What the model needs: its MLP kind, activation checkpointing, and the parallel sizes it is cut for.

    Attributes:
        tp: the MLPs of the dense blocks are tensor-parallel (column then row parallel over the grid's model axis).
        moe: the last block's MLP is an MoE layer (its experts are dense; the other blocks' MLPs stay as ``tp`` says).
        ac: run every block under activation checkpointing (``deepspeed.checkpointing.checkpoint`` in the single
            module; ``activation_checkpoint_interval=1`` in the pipeline).
        ep: expert-parallel size of the MoE layer.
    """

    tp: bool = False
    moe: bool = False
    ac: bool = False
    ep: int = 1

    def mlp(self, block: int) -> str:
        """The MLP kind of block ``block``: ``"moe"``, ``"tp"`` or ``"dense"``."""
        if self.moe and block == N_BLOCKS - 1:
            return "moe"
        return "tp" if self.tp else "dense"


def data_seed(ids: torch.Tensor) -> int:
    """The seed of a micro-batch's random draws: its first token (see :func:`micro_batch`) and its length."""
    return 1000 * int(ids[0, 0]) + ids.shape[-1]


class Embed(nn.Module):
    """Token plus position embedding; reseeds torch's generator from the ids (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(SEQ, WIDTH)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` ``(B, T)`` -> ``(B, T, WIDTH)``."""
        torch.manual_seed(data_seed(ids))
        return self.tok(ids.long()) + self.pos(torch.arange(ids.shape[1], device=ids.device))


class DenseMLP(nn.Module):
    """``Linear(W, 2W) -> GELU -> Linear(2W, W)``; with ``tp`` the two Linears are cut column- then row-parallel."""

    def __init__(self, tp: bool = False) -> None:
        super().__init__()
        fc, proj = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        nn.init.normal_(fc.weight, std=0.02)
        nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * N_BLOCKS))
        nn.init.zeros_(fc.bias)
        nn.init.zeros_(proj.bias)
        if tp:
            from microspeed_pipeline.tensor_parallel import ColumnParallelLinear, RowParallelLinear

            fc = ColumnParallelLinear.from_dense(fc, gather_output=False)
            proj = RowParallelLinear.from_dense(proj, input_is_parallel=True)
        self.fc, self.proj = fc, proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., W) -> (..., W)``."""
        return self.proj(F.gelu(self.fc(x)))


class MoEMLP(nn.Module):
    """A top-1 :class:`~microspeed_moe.layer.MoE` layer of ``EXPERTS`` dense MLPs (no token dropping, no noise).

    The load-balancing loss is not added to the training loss (a pipeline's last stage cannot see it), so the
    gate learns through the combine weights only; routing is deterministic, so any expert-parallel size routes as
    one process does.
    """

    def __init__(self, ep: int = 1) -> None:
        super().__init__()
        from microspeed_moe.layer import MoE

        self.moe = MoE(WIDTH, DenseMLP(), num_experts=EXPERTS, ep_size=ep, k=1, capacity_factor=1.0,
                       min_capacity=1, drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, W) -> (B, T, W)``."""
        out, _, _ = self.moe(x)
        return out


STEP = 0
"""The optimizer step being trained (the training loop sets it): part of the key of progressive layer drop's draws."""


def _in_backward() -> bool:
    """Whether autograd runs a backward on this thread (an activation checkpoint recomputing a forward)."""
    return torch._C._current_graph_task_id() != -1


class Block(nn.Module):
    """Pre-LayerNorm transformer block ``x + attn(ln1(x))``, ``x + mlp(ln2(x))`` (see :class:`ModelSpec`).

    It takes progressive layer drop's keywords (``progressive_layer_drop``, ``pld_theta``): in training, block ``i``
    of ``L`` then runs with probability ``keep_i = 1 - (i + 1) / L * (1 - theta)`` and its branches are divided by
    ``keep_i``, as :class:`microspeed.models.GPT`'s blocks do. The draw is keyed by ``(STEP, n % 2, i)``, ``n``
    counting the block's training forwards in the step (forwards inside a backward, activation checkpointing's
    recomputes, are counted apart and redraw the same): every schedule runs a block's micro-batches in order, so the
    pipeline form, the single module and every data-parallel rank draw alike for the same micro-batch position
    (see :func:`micro_batch`).
    """

    def __init__(self, spec: ModelSpec = ModelSpec(), index: int = 0) -> None:
        super().__init__()
        self.index = index
        self._counts = [-1, 0, 0]  # step, forwards, recomputes
        self.ln_1 = nn.LayerNorm(WIDTH)
        self.attn = CausalSelfAttention(GPT_CONFIG)
        nn.init.normal_(self.attn.qkv.weight, std=0.02)
        nn.init.zeros_(self.attn.qkv.bias)
        nn.init.normal_(self.attn.proj.weight, std=0.02 / math.sqrt(2 * N_BLOCKS))
        nn.init.zeros_(self.attn.proj.bias)
        self.ln_2 = nn.LayerNorm(WIDTH)
        kind = spec.mlp(index)
        self.mlp: nn.Module = MoEMLP(spec.ep) if kind == "moe" else DenseMLP(tp=kind == "tp")

    def _draw(self) -> float:
        if self._counts[0] != STEP:
            self._counts[:] = [STEP, 0, 0]
        slot = 2 if _in_backward() else 1
        n = self._counts[slot]
        self._counts[slot] += 1
        g = torch.Generator().manual_seed(100003 * STEP + 101 * (n % 2) + self.index)
        return float(torch.rand((), generator=g))

    def forward(self, x: torch.Tensor, progressive_layer_drop: bool = False, pld_theta: float = 1.0) -> torch.Tensor:
        """Transform ``(B, T, W)`` (skipped, or rescaled, under progressive layer drop)."""
        keep = 1.0
        if progressive_layer_drop and self.training:
            keep = 1.0 - (self.index + 1) / N_BLOCKS * (1.0 - float(pld_theta))
            if self._draw() >= keep:
                return x
        x = x + self.attn(self.ln_1(x)) / keep
        return x + self.mlp(self.ln_2(x)) / keep


class Head(nn.Module):
    """Final LayerNorm and the output projection to the vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB, bias=False)
        nn.init.normal_(self.out.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, W) -> (B, T, VOCAB)`` logits."""
        return self.out(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, in float32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1).long())


def layer_specs(spec: ModelSpec) -> list:
    """The model as pipeline layer specs: embed, blocks, head."""
    from microspeed_pipeline import LayerSpec

    return [LayerSpec(Embed), *[LayerSpec(Block, spec, i) for i in range(N_BLOCKS)], LayerSpec(Head)]


class Stack(nn.Module):
    """The single-module form: ``forward((ids, targets))`` returns the loss.

    It takes progressive layer drop's keywords (``progressive_layer_drop``, ``pld_theta``) and hands them to every
    block (see :class:`Block`).
    """

    def __init__(self, spec: ModelSpec = ModelSpec()) -> None:
        super().__init__()
        self.spec = spec
        torch.manual_seed(BASE_SEED)
        self.embed = Embed()
        blocks = []
        for i in range(N_BLOCKS):
            torch.manual_seed(BASE_SEED + 1 + i)
            blocks.append(Block(spec, i))
        self.blocks = nn.ModuleList(blocks)
        torch.manual_seed(BASE_SEED + 1 + N_BLOCKS)
        self.head = Head()

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor], progressive_layer_drop: bool = False,
                pld_theta: float = 1.0) -> torch.Tensor:
        """The mean cross-entropy of the ``(ids, targets)`` micro-batch."""
        ids, targets = batch
        x = self.embed(ids)
        for block in self.blocks:
            if self.spec.ac and self.training:
                from microspeed_pipeline.checkpointing import checkpoint

                x = checkpoint(block, x, progressive_layer_drop, pld_theta)
            else:
                x = block(x, progressive_layer_drop, pld_theta)
        return lm_loss(self.head(x), targets)


def build_stack(spec: ModelSpec) -> Stack:
    """The single-module form (layer ``i`` seeded with ``BASE_SEED + i``)."""
    return Stack(spec)


def build_pipeline(spec: ModelSpec, topology, chunks: int = 1):
    """The :class:`PipelineModule` form over ``topology`` (``chunks`` model chunks per rank)."""
    from microspeed_pipeline import PipelineModule

    return PipelineModule(layer_specs(spec), topology=topology, loss_fn=lm_loss, seed_layers=True,
                          base_seed=BASE_SEED, partition_method="uniform", num_chunks=chunks,
                          activation_checkpoint_interval=1 if spec.ac else 0)


def micro_batch(step: int, index: int, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``index`` (0 .. N_MICRO - 1) of the global batch of ``step``: ``(ids, targets)``.

    Sequences count up from a random start (``t, t+1, ...`` modulo ``VOCAB``), so the next token is learnable and
    the loss falls quickly: a run that goes wrong shows in the losses. The first sequence starts at a token that
    depends only on ``step`` and ``index % 2``: the key of the micro-batch's random draws (:func:`data_seed`).
    """
    g = torch.Generator().manual_seed(1009 * step + index + 17)
    start = torch.randint(0, VOCAB, (MICRO, 1), generator=g)
    start[0, 0] = (3 * step + index % 2) % VOCAB
    ids = (start + torch.arange(seq + 1)) % VOCAB
    return ids[:, :-1], ids[:, 1:]
