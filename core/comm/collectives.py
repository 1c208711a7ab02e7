"""The collectives: ``torch.distributed``'s, counted in the current context's stats and shown to its observers.

With no observer attached a wrapper costs one look at the current context; with some, each call
becomes a :class:`~microspeed.comm.context.Collective` record, and an asynchronous call returns an
:class:`ObservedWork` whose ``wait()`` tells them too. Every wrapper is a no-op (or a local copy) on a
one-rank group.

A collective that fails (the transport's ``RuntimeError``: a peer's connection closed or reset) is
shown to the context's watchdog, when one runs: it asks the other ranks through the c10d store who is
still there, and the error raised names the ranks that are gone (:class:`~microspeed.comm.LostRanksError`,
the transport's error as its ``__cause__``). A watchdog observes every collective, so this is the
observed path's.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import torch
import torch.distributed as dist

from microspeed.comm import context as _ctx
from microspeed.comm.context import Collective, CollectiveObserver, group_label, wire_bytes
from microspeed.comm.setup import get_world_size


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _nbytes_list(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _count(op: str, nbytes: int, group: Any) -> _ctx.CommContext:
    """Record one call of ``op`` in the current context's stats; return that context."""
    ctx = _ctx._current
    ctx.stats.record(op, nbytes, wire_bytes(op, nbytes, get_world_size(group)))
    return ctx


class ObservedWork:
    """The work of an observed asynchronous collective: ``wait()`` tells the observers.

    Behaves like the ``torch.distributed`` work object it wraps (other attributes pass through).
    """

    __slots__ = ("work", "call", "_observers", "_finished", "_sync", "_context")

    def __init__(self, work: Any, call: Collective, observers: tuple[CollectiveObserver, ...],
                 sync_cuda: bool = False, context: _ctx.CommContext | None = None) -> None:
        self.work, self.call, self._observers, self._finished, self._sync = work, call, observers, False, sync_cuda
        self._context = context

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
            if call.cuda and self._sync:
                torch.cuda.synchronize()
        except BaseException as exc:
            self._finished = True
            call.t_end = time.perf_counter_ns()
            for o in self._observers:
                o.collective_end(call, exc)
            better = _explained(self._context, call, exc)
            if better is not exc:
                raise better from exc
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
    ctx = _ctx._current
    obs, sync = ctx.observers, ctx.sync_cuda
    cuda = isinstance(tensor, torch.Tensor) and tensor.is_cuda
    call = Collective(op, nbytes, group, async_op, cuda, ctx)
    for o in obs:
        o.collective_start(call)
    try:
        result = fn(*args, **kwargs)
        if cuda and sync and not async_op:
            torch.cuda.synchronize()
    except BaseException as exc:
        call.t_end = time.perf_counter_ns()
        for o in obs:
            o.collective_end(call, exc)
        better = _explained(ctx, call, exc)
        if better is not exc:
            raise better from exc
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
        return ObservedWork(result, call, obs, sync, ctx)
    call.t_done = call.t_end = now
    for o in obs:
        o.collective_end(call, None)
    return result


def _mark_done(call: Collective) -> None:
    call.t_done = time.perf_counter_ns()


def _explained(ctx: _ctx.CommContext | None, call: Collective, exc: BaseException) -> BaseException:
    """The error to raise for a failed collective: the watchdog's account of ``exc`` (naming the ranks that are
    gone) when ``ctx`` has a watchdog and it gives one, else ``exc`` itself."""
    watchdog = getattr(ctx, "watchdog", None)
    if watchdog is None or not isinstance(exc, RuntimeError):
        return exc
    try:
        better = watchdog.explain_failure(call, exc)
    except Exception:  # the account is a courtesy: never hide the transport's error behind our own
        return exc
    return exc if better is None else better



