"""Who is told about collectives: per-engine communication contexts and the observer protocol.

A :class:`CommContext` holds what one engine records about its communication: byte counts
(:class:`CommStats`), the observers told about each collective (its tracing probe, its watchdog, its
comms logger) and the per-group call numbers. Each engine has its own (:func:`context_for` its plugin
manager; the built-in ``comms_logger`` plugin makes it current at the start of ``initialize()`` and at
each ``forward``, ``backward`` and ``step`` of its engine), so two engines in one process keep separate
counts. Code outside any engine (a plain script, a unit test) uses the process's :func:`default_context`.

:func:`current` is the context collectives report to now: the last engine's that ran a step (or was
built), else the default. DeepSpeed's module-level calls (``comm.configure``, ``comm.log_summary``,
``comm.stats``) act on it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from microspeed.comm.setup import get_world_size

if TYPE_CHECKING:
    from microspeed.observe.comms_logger import CommsLogger

#: Ops whose bandwidth follows each formula (nccl-tests' PERFORMANCE.md, DeepSpeed's ``calc_bw_log``).
ALL_REDUCE_OPS = frozenset({"all_reduce", "all_reduce_coalesced", "inference_all_reduce"})
GATHER_OPS = frozenset({"all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
                        "reduce_scatter_tensor"})
ALL_TO_ALL_OPS = frozenset({"all_to_all", "all_to_all_single"})


class CommStats:
    """Bytes and calls per collective name, since the last :meth:`reset`.

    ``bytes`` is this rank's payload (the tensor it passes in); ``wire`` the bytes this rank sends
    over the network with the bandwidth-optimal algorithm for the op (:func:`wire_bytes`): the
    measure to compare an all-reduce with a compressed all-to-all plus all-gather.
    """

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.wire: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def record(self, op: str, nbytes: int, wire: int | None = None) -> None:
        """Count one call of ``op`` with ``nbytes`` of payload and ``wire`` bytes sent (default: ``nbytes``)."""
        self.bytes[op] += nbytes
        self.wire[op] += nbytes if wire is None else wire
        self.calls[op] += 1

    def total_bytes(self) -> int:
        """All payload bytes recorded, over every op."""
        return sum(self.bytes.values())

    def total_wire_bytes(self) -> int:
        """All bytes sent over the network, over every op."""
        return sum(self.wire.values())

    def reset(self) -> None:
        """Forget everything recorded."""
        self.bytes.clear()
        self.wire.clear()
        self.calls.clear()


def wire_bytes(op: str, nbytes: int, n: int) -> int:
    """Bytes one rank of an ``n``-rank group sends for ``op`` with a payload of ``nbytes``.

    The costs of the bandwidth-optimal algorithms (those behind DeepSpeed's and nccl-tests' bus
    bandwidth): all-reduce ``2 (n-1)/n S`` (reduce-scatter then all-gather), all-gather of an
    input ``S`` ``(n-1) S``, reduce-scatter and all-to-all of an input ``S`` ``(n-1)/n S``,
    broadcast ``S``. One rank sends nothing.
    """
    if n <= 1:
        return 0
    if op in ALL_REDUCE_OPS:
        return 2 * (n - 1) * nbytes // n
    if op in ("all_gather", "all_gather_into_tensor"):
        return (n - 1) * nbytes
    if op in ALL_TO_ALL_OPS or op in ("reduce_scatter", "reduce_scatter_tensor"):
        return (n - 1) * nbytes // n
    return nbytes


# --------------------------------------------------------------------------------------------
# Observing collectives
# --------------------------------------------------------------------------------------------


class Collective:
    """One collective call, as observers see it.

    ``nbytes`` is this rank's payload (what :class:`CommStats` counts; for object collectives the
    pickled size). ``label`` names the group (``"world"`` or ``"ranks 0,2"``), ``group_size`` its
    size and ``seq`` the number of this call among the observed collectives on that group in its
    context (1-based, the same on every rank of a healthy job). Times are ``time.perf_counter_ns()``:
    ``t0`` at the call, ``t_launched`` when an asynchronous call returned its work, ``t_wait`` when
    ``wait()`` was called, ``t_done`` when the operation completed (as far as the host can tell) and
    ``t_end`` when the call (or ``wait()``) returned. ``context`` is set by observers (the enclosing hook).
    """

    __slots__ = ("op", "nbytes", "group", "label", "group_size", "async_op", "cuda", "seq", "t0",
                 "t_launched", "t_wait", "t_done", "t_end", "context", "caller")

    def __init__(self, op: str, nbytes: int, group: Any, async_op: bool, cuda: bool,
                 comm_context: CommContext | None = None) -> None:
        self.op, self.nbytes, self.group, self.async_op, self.cuda = op, nbytes, group, async_op, cuda
        self.label, ranks = group_label(group)
        self.group_size = len(ranks)
        seq = (comm_context or _current).seq
        seq[self.label] = self.seq = seq.get(self.label, 0) + 1
        self.t0 = time.perf_counter_ns()
        self.t_launched = self.t_wait = self.t_done = self.t_end = 0
        self.context: Any = None
        self.caller = ""

    def __repr__(self) -> str:
        return f"Collective({self.op} #{self.seq} on {self.label}, {self.nbytes} B, async={self.async_op})"


class CollectiveObserver:
    """What :mod:`microspeed.comm` tells an observer about each collective (all no-ops here).

    A synchronous call is ``collective_start`` then ``collective_end``; an asynchronous one is
    ``collective_start``, ``collective_launched`` (the work was returned), then, when the caller
    waits on the work, ``collective_wait`` and ``collective_end``. ``exc`` is the exception the
    call or the wait raised, else ``None``. Observers are called on the calling thread. An observer
    whose ``sync_cuda`` is true makes its context synchronize CUDA around each call (accurate timing).
    """

    sync_cuda = False

    def collective_start(self, call: Collective) -> None:
        """The call is about to be made."""

    def collective_launched(self, call: Collective) -> None:
        """An asynchronous call returned its work object (the operation may still be running)."""

    def collective_wait(self, call: Collective) -> None:
        """The caller started waiting on an asynchronous call's work."""

    def collective_end(self, call: Collective, exc: BaseException | None) -> None:
        """The call (or the wait on its work) returned or raised ``exc``."""


