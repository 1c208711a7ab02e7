"""How elastic batch sizes are chosen (DeepSpeed 0.16's algorithm versions 0.1 and 0.2).

A global batch is *elastic* for a GPU count ``n`` when ``batch = micro * accumulation * n`` for
some allowed micro batch: then the job can move between such counts and keep its batch, so
training converges the same. Version 0.1 picks, among a few candidate batches no larger than
``max_train_batch_size``, the one valid for the most GPU counts in ``[min_gpus, max_gpus]``.
Candidates: each micro batch, and the least common multiple of all of them, scaled by the
largest highly composite number that keeps the product within the maximum (highly composite
numbers have more divisors than any smaller number, so they make many GPU counts valid).
Version 0.2 works on nodes: the same search over node counts with the maximum batch divided by
the data-parallel ranks per node, scaled back; a world size outside the list gets a batch of its
own (the largest or smallest multiple of ``micro * data-parallel size`` within the maximum).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from microspeed.elasticity.errors import ElasticityConfigError, ElasticityError

#: The highly composite numbers up to 720720 (OEIS A002182): enough for batches of 720K samples.
HIGHLY_COMPOSITE: tuple[int, ...] = (
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560, 10080, 15120,
    20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200, 332640, 498960, 554400,
    665280, 720720,
)


def candidate_batch_sizes(bases: Iterable[int], max_batch: int) -> list[int]:
    """Each base scaled by the largest highly composite number that keeps it within ``max_batch``.

    A base at or above ``max_batch`` is its own candidate. Duplicates are dropped.
    """
    found = set()
    for base in bases:
        if base >= max_batch:
            found.add(base)
            continue
        room = max_batch // base
        scale = max(h for h in HIGHLY_COMPOSITE if h <= room)
        found.add(scale * base)
    return sorted(found)


def _divisors(n: int) -> list[int]:
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def valid_gpu_counts(batch: int, micro_batches: Sequence[int], min_gpus: float, max_gpus: float) -> list[int]:
    """The GPU counts in ``[min_gpus, max_gpus]`` that split ``batch`` into whole micro batches and accumulation.

    ``n`` is valid when some micro batch ``m`` divides ``batch`` and ``n`` divides ``batch // m``.
    """
    counts: set[int] = set()
    for micro in micro_batches:
        if batch % micro == 0:
            counts.update(d for d in _divisors(int(batch // micro)) if min_gpus <= d <= max_gpus)
    return sorted(counts)


def most_elastic(candidates: Iterable[int], micro_batches: Sequence[int], min_gpus: float, max_gpus: float,
                 prefer_larger: bool) -> tuple[int, list[int] | None]:
    """The candidate valid for the most GPU counts, ties to the larger (or smaller) batch; with its counts.

    The search starts from "the smallest micro batch, valid nowhere": when no candidate beats it
    (none has a valid count, and none is larger — or, with ``prefer_larger`` false, smaller), the
    answer is that micro batch and ``None`` (nothing was chosen), as in DeepSpeed.
    """
    best_batch, best_counts = min(micro_batches), None
    for batch in candidates:
        counts = valid_gpu_counts(batch, micro_batches, min_gpus, max_gpus)
        have = len(best_counts or [])
        if len(counts) != have:
            better = len(counts) > have
        else:
            better = batch > best_batch if prefer_larger else batch < best_batch
        if better:
            best_batch, best_counts = batch, counts
    return best_batch, best_counts


def batch_for_gpus_v01(micro_batches: Sequence[int], max_batch: int, min_gpus: float | None = None,
                       max_gpus: float | None = None, prefer_larger: bool = True) -> tuple[int, list[int] | None]:
    """Version 0.1: ``(global batch, valid GPU counts)`` (``None``: see :func:`most_elastic`).

    A missing (or zero) ``min_gpus`` is 1, a missing ``max_gpus`` is ``max_batch // min(micro_batches)``.
    """
    min_gpus = min_gpus or 1
    max_gpus = max_gpus or max_batch // min(micro_batches)
    if any(m > max_batch for m in micro_batches):
        raise ElasticityConfigError(
            f"elasticity.micro_batch_sizes: every micro batch must be <= max_train_batch_size={max_batch}, "
            f"given {list(micro_batches)}; raise elasticity.max_train_batch_size or drop the larger sizes.")
    bases = [*micro_batches, math.lcm(*micro_batches)]
    return most_elastic(candidate_batch_sizes(bases, max_batch), micro_batches, min_gpus, max_gpus, prefer_larger)


def _micro_batch_dividing(batch: float, num_gpus: int, micro_batches: Sequence[int], prefer_larger: bool) -> int | None:
    """The first micro batch (in the given order) dividing ``batch // num_gpus``; the largest if ``prefer_larger``."""
    fitting = [m for m in micro_batches if batch // num_gpus % m == 0]
    if not fitting:
        return None
    return max(fitting) if prefer_larger else fitting[0]


def batch_for_gpus_v02(micro_batches: Sequence[int], max_batch: int, current_num_gpus: int,
                       min_gpus: float | None = None, max_gpus: float | None = None, prefer_larger: bool = True,
                       num_gpus_per_node: int = 1, model_parallel_size: int = 1
                       ) -> tuple[int | float, list[int], int | None]:
    """Version 0.2: ``(global batch, valid data-parallel sizes, micro batch)`` for ``current_num_gpus``.

    The search of version 0.1 runs over node counts (``min_gpus`` / ``max_gpus`` divided by
    ``num_gpus_per_node``) with ``max_batch`` divided by the data-parallel ranks per node, and is
    scaled back. When ``current_num_gpus // model_parallel_size`` is not among the valid sizes, the
    batch is the largest (``prefer_larger``) or smallest of ``k * micro * dp`` within ``max_batch``
    over the micro batches, valid only for this data-parallel size ``dp``.
    """
    if num_gpus_per_node % model_parallel_size != 0:
        raise ElasticityError(
            f"elasticity.num_gpus_per_node: {num_gpus_per_node} must be divisible by elasticity.model_parallel_size"
            f" {model_parallel_size} (version 0.2 places whole model-parallel groups on a node).")
    dp_per_node = num_gpus_per_node // model_parallel_size
    node_batch, node_counts = batch_for_gpus_v01(
        micro_batches, int(max_batch / dp_per_node), int(min_gpus / num_gpus_per_node),
        int(max_gpus / num_gpus_per_node), prefer_larger=prefer_larger)
    if node_counts is None:
        raise ElasticityConfigError(
            f"elasticity.min_gpus / max_gpus: no node count in [{min_gpus} / {num_gpus_per_node}, {max_gpus} / "
            f"{num_gpus_per_node}] splits any batch up to max_train_batch_size={max_batch} into micro batches "
            f"{list(micro_batches)}; widen the GPU range or change the batch sizes.")
    batch = int(node_batch) * dp_per_node
    valid_dp = [n * dp_per_node for n in node_counts]
    if current_num_gpus // model_parallel_size in valid_dp:
        return batch, valid_dp, _micro_batch_dividing(batch, current_num_gpus, micro_batches, prefer_larger)
    dp_size = current_num_gpus / num_gpus_per_node * dp_per_node
    own = [math.floor(max_batch / float(m * dp_size)) * (m * dp_size) for m in micro_batches]
    batch_here = max(own) if prefer_larger else min(own)
    return batch_here, [int(dp_size)], _micro_batch_dividing(batch_here, current_num_gpus, micro_batches, prefer_larger)
