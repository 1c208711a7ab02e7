"""Start-up of ``torch.distributed`` and the process's place in it: backend, device, ranks, groups.

DeepSpeed's ``deepspeed.comm`` start-up names (``init_distributed``, ``get_rank``, ``new_group``, ...),
re-exported by :mod:`microspeed.comm`.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
"""``torch.distributed``'s process-group timeout (DeepSpeed's default). The watchdog ends hangs far sooner."""


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
        raise DistributedNotInitializedError(
            "init_distributed(dist_init_required=False): torch.distributed is not initialized. Pass "
            "dist_init_required=True (or leave it None) to start it here, or call "
            "torch.distributed.init_process_group() first.")
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
    from microspeed import store_server

    store_server.install(store_server.spans_machines_from_env())  # rank 0's store listens on one address
    kwargs: dict[str, Any] = {"init_method": init_method or "env://", "timeout": timeout}
    if rank >= 0:
        kwargs["rank"] = rank
    if world_size >= 0:
        kwargs["world_size"] = world_size
    dist.init_process_group(backend, **kwargs)


class DistributedNotInitializedError(AssertionError):
    """``init_distributed(dist_init_required=False)`` was called before any process group existed.

    An ``AssertionError``, as DeepSpeed raises in the same case.
    """


def get_world_size(group: Any = None) -> int:
    """World size of ``group`` (1 when torch.distributed is not started)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_rank(group: Any = None) -> int:
    """Rank in ``group`` (0 when torch.distributed is not started)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def is_initialized() -> bool:
    """Whether ``torch.distributed`` has a default process group (``deepspeed.comm.is_initialized``)."""
    return dist.is_available() and dist.is_initialized()


def new_group(ranks: list[int], **kwargs: Any) -> Any:
    """A process group of the global ``ranks`` (every rank must call it, as ``torch.distributed.new_group``)."""
    _require_initialized("new_group")
    return dist.new_group(ranks=list(ranks), **kwargs)


def get_world_group() -> Any:
    """The default (world) process group."""
    _require_initialized("get_world_group")
    return dist.group.WORLD


def get_local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK``, 0 without a launcher)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    """The global rank of ``group_rank`` in ``group`` (the world group: the same number)."""
    if group is None or not is_initialized():
        return group_rank
    return dist.get_global_rank(group, group_rank)


def destroy_process_group(group: Any = None) -> None:
    """End ``group`` (default: the world group and torch.distributed)."""
    if is_initialized():
        dist.destroy_process_group(group)


def _require_initialized(what: str) -> None:
    if not is_initialized():
        raise DistributedNotInitializedError(
            f"{what}(): torch.distributed is not initialized; call microspeed.init_distributed() "
            "(deepspeed.init_distributed()) first.")


class MissingRanksError(TimeoutError):
    """Some ranks did not reach a point every rank must reach (``initialize()``'s agreement) in time.

    ``missing`` lists their global ranks.
    """

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


class LostRanksError(RuntimeError):
    """A collective failed because ranks are gone (their process or host died): the message names them.

    Raised by :mod:`microspeed.comm`'s collectives, from the connection error of the transport (kept as
    ``__cause__``), when the watchdog (:mod:`microspeed.observe.watchdog`) finds ranks that no longer
    answer through the c10d store. ``lost`` lists their global ranks (empty when the store itself did not
    answer, so nobody could be asked), ``answered`` the ranks that did. A ``RuntimeError`` as the
    transport's own error is, so whatever caught that (torchrun's elastic agent restarts on any worker
    failure) catches this one.
    """

    def __init__(self, message: str, lost: list[int], answered: list[int]) -> None:
        super().__init__(message)
        self.lost = lost
        self.answered = answered


_arrivals = 0  # agreements this process took part in on its group: every rank counts the same (the keys' round)
_arrivals_group = 0  # id() of the default group they were counted on (a new group starts again from 0)
_GAVE_UP = "gave_up"


def wait_for_ranks(what: str, timeout_s: float | None) -> None:
    """Wait until every rank has reached this point, at most ``timeout_s`` seconds, through the c10d store.

    Before a collective that every rank must join (``initialize()``'s agreement), so that a rank that
    never comes ends in a :class:`MissingRanksError` naming it within ``timeout_s``, not in the process
    group's timeout (30 minutes). A store is used, not a collective, so that the ranks present can tell
    who is missing. A no-op on one rank or without a default store; with ``timeout_s`` ``None`` this rank
    only says it arrived (every rank must call it the same number of times).
    """
    global _arrivals, _arrivals_group
    world = get_world_size()
    if world <= 1:
        return
    from torch.distributed import distributed_c10d as c10d

    try:
        store = c10d._get_default_store()
    except Exception:
        return
    group = id(c10d._get_default_group())
    if group != _arrivals_group:
        _arrivals, _arrivals_group = 0, group
    _arrivals += 1
    prefix = f"microspeed/arrive/{_arrivals}/"
    store.set(prefix + str(get_rank()), what)  # always: the ranks' rounds stay in step whatever their timeouts
    if timeout_s is None:
        return
    keys = [prefix + str(r) for r in range(world)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception:  # the store's timeout (DistStoreError, or RuntimeError on older torch)
        missing = [r for r in range(world) if not store.check([prefix + str(r)])]
        if missing:
            store.set(prefix + _GAVE_UP, str(get_rank()))
            ranks = ", ".join(map(str, missing))
            raise MissingRanksError(
                f"{what}: rank{'s' if len(missing) > 1 else ''} {ranks} of {world} did not arrive within "
                f"{timeout_s:g} s (rank {get_rank()} waited); a rank that never reaches this point (stuck, crashed, "
                "or running other code) hangs the job. Set the watchdog timeout higher (\"watchdog\": "
                "{\"timeout_s\": ...} or MICROSPEED_WATCHDOG_TIMEOUT) if it is just slow.", missing) from None
    if store.check([prefix + _GAVE_UP]):
        other = store.get(prefix + _GAVE_UP).decode()
        raise MissingRanksError(f"{what}: rank {other} stopped waiting for this rank (it arrived later than the "
                                "watchdog timeout); the job cannot go on.", [get_rank()])
