"""Mixture-of-Experts gating in sparse form: for each token's choices, which expert, which slot, which weight.

This is the fast path the MoE layer routes with. It never builds DeepSpeed's dense ``[tokens, experts,
capacity]`` ``combine_weights`` / ``dispatch_mask``; a :class:`Routing` holds ``[tokens, k]`` tensors instead,
and :func:`microspeed_moe.sharded_moe.dense` expands one into DeepSpeed's dense form when a caller wants it.

The semantics are DeepSpeed's (``deepspeed.moe.sharded_moe``), one function per gate:

* :func:`route_top1` — Switch Transformer top-1 (``top1gating``): argmax expert (of the logits plus Gumbel
  noise with the ``'RSample'`` policy), an optional ``used_token`` mask, capacity dropping with random token
  selection (RTS) or in token order, combine weight = the router probability;
* :func:`route_top2` — GShard top-2 (``top2gating``): the second expert is the argmax of the other logits
  (plus Gumbel noise when ``top2_2nd_expert_sampling``); an expert's second-choice tokens queue after all
  its first-choice tokens; the two weights are normalised by the sum of the kept ones;
* :func:`route_topk` — general top-k (``topkgating``): the k most probable experts; over capacity an expert
  keeps its most probable tokens (``drop_policy="probs"``) or its first ones (``"position"``).

:func:`route` picks one of them by ``k`` as DeepSpeed's ``TopKGate`` does. In every gate, the kept tokens of
an expert take its capacity slots ``0, 1, …`` in token order (top-2: first choices, then second choices),
so the dense form built from a :class:`Routing` equals DeepSpeed's tensors element for element.

Capacity is ``max(ceil(tokens / experts × capacity_factor × k), min_capacity)`` when dropping tokens; with
``drop_tokens=False`` it is the busiest expert's count, the maximum over the expert-parallel group
(``all_reduce(MAX)`` over ``ep_group``), so no token is dropped and every rank's buffers have one shape.

The load-balancing loss is Switch's ``E · Σ_e f_e · P_e`` (``f_e`` the fraction of tokens whose first choice is
``e``, ``P_e`` the mean router probability of ``e``); top-k counts all ``k`` choices in ``f_e`` and divides by
``k``, as DeepSpeed does.
"""

from __future__ import annotations

import math
import numbers
import struct
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")
"""Accepted ``noisy_gate_policy`` values (``'None'`` is ``None``, as in DeepSpeed's configs)."""

DROP_POLICIES = ("probs", "position")
"""Accepted ``drop_policy`` values of :func:`route_topk`."""


@dataclass
class Routing:
    """Where each of a token's ``k`` choices goes: the sparse form of DeepSpeed's gate output.

    Row ``t`` column ``j`` describes token ``t``'s ``j``-th choice. A choice dropped by the capacity limit (or a
    token masked out by ``used_token``) keeps its expert in ``experts`` but has ``slots == -1`` and weight 0.
    """

    l_aux: torch.Tensor
    """0-d load-balancing loss (differentiable with respect to the logits)."""
    experts: torch.Tensor
    """``[T, k]`` long: the expert of each token's ``j``-th choice."""
    weights: torch.Tensor
    """``[T, k]`` float: the combine weight of that choice (0 where dropped; differentiable)."""
    slots: torch.Tensor
    """``[T, k]`` long: the position in that expert's capacity buffer, ``-1`` where dropped."""
    exp_counts: torch.Tensor
    """``[E]`` long: tokens routed to each expert before capacity dropping, as DeepSpeed's ``exp_counts``."""
    capacity: int
    """Slots per expert (the ``C`` of DeepSpeed's ``[T, E, C]`` tensors)."""

    @property
    def num_tokens(self) -> int:
        """Tokens routed (``T``)."""
        return int(self.experts.shape[0])

    @property
    def k(self) -> int:
        """Choices per token."""
        return int(self.experts.shape[1])

    @property
    def kept(self) -> torch.Tensor:
        """``[T, k]`` bool: the choices that got a slot."""
        return self.slots >= 0

    def flat_slots(self) -> torch.Tensor:
        """``[T, k]`` long: index into a flat ``[E * capacity]`` expert buffer, ``-1`` where dropped."""
        return torch.where(self.kept, self.experts * self.capacity + self.slots, torch.full_like(self.slots, -1))


# --------------------------------------------------------------------------------------------
# Capacity and noise
# --------------------------------------------------------------------------------------------


def _float32(x: float) -> float:
    """``x`` rounded to the nearest single-precision value."""
    return struct.unpack("f", struct.pack("f", x))[0]


def capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """Slots per expert: ``max(ceil(num_tokens / num_experts × capacity_factor), min_capacity)``.

    The product is rounded to single precision before the ceiling, as DeepSpeed computes it (a float32
    tensor), so the two agree even where the product lands within a rounding error of an integer (for
    ``10 / 3 × 1.5`` double precision gives ``5.000000000000001`` and a ceiling of 6; both give 5 here).
    Top-k gates pass ``capacity_factor × k``.
    """
    product = _float32(_float32(num_tokens / num_experts) * _float32(capacity_factor))
    return max(math.ceil(product), int(min_capacity))


def gumbel_noise(shape: tuple[int, ...] | torch.Size, device: torch.device | str | None = None) -> torch.Tensor:
    """Standard Gumbel samples ``-log(-log(u))`` in float32, ``u`` uniform on ``[tiny, 1 - eps)``.

    Draws one ``torch.rand(shape)``, the same random numbers DeepSpeed's ``gumbel_rsample`` draws, so a
    seeded gate picks the same experts as DeepSpeed's.
    """
    info = torch.finfo(torch.float32)
    uniform = torch.rand(shape, dtype=torch.float32, device=device) * (1.0 - info.eps) + info.tiny
    return -torch.log(-torch.log(uniform))


def multiplicative_jitter(x: torch.Tensor, epsilon: float = 1e-2) -> torch.Tensor:
    """``x`` times noise uniform on ``[1 - epsilon, 1 + epsilon)`` (the ``'Jitter'`` policy, applied to the gate input).

    The noise is float32 and drawn by one ``torch.rand(x.shape)``, as DeepSpeed draws it; ``epsilon == 0``
    returns ``x`` itself.
    """
    if epsilon == 0:
        return x
    low = torch.tensor(1.0 - epsilon, dtype=torch.float32, device=x.device)
    high = torch.tensor(1.0 + epsilon, dtype=torch.float32, device=x.device)
    return x * (low + torch.rand(x.shape, dtype=torch.float32, device=x.device) * (high - low))


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------


def _check_logits(logits: Any, fn: str) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"{fn}: logits must be a floating-point [tokens, experts] tensor, got {shape}")
    if logits.shape[1] < 1:
        raise ValueError(f"{fn}: logits must have at least one expert column, got shape {tuple(logits.shape)}")


def _check_factor(fn: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{fn}: {name} must be a finite number > 0, got {value!r}")


def _check_capacity_args(fn: str, capacity_factor: Any, min_capacity: Any) -> None:
    _check_factor(fn, "capacity_factor", capacity_factor)
    if isinstance(min_capacity, bool) or not isinstance(min_capacity, numbers.Integral) or min_capacity < 0:
        raise ValueError(f"{fn}: min_capacity must be an int >= 0, got {min_capacity!r}")


def _check_k(fn: str, k: Any, num_experts: int) -> None:
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ValueError(f"{fn}: k must be an int >= 1, got {k!r}")
    if k > num_experts:
        raise ValueError(f"{fn}: k={k} exceeds the number of experts ({num_experts})")


def check_noisy_gate_policy(noisy_gate_policy: Any, fn: str = "route") -> str | None:
    """Return the policy with ``'None'`` read as ``None``; raise ``ValueError`` for anything not accepted."""
    if noisy_gate_policy not in NOISY_GATE_POLICIES:
        raise ValueError(f"{fn}: noisy_gate_policy must be one of {NOISY_GATE_POLICIES}, got {noisy_gate_policy!r}")
    return None if noisy_gate_policy == "None" else noisy_gate_policy


def _check_drop_policy(fn: str, drop_policy: Any) -> None:
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"{fn}: drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")


# --------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------


def _expert_counts(experts: torch.Tensor, num_experts: int, weight: torch.Tensor | None = None) -> torch.Tensor:
    """``[E]`` long: how many entries of ``experts`` (counting only where ``weight``) name each expert."""
    flat = experts.reshape(-1)
    ones = torch.ones_like(flat) if weight is None else weight.reshape(-1).to(torch.long)
    return torch.zeros(num_experts, dtype=torch.long, device=flat.device).index_add_(0, flat, ones)


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    """The place of each index in ``permutation`` (``inverse[permutation[i]] == i``)."""
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.numel(), device=permutation.device)
    return inverse


