"""The shared GPT (:mod:`microspeed.models`, the model the demo trains) with Mixture-of-Experts layers.

``moe_gpt(config, num_experts, k, ep_size=1, every=2)`` builds a :class:`MoEGPT`: the demo's
:class:`~microspeed.models.GPT` in which every ``every``-th block (blocks ``every - 1``, ``2 * every - 1``, …;
0-based) is a :class:`MoEBlock`, whose MLP is a :class:`~microspeed_moe.layer.MoE` layer with
``num_experts`` copies of the demo's :class:`~microspeed.models.MLP` as experts (each rank holds
``num_experts / ep_size`` of them). Everything else — embeddings, attention, the tied LM head — is the demo's.

The training loss, what ``forward(batch)`` returns, is the language-model loss plus the experts' load-balancing
loss, DeepSpeed-style::

    loss = cross_entropy(logits, targets) + aux_loss_coef * sum(l_aux of every MoE layer)

(``aux_loss_coef`` 0.01 by default, the coefficient DeepSpeed's Megatron examples use). After each forward the
model keeps, for logging, :attr:`MoEGPT.last_lm_loss`, :attr:`MoEGPT.last_l_aux` (the summed auxiliary loss) and
:attr:`MoEGPT.last_exp_counts` (one ``[num_experts]`` tensor per MoE layer: tokens routed to each expert before
capacity dropping), all detached.

Initialisation is GPT-2's, as the demo model's, and does not depend on ``ep_size``: the global RNG initialises
the replicated parameters (the same draws on every rank), and expert ``e`` of an MoE layer is initialised from
its own generator, seeded by a per-layer seed (drawn from the global RNG) plus ``e`` — its global index. So the
same ``torch.manual_seed`` gives the same experts whether they sit on one rank or are spread over several, and
``ep_size`` 2 on 2 ranks trains exactly as ``ep_size`` 1 in one process over both ranks' micro-batches.

Example::

    torch.manual_seed(0)
    model = moe_gpt(GPTConfig.tiny(), num_experts=4, k=1)
    engine, *_ = microspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    loss = engine(batch)           # LM loss + 0.01 * l_aux
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from microspeed.models import GPT, MLP, AttentionFactory, Block, GPTConfig
from microspeed_moe.gating import check_noisy_gate_policy
from microspeed_moe.layer import MoE

__all__ = ["MoEBlock", "MoEGPT", "MoEGPTConfig", "moe_gpt"]


@dataclass(frozen=True)
class MoEGPTConfig:
    """Where the MoE layers go and how they route (the arguments of :class:`~microspeed_moe.layer.MoE`).

    Attributes:
        num_experts: experts per MoE layer.
        k: experts per token (1: Switch, 2: GShard).
        ep_size: ranks the experts of a layer are spread over; must divide ``num_experts`` and the world size.
        every: every ``every``-th block is an MoE block (blocks ``every - 1``, ``2 * every - 1``, …); 1 makes
            every block one.
        capacity_factor / eval_capacity_factor / min_capacity: expert capacity in training / evaluation.
        drop_tokens: drop tokens over capacity (``False``: capacity is the busiest expert's count).
        use_rts: random token selection among an over-full expert's tokens.
        noisy_gate_policy: ``None``, ``"Jitter"`` or ``"RSample"``.
        top2_2nd_expert_sampling: choose top-2's second expert with Gumbel noise.
        use_residual: Residual MoE (a dense MLP beside the experts).
        aux_loss_coef: weight of the summed load-balancing losses in the training loss (DeepSpeed-style 0.01).
    """

    num_experts: int = 4
    k: int = 1
    ep_size: int = 1
    every: int = 2
    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 4
    drop_tokens: bool = True
    use_rts: bool = True
    noisy_gate_policy: str | None = None
    top2_2nd_expert_sampling: bool = True
    use_residual: bool = False
    aux_loss_coef: float = 0.01

    def __post_init__(self) -> None:
        for name in ("num_experts", "k", "ep_size", "every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEGPTConfig.{name} must be an int >= 1, got {value!r}")
        if self.k > self.num_experts:
            raise ValueError(f"MoEGPTConfig.k={self.k} exceeds num_experts={self.num_experts}: lower k or add experts")
        if self.num_experts % self.ep_size:
            raise ValueError(f"MoEGPTConfig.ep_size={self.ep_size} must divide num_experts={self.num_experts}")
        for name in ("capacity_factor", "eval_capacity_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"MoEGPTConfig.{name} must be a finite number > 0, got {value!r}")
        coef = self.aux_loss_coef
        if isinstance(coef, bool) or not isinstance(coef, numbers.Real) or not math.isfinite(coef) or coef < 0:
            raise ValueError(f"MoEGPTConfig.aux_loss_coef must be a finite number >= 0, got {coef!r}")
        check_noisy_gate_policy(self.noisy_gate_policy, "MoEGPTConfig")

    def is_moe_block(self, index: int) -> bool:
        """Whether block ``index`` (0-based) is an MoE block."""
        return index % self.every == self.every - 1


class MoEBlock(Block):
    """The demo's pre-LayerNorm block with an :class:`~microspeed_moe.layer.MoE` layer as its MLP (``self.mlp``).

    ``forward(x)`` returns ``x + attn(ln_1(x))`` then adds the MoE output; the layer's ``l_aux`` and
    ``exp_counts`` of that forward are kept as :attr:`l_aux` and :attr:`exp_counts`.
    """

    def __init__(self, config: GPTConfig, moe: MoEGPTConfig, attention: AttentionFactory | None = None) -> None:
        super().__init__(config, attention)
        self.mlp = MoE(config.d_model, MLP(config), num_experts=moe.num_experts, ep_size=moe.ep_size, k=moe.k,
                       capacity_factor=moe.capacity_factor, eval_capacity_factor=moe.eval_capacity_factor,
                       min_capacity=moe.min_capacity, use_residual=moe.use_residual,
                       noisy_gate_policy=moe.noisy_gate_policy, drop_tokens=moe.drop_tokens, use_rts=moe.use_rts,
                       top2_2nd_expert_sampling=moe.top2_2nd_expert_sampling)
        self.l_aux: torch.Tensor | None = None
        """The load-balancing loss of the last forward (differentiable)."""
        self.exp_counts: torch.Tensor | None = None
        """``[num_experts]``: tokens routed to each expert in the last forward, before capacity dropping."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Transform the residual stream ``x`` of shape ``(B, T, d_model)``."""
        x = x + self.attn(self.ln_1(x))
        out, self.l_aux, self.exp_counts = self.mlp(self.ln_2(x))
        return x + out


class MoEGPT(GPT):
    """The demo GPT with :class:`MoEBlock` s where ``moe.is_moe_block(i)``; see the module docstring.

    ``forward(idx, targets)`` (or ``forward((idx, targets))``) returns the LM loss plus ``aux_loss_coef`` times
    the summed ``l_aux`` of the MoE layers; without targets, the logits. Either way the last forward's
    :attr:`last_lm_loss`, :attr:`last_l_aux` and :attr:`last_exp_counts` are kept (detached) for logging.

    Args:
        config: the demo model's hyper-parameters (``dropout`` applies inside the experts too).
        moe: where the MoE layers go and how they route (default :class:`MoEGPTConfig` ``()``).
        attention: factory for each block's attention module, as in :class:`~microspeed.models.GPT`.
    """

    def __init__(self, config: GPTConfig | None = None, moe: MoEGPTConfig | None = None,
                 attention: AttentionFactory | None = None) -> None:
        config = config or GPTConfig()
        moe = moe or MoEGPTConfig()
        if not isinstance(moe, MoEGPTConfig):
            raise TypeError(f"MoEGPT(moe=...): expected a MoEGPTConfig, got {type(moe).__name__}")
        if not any(moe.is_moe_block(i) for i in range(config.n_layer)):
            raise ValueError(f"MoEGPT: every={moe.every} leaves no MoE block among n_layer={config.n_layer} blocks; "
                             f"use every <= n_layer")
        self._building = True  # GPT.__init__ calls reset_parameters before the MoE blocks exist
        super().__init__(config, attention)
        self.moe_config = moe
        for i in range(config.n_layer):
            if moe.is_moe_block(i):
                self.blocks[i] = MoEBlock(config, moe, attention)
        self._building = False
        self.last_lm_loss: torch.Tensor | None = None
        """The language-model loss of the last forward with targets (detached)."""
        self.last_l_aux: torch.Tensor | None = None
        """The summed load-balancing loss of the last forward (detached, before ``aux_loss_coef``)."""
        self.last_exp_counts: list[torch.Tensor] = []
        """Per MoE layer, in block order: ``[num_experts]`` tokens routed to each expert in the last forward."""
        self.reset_parameters()

    @property
    def moe_blocks(self) -> list[MoEBlock]:
        """The MoE blocks, in order."""
        return [b for b in self.blocks if isinstance(b, MoEBlock)]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 initialisation of every parameter, independent of ``ep_size`` (see the module docstring)."""
        if getattr(self, "_building", False):
            return
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        expert_modules = set()
        for block in self.moe_blocks:
            expert_modules.update(id(m) for m in block.mlp.deepspeed_moe.experts.modules())
        for module in self.modules():
            if id(module) in expert_modules:
                continue
            _init_module(module, residual_std, None)
        for block in self.moe_blocks:
            layer_seed = int(torch.randint(0, 2**62, ()).item())  # the same draw on every rank
            experts = block.mlp.deepspeed_moe.experts
            for index in experts.local_indices():
                generator = torch.Generator().manual_seed(layer_seed + index)
                for module in experts.deepspeed_experts[str(index)].modules():
                    _init_module(module, residual_std, generator)

    def forward(self, idx: torch.Tensor | Sequence[torch.Tensor], targets: torch.Tensor | None = None) -> torch.Tensor:
        """The LM loss plus ``aux_loss_coef * sum(l_aux)`` (with targets), or the logits (without).

        Arguments as :meth:`microspeed.models.GPT.forward`.
        """
        out = super().forward(idx, targets)
        blocks = self.moe_blocks
        l_aux = torch.stack([b.l_aux.float() for b in blocks]).sum()
        self.last_l_aux = l_aux.detach()
        self.last_exp_counts = [b.exp_counts.detach() for b in blocks]
        if out.dim() != 0:  # logits: no targets
            return out
        self.last_lm_loss = out.detach()
        return out + self.moe_config.aux_loss_coef * l_aux


def _init_module(module: nn.Module, residual_std: float, generator: torch.Generator | None) -> None:
    """GPT-2's initialisation of one module's own parameters (``generator``: None for the global RNG)."""
    if isinstance(module, nn.Linear):
        std = residual_std if getattr(module, "is_residual_projection", False) else 0.02
        nn.init.normal_(module.weight, mean=0.0, std=std, generator=generator)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02, generator=generator)
    elif isinstance(module, nn.LayerNorm):
        if module.weight is not None:
            nn.init.ones_(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


def moe_gpt(config: GPTConfig | None = None, num_experts: int = 4, k: int = 1, ep_size: int = 1, every: int = 2,
            attention: AttentionFactory | None = None, **moe_kwargs) -> MoEGPT:
    """A :class:`MoEGPT` of ``config`` with ``num_experts`` experts (top-``k``) in every ``every``-th block.

    ``moe_kwargs`` are the other fields of :class:`MoEGPTConfig` (``capacity_factor``, ``drop_tokens``,
    ``use_rts``, ``aux_loss_coef``, …). ``ep_size > 1`` needs ``torch.distributed`` started first.
    """
    unknown = set(moe_kwargs) - set(MoEGPTConfig.__dataclass_fields__)
    if unknown:
        raise TypeError(f"moe_gpt(): unknown MoE option(s) {sorted(unknown)}; "
                        f"expected fields of MoEGPTConfig: {sorted(MoEGPTConfig.__dataclass_fields__)}")
    moe = MoEGPTConfig(num_experts=num_experts, k=k, ep_size=ep_size, every=every, **moe_kwargs)
    return MoEGPT(config, moe, attention)
