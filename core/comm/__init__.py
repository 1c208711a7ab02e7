"""A thin layer over ``torch.distributed``: start-up, device choice, collectives with byte counts.

Nothing here replaces torch.distributed; the wrappers only count what goes over the wire so that
plugins (compressed communication, for one) can show their savings, and tracing can see it.

The package, by job:

* :mod:`microspeed.comm.setup`: ``init_distributed``, backend, device, ranks and groups;
* :mod:`microspeed.comm.context`: per-engine :class:`CommContext` (byte counts, observers, call
  numbers, comms logger), the observer protocol (:class:`CollectiveObserver`, :class:`Collective`);
* :mod:`microspeed.comm.collectives`: the counted and observed collectives;
* :mod:`microspeed.observe.comms_logger`: DeepSpeed's comms logger (:class:`CommsLogger`, ``calc_bw_log``).

Every name is re-exported here (``from microspeed import comm; comm.all_reduce(...)``). ``comm.stats``
and ``comm.comms_logger`` are the *current* context's (the last active engine's, else the process
default), and so are DeepSpeed's :func:`configure`, :func:`log_summary` and :func:`reset_log`.
"""

from __future__ import annotations

from typing import Any

from microspeed.comm.collectives import (
    ObservedWork,
    _nbytes,
    _nbytes_list,
    _observe,
    all_gather,
    all_gather_into_tensor,
    all_gather_object,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    get_all_ranks_from_group,
    inference_all_reduce,
    observed,
    reduce_scatter,
    reduce_scatter_tensor,
)
from microspeed.comm.context import (
    Collective,
    CollectiveObserver,
    CommContext,
    CommStats,
    activate,
    add_observer,
    collective_counts,
    context_for,
    current,
    deactivate,
    default_context,
    group_label,
    observers,
    remove_observer,
    wire_bytes,
)
from microspeed.comm.setup import (
    DEFAULT_TIMEOUT,
    DistributedNotInitializedError,
    LostRanksError,
    MissingRanksError,
    default_backend,
    destroy_process_group,
    device,
    get_global_rank,
    get_local_rank,
    get_rank,
    get_world_group,
    get_world_size,
    init_distributed,
    is_initialized,
    new_group,
    wait_for_ranks,
)
from microspeed.observe.comms_logger import CommsLogger, calc_bw_log, convert_size, trim_mean

__all__ = [
    "DEFAULT_TIMEOUT", "Collective", "CollectiveObserver", "CommContext", "CommStats", "CommsLogger",
    "DistributedNotInitializedError", "LostRanksError", "MissingRanksError", "ObservedWork", "activate", "add_observer",
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all", "all_to_all_single",
    "barrier", "broadcast", "calc_bw_log", "collective_counts", "comms_logger", "configure", "context_for",
    "convert_size", "current", "deactivate", "default_backend", "default_context", "destroy_process_group",
    "device", "get_all_ranks_from_group", "get_global_rank", "get_local_rank", "get_rank", "get_world_group",
    "get_world_size", "group_label", "inference_all_reduce", "init_distributed", "is_initialized", "log_summary",
    "new_group", "observed", "observers", "reduce_scatter", "reduce_scatter_tensor", "remove_observer", "reset_log",
    "stats", "trim_mean", "wait_for_ranks", "wire_bytes", "_nbytes", "_nbytes_list", "_observe",
]


def __getattr__(name: str) -> Any:
    """``stats`` and ``comms_logger``: the current context's (see :func:`current`)."""
    if name == "stats":
        return current().stats
    if name == "comms_logger":
        return current().comms_logger
    raise AttributeError(f"module 'microspeed.comm' has no attribute {name!r}")


def configure(enabled: bool | None = None, prof_all: bool | None = None, prof_ops: list[str] | None = None,
              verbose: bool | None = None, debug: bool | None = None) -> None:
    """Configure the current context's comms logger, as ``deepspeed.comm.configure``.

    Called before ``initialize()`` (the default context), the settings carry over to the engines built after.
    """
    current().comms_logger.configure(enabled=enabled, prof_all=prof_all, prof_ops=prof_ops, verbose=verbose,
                                     debug=debug)


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> Any:
    """Print the current context's comms logger table on rank 0 (every rank must call it).

    As ``deepspeed.comm.log_summary``: see :meth:`CommsLogger.log_summary`.
    """
    return current().comms_logger.log_summary(show_straggler=show_straggler, return_dict=return_dict)


def reset_log() -> None:
    """Forget what the current context's comms logger recorded."""
    current().comms_logger.reset_data()
