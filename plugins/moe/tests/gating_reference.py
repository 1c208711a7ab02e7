"""A slow, loop-based reference for MoE gating, written from the papers' definitions (tests only).

Everything is computed token by token in Python double precision; the result is DeepSpeed's dense gate
output ``(l_aux, combine_weights [T, E, C], dispatch_mask [T, E, C], exp_counts [E])`` so tests can hold
the fast gates against it. Notation: ``T`` tokens, ``E`` experts, ``p[t][e]`` the router probability
``softmax(logits[t])[e]``, ``C`` the expert capacity.

Capacity (Switch Transformer, Fedus et al. 2021, §2.1; GShard, Lepikhin et al. 2020, Algorithm 1)::

    C = max(ceil(T / E × capacity_factor × k), min_capacity)          when tokens are dropped
    C = max_e count_e                                                   when they are not

(top-1 without dropping also caps it at ``T``). The product is rounded to single precision before the
ceiling, because that is how DeepSpeed evaluates it (a float32 tensor); in exact arithmetic a product such
as ``2 / 7 × 10.5 = 3`` would give 3 where DeepSpeed, and so this reference, give 4.

Top-1 (Switch): ``e_t = argmax_e p[t][e]``; an expert keeps its first ``C`` tokens in token order (random
token selection off), each at the next free slot; the combine weight is ``p[t][e_t]``. The auxiliary loss
is ``E · Σ_e f_e · P_e`` with ``f_e`` the fraction of the ``T`` tokens whose choice is ``e`` (tokens masked out
by ``used_token`` count for none) and ``P_e = (1/T) Σ_t p[t][e]``.

Top-2 (GShard): the first expert ``e1 = argmax p[t]``, the second ``e2 = argmax`` over the other experts
(sampling off). An expert's first-choice tokens take slots ``0, 1, …`` in token order; its second-choice
tokens queue after *all* its first-choice tokens (``slot = count1_e + earlier second choices of e``); a
choice whose slot is ``>= C`` is dropped. The weights are the kept probabilities over their sum,
``w_i = p_i·kept_i / max(Σ_j p_j·kept_j, eps)`` — DeepSpeed's and fairscale's order (GShard's Algorithm 1
normalises before dropping; the two differ only when one of the pair is dropped). The auxiliary loss is
Switch's, over first choices (DeepSpeed writes it ``mean_e(P_e · f_e) · E²``).

Top-k (DeepSpeed's ``topkgating``): the ``k`` most probable experts of each token; capacity uses
``capacity_factor × k``; an expert over capacity keeps its ``C`` most probable tokens (``drop_policy="probs"``)
or its first ``C`` (``"position"``); kept tokens take slots in token order; weights as for top-2 over the
kept choices. The auxiliary loss is ``E / k · Σ_e f_e · P_e`` with ``f_e`` the fraction of tokens having ``e``
among their ``k`` choices (DeepSpeed: ``mean_e(P_e · f_e) · E² / k``).
"""

from __future__ import annotations

import math
import struct

import torch

EPS = torch.finfo(torch.float32).eps
"""The clamp on a weight normaliser (float32 epsilon, as DeepSpeed's fp32 gate uses)."""


def softmax(row: list[float]) -> list[float]:
    """Softmax of one row of logits, in double precision."""
    top = max(row)
    exps = [math.exp(x - top) for x in row]
    total = sum(exps)
    return [x / total for x in exps]


def _single(x: float) -> float:
    """``x`` rounded to single precision."""
    return struct.unpack("f", struct.pack("f", x))[0]


def capacity(num_tokens: int, num_experts: int, factor: float, min_capacity: int) -> int:
    """``max(ceil(T / E × factor), min_capacity)``, the product in single precision (see the module notes)."""
    return max(math.ceil(_single(_single(num_tokens / num_experts) * _single(factor))), min_capacity)


def _probs(logits: torch.Tensor) -> list[list[float]]:
    """``p[t][e]``, row by row."""
    return [softmax(row) for row in logits.double().tolist()]


def _switch_loss(probs: list[list[float]], counted: list[int]) -> float:
    """``Σ_e f_e · P_e``: ``f_e = counted_e / T``, ``P_e`` the mean probability of expert ``e``."""
    num_tokens, num_experts = len(probs), len(probs[0])
    total = 0.0
    for e in range(num_experts):
        mean_prob = sum(probs[t][e] for t in range(num_tokens)) / num_tokens
        total += counted[e] / num_tokens * mean_prob
    return total


GateOutput = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""``(l_aux, combine_weights [T, E, C] float64, dispatch_mask [T, E, C] bool, exp_counts [E] long)``."""


def _dense(num_tokens: int, num_experts: int, cap: int,
           placed: list[tuple[int, int, int, float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense gate tensors with ``weight`` at each placed ``(token, expert, slot)``."""
    combine = torch.zeros(num_tokens, num_experts, cap, dtype=torch.float64)
    for t, e, slot, weight in placed:
        combine[t, e, slot] = weight
    return combine, combine != 0