class CommContext:
    """What one engine (or the process's code outside engines) records about its collectives.

    ``stats`` (bytes per op), ``observers`` (told about each collective; empty: the wrappers take
    their plain path), ``seq`` (observed calls per group label), ``comms_logger`` (DeepSpeed's
    comms logger of this context, attached as an observer when enabled), ``probe`` and ``watchdog``
    (set by :mod:`microspeed.observe.trace` and :mod:`microspeed.observe.watchdog` when they run for
    this context), ``ranks_timeout_s`` (how long ``initialize()``'s rank agreement waits for a rank
    that does not arrive; ``None``: no limit but torch's).
    """

    def __init__(self, name: str = "default") -> None:
        self.name = name
        self.stats = CommStats()
        self.observers: tuple[CollectiveObserver, ...] = ()
        self.seq: dict[str, int] = {}
        self.sync_cuda = False
        self.probe: Any = None
        self.watchdog: Any = None
        self.ranks_timeout_s: float | None = None
        self._comms_logger: CommsLogger | None = None

    def __repr__(self) -> str:
        return f"CommContext({self.name}, observers={len(self.observers)})"

    @property
    def comms_logger(self) -> CommsLogger:
        """This context's comms logger (made on first use)."""
        if self._comms_logger is None:
            from microspeed.observe.comms_logger import CommsLogger

            self._comms_logger = CommsLogger(self)
        return self._comms_logger

    def add_observer(self, observer: CollectiveObserver) -> None:
        """Tell ``observer`` about every collective of this context from now on (idempotent)."""
        if observer not in self.observers:
            self.observers = (*self.observers, observer)
        self._update_sync()

    def remove_observer(self, observer: CollectiveObserver) -> None:
        """Stop telling ``observer`` (no error if it was not added)."""
        self.observers = tuple(o for o in self.observers if o is not observer)
        self._update_sync()

    def _update_sync(self) -> None:
        self.sync_cuda = torch.cuda.is_available() and any(getattr(o, "sync_cuda", False) for o in self.observers)


_default = CommContext()
_current: CommContext = _default
_ATTR = "_microspeed_comm_context"  # where an owner (an engine's plugin manager) keeps its context


def default_context() -> CommContext:
    """The process's context for collectives made outside any engine."""
    return _default


def current() -> CommContext:
    """The context collectives report to now (the last active engine's, else the default)."""
    return _current


def activate(context: CommContext) -> CommContext:
    """Make ``context`` current (collectives report to it from now on); returns the one it replaces."""
    global _current
    previous, _current = _current, context
    return previous


def deactivate(context: CommContext) -> None:
    """Make the default context current again if ``context`` is current (an engine is done)."""
    global _current
    if _current is context:
        _current = _default


def context_for(owner: Any) -> CommContext:
    """The context of an engine, kept on its plugin manager (or any object that takes attributes); made on first use.

    The context lives as long as its owner (no process-wide table holds it). A new context's comms
    logger starts from the default context's settings, so that ``microspeed.comm.configure(...)``
    called before ``initialize()`` applies to the engine, as in DeepSpeed.
    """
    found = getattr(owner, _ATTR, None)
    if found is None:
        found = CommContext(f"engine {id(owner):#x}")
        setattr(owner, _ATTR, found)
        if _default._comms_logger is not None and _default._comms_logger.enabled:
            found.comms_logger.copy_settings(_default._comms_logger)
    return found


def add_observer(observer: CollectiveObserver) -> None:
    """Tell ``observer`` about every collective of the current context (idempotent)."""
    _current.add_observer(observer)


def remove_observer(observer: CollectiveObserver) -> None:
    """Stop telling ``observer`` about the current context's collectives."""
    _current.remove_observer(observer)


def observers() -> tuple[CollectiveObserver, ...]:
    """The observers of the current context (empty when no tracing, comms logger or watchdog is on)."""
    return _current.observers


def collective_counts(context: CommContext | None = None) -> dict[str, int]:
    """Observed collectives issued so far per group label (what the watchdog compares across ranks)."""
    return dict((context or _current).seq)


_group_labels: dict[int, tuple[Any, str, list[int]]] = {}  # a cache of the process's groups, not engine state


def group_label(group: Any) -> tuple[str, list[int]]:
    """``(label, global ranks)`` of a process group: ``("world", [0, 1, ...])`` or ``("ranks 0,2", [0, 2])``."""
    key = id(group)
    hit = _group_labels.get(key)
    if hit is not None and hit[0] is group:
        return hit[1], hit[2]
    world = get_world_size()
    try:
        ranks = list(range(world)) if group is None else list(dist.get_process_group_ranks(group))
    except Exception:
        ranks = list(range(get_world_size(group)))
    if ranks == list(range(world)):
        label = "world"
    elif len(ranks) <= 8:
        label = "ranks " + ",".join(map(str, ranks))
    else:
        label = f"ranks {ranks[0]}..{ranks[-1]} ({len(ranks)})"
    _group_labels[key] = (group, label, ranks)
    return label, ranks
