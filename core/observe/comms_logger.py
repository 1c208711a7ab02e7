"""DeepSpeed's comms logger: counts, message sizes, latencies, algorithm and bus bandwidths per op.

Each engine has its own :class:`CommsLogger` (its :class:`~microspeed.comm.context.CommContext`'s
``comms_logger``), configured by the ``comms_logger`` config section; ``microspeed.comm.configure``,
``log_summary`` and ``reset_log`` (DeepSpeed's ``deepspeed.comm`` functions) act on the current context's.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from microspeed.comm.context import ALL_REDUCE_OPS, ALL_TO_ALL_OPS, GATHER_OPS, Collective, CollectiveObserver
from microspeed.comm.setup import get_rank, get_world_size

if TYPE_CHECKING:
    from microspeed.comm.context import CommContext

_HIDDEN_FRAMES = ("microspeed.comm", "microspeed.comm.collectives", "microspeed.observe.trace", __name__)


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
    if comm_op in ALL_TO_ALL_OPS:
        algbw = size / duration_ms
        busbw = algbw * ((n - 1) / n)
    elif comm_op in GATHER_OPS:
        algbw = size * n / duration_ms
        busbw = algbw * ((n - 1) / n)
    elif comm_op in ALL_REDUCE_OPS:
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

    def __init__(self, context: CommContext | None = None) -> None:
        self.context = context
        self.comms_dict: dict[str, dict[int, list[Any]]] = {}
        self.enabled = False
        self.verbose = False
        self.prof_all = True
        self.prof_ops: list[str] = []
        self.debug = False
        self._log: Any = None

    def configure(self, enabled: bool | None = None, prof_all: bool | None = None, prof_ops: list[str] | None = None,
                  verbose: bool | None = None, debug: bool | None = None) -> None:
        """Change any setting; enabling attaches the logger to its context (else the current one).

        Disabling detaches it.
        """
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
            from microspeed.comm import context

            ctx = self.context or context.current()
            if enabled:
                ctx.add_observer(self)
            else:
                ctx.remove_observer(self)

    @property
    def sync_cuda(self) -> bool:
        """Synchronize CUDA around observed collectives while enabled (accurate latencies, as DeepSpeed)."""
        return self.enabled

    def copy_settings(self, other: CommsLogger) -> None:
        """Take ``other``'s settings (enabled, prof_all, prof_ops, verbose, debug), not its records."""
        self.configure(enabled=other.enabled, prof_all=other.prof_all, prof_ops=list(other.prof_ops),
                       verbose=other.verbose, debug=other.debug)

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
            while frame is not None and frame.f_globals.get("__name__") in _HIDDEN_FRAMES:
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


    def log_summary(self, show_straggler: bool = False, return_dict: bool = False) -> Any:
        """Print the table on rank 0 (every rank must call it), as ``deepspeed.comm.log_summary``.

        Ranks meet at a barrier before and after (not recorded). With ``show_straggler`` the fastest
        rank's latency and each rank's excess over it are added (a collective over the records; every
        rank must have recorded the same ops). With ``return_dict`` every rank returns the statistics.
        """
        if get_world_size() > 1:
            dist.barrier()
        result = self.log_all(print_log=get_rank() == 0, show_straggler=show_straggler, return_dict=return_dict)
        if get_world_size() > 1:
            dist.barrier()
        return result