def top1(logits: torch.Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
         used_token: torch.Tensor | None = None, busiest: int | None = None) -> GateOutput:
    """Switch top-1 gating (no noise, no random token selection).

    ``busiest`` stands in for the largest expert count over the expert-parallel group (without dropping).
    Returns ``(l_aux, combine_weights, dispatch_mask, exp_counts)``.
    """
    probs = _probs(logits)
    num_tokens, num_experts = len(probs), len(probs[0])
    used = [True] * num_tokens if used_token is None else [bool(u) for u in used_token.tolist()]
    choice = [max(range(num_experts), key=lambda e, row=row: (row[e], -e)) for row in probs]
    counts = [0] * num_experts
    for t in range(num_tokens):
        if used[t]:
            counts[choice[t]] += 1
    if drop_tokens:
        cap = capacity(num_tokens, num_experts, capacity_factor, min_capacity)
    else:
        cap = min(max(counts) if busiest is None else busiest, num_tokens)
    filled = [0] * num_experts
    placed = []
    for t in range(num_tokens):
        e = choice[t]
        if used[t] and filled[e] < cap:
            placed.append((t, e, filled[e], probs[t][e]))
            filled[e] += 1
    l_aux = num_experts * _switch_loss(probs, counts)
    return (torch.tensor(l_aux, dtype=torch.float64), *_dense(num_tokens, num_experts, cap, placed),
            torch.tensor(counts))


def top2(logits: torch.Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
         busiest: int | None = None) -> GateOutput:
    """GShard top-2 gating with the second expert taken by argmax (sampling off).

    Returns ``(l_aux, combine_weights, dispatch_mask, exp_counts)``.
    """
    probs = _probs(logits)
    num_tokens, num_experts = len(probs), len(probs[0])
    first = [max(range(num_experts), key=lambda e, row=row: (row[e], -e)) for row in probs]
    second = [max((e for e in range(num_experts) if e != first[t]), key=lambda e, row=probs[t]: (row[e], -e))
              for t in range(num_tokens)]
    first_counts = [first.count(e) for e in range(num_experts)]
    counts = [first_counts[e] + second.count(e) for e in range(num_experts)]
    if drop_tokens:
        cap = capacity(num_tokens, num_experts, capacity_factor * 2, min_capacity)
    else:
        cap = max(counts) if busiest is None else busiest
    slot1, slot2 = [0] * num_tokens, [0] * num_tokens
    seen1, seen2 = [0] * num_experts, [0] * num_experts
    for t in range(num_tokens):
        slot1[t] = seen1[first[t]]
        seen1[first[t]] += 1
    for t in range(num_tokens):
        slot2[t] = first_counts[second[t]] + seen2[second[t]]
        seen2[second[t]] += 1
    placed = []
    for t in range(num_tokens):
        g1 = probs[t][first[t]] if slot1[t] < cap else 0.0
        g2 = probs[t][second[t]] if slot2[t] < cap else 0.0
        denom = max(g1 + g2, EPS)
        if slot1[t] < cap:
            placed.append((t, first[t], slot1[t], g1 / denom))
        if slot2[t] < cap:
            placed.append((t, second[t], slot2[t], g2 / denom))
    l_aux = num_experts * _switch_loss(probs, first_counts)
    return (torch.tensor(l_aux, dtype=torch.float64), *_dense(num_tokens, num_experts, cap, placed),
            torch.tensor(counts))


def topk(logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
         drop_policy: str = "probs", busiest: int | None = None) -> GateOutput:
    """General top-k gating.

    Returns ``(l_aux, combine_weights, dispatch_mask, exp_counts)``.
    """
    probs = _probs(logits)
    num_tokens, num_experts = len(probs), len(probs[0])
    chosen = [sorted(range(num_experts), key=lambda e, row=row: (-row[e], e))[:k] for row in probs]
    counts = [sum(e in choices for choices in chosen) for e in range(num_experts)]
    if drop_tokens:
        cap = capacity(num_tokens, num_experts, capacity_factor * k, min_capacity)
    else:
        cap = max(counts) if busiest is None else busiest
    kept: set[tuple[int, int]] = set()
    for e in range(num_experts):
        tokens = [t for t in range(num_tokens) if e in chosen[t]]
        if drop_tokens and drop_policy == "probs":
            tokens = sorted(tokens, key=lambda t, e=e: (-probs[t][e], t))
        kept.update((t, e) for t in tokens[:cap])
    filled = [0] * num_experts
    placed = []
    for t in range(num_tokens):
        denom = max(sum(probs[t][e] for e in chosen[t] if (t, e) in kept), EPS)
        for e in chosen[t]:
            if (t, e) in kept:
                placed.append((t, e, filled[e], probs[t][e] / denom))
                filled[e] += 1
    l_aux = num_experts / k * _switch_loss(probs, counts)
    return (torch.tensor(l_aux, dtype=torch.float64), *_dense(num_tokens, num_experts, cap, placed),
            torch.tensor(counts))
