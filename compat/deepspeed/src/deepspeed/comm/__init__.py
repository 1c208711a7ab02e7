"""``deepspeed.comm``: :mod:`microspeed.comm` (counted collectives) under DeepSpeed's names.

Names DeepSpeed's comm module takes straight from ``torch.distributed`` (point-to-point, ``reduce``,
``gather``, ``scatter``, object collectives with torch's signatures, ...) are ``torch.distributed``'s
here too; they are not counted in :data:`microspeed.comm.stats`.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as _dist

from microspeed.comm import (
    DistributedNotInitializedError,
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    configure,
    destroy_process_group,
    get_all_ranks_from_group,
    get_global_rank,
    get_local_rank,
    get_rank,
    get_world_group,
    get_world_size,
    inference_all_reduce,
    init_distributed,
    is_initialized,
    log_summary,
    new_group,
    reduce_scatter,
    reduce_scatter_tensor,
    reset_log,
)

ReduceOp = _dist.ReduceOp

#: Taken from ``torch.distributed`` as they are (DeepSpeed's comm module forwards them the same way).
TORCH_NAMES = ("all_gather_object", "all_to_all", "broadcast_object_list", "gather", "gather_object", "get_backend",
               "irecv", "isend", "monitored_barrier", "recv", "reduce", "scatter", "scatter_object_list", "send",
               "is_available", "group", "batch_isend_irecv", "P2POp", "ProcessGroup")

__all__ = ["DistributedNotInitializedError", "ReduceOp", "all_gather", "all_gather_into_tensor", "all_reduce",
           "all_to_all_single", "barrier", "broadcast", "comms_logger", "configure", "destroy_process_group",
           "get_all_ranks_from_group", "get_global_rank", "get_local_rank", "get_rank", "get_world_group",
           "get_world_size", "inference_all_reduce", "init_distributed", "is_initialized", "log_summary", "new_group",
           "reduce_scatter", "reduce_scatter_tensor", "reset_log", *TORCH_NAMES]


def has_all_reduce_coalesced() -> bool:
    """Whether a coalesced all-reduce is available (microspeed does not use one)."""
    return False


def __getattr__(name: str) -> Any:
    if name == "comms_logger":  # the current engine's (microspeed.comm.comms_logger), looked up on each access
        from microspeed import comm as _comm

        return _comm.comms_logger
    if name in TORCH_NAMES:
        return getattr(_dist, name)
    from deepspeed import _aliases

    found = _aliases.submodule(__name__, name)
    if found is not None:
        return found
    raise AttributeError(f"module 'deepspeed.comm' (microspeed stand-in) has no attribute {name!r}")