def _rank_in_expert(experts: torch.Tensor, member: torch.Tensor, order: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Each member entry's rank among the member entries of its expert, ranked by ``order``; ``-1`` elsewhere.

    ``experts``, ``member`` and ``order`` are flat ``[N]``; ``order`` is a permutation of ``0..N-1`` giving each
    entry's place in the queue (0 first). One sort by ``(expert, order)`` — ``O(N log N)``, no ``[N, E]`` tensor.
    """
    n = experts.numel()
    bucket = torch.where(member, experts, torch.full_like(experts, num_experts))  # non-members queue apart
    queue = torch.argsort(bucket * n + order)
    sizes = torch.zeros(num_experts + 1, dtype=torch.long, device=experts.device).index_add_(
        0, bucket, torch.ones_like(bucket))
    starts = torch.cumsum(sizes, 0) - sizes
    rank = torch.empty_like(experts)
    rank[queue] = torch.arange(n, device=experts.device) - starts[bucket[queue]]
    return torch.where(member, rank, torch.full_like(rank, -1))


def _busiest(exp_counts: torch.Tensor, ep_group: Any) -> int:
    """The largest expert count here, or across ``ep_group`` (``all_reduce(MAX)``) when it spans several ranks."""
    busiest = exp_counts.max().clone()
    if ep_group is not None:
        from microspeed.plugin_api import comm

        if comm.get_world_size(ep_group) > 1:
            comm.all_reduce(busiest, op=torch.distributed.ReduceOp.MAX, group=ep_group)
    return int(busiest.item())


def _balance_terms(gates: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``[E]``: ``P_e · f_e``, the mean router probability of ``e`` times the fraction of tokens counted for it."""
    mean_probs = torch.mean(gates, dim=0)
    fractions = counts.to(torch.float32) / gates.shape[0]
    return mean_probs * fractions


# --------------------------------------------------------------------------------------------
# The gates
# --------------------------------------------------------------------------------------------


def route_top1(logits: torch.Tensor,
               capacity_factor: float,
               min_capacity: int,
               used_token: torch.Tensor | None = None,
               noisy_gate_policy: str | None = None,
               drop_tokens: bool = True,
               use_rts: bool = True,
               ep_group: Any = None) -> Routing:
    """Switch Transformer top-1 routing with DeepSpeed's ``top1gating`` semantics.

    Args:
        logits: ``[T, E]`` router logits.
        capacity_factor: capacity is ``max(ceil(T / E × capacity_factor), min_capacity)`` when dropping.
        min_capacity: the capacity floor.
        used_token: optional ``[T]`` mask; tokens where it is 0 are routed nowhere (and not counted).
        noisy_gate_policy: ``'RSample'`` picks the argmax of ``logits + Gumbel noise`` (the weight is still the
            noiseless probability); ``'Jitter'`` acts on the gate *input* (see :func:`multiplicative_jitter`)
            and is a no-op here.
        drop_tokens: drop tokens over capacity; otherwise capacity is the busiest expert's count (over
            ``ep_group``), at most ``T``.
        use_rts: random token selection: an expert over capacity keeps the tokens with the highest random
            priority (``torch.rand(T, E)``, drawn as DeepSpeed draws it) instead of its first ones.
        ep_group: expert-parallel group for ``drop_tokens=False``.

    Returns:
        a :class:`Routing` with ``k == 1``; ``l_aux = E · Σ_e f_e · P_e``.
    """
    fn = "top1gating"
    _check_logits(logits, fn)
    _check_capacity_args(fn, capacity_factor, min_capacity)
    noisy_gate_policy = check_noisy_gate_policy(noisy_gate_policy, fn)
    num_tokens, num_experts = logits.shape
    device = logits.device
    if used_token is not None and used_token.numel() != num_tokens:
        raise ValueError(f"{fn}: used_token must have one entry per token ({num_tokens}), "
                         f"got shape {tuple(used_token.shape)}")

    gates = F.softmax(logits, dim=1)
    if noisy_gate_policy == "RSample":
        choice = torch.argmax(logits.detach() + gumbel_noise(logits.shape, device), dim=1)
    else:
        choice = torch.argmax(gates, dim=1)
    used = (torch.ones(num_tokens, dtype=torch.bool, device=device) if used_token is None
            else used_token.reshape(num_tokens).to(device) != 0)
    exp_counts = _expert_counts(choice, num_experts, used)
    l_aux = torch.sum(_balance_terms(gates, exp_counts)) * num_experts

    if drop_tokens:
        cap = capacity(num_tokens, num_experts, capacity_factor, min_capacity)
    else:
        cap = min(_busiest(exp_counts, ep_group), num_tokens)

    token_order = torch.arange(num_tokens, device=device)
    if use_rts:
        priority = torch.rand(num_tokens, num_experts, device=device).gather(1, choice.unsqueeze(1)).squeeze(1)
        queue = _rank_in_expert(choice, used, _inverse(torch.argsort(-priority, stable=True)), num_experts)
        kept = used & (queue < cap)
        slots = _rank_in_expert(choice, kept, token_order, num_experts)
    else:
        slots = _rank_in_expert(choice, used, token_order, num_experts)
        kept = used & (slots < cap)
        slots = torch.where(kept, slots, torch.full_like(slots, -1))

    weights = gates.gather(1, choice.unsqueeze(1)) * kept.unsqueeze(1).to(gates.dtype)
    return Routing(l_aux=l_aux, experts=choice.unsqueeze(1), weights=weights, slots=slots.unsqueeze(1),
                   exp_counts=exp_counts, capacity=cap)


def route_top2(logits: torch.Tensor,
               capacity_factor: float,
               min_capacity: int,
               drop_tokens: bool = True,
               ep_group: Any = None,
               top2_2nd_expert_sampling: bool = True) -> Routing:
    """GShard top-2 routing with DeepSpeed's ``top2gating`` semantics.

    The first expert is the most probable one; the second is the argmax of the other experts' logits, plus
    Gumbel noise when ``top2_2nd_expert_sampling`` (the Gumbel-max trick samples it from the softmax). An
    expert's first-choice tokens take its slots in token order, its second-choice tokens queue after *all*
    of them; any choice whose place is ``>= capacity`` is dropped, capacity being
    ``max(ceil(T / E × 2 × capacity_factor), min_capacity)`` (or the busiest expert's count of both choices
    over ``ep_group`` with ``drop_tokens=False``). The two weights are the kept probabilities divided by their
    sum (clamped at float epsilon). ``l_aux = E · Σ_e f_e · P_e`` over first choices.
    """
    fn = "top2gating"
    _check_logits(logits, fn)
    _check_capacity_args(fn, capacity_factor, min_capacity)
    num_tokens, num_experts = logits.shape
    _check_k(fn, 2, num_experts)
    device = logits.device

    gates = F.softmax(logits, dim=1)
    first = torch.argmax(gates, dim=1)
    scores = logits.detach()
    if top2_2nd_expert_sampling:
        scores = scores + gumbel_noise(logits.shape, device)
    second = torch.argmax(scores.scatter(1, first.unsqueeze(1), float("-inf")), dim=1)
    experts = torch.stack([first, second], dim=1)

    exp_counts = _expert_counts(experts, num_experts)
    first_counts = _expert_counts(first, num_experts)
    l_aux = torch.mean(_balance_terms(gates, first_counts)) * num_experts * num_experts

    if drop_tokens:
        cap = capacity(num_tokens, num_experts, capacity_factor * 2, min_capacity)
    else:
        cap = _busiest(exp_counts, ep_group)

    # Queue order: every first choice (token order), then every second choice (token order).
    order = (torch.arange(2, device=device).unsqueeze(0) * num_tokens
             + torch.arange(num_tokens, device=device).unsqueeze(1)).reshape(-1)
    everyone = torch.ones(2 * num_tokens, dtype=torch.bool, device=device)
    place = _rank_in_expert(experts.reshape(-1), everyone, order, num_experts).view(num_tokens, 2)
    kept = place < cap
    slots = torch.where(kept, place, torch.full_like(place, -1))

    kept_gates = gates.gather(1, experts) * kept.to(gates.dtype)
    denom = torch.clamp(kept_gates[:, 0] + kept_gates[:, 1], min=torch.finfo(kept_gates.dtype).eps)
    weights = kept_gates / denom.unsqueeze(1)
    return Routing(l_aux=l_aux, experts=experts, weights=weights, slots=slots, exp_counts=exp_counts, capacity=cap)


def route_topk(logits: torch.Tensor,
               k: int,
               capacity_factor: float,
               min_capacity: int,
               drop_tokens: bool = True,
               ep_group: Any = None,
               drop_policy: str = "probs") -> Routing:
    """General top-k routing with DeepSpeed's ``topkgating`` semantics.

    Each token picks its ``k`` most probable experts (``torch.topk``, most probable first). Capacity is
    ``max(ceil(T / E × k × capacity_factor), min_capacity)``; an expert over it keeps its ``capacity`` most
    probable tokens (``drop_policy="probs"``) or its first ones (``"position"``). With ``drop_tokens=False``
    capacity is the busiest expert's count over ``ep_group``. Kept tokens take the slots in token order; the
    weights are the kept probabilities normalised by their sum (clamped at float epsilon).
    ``l_aux = E / k · Σ_e f_e · P_e`` with ``f_e`` the fraction of tokens having ``e`` among their ``k`` choices.
    """
    fn = "topkgating"
    _check_logits(logits, fn)
    _check_capacity_args(fn, capacity_factor, min_capacity)
    _check_drop_policy(fn, drop_policy)
    num_tokens, num_experts = logits.shape
    _check_k(fn, k, num_experts)
    device = logits.device

    gates = F.softmax(logits, dim=1)
    top_gates, experts = torch.topk(gates, k=k, dim=1)
    flat_experts = experts.reshape(-1)
    exp_counts = _expert_counts(flat_experts, num_experts)
    l_aux = torch.mean(_balance_terms(gates, exp_counts)) * num_experts * num_experts / k

    # A token names each expert at most once, so the flat index t * k + j queues an expert's tokens in order.
    token_order = torch.arange(num_tokens * k, device=device)
    everyone = torch.ones(num_tokens * k, dtype=torch.bool, device=device)
    if drop_tokens:
        cap = capacity(num_tokens, num_experts, capacity_factor * k, min_capacity)
        if drop_policy == "probs":
            by_prob = _inverse(torch.argsort(-top_gates.detach().reshape(-1), stable=True))
            kept = _rank_in_expert(flat_experts, everyone, by_prob, num_experts) < cap
            slots = _rank_in_expert(flat_experts, kept, token_order, num_experts)
        else:
            slots = _rank_in_expert(flat_experts, everyone, token_order, num_experts)
            kept = slots < cap
            slots = torch.where(kept, slots, torch.full_like(slots, -1))
    else:
        cap = _busiest(exp_counts, ep_group)
        slots = _rank_in_expert(flat_experts, everyone, token_order, num_experts)
        kept = everyone
    kept = kept.view(num_tokens, k)

    kept_gates = top_gates * kept.to(top_gates.dtype)
    # The normaliser sums a [T, E] row as DeepSpeed does, so the weights agree with its bit for bit.
    row_sums = torch.zeros_like(gates).scatter(1, experts, kept_gates).sum(dim=-1, keepdim=True)
    weights = kept_gates / torch.clamp(row_sums, min=torch.finfo(gates.dtype).eps)
    return Routing(l_aux=l_aux, experts=experts, weights=weights, slots=slots.view(num_tokens, k),
                   exp_counts=exp_counts, capacity=cap)


def route(logits: torch.Tensor,
          k: int = 1,
          capacity_factor: float = 1.0,
          min_capacity: int = 4,
          drop_tokens: bool = True,
          use_rts: bool = True,
          noisy_gate_policy: str | None = None,
          top2_2nd_expert_sampling: bool = True,
          drop_policy: str = "probs",
          used_token: torch.Tensor | None = None,
          ep_group: Any = None,
          training: bool = True) -> Routing:
    """Route ``[T, E]`` logits to ``k`` experts per token, as DeepSpeed's ``TopKGate`` would.

    ``k == 1`` is :func:`route_top1`, ``k == 2`` :func:`route_top2`, larger ``k`` :func:`route_topk`. As in
    DeepSpeed, ``use_rts``, ``used_token`` and ``noisy_gate_policy='RSample'`` act on top-1 only,
    ``top2_2nd_expert_sampling`` on top-2 only and ``drop_policy`` on ``k >= 3`` only (all are validated
    whatever ``k`` is). ``training=False`` turns the noisy gate policy off (DeepSpeed's evaluation mode; it
    keeps RTS and top-2 sampling). The caller chooses ``capacity_factor`` (the gate passes its
    ``eval_capacity_factor`` in evaluation).
    """
    fn = "route"
    _check_logits(logits, fn)
    _check_k(fn, k, logits.shape[1])
    noisy_gate_policy = check_noisy_gate_policy(noisy_gate_policy, fn)
    _check_drop_policy(fn, drop_policy)
    if k == 1:
        return route_top1(logits, capacity_factor, min_capacity, used_token=used_token,
                          noisy_gate_policy=noisy_gate_policy if training else None, drop_tokens=drop_tokens,
                          use_rts=use_rts, ep_group=ep_group)
    if k == 2:
        return route_top2(logits, capacity_factor, min_capacity, drop_tokens=drop_tokens, ep_group=ep_group,
                          top2_2nd_expert_sampling=top2_2nd_expert_sampling)
    return route_topk(logits, k, capacity_factor, min_capacity, drop_tokens=drop_tokens, ep_group=ep_group,
                      drop_policy=drop_policy)
