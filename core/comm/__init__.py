"""A thin layer over ``torch.distributed``: start-up, device choice, collectives with byte counts.

Nothing here replaces torch.distributed; the wrappers only count what goes over the wire so that
plugins (compressed communication, for one) can show their savings, and tracing can see it.

Observers (:class:`CollectiveObserver`: tracing, the comms logger, the watchdog) are told about
every collective made through these wrappers. With none attached a wrapper costs one test of a
module-level tuple; with some, each call becomes a :class:`Collective` record, and an
asynchronous call returns an :class:`ObservedWork` whose ``wait()`` tells them too.

The comms logger (:data:`comms_logger`, :func:`configure`, :func:`log_summary`) is DeepSpeed's:
counts, message sizes, latencies, algorithm and bus bandwidths per op.
"""

from __future__ import annotations

import datetime
import math
import os
import pickle
import sys
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


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
    if op in _ALL_REDUCE_OPS:
        return 2 * (n - 1) * nbytes // n
    if op in ("all_gather", "all_gather_into_tensor"):
        return (n - 1) * nbytes
    if op in _ALL_TO_ALL_OPS or op in ("reduce_scatter", "reduce_scatter_tensor"):
        return (n - 1) * nbytes // n
    return nbytes


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


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _nbytes_list(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# --------------------------------------------------------------------------------------------
# Observing collectives (tracing, the comms logger, the watchdog)
# --------------------------------------------------------------------------------------------


class Collective:
    """One collective call, as observers see it.

    ``nbytes`` is this rank's payload (what :data:`stats` counts; for object collectives the
    pickled size). ``label`` names the group (``"world"`` or ``"ranks 0,2"``), ``group_size`` its
    size and ``seq`` the number of this call among the observed collectives on that group (1-based,
    the same on every rank of a healthy job). Times are ``time.perf_counter_ns()``: ``t0`` at the
    call, ``t_launched`` when an asynchronous call returned its work, ``t_wait`` when ``wait()`` was
    called, ``t_done`` when the operation completed (as far as the host can tell) and ``t_end``
    when the call (or ``wait()``) returned. ``context`` is set by observers (the enclosing hook).
    """

    __slots__ = ("op", "nbytes", "group", "label", "group_size", "async_op", "cuda", "seq", "t0",
                 "t_launched", "t_wait", "t_done", "t_end", "context", "caller")

    def __init__(self, op: str, nbytes: int, group: Any, async_op: bool, cuda: bool) -> None:
        self.op, self.nbytes, self.group, self.async_op, self.cuda = op, nbytes, group, async_op, cuda
        self.label, ranks = group_label(group)
        self.group_size = len(ranks)
        _seq[self.label] = self.seq = _seq.get(self.label, 0) + 1
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
    call or the wait raised, else ``None``. Observers are called on the calling thread.
    """

    def collective_start(self, call: Collective) -> None:
        """The call is about to be made."""

    def collective_launched(self, call: Collective) -> None:
        """An asynchronous call returned its work object (the operation may still be running)."""

    def collective_wait(self, call: Collective) -> None:
        """The caller started waiting on an asynchronous call's work."""

    def collective_end(self, call: Collective, exc: BaseException | None) -> None:
        """The call (or the wait on its work) returned or raised ``exc``."""


_observers: tuple[CollectiveObserver, ...] = ()  # empty: the wrappers take their plain path
_seq: dict[str, int] = {}
_group_labels: dict[int, tuple[Any, str, list[int]]] = {}
_sync_cuda = False  # synchronize CUDA around observed calls (the comms logger's accurate timing)


def add_observer(observer: CollectiveObserver) -> None:
    """Tell ``observer`` about every collective from now on (idempotent)."""
    global _observers
    if observer not in _observers:
        _observers = (*_observers, observer)


def remove_observer(observer: CollectiveObserver) -> None:
    """Stop telling ``observer`` (no error if it was not added)."""
    global _observers
    _observers = tuple(o for o in _observers if o is not observer)


def observers() -> tuple[CollectiveObserver, ...]:
    """The observers now attached (empty when no tracing, comms logger or watchdog is on)."""
    return _observers


def collective_counts() -> dict[str, int]:
    """Observed collectives issued so far, per group label (what the watchdog compares across ranks)."""
    return dict(_seq)


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


class ObservedWork:
    """The work of an observed asynchronous collective: ``wait()`` tells the observers.

    Behaves like the ``torch.distributed`` work object it wraps (other attributes pass through).
    """

    __slots__ = ("work", "call", "_observers", "_finished")

    def __init__(self, work: Any, call: Collective, observers: tuple[CollectiveObserver, ...]) -> None:
        self.work, self.call, self._observers, self._finished = work, call, observers, False

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        """Wait for the operation (as the wrapped work's ``wait``), telling the observers."""
        if self._finished:
            return self.work.wait(*args, **kwargs)
        call = self.call
        call.t_wait = time.perf_counter_ns()
        for o in self._observers:
            o.collective_wait(call)
        try:
            result = self.work.wait(*args, **kwargs)
            if call.cuda and _sync_cuda:
                torch.cuda.synchronize()
        except BaseException as exc:
            self._finished = True
            call.t_end = time.perf_counter_ns()
            for o in self._observers:
                o.collective_end(call, exc)
            raise
        self._finished = True
        call.t_end = time.perf_counter_ns()
        if not call.t_done or call.t_done > call.t_end:
            call.t_done = call.t_end
        for o in self._observers:
            o.collective_end(call, None)
        return result

    def is_completed(self) -> bool:
        """Whether the wrapped work completed."""
        return self.work.is_completed()

    def get_future(self) -> Any:
        """The wrapped work's future."""
        return self.work.get_future()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def _observe(op: str, nbytes: int, group: Any, async_op: bool, tensor: Any, fn: Any, /, *args: Any,
             **kwargs: Any) -> Any:
    """Make the call ``fn(*args, **kwargs)`` with the observers told about it."""
    obs = _observers
    cuda = isinstance(tensor, torch.Tensor) and tensor.is_cuda
    call = Collective(op, nbytes, group, async_op, cuda)
    for o in obs:
        o.collective_start(call)
    try:
        result = fn(*args, **kwargs)
        if cuda and _sync_cuda and not async_op:
            torch.cuda.synchronize()
    except BaseException as exc:
        call.t_end = time.perf_counter_ns()
        for o in obs:
            o.collective_end(call, exc)
        raise
    now = time.perf_counter_ns()
    if async_op and result is not None:
        call.t_launched = now
        if not cuda:  # CPU (gloo) work completes its future when the data is there: note the time
            try:
                result.get_future().add_done_callback(lambda _f, call=call: _mark_done(call))
            except Exception:
                pass
        for o in obs:
            o.collective_launched(call)
        return ObservedWork(result, call, obs)
    call.t_done = call.t_end = now
    for o in obs:
        o.collective_end(call, None)
    return result


def _mark_done(call: Collective) -> None:
    call.t_done = time.perf_counter_ns()


# --------------------------------------------------------------------------------------------
# Collectives
# --------------------------------------------------------------------------------------------


def all_reduce(tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
    """``dist.all_reduce`` that counts bytes; a no-op on a one-rank group."""
    if get_world_size(group) == 1:
        return None
    nbytes = _nbytes(tensor)
    stats.record("all_reduce", nbytes, wire_bytes("all_reduce", nbytes, get_world_size(group)))
    op = dist.ReduceOp.SUM if op is None else op
    if _observers:
        return _observe("all_reduce", nbytes, group, async_op, tensor, dist.all_reduce, tensor, op=op, group=group,
                        async_op=async_op)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    """``dist.broadcast`` that counts bytes; a no-op on a one-rank group."""
    if get_world_size(group) == 1:
        return None
    nbytes = _nbytes(tensor)
    stats.record("broadcast", nbytes, wire_bytes("broadcast", nbytes, get_world_size(group)))
    if _observers:
        return _observe("broadcast", nbytes, group, async_op, tensor, dist.broadcast, tensor, src=src, group=group,
                        async_op=async_op)
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` on one rank).

    Not counted in :data:`stats`; observers see the pickled size of ``obj`` as its bytes.
    """
    if get_world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * get_world_size(group)
    if _observers:
        try:
            nbytes = len(pickle.dumps(obj))
        except Exception:
            nbytes = 0
        _observe("all_gather_object", nbytes, group, False, None, dist.all_gather_object, out, obj, group=group)
        return out
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group: Any = None) -> None:
    """``dist.barrier`` when there is more than one rank."""
    if get_world_size(group) > 1:
        if _observers:
            _observe("barrier", 0, group, False, None, dist.barrier, group=group)
            return
        dist.barrier(group=group)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """``dist.all_gather`` that counts this rank's input bytes; a local copy on a one-rank group."""
    if get_world_size(group) == 1:
        tensor_list[0].copy_(tensor)
        return None
    nbytes = _nbytes(tensor)
    stats.record("all_gather", nbytes, wire_bytes("all_gather", nbytes, get_world_size(group)))
    if _observers:
        return _observe("all_gather", nbytes, group, async_op, tensor, dist.all_gather, tensor_list, tensor,
                        group=group, async_op=async_op)
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


# torch 2.13 renamed the flat-tensor collectives (the old names warn); older torch has only the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group: Any = None,
                           async_op: bool = False) -> Any:
    """``dist.all_gather_into_tensor`` (input bytes counted); a local copy on a one-rank group."""
    if get_world_size(group) == 1:
        output.copy_(input.reshape(output.shape))
        return None
    nbytes = _nbytes(input)
    stats.record("all_gather_into_tensor", nbytes, wire_bytes("all_gather_into_tensor", nbytes, get_world_size(group)))
    if _observers:
        return _observe("all_gather_into_tensor", nbytes, group, async_op, input, _all_gather_single,
                        output, input, group=group, async_op=async_op)
    return _all_gather_single(output, input, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = None, group: Any = None,
                   async_op: bool = False) -> Any:
    """``dist.reduce_scatter`` (the whole input list counted); a local copy on a one-rank group."""
    if get_world_size(group) == 1:
        output.copy_(input_list[0])
        return None
    nbytes = _nbytes_list(input_list)
    stats.record("reduce_scatter", nbytes, wire_bytes("reduce_scatter", nbytes, get_world_size(group)))
    op = dist.ReduceOp.SUM if op is None else op
    if _observers:
        return _observe("reduce_scatter", nbytes, group, async_op, output, dist.reduce_scatter, output, input_list,
                        op=op, group=group, async_op=async_op)
    return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: Any = None, group: Any = None,
                          async_op: bool = False) -> Any:
    """``dist.reduce_scatter_tensor`` (input bytes counted); a local copy on a one-rank group."""
    if get_world_size(group) == 1:
        output.copy_(input.reshape(output.shape))
        return None
    nbytes = _nbytes(input)
    stats.record("reduce_scatter_tensor", nbytes, wire_bytes("reduce_scatter_tensor", nbytes, get_world_size(group)))
    op = dist.ReduceOp.SUM if op is None else op
    if _observers:
        return _observe("reduce_scatter_tensor", nbytes, group, async_op, input, _reduce_scatter_single, output,
                        input, op=op, group=group, async_op=async_op)
    return _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor], group: Any = None,
               async_op: bool = False) -> Any:
    """``dist.all_to_all`` (the whole input list counted); a local copy on a one-rank group."""
    if get_world_size(group) == 1:
        output_tensor_list[0].copy_(input_tensor_list[0])
        return None
    nbytes = _nbytes_list(input_tensor_list)
    stats.record("all_to_all", nbytes, wire_bytes("all_to_all", nbytes, get_world_size(group)))
    if _observers:
        return _observe("all_to_all", nbytes, group, async_op, input_tensor_list[0], dist.all_to_all,
                        output_tensor_list, input_tensor_list, group=group, async_op=async_op)
    return dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: Any = None, async_op: bool = False) -> Any:
    """``dist.all_to_all_single`` (input bytes counted); a local copy on a one-rank group."""
    if get_world_size(group) == 1:
        output.copy_(input)
        return None
    nbytes = _nbytes(input)
    stats.record("all_to_all_single", nbytes, wire_bytes("all_to_all_single", nbytes, get_world_size(group)))
    kwargs = {"output_split_sizes": output_split_sizes, "input_split_sizes": input_split_sizes, "group": group,
              "async_op": async_op}
    if _observers:
        return _observe("all_to_all_single", nbytes, group, async_op, input, dist.all_to_all_single, output, input,
                        **kwargs)
    return dist.all_to_all_single(output, input, **kwargs)


# --------------------------------------------------------------------------------------------
# The comms logger (DeepSpeed's ``comms_logger``)
# --------------------------------------------------------------------------------------------

#: Ops whose bandwidth follows each formula of DeepSpeed's ``calc_bw_log`` (nccl-tests' PERFORMANCE.md).
_ALL_REDUCE_OPS = frozenset({"all_reduce", "all_reduce_coalesced", "inference_all_reduce"})
_GATHER_OPS = frozenset({"all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
                         "reduce_scatter_tensor"})
_ALL_TO_ALL_OPS = frozenset({"all_to_all", "all_to_all_single"})


def calc_bw_log(comm_op: str, size: int, duration_ms: float, n: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in Gbps for ``size`` message bytes moved by ``comm_op`` over ``n`` ranks in ``duration_ms``.

    DeepSpeed's formulas (``deepspeed.utils.comms_logging.calc_bw_log``):

    * all-reduce: ``algbw = 2 S / t``, ``busbw = S / t * 2 (n - 1) / n``;
    * all-gather and reduce-scatter: ``S`` is taken ``n`` times the message, then
      ``algbw = S / t``, ``busbw = algbw (n - 1) / n``;
    * all-to-all: ``algbw = S / t``, ``busbw = algbw (n - 1) / n``;
    * broadcast, barrier and point-to-point: ``busbw = algbw = S / t``.

    Two deliberate differences: ``n`` is the size of the op's group (DeepSpeed uses the world
    size), and for reduce-scatter the message is the output shard (DeepSpeed passes the whole
    input and then multiplies it by ``n`` once more). Unknown ops are treated like broadcast.
    """
    if duration_ms <= 0:
        return 0.0, 0.0
    n = max(n, 1)
    if comm_op in _ALL_TO_ALL_OPS:
        algbw = size / duration_ms
        busbw = algbw * ((n - 1) / n)
    elif comm_op in _GATHER_OPS:
        algbw = size * n / duration_ms
        busbw = algbw * ((n - 1) / n)
    elif comm_op in _ALL_REDUCE_OPS:
        algbw = size * 2 / duration_ms
        busbw = (size / duration_ms) * (2 * (n - 1) / n)
    else:
        algbw = busbw = size / duration_ms
    # bytes per ms -> Gbit per s
    return algbw * 8 / 1e6, busbw * 8 / 1e6


def convert_size(size_bytes: int) -> str:
    """``1536 -> "1.5 KB"`` (powers of 1024, as DeepSpeed prints message sizes)."""
    if size_bytes <= 0:
        return "0B"
    names = ("B", "KB", "MB", "GB", "TB", "PB")
    i = min(int(math.floor(math.log(size_bytes, 1024))), len(names) - 1)
    return f"{round(size_bytes / 1024 ** i, 2)} {names[i]}"


def trim_mean(data: list[float], trim_fraction: float = 0.1) -> float:
    """Mean of ``data`` without the ``trim_fraction`` smallest and largest values (0 for no data)."""
    n = len(data)
    if n == 0:
        return 0.0
    k = int(round(n * trim_fraction))
    kept = sorted(data)[k:n - k] or sorted(data)
    return sum(kept) / len(kept)


class CommsLogger(CollectiveObserver):
    """Counts, sizes, latencies and bandwidths of collectives, as DeepSpeed's ``comms_logger``.

    Records go to ``comms_dict[record_name][msg_size] = [count, [latency_ms], [algbw], [busbw]]``
    (DeepSpeed's layout). ``record_name`` is the op, with ``" | [Caller Func: f]"`` appended when
    ``debug`` is on. An op is recorded when ``prof_all`` is on or its name is in ``prof_ops``.
    Latency is from the call to completion: for an asynchronous op, to when its work completed
    (CPU) or when ``wait()`` returned (CUDA, after a device synchronize, as DeepSpeed does).
    """

    def __init__(self) -> None:
        self.comms_dict: dict[str, dict[int, list[Any]]] = {}
        self.enabled = False
        self.verbose = False
        self.prof_all = True
        self.prof_ops: list[str] = []
        self.debug = False
        self._log: Any = None

    def configure(self, enabled: bool | None = None, prof_all: bool | None = None, prof_ops: list[str] | None = None,
                  verbose: bool | None = None, debug: bool | None = None) -> None:
        """Change any setting; enabling attaches the logger to :mod:`microspeed.comm`, disabling detaches it."""
        global _sync_cuda
        if prof_all is not None:
            self.prof_all = prof_all
        if prof_ops is not None:
            self.prof_ops = list(prof_ops)
        if verbose is not None:
            self.verbose = verbose
        if debug is not None:
            self.debug = debug
        if enabled is not None:
            self.enabled = enabled
            if enabled:
                add_observer(self)
            else:
                remove_observer(self)
            _sync_cuda = enabled and torch.cuda.is_available()

    def start_profiling_comms(self) -> None:
        """Record every op (``prof_all = True``)."""
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        """Record only the ops in ``prof_ops``."""
        self.prof_all = False

    def start_profiling_op(self, op_name_list: list[str]) -> None:
        """Add ops to ``prof_ops``."""
        self.prof_ops = sorted(set(self.prof_ops) | set(op_name_list))

    def stop_profiling_op(self, op_name_list: list[str]) -> None:
        """Remove ops from ``prof_ops``."""
        self.prof_ops = [op for op in self.prof_ops if op not in op_name_list]

    def collective_start(self, call: Collective) -> None:
        """Note the calling function when ``debug`` is on."""
        if self.debug:
            frame = sys._getframe(1)
            while frame is not None and frame.f_globals.get("__name__") in (__name__, "microspeed.observe.trace"):
                frame = frame.f_back
            call.caller = frame.f_code.co_name if frame is not None else "?"

    def collective_end(self, call: Collective, exc: BaseException | None) -> None:
        """Record a completed op that is being profiled."""
        if exc is not None or not (self.prof_all or call.op in self.prof_ops):
            return
        latency_ms = ((call.t_done or call.t_end) - call.t0) / 1e6
        size = call.nbytes // max(call.group_size, 1) if call.op.startswith("reduce_scatter") else call.nbytes
        name = f"{call.op} | [Caller Func: {call.caller}]" if self.debug else call.op
        self.append(call.op, name, latency_ms, size, call.group_size)

    def append(self, raw_name: str, record_name: str, latency_ms: float, msg_size: int, n: int | None = None) -> None:
        """Add one record (and print it when ``verbose``)."""
        algbw, busbw = calc_bw_log(raw_name, msg_size, latency_ms, n if n is not None else get_world_size())
        by_size = self.comms_dict.setdefault(record_name, {})
        entry = by_size.get(msg_size)
        if entry is None:
            by_size[msg_size] = [1, [latency_ms], [algbw], [busbw]]
        else:
            entry[0] += 1
            entry[1].append(latency_ms)
            entry[2].append(algbw)
            entry[3].append(busbw)
        if self.verbose and get_rank() == 0:
            if self._log is None:
                from microspeed.log import get_logger

                self._log = get_logger("microspeed.comm")
            self._log.info("comm op", op=record_name, time_ms=round(latency_ms, 3), msg_size=convert_size(msg_size),
                           algbw_gbps=round(algbw, 3), busbw_gbps=round(busbw, 3))

    def reset_data(self) -> None:
        """Forget every record."""
        self.comms_dict.clear()

    def has_data(self) -> bool:
        """Whether anything was recorded."""
        return bool(self.comms_dict)

    def get_total_operations(self) -> int:
        """Number of recorded ops over all names and sizes."""
        return sum(entry[0] for by_size in self.comms_dict.values() for entry in by_size.values())

    def get_operation_names(self) -> list[str]:
        """Recorded op (record) names."""
        return list(self.comms_dict)

    def get_raw_data(self) -> dict[str, dict[int, list[Any]]]:
        """A copy of ``comms_dict``."""
        return {k: {s: [e[0], list(e[1]), list(e[2]), list(e[3])] for s, e in v.items()}
                for k, v in self.comms_dict.items()}

    def summary(self) -> dict[str, dict[int, dict[str, Any]]]:
        """``{op: {msg_size: {count, total_latency_ms, avg_latency_ms, tput_avg_gbps, busbw_avg_gbps, ...}}}``.

        Averages are 10 %-trimmed means, as DeepSpeed prints them.
        """
        out: dict[str, dict[int, dict[str, Any]]] = {}
        for name, by_size in self.comms_dict.items():
            out[name] = {}
            for size, (count, lats, algbws, busbws) in sorted(by_size.items()):
                out[name][size] = {
                    "count": count, "total_latency_ms": sum(lats), "avg_latency_ms": trim_mean(lats),
                    "tput_avg_gbps": trim_mean(algbws), "busbw_avg_gbps": trim_mean(busbws),
                    "msg_size_bytes": size, "msg_size_str": convert_size(size),
                }
        return out

    def log_all(self, print_log: bool = True, show_straggler: bool = False, return_dict: bool = False) -> Any:
        """Print the table of every op and message size (and the straggler breakdown); maybe return it as a dict."""
        summary = self.summary()
        lines = [f"{'Comm. Op':<20}{'Message Size':<20}{'Count':<20}{'Total Latency(ms)':<20}"
                 f"{'Avg Latency(ms)':<20}{'tput_avg (Gbps)':<20}{'busbw_avg (Gbps)':<20}"]
        for name, by_size in summary.items():
            lines.append(name)
            for s in by_size.values():
                lines.append(f"{'':<20}{s['msg_size_str']:<20}{s['count']:<20}{s['total_latency_ms']:<20.2f}"
                             f"{s['avg_latency_ms']:<20.2f}{s['tput_avg_gbps']:<20.2f}{s['busbw_avg_gbps']:<20.2f}")
        straggler = self._straggler_analysis(lines) if show_straggler else None
        if print_log:
            print("\n".join(lines), flush=True)
        if not return_dict:
            return None
        import datetime as _dt

        return {"summary": summary, "straggler_analysis": straggler,
                "metadata": {"world_size": get_world_size(), "rank": get_rank(),
                             "timestamp": _dt.datetime.now().isoformat()}}

    def _straggler_analysis(self, lines: list[str]) -> dict[str, Any] | None:
        """Per op and size, the fastest rank's latency (MIN over ranks) and each rank's excess over it."""
        keys = [(name, size, entry[0]) for name, by_size in self.comms_dict.items() for size, entry in by_size.items()]
        if get_world_size() > 1:
            everyone = [None] * get_world_size()
            dist.all_gather_object(everyone, keys)
            if any(k != keys for k in everyone):
                lines.append("straggler analysis skipped: ranks recorded different ops or counts")
                return None
        lines += ["_______________________________", "Breakdown with straggler effect",
                  "-------------------------------",
                  f"{'Comm. Op':<20}{'Message Size':<20}{'Count':<20}{'Total comm lat(ms)':<20}"
                  f"{'Total straggler(ms)':<20}{'Avg comm lat(ms)':<20}{'Avg straggler(ms)':<20}"]
        out: dict[str, Any] = {}
        for name, by_size in self.comms_dict.items():
            lines.append(name)
            out[name] = {}
            for size, entry in sorted(by_size.items()):
                lats = torch.tensor(entry[1], dtype=torch.float64)
                mins = lats.clone()
                if get_world_size() > 1:
                    dist.all_reduce(mins, op=dist.ReduceOp.MIN)
                excess = lats - mins
                row = {"count": entry[0], "total_comm_lat_ms": mins.sum().item(),
                       "total_straggler_ms": excess.sum().item(), "avg_comm_lat_ms": trim_mean(mins.tolist()),
                       "avg_straggler_ms": trim_mean(excess.tolist()), "msg_size_bytes": size,
                       "msg_size_str": convert_size(size)}
                out[name][size] = row
                lines.append(f"{'':<20}{row['msg_size_str']:<20}{row['count']:<20}{row['total_comm_lat_ms']:<20.2f}"
                             f"{row['total_straggler_ms']:<20.2f}{row['avg_comm_lat_ms']:<20.2f}"
                             f"{row['avg_straggler_ms']:<20.2f}")
        return out


comms_logger = CommsLogger()
"""The process's comms logger (one process is one rank), configured by the ``comms_logger`` section."""


def configure(enabled: bool | None = None, prof_all: bool | None = None, prof_ops: list[str] | None = None,
              verbose: bool | None = None, debug: bool | None = None) -> None:
    """Configure the comms logger, as ``deepspeed.comm.configure``."""
    comms_logger.configure(enabled=enabled, prof_all=prof_all, prof_ops=prof_ops, verbose=verbose, debug=debug)


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> Any:
    """Print the comms logger's table on rank 0 (every rank must call it), as ``deepspeed.comm.log_summary``.

    Ranks meet at a barrier before and after (not recorded). With ``show_straggler`` the fastest
    rank's latency and each rank's excess over it are added (a collective over the records; every
    rank must have recorded the same ops). With ``return_dict`` every rank returns the statistics.
    """
    if get_world_size() > 1:
        dist.barrier()
    result = comms_logger.log_all(print_log=get_rank() == 0, show_straggler=show_straggler, return_dict=return_dict)
    if get_world_size() > 1:
        dist.barrier()
    return result


def reset_log() -> None:
    """Forget what the comms logger recorded."""
    comms_logger.reset_data()


# --------------------------------------------------------------------------------------------
# DeepSpeed's ``deepspeed.comm`` names that torch.distributed answers directly
# --------------------------------------------------------------------------------------------


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


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    """Global ranks of ``group``'s members, in group-rank order."""
    return group_label(group)[1]


def inference_all_reduce(tensor: torch.Tensor, op: Any = None, group: Any = None) -> Any:
    """All-reduce for inference (DeepSpeed's fast path for small messages); here the counted :func:`all_reduce`."""
    return all_reduce(tensor, op=op, group=group)


def destroy_process_group(group: Any = None) -> None:
    """End ``group`` (default: the world group and torch.distributed)."""
    if is_initialized():
        dist.destroy_process_group(group)


def _require_initialized(what: str) -> None:
    if not is_initialized():
        raise DistributedNotInitializedError(
            f"{what}(): torch.distributed is not initialized; call microspeed.init_distributed() "
            "(deepspeed.init_distributed()) first.")
