"""A thin layer over ``torch.distributed``: start-up, device choice, collectives with byte counts.

Nothing here replaces torch.distributed; the wrappers only count what goes over the wire so that
plugins (compressed communication, for one) can show their savings, and tracing can see it.
"""

from __future__ import annotations

import datetime
import os
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


class CommStats:
    """Bytes and calls per collective name, since the last :meth:`reset`."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def record(self, op: str, nbytes: int) -> None:
        """Count one call of ``op`` moving ``nbytes`` (this rank's payload)."""
        self.bytes[op] += nbytes
        self.calls[op] += 1

    def total_bytes(self) -> int:
        """All bytes recorded, over every op."""
        return sum(self.bytes.values())

    def reset(self) -> None:
        """Forget everything recorded."""
        self.bytes.clear()
        self.calls.clear()


stats = CommStats()
"""Process-wide byte accounting (one process is one rank)."""


def default_backend() -> str:
    """``nccl`` when CUDA is available, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Start ``torch.distributed`` as DeepSpeed's ``init_distributed`` does (idempotent).

    Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) it uses ``env://``; as a plain process with
    no launcher it starts a one-process group, so the same code runs in both. ``auto_mpi_discovery``,
    ``distributed_port``, ``verbose`` and ``config`` are accepted for DeepSpeed compatibility.
    """
    del auto_mpi_discovery, verbose, config
    if dist.is_initialized():
        return
    if dist_init_required is False:
        return
    backend = dist_backend or default_backend()
    if backend not in ("gloo", "nccl", "mpi", "ucc"):
        raise ValueError(f"dist_backend={backend!r}: expected 'gloo' (CPU) or 'nccl' (CUDA).")
    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(device())
    env_world = int(os.environ.get("WORLD_SIZE", "-1"))
    if world_size < 0 and env_world < 0 and init_method is None:
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        return
    if init_method is None and "MASTER_ADDR" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    kwargs: dict[str, Any] = {"init_method": init_method or "env://", "timeout": timeout}
    if rank >= 0:
        kwargs["rank"] = rank
    if world_size >= 0:
        kwargs["world_size"] = world_size
    dist.init_process_group(backend, **kwargs)


def get_world_size(group: Any = None) -> int:
    """World size of ``group`` (1 when torch.distributed is not started)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_rank(group: Any = None) -> int:
    """Rank in ``group`` (0 when torch.distributed is not started)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def all_reduce(tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
    """``dist.all_reduce`` that counts bytes; a no-op on a one-rank group."""
    if get_world_size(group) == 1:
        return None
    stats.record("all_reduce", _nbytes(tensor))
    return dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    """``dist.broadcast`` that counts bytes; a no-op on a one-rank group."""
    if get_world_size(group) == 1:
        return None
    stats.record("broadcast", _nbytes(tensor))
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` on one rank)."""
    if get_world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group: Any = None) -> None:
    """``dist.barrier`` when there is more than one rank."""
    if get_world_size(group) > 1:
        dist.barrier(group=group)
