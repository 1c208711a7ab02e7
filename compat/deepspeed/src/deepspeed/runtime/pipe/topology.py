"""``deepspeed.runtime.pipe.topology``: :mod:`microspeed.pipe.topology` under DeepSpeed's names."""

from __future__ import annotations

from typing import Any

from microspeed.pipe.topology import (
    ParallelGrid,
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
    make_topology,
)


class PipelineParallelGrid(ParallelGrid):
    """DeepSpeed's grid constructor: ``PipelineParallelGrid(topology=None, process_group=None)``.

    Without a topology, all ranks are data parallel (one stage). ``process_group`` must be ``None``
    or the world group: microspeed's grids span the whole world.
    """

    def __init__(self, topology: ProcessTopology | None = None, process_group: Any = None) -> None:
        import torch.distributed as dist

        if process_group is not None and process_group is not dist.group.WORLD:
            raise ValueError("PipelineParallelGrid(process_group=...): microspeed's grids span the whole world; "
                             "leave process_group=None")
        if topology is None:
            topology = make_topology(pipe=1, model=1)
        super().__init__(topology)


def _prime_factors(n: int) -> list[int]:
    """The prime factors of ``n`` in ascending order, with repeats (``12 -> [2, 2, 3]``)."""
    if n <= 0:
        raise ValueError(f"_prime_factors({n}): expected a positive integer")
    factors, p = [], 2
    while p * p <= n:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    if n > 1:
        factors.append(n)
    return factors


__all__ = ["ParallelGrid", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid",
           "ProcessTopology", "_prime_factors"]
