"""The collectives ZeRO runs, each chosen per backend for speed (measured in BENCHMARKS.md).

On gloo (CPU) the ring all-gather and reduce-scatter are slow: for 45M fp32 values on 2 ranks
here ``all_gather_into_tensor`` took 411 ms where sending each rank's slice straight to every
peer (``batch_isend_irecv``) took 124 ms (4 ranks: 682 vs 236 ms), and ``reduce_scatter_tensor``
took about twice an all-reduce. So on gloo a segment is gathered with point-to-point sends into
the flat buffer's slices, and reduced with ``all_to_all_single`` (each rank receives every rank's
copy of its own slice) followed by a local sum. NCCL keeps its native collectives.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from microspeed.plugin_api import comm


def backend_of(group: Any) -> str:
    """``"nccl"``, ``"gloo"``, ... for ``group`` (``"none"`` without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return "none"
    return str(dist.get_backend(group)).lower()


class Works:
    """Several pending works waited as one."""

    __slots__ = ("works",)

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        """Wait for every work."""
        for w in self.works:
            w.wait()
        self.works = []


def gather_slices(flat: torch.Tensor, local: torch.Tensor, rank: int, world: int, group: Any, async_op: bool,
                  lo: int = 0, hi: int | None = None) -> Any:
    """Fill ``flat`` (``world`` equal slices) with every rank's ``local`` slice (elements ``lo:hi`` of each).

    ``local`` may be ``flat``'s own slice (in place). Returns a work with ``wait()`` (or ``None``).
    """
    size = local.numel()
    hi = size if hi is None else hi
    mine = flat[rank * size:(rank + 1) * size]
    if local.data_ptr() != mine.data_ptr():
        mine[lo:hi].copy_(local[lo:hi])
    if world == 1:
        return None
    if backend_of(group) != "gloo":
        if lo == 0 and hi == size:
            return comm.all_gather_into_tensor(flat, mine, group=group, async_op=async_op)
        outs = [flat[q * size + lo:q * size + hi] for q in range(world)]
        return comm.all_gather(outs, outs[rank], group=group, async_op=async_op)
    ops = []
    for q in range(world):
        if q == rank:
            continue
        peer = dist.get_global_rank(group, q) if group is not None else q
        ops.append(dist.P2POp(dist.isend, mine[lo:hi], peer, group))
        ops.append(dist.P2POp(dist.irecv, flat[q * size + lo:q * size + hi], peer, group))
    comm.stats.record("all_gather_p2p", (hi - lo) * flat.element_size() * (world - 1))
    works = Works(dist.batch_isend_irecv(ops))
    if not async_op:
        works.wait()
        return None
    return works


class PartitionedReduce:
    """Sum a padded buffer over the group so that each rank gets its own slice (per-backend collective).

    ``start(wire, out)`` launches: gloo ``all_to_all_single`` into ``out`` (same size as ``wire``);
    NCCL ``reduce_scatter_tensor`` into ``out[:slice]``; or an all-reduce of ``wire`` in place.
    ``result(wire, out)`` then yields the rows to sum for this rank's slice.
    """

    def __init__(self, group: Any, world: int, rank: int, reduce_scatter: bool) -> None:
        self.group, self.world, self.rank = group, world, rank
        backend = backend_of(group)
        self.mode = "all_reduce" if not reduce_scatter or world == 1 else {
            "gloo": "all_to_all", "nccl": "reduce_scatter"}.get(backend, "all_reduce")

    @property
    def needs_out(self) -> bool:
        """Whether :meth:`start` needs an output buffer."""
        return self.mode != "all_reduce"

    def start(self, wire: torch.Tensor, out: torch.Tensor | None) -> Any:
        """Launch the reduction of ``wire`` asynchronously."""
        if self.mode == "all_to_all":
            return comm.all_to_all_single(out, wire, group=self.group, async_op=True)
        if self.mode == "reduce_scatter":
            return comm.reduce_scatter_tensor(out[:wire.numel() // self.world], wire, group=self.group,
                                              async_op=True)
        return comm.all_reduce(wire, group=self.group, async_op=True)

    def rows(self, wire: torch.Tensor, out: torch.Tensor | None, shard: int) -> list[torch.Tensor]:
        """After the wait: tensors whose sum is this rank's reduced slice (of length ``shard``)."""
        if self.mode == "all_to_all":
            return list(out.view(self.world, -1)[:, :shard].unbind(0))
        if self.mode == "reduce_scatter":
            return [out[:shard]]
        start = self.rank * shard
        return [wire[start:min(start + shard, wire.numel())]]
