"""DeepSpeed's gating API (``deepspeed.moe.sharded_moe``): ``top1gating``, ``top2gating``, ``topkgating``, ``TopKGate``.

These return DeepSpeed's dense gate output ``(l_aux, combine_weights, dispatch_mask, exp_counts)`` with
``combine_weights`` a float ``[tokens, experts, capacity]`` tensor and ``dispatch_mask`` its nonzero pattern,
or, with ``sparse_routes=True`` (DeepSpeed 0.19.8's argument), its sparse form ``(l_aux, capacity,
num_experts, indices [k, T] int32 (-1 where dropped), locations [k, T] int32, gates [k, T], exp_counts)``
(:func:`sparse`).
Each is the sparse :class:`~microspeed_moe.gating.Routing` of :mod:`microspeed_moe.gating` expanded by
:func:`dense`, so the fast path (which never builds the dense tensors) and this API agree by construction.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from microspeed_moe.gating import (
    Routing,
    _check_capacity_args,
    _check_factor,
    _check_k,
    check_noisy_gate_policy,
    gumbel_noise,
    route,
    route_top1,
    route_top2,
    route_topk,
)
from microspeed_moe.gating import multiplicative_jitter as _jitter

__all__ = ["Routing", "TopKGate", "dense", "gumbel_rsample", "multiplicative_jitter", "sparse", "top1gating",
           "top2gating", "topkgating"]

GateOutput = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""``(l_aux, combine_weights [T, E, C] float, dispatch_mask [T, E, C] bool, exp_counts [E] long)``."""


