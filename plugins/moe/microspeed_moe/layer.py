"""``MoE``: DeepSpeed's Mixture-of-Experts layer, routed by index instead of dense one-hot tensors.

``MoE(hidden_size, expert, num_experts, ep_size, k, ...)`` replaces an MLP: each token goes to its top-k
experts (within their capacity), the experts' outputs are summed with the gate weights, and the layer
returns ``(output, l_aux, exp_counts)`` like DeepSpeed's. One layer's forward:

1. the gate (:class:`~microspeed_moe.sharded_moe.TopKGate`) routes every token: for each of its ``k``
   choices an expert, a slot in that expert's capacity (−1 when dropped) and a weight;
2. :func:`~microspeed_moe.routing.dispatch` copies each kept token into ``[experts, capacity, hidden]``
   (O(tokens·k·hidden) work, never DeepSpeed's ``tokens × experts × capacity`` one-hot einsum);
3. with ``ep_size > 1``, an ``all_to_all`` over the expert-parallel group brings every rank's tokens for
   an expert to the rank that holds it; the local experts run; a second ``all_to_all`` sends results back;
4. :func:`~microspeed_moe.routing.combine` sums each token's expert outputs with its gate weights.

``use_residual`` makes it a Residual MoE (PR-MoE): a dense copy of the expert runs beside, mixed by a
learned two-way softmax coefficient.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from microspeed_moe.all_to_all import all_to_all
from microspeed_moe.experts import Experts
from microspeed_moe.groups import get_expert_groups
from microspeed_moe.routing import combine, dispatch
from microspeed_moe.sharded_moe import TopKGate


class MOELayer(nn.Module):
    """Gate, dispatch, (all-to-all,) experts, (all-to-all,) combine — see the module docstring."""

    def __init__(self, gate: TopKGate, experts: Experts, ep_size: int = 1) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_size = ep_size
        self.num_local_experts = experts.num_local
        self.ep_group: Any = None
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None

    def _set_ep_group(self, group: Any) -> None:
        """Use ``group`` for the token exchange (DeepSpeed's name)."""
        self.ep_group = group
        self.gate.ep_group = group

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None) -> torch.Tensor:
        """Route, run the experts and combine; ``l_aux`` and ``exp_counts`` are kept on the layer."""
        if self.ep_size > 1 and self.ep_group is None:  # built before initialize: groups at first use
            groups = get_expert_groups(self.ep_size)
            self._set_ep_group(groups.ep_group)
            self.experts.place(groups.ep_rank)
        d = hidden_states.shape[-1]
        x = hidden_states.reshape(-1, d)
        routing = self.gate.route(x, used_token)
        e, c = self.gate.num_experts, routing.capacity
        dispatched = dispatch(x, routing.experts, routing.slots, e, c)             # [E, C, H]
        received = all_to_all(dispatched, self.ep_group)                           # [ep · local, C, H]
        local_in = received.reshape(self.ep_size, self.num_local_experts, c, d).transpose(0, 1)
        local_out = self.experts(local_in.reshape(self.num_local_experts, self.ep_size * c, d))
        back = local_out.reshape(self.num_local_experts, self.ep_size, c, d).transpose(0, 1)
        expert_out = all_to_all(back.reshape(e, c, d), self.ep_group)              # [E, C, H], this rank's tokens
        out = combine(expert_out.to(x.dtype), routing.experts, routing.slots, routing.weights.to(x.dtype))
        self.l_aux, self.exp_counts = routing.l_aux, routing.exp_counts
        return out.reshape(hidden_states.shape)


class MoE(nn.Module):
    """DeepSpeed's ``deepspeed.moe.layer.MoE``; ``forward(hidden_states, used_token=None)`` returns
    ``(output, l_aux, exp_counts)``.

    Args:
        hidden_size: the input and output width.
        expert: the module each expert copies (an MLP ``[tokens, hidden] -> [tokens, hidden]``).
        num_experts: experts in the layer; ``ep_size`` must divide it.
        ep_size: ranks the experts are spread over (expert parallelism); the world size must be a
            multiple of it. Each rank holds ``num_experts / ep_size`` of them.
        k: experts per token (1: Switch, 2: GShard, more: top-k).
        capacity_factor / eval_capacity_factor: expert capacity is ``ceil(tokens / experts × factor)``
            in training / evaluation, at least ``min_capacity``.
        use_residual: Residual MoE (PR-MoE).
        noisy_gate_policy: ``None``, ``"Jitter"`` (multiplicative noise on the gate's input) or
            ``"RSample"`` (Gumbel noise on the top-1 choice).
        drop_tokens: ``False`` sizes the capacity to the busiest expert over the expert-parallel group.
        use_rts: random token selection (which tokens keep an over-full expert's capacity).
        use_tutel, enable_expert_tensor_parallelism: DeepSpeed options that must stay ``False`` here.
        top2_2nd_expert_sampling: choose top-2's second expert with Gumbel noise.
    """

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if use_tutel:
            raise ValueError("MoE(use_tutel=True): Tutel is not used by microspeed; its index routing is built in. "
                             "Drop use_tutel.")
        if enable_expert_tensor_parallelism:
            raise ValueError("MoE(enable_expert_tensor_parallelism=True): experts split by tensor parallelism are "
                             "not supported; drop the argument.")
        self.use_residual = use_residual
        self.hidden_size = hidden_size
        self.ep_size = ep_size
        self.num_experts = num_experts
        self.num_local_experts = num_experts // max(ep_size, 1)
        self.expert_group_name = f"ep_size_{ep_size}"
        experts = Experts(expert, num_experts, ep_size, self.expert_group_name)
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling)
        self.deepspeed_moe = MOELayer(gate, experts, ep_size)
        if use_residual:
            self.mlp = copy.deepcopy(expert)
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Create (or reuse) this layer's expert-parallel groups and use them (DeepSpeed's name)."""
        if use_data_before_expert_parallel_:
            raise ValueError("use_data_before_expert_parallel_=True is not supported: expert-parallel groups are "
                             "consecutive ranks.")
        groups = get_expert_groups(self.ep_size)
        self.deepspeed_moe._set_ep_group(groups.ep_group)
        self.deepspeed_moe.experts.place(groups.ep_rank)

    def forward(self, hidden_states: torch.Tensor,
                used_token: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(output, l_aux, exp_counts)`` for ``hidden_states`` of shape ``[..., hidden_size]``."""
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"MoE.forward: hidden_states has last dimension {hidden_states.shape[-1]}, but the layer "
                             f"was built with hidden_size={self.hidden_size}; pass [..., {self.hidden_size}].")
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            dense = dense[0] if isinstance(dense, tuple) else dense
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