def all_reduce(tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
    """``dist.all_reduce`` that counts bytes; a no-op on a one-rank group."""
    if get_world_size(group) == 1:
        return None
    nbytes = _nbytes(tensor)
    ctx = _count("all_reduce", nbytes, group)
    op = dist.ReduceOp.SUM if op is None else op
    if ctx.observers:
        return _observe("all_reduce", nbytes, group, async_op, tensor, dist.all_reduce, tensor, op=op, group=group,
                        async_op=async_op)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    """``dist.broadcast`` that counts bytes; a no-op on a one-rank group."""
    if get_world_size(group) == 1:
        return None
    nbytes = _nbytes(tensor)
    ctx = _count("broadcast", nbytes, group)
    if ctx.observers:
        return _observe("broadcast", nbytes, group, async_op, tensor, dist.broadcast, tensor, src=src, group=group,
                        async_op=async_op)
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` on one rank).

    Not counted in the context's ``stats``; observers see the pickled size of ``obj`` as its bytes.
    """
    if get_world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * get_world_size(group)
    if _ctx._current.observers:
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
        if _ctx._current.observers:
            _observe("barrier", 0, group, False, None, dist.barrier, group=group)
            return
        dist.barrier(group=group)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """``dist.all_gather`` that counts this rank's input bytes; a local copy on a one-rank group."""
    if get_world_size(group) == 1:
        tensor_list[0].copy_(tensor)
        return None
    nbytes = _nbytes(tensor)
    ctx = _count("all_gather", nbytes, group)
    if ctx.observers:
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
    ctx = _count("all_gather_into_tensor", nbytes, group)
    if ctx.observers:
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
    ctx = _count("reduce_scatter", nbytes, group)
    op = dist.ReduceOp.SUM if op is None else op
    if ctx.observers:
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
    ctx = _count("reduce_scatter_tensor", nbytes, group)
    op = dist.ReduceOp.SUM if op is None else op
    if ctx.observers:
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
    ctx = _count("all_to_all", nbytes, group)
    if ctx.observers:
        return _observe("all_to_all", nbytes, group, async_op, input_tensor_list[0], dist.all_to_all,
                        output_tensor_list, input_tensor_list, group=group, async_op=async_op)
    return dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


def observed(op: str, tensor: torch.Tensor | None, group: Any, async_op: bool, fn: Any, /, *args: Any,
             **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)``: collective ``op`` carried by a transport of the caller's own (a plugin's
    shared-memory exchange between the ranks of one host, say), counted in the stats and told to the observers
    (tracing, the watchdog, the comms logger) as microspeed's wrappers count and tell theirs. ``tensor`` is the
    payload (its bytes are counted, as the wrapper of ``op`` counts its input); with ``async_op`` ``fn`` returns a
    work with ``wait()``, which the observers see waited."""
    nbytes = _nbytes(tensor) if tensor is not None else 0
    ctx = _count(op, nbytes, group)
    if ctx.observers:
        return _observe(op, nbytes, group, async_op, tensor, fn, *args, **kwargs)
    return fn(*args, **kwargs)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: Any = None, async_op: bool = False) -> Any:
    """``dist.all_to_all_single`` (input bytes counted); a local copy on a one-rank group."""
    if get_world_size(group) == 1:
        output.copy_(input)
        return None
    nbytes = _nbytes(input)
    ctx = _count("all_to_all_single", nbytes, group)
    kwargs = {"output_split_sizes": output_split_sizes, "input_split_sizes": input_split_sizes, "group": group,
              "async_op": async_op}
    if ctx.observers:
        return _observe("all_to_all_single", nbytes, group, async_op, input, dist.all_to_all_single, output, input,
                        **kwargs)
    return dist.all_to_all_single(output, input, **kwargs)


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    """Global ranks of ``group``'s members, in group-rank order."""
    return group_label(group)[1]


def inference_all_reduce(tensor: torch.Tensor, op: Any = None, group: Any = None) -> Any:
    """All-reduce for inference (DeepSpeed's fast path for small messages); here the counted :func:`all_reduce`."""
    return all_reduce(tensor, op=op, group=group)