def dense(routing: Routing, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expand a :class:`Routing` into DeepSpeed's ``(combine_weights, dispatch_mask)``, each ``[T, E, capacity]``.

    ``combine_weights[t, e, c]`` is the weight of token ``t``'s choice that took slot ``c`` of expert ``e``
    (differentiable with respect to ``routing.weights``); ``dispatch_mask`` is ``combine_weights != 0``, as
    DeepSpeed defines it.
    """
    num_tokens, k = routing.experts.shape
    cap = routing.capacity
    size = num_tokens * num_experts * cap
    token = torch.arange(num_tokens, device=routing.experts.device).unsqueeze(1).expand(num_tokens, k)
    flat = (token * num_experts + routing.experts) * cap + routing.slots
    flat = torch.where(routing.kept, flat, torch.full_like(flat, size))  # dropped choices land on a scratch cell
    combine = routing.weights.new_zeros(size + 1).index_add_(0, flat.reshape(-1), routing.weights.reshape(-1))
    combine_weights = combine[:size].view(num_tokens, num_experts, cap)
    return combine_weights, combine_weights.bool()


SparseGateOutput = tuple[torch.Tensor, int, int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""``(l_aux, capacity, num_experts, indices [k, T] int32, locations [k, T] int32, gates [k, T], exp_counts)``."""


def sparse(routing: Routing, num_experts: int) -> SparseGateOutput:
    """A :class:`Routing` as DeepSpeed's ``sparse_routes=True`` gate output (one row per choice, ``[k, T]``).

    ``indices`` is the expert of each route, ``-1`` where the capacity limit (or ``used_token``) dropped it;
    ``locations`` its slot in the expert's buffer (0 where dropped); ``gates`` its combine weight (0 where
    dropped; differentiable). ``capacity`` is a Python int.
    """
    kept = routing.kept
    indices = torch.where(kept, routing.experts, torch.full_like(routing.experts, -1))
    locations = torch.where(kept, routing.slots, torch.zeros_like(routing.slots))
    return (routing.l_aux, routing.capacity, num_experts, indices.t().to(torch.int32).contiguous(),
            locations.t().to(torch.int32).contiguous(), routing.weights.t().contiguous(), routing.exp_counts)


def _gate_output(routing: Routing, num_experts: int, sparse_routes: bool = False) -> GateOutput | SparseGateOutput:
    if sparse_routes:
        return sparse(routing, num_experts)
    combine_weights, dispatch_mask = dense(routing, num_experts)
    return routing.l_aux, combine_weights, dispatch_mask, routing.exp_counts


def _route_slots(indices: torch.Tensor, locations: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """DeepSpeed's helper for the sparse routes: ``[k, T]`` flat slots ``expert * capacity + location`` in an
    ``[E * C]`` buffer; a dropped route (index ``-1``) gets the extra slot ``E * C``."""
    flat = indices.long() * capacity + locations.long()
    return flat.masked_fill(indices < 0, num_experts * capacity)


def _sparse_encode(reshaped_input: torch.Tensor, slots: torch.Tensor, num_experts: int,
                   capacity: int) -> torch.Tensor:
    """DeepSpeed's helper: the ``[E, C, M]`` expert buffer holding each routed token of ``[T, M]`` at its slot
    (empty slots are zero; dropped routes go nowhere)."""
    num_tokens, d_model = reshaped_input.shape
    buffer = reshaped_input.new_zeros(num_experts * capacity + 1, d_model)
    token = torch.arange(num_tokens, device=slots.device).expand_as(slots).reshape(-1)
    buffer.index_copy_(0, slots.reshape(-1), reshaped_input.index_select(0, token))
    return buffer[:-1].view(num_experts, capacity, d_model)


def _sparse_decode(expert_output: torch.Tensor, slots: torch.Tensor, gates: torch.Tensor,
                   num_tokens: int) -> torch.Tensor:
    """DeepSpeed's helper: each token's ``sum_j gates[j, t] * expert_output[slots[j, t]]`` (fp32 sums, cast back
    to the output's dtype); ``expert_output`` is the flat ``[E * C, M]`` buffer."""
    d_model = expert_output.shape[-1]
    padded = torch.cat([expert_output.float(), expert_output.new_zeros(1, d_model, dtype=torch.float32)])
    routed = padded.index_select(0, slots.reshape(-1)).view(slots.shape[0], num_tokens, d_model)
    return (routed * gates.float().unsqueeze(-1)).sum(0).to(expert_output.dtype)


def _no_tutel(use_tutel: bool) -> None:
    if use_tutel:
        raise ValueError("use_tutel=True: Tutel is not used by microspeed (its routing is built in, with the same "
                         "result); drop use_tutel.")


def top1gating(logits: torch.Tensor,
               capacity_factor: float,
               min_capacity: int,
               used_token: torch.Tensor | None = None,
               noisy_gate_policy: str | None = None,
               drop_tokens: bool = True,
               use_rts: bool = True,
               ep_group: Any = None,
               sparse_routes: bool = False,
               use_tutel: bool = False) -> GateOutput | SparseGateOutput:
    """Switch top-1 gating of ``[T, E]`` logits: DeepSpeed's ``top1gating`` (:func:`~.gating.route_top1`).

    Returns ``(l_aux, combine_weights, dispatch_mask, exp_counts)``, or the sparse form with
    ``sparse_routes``; ``exp_counts`` counts each expert's (used) tokens before dropping. ``use_tutel``
    must stay ``False`` (Tutel's kernels are not used here; the result would be the same).
    """
    _no_tutel(use_tutel)
    routing = route_top1(logits, capacity_factor, min_capacity, used_token=used_token,
                         noisy_gate_policy=noisy_gate_policy, drop_tokens=drop_tokens, use_rts=use_rts,
                         ep_group=ep_group)
    return _gate_output(routing, logits.shape[1], sparse_routes)


def top2gating(logits: torch.Tensor,
               capacity_factor: float,
               min_capacity: int,
               drop_tokens: bool = True,
               ep_group: Any = None,
               top2_2nd_expert_sampling: bool = True,
               sparse_routes: bool = False) -> GateOutput | SparseGateOutput:
    """GShard top-2 gating of ``[T, E]`` logits: DeepSpeed's ``top2gating`` (:func:`~.gating.route_top2`).

    Returns ``(l_aux, combine_weights, dispatch_mask, exp_counts)``; ``exp_counts`` counts first and second
    choices before dropping. Unlike DeepSpeed's, it does not add the sampling noise to ``logits`` in place.
    """
    routing = route_top2(logits, capacity_factor, min_capacity, drop_tokens=drop_tokens, ep_group=ep_group,
                         top2_2nd_expert_sampling=top2_2nd_expert_sampling)
    return _gate_output(routing, logits.shape[1], sparse_routes)


def topkgating(logits: torch.Tensor,
               k: int,
               capacity_factor: float,
               min_capacity: int,
               drop_tokens: bool = True,
               ep_group: Any = None,
               drop_policy: str = "probs",
               sparse_routes: bool = False) -> GateOutput | SparseGateOutput:
    """Top-k gating on ``[T, E]`` logits, DeepSpeed's ``topkgating`` (:func:`~.gating.route_topk`).

    Returns ``(l_aux, combine_weights, dispatch_mask, exp_counts)``; ``exp_counts`` counts all ``k`` choices
    before dropping.
    """
    routing = route_topk(logits, k, capacity_factor, min_capacity, drop_tokens=drop_tokens, ep_group=ep_group,
                         drop_policy=drop_policy)
    return _gate_output(routing, logits.shape[1], sparse_routes)


def multiplicative_jitter(x: torch.Tensor, device: torch.device | None = None, epsilon: float = 1e-2) -> torch.Tensor:
    """DeepSpeed's ``multiplicative_jitter(x, device, epsilon)``: ``x`` times uniform noise in ``[1 ± epsilon)``.

    ``device`` is accepted for DeepSpeed compatibility; the noise is made on ``x``'s device.
    """
    return _jitter(x, epsilon)


def gumbel_rsample(shape: tuple[int, ...] | torch.Size, device: torch.device | str | None = None) -> torch.Tensor:
    """DeepSpeed's ``gumbel_rsample(shape, device)``: standard Gumbel samples in float32."""
    return gumbel_noise(shape, device)


class TopKGate(nn.Module):
    """The gate network of a MoE layer, DeepSpeed's ``TopKGate``: a bias-free ``Linear(model_dim, num_experts)``.

    The logits are computed in float32 (``wg.weight.float()`` on ``input.float()``), after multiplying the
    input by :func:`~microspeed_moe.gating.multiplicative_jitter` noise when ``noisy_gate_policy == 'Jitter'``
    and the module is training. Evaluation uses ``eval_capacity_factor`` and no noisy gate policy.
    ``k == 1`` gates like ``top1gating``, ``k == 2`` like ``top2gating``, larger ``k`` like ``topkgating``.

    ``forward(input, used_token)`` returns DeepSpeed's dense ``(l_aux, combine_weights, dispatch_mask,
    exp_counts)``; :meth:`route` returns the sparse :class:`~microspeed_moe.gating.Routing` the layer uses.
    """

    wg: nn.Linear

    def __init__(self,
                 model_dim: int,
                 num_experts: int,
                 k: int = 1,
                 capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0,
                 min_capacity: int = 8,
                 noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True,
                 use_rts: bool = True,
                 ep_group: Any = None,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        fn = "TopKGate"
        for name, value in (("model_dim", model_dim), ("num_experts", num_experts)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{fn}: {name} must be an int >= 1, got {value!r}")
        _check_k(fn, k, num_experts)
        _check_capacity_args(fn, capacity_factor, min_capacity)
        _check_factor(fn, "eval_capacity_factor", eval_capacity_factor)
        self.noisy_gate_policy = check_noisy_gate_policy(noisy_gate_policy, fn)
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.wall_clock_breakdown = False
        self.gate_time = 0.0

    @property
    def num_experts(self) -> int:
        """Experts the gate routes to."""
        return self.wg.out_features

    def _set_ep_group(self, ep_group: Any) -> None:
        """Set the expert-parallel group once (the layer calls it when the groups exist)."""
        if self.ep_group is not None:
            raise RuntimeError("TopKGate: attempting to override an existing ep_group")
        self.ep_group = ep_group

    def logits(self, input: torch.Tensor) -> torch.Tensor:
        """``[T, E]`` float32 router logits of ``input`` (``[..., model_dim]``, leading dimensions flattened)."""
        input_fp32 = input.reshape(-1, input.shape[-1]).float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            input_fp32 = _jitter(input_fp32)
        return nn.functional.linear(input_fp32, self.wg.weight.float())

    def route(self, input: torch.Tensor, used_token: torch.Tensor | None = None) -> Routing:
        """The sparse routing of ``input``'s tokens (the layer's fast path)."""
        return route(self.logits(input),
                     k=self.k,
                     capacity_factor=self.capacity_factor if self.training else self.eval_capacity_factor,
                     min_capacity=self.min_capacity,
                     drop_tokens=self.drop_tokens,
                     use_rts=self.use_rts,
                     noisy_gate_policy=self.noisy_gate_policy,
                     top2_2nd_expert_sampling=self.top2_2nd_expert_sampling,
                     used_token=used_token,
                     ep_group=self.ep_group,
                     training=self.training)

    def forward(self, input: torch.Tensor, used_token: torch.Tensor | None = None, sparse_routes: bool = False,
                use_tutel: bool = False) -> GateOutput | SparseGateOutput:
        """DeepSpeed's dense gate output ``(l_aux, combine_weights, dispatch_mask, exp_counts)`` for ``input``.

        With ``sparse_routes`` (DeepSpeed's argument) the sparse form (:func:`sparse`); ``use_tutel`` must stay
        ``False``.
        """
        _no_tutel(use_tutel)
        start = time.perf_counter() if self.wall_clock_breakdown else 0.0
        output = _gate_output(self.route(input, used_token), self.num_experts, sparse_routes)
        if self.wall_clock_breakdown:
            self.gate_time = (time.perf_counter() - start) * 1000.0
        return output


def __getattr__(name: str) -> Any:
    """``MOELayer`` lives in :mod:`microspeed_moe.layer` (which imports this module); DeepSpeed exposes it here."""
    if name == "MOELayer":
        from microspeed_moe.layer import MOELayer

        return MOELayer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
