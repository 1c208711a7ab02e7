"""DeepSpeed's ``aio`` section, and the direct, asynchronous file I/O the NVMe swap store runs it with.

The section (DeepSpeed 0.19.8's keys and defaults, ``runtime/swap_tensor/constants.py``)::

    "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1,
            "single_submit": false, "overlap_events": true, "use_gds": false}

``thread_count`` is DeepSpeed's older name of ``intra_op_parallelism`` (its documentation and many
configs still write it; 0.19.8 itself no longer reads it): here it means the same, and the two may
not disagree. How :class:`~microspeed_zero.nvme.TensorFileStore` acts on each key:

* ``block_size``: bytes per I/O request (one ``pread``/``pwrite``, or one kernel AIO request); a
  multiple of 4096, as direct I/O needs.
* ``intra_op_parallelism`` / ``thread_count``: I/O worker threads; each transfer is cut into that many
  contiguous stripes of whole blocks, one per worker, moved at once (DeepSpeed's intra-op split).
* ``queue_depth``: requests in flight per worker: each worker owns one kernel AIO context
  (``io_setup``) and keeps up to that many of its stripe's requests submitted.
* ``single_submit``: ``true`` submits one request per ``io_submit`` call; ``false`` submits all the
  requests that fit in the queue with one call.
* ``overlap_events``: ``true`` keeps the queue full — a new request is submitted as soon as any
  completes; ``false`` submits a batch of ``queue_depth`` requests, waits for all of them, then
  submits the next batch (DeepSpeed's sequential mode). Reads of the next sub-group overlapping the
  optimizer step and write-back (the :class:`~microspeed_zero.nvme.Prefetcher`) are not this key:
  they are always on (DeepSpeed's ``pipeline_read``/``pipeline_write``).
* ``use_gds``: ``true`` (NVIDIA GPUDirect Storage) is refused: swap files move through host memory.

Direct I/O: swap files are opened with ``O_DIRECT`` where the folder's file system accepts it
(:func:`direct_io_supported`), for the whole 4096-byte pages of a transfer whose memory starts on a
page (the swappers allocate their buffers with :func:`aligned_empty`); a transfer's last partial
page, an unaligned tensor and a file system refusing ``O_DIRECT`` use buffered ``pread``/``pwrite`` in
``block_size`` requests, on the same workers. Kernel AIO is Linux's ``io_setup``/``io_submit``/
``io_getevents``, called through ``ctypes`` (no libaio needed); where it is missing (another
architecture, a sandbox refusing the calls) the workers issue their requests one at a time with
``pread``/``pwrite``, and ``queue_depth``, ``single_submit`` and ``overlap_events`` have no effect
(:func:`kernel_aio_unavailable` says why, and a warning is logged once).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import secrets
import sys
from dataclasses import dataclass
from typing import Any

import torch

from microspeed.plugin_api import ConfigError, Field, Section, positive
from microspeed_zero.host_memory import anonymous_pages

__all__ = ["ALIGN", "AioConfig", "AioContext", "AlignedPool", "IoStats", "aio_section", "aligned_empty",
           "direct_io_supported", "kernel_aio_unavailable"]

ALIGN = 4096
"""Alignment of direct I/O: buffer addresses, file offsets and request sizes are multiples of it."""

_log = logging.getLogger("microspeed.zero")


def _page_multiple(v: Any) -> str | None:
    return None if v >= ALIGN and v % ALIGN == 0 else f"a positive multiple of {ALIGN} bytes (direct I/O requests)"


def aio_section() -> Section:
    """The schema of DeepSpeed's top-level ``aio`` section, as microspeed-zero acts on it."""
    return Section({
        "block_size": Field((int,), 1_048_576, "bytes per NVMe swap I/O request", _page_multiple),
        "queue_depth": Field((int,), 8, "NVMe swap requests in flight per I/O thread (kernel AIO)", positive),
        "intra_op_parallelism": Field((int,), 1, "NVMe swap I/O threads; each moves one stripe of every "
                                      "transfer", positive),
        "thread_count": Field((int, type(None)), None, "DeepSpeed's older name of intra_op_parallelism",
                              lambda v: positive(v) if v is not None else None),
        "single_submit": Field((bool,), False, "submit one request per io_submit call (false: the whole queue at "
                               "once)"),
        "overlap_events": Field((bool,), True, "submit a request as soon as one completes (false: wait for the "
                                "whole batch)"),
        "use_gds": Field((bool,), False, "NVIDIA GPUDirect Storage: refused (swap files move through host "
                         "memory)"),
    }, doc="NVMe swap I/O of ZeRO-Infinity offload (microspeed-zero)")


@dataclass(frozen=True)
class AioConfig:
    """The parsed ``aio`` section (see the module docstring for what each field does)."""

    block_size: int = 1_048_576
    queue_depth: int = 8
    intra_op_parallelism: int = 1
    single_submit: bool = False
    overlap_events: bool = True

    @classmethod
    def from_section(cls, section: Any) -> AioConfig:
        """From the validated ``config["aio"]`` mapping; :class:`ConfigError` for ``use_gds`` and a disagreement."""
        sec = dict(section or {})
        if sec.get("use_gds"):
            raise ConfigError("aio.use_gds: true asks for NVIDIA GPUDirect Storage (NVMe to GPU memory without the "
                              "CPU), which microspeed-zero's NVMe swapping does not do: its files move through host "
                              "memory. Set aio.use_gds to false (or remove it).")
        threads = sec.get("intra_op_parallelism", 1)
        old = sec.get("thread_count")
        if old is not None:
            if threads not in (1, old):  # 1 is the default: thread_count alone decides
                raise ConfigError(f"aio.thread_count ({old}) and aio.intra_op_parallelism ({threads}) are the same "
                                  f"setting (thread_count is DeepSpeed's older name) with different values; keep "
                                  f"intra_op_parallelism.")
            threads = old
        return cls(block_size=int(sec.get("block_size", 1_048_576)), queue_depth=int(sec.get("queue_depth", 8)),
                   intra_op_parallelism=int(threads), single_submit=bool(sec.get("single_submit", False)),
                   overlap_events=bool(sec.get("overlap_events", True)))

    def store_options(self) -> dict[str, Any]:
        """Keyword arguments of :class:`~microspeed_zero.nvme.TensorFileStore` for these settings (direct I/O on)."""
        return {"threads": self.intra_op_parallelism, "block_size": self.block_size, "queue_depth": self.queue_depth,
                "single_submit": self.single_submit, "overlap_events": self.overlap_events, "direct": True}


def aligned_empty(numel: int, dtype: torch.dtype, pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised flat CPU tensor whose memory starts on a page (as ``O_DIRECT`` needs), of exactly its size.

    Anonymous ``mmap`` memory (page-aligned; the storage holds exactly ``numel`` elements, so memory
    accounting is unchanged); ``pin_memory`` with CUDA available: torch's pinned allocation (page-aligned).
    """
    nbytes = int(numel) * dtype.itemsize
    if pin_memory and torch.cuda.is_available():
        return torch.empty(int(numel), dtype=dtype, pin_memory=True)
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(anonymous_pages(nbytes), dtype=torch.uint8).view(dtype)


class AlignedPool:
    """Page-aligned buffers (:func:`aligned_empty`) kept for reuse, so that buffers out and kept stay within
    ``cap_bytes`` whenever those out do.

    A fresh buffer faults in every 4 KiB page on its first write (kernel time, which a file read into it pays);
    a kept one is refilled without a fault. :meth:`take` hands out a kept buffer of exactly that many bytes, or a
    new one; :meth:`give` takes a buffer back and keeps it while the bytes kept and out stay within
    ``cap_bytes`` (else it is dropped: its memory goes back to the system). The caller gives a buffer back only
    once nothing uses it.
    """

    __slots__ = ("cap_bytes", "_free", "_kept", "_out")

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = int(cap_bytes)
        self._free: dict[int, list[torch.Tensor]] = {}
        self._kept = 0
        self._out = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat page-aligned ``numel``-element ``dtype`` tensor, uninitialised (a kept one when there is)."""
        nbytes = int(numel) * dtype.itemsize
        self._out += nbytes
        free = self._free.get(nbytes)
        if free:
            self._kept -= nbytes
            return free.pop().view(dtype)
        return aligned_empty(numel, dtype)

    def give(self, buf: torch.Tensor) -> None:
        """Take back ``buf`` (from :meth:`take`, no longer used); keep it for a later :meth:`take` of its size
        while the cap allows."""
        nbytes = buf.nbytes
        self._out = max(0, self._out - nbytes)
        if nbytes and self._kept + self._out + nbytes <= self.cap_bytes:
            self._free.setdefault(nbytes, []).append(buf.view(torch.uint8))
            self._kept += nbytes

    def kept_bytes(self) -> int:
        """Bytes of the buffers kept now (not those out)."""
        return self._kept


_DIRECT_CACHE: dict[str, bool] = {}


def direct_io_supported(folder: str) -> bool:
    """Whether files in ``folder`` can be opened with ``O_DIRECT`` (tried once per folder with a scratch file)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    folder = os.path.abspath(folder)
    if folder not in _DIRECT_CACHE:
        probe = os.path.join(folder, f".microspeed-direct-{os.getpid()}-{secrets.token_hex(8)}")
        ours = True
        try:  # a new file of our own (a name nobody can guess): never through a link, never over a file there
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_DIRECT, 0o600))
            _DIRECT_CACHE[folder] = True
        except OSError as exc:
            ours = exc.errno != errno.EEXIST  # a file system refusing O_DIRECT may have created it first
            _DIRECT_CACHE[folder] = False
        finally:
            if ours:
                try:
                    os.unlink(probe)
                except OSError:
                    pass
    return _DIRECT_CACHE[folder]


class IoStats:
    """Counters of one store's requests (for tests and benchmarks); merged from each stripe under the store's lock.

    ``requests``: requests issued; ``sizes``: request bytes -> count; ``submit_calls``: ``io_submit``
    calls; ``max_in_flight``: the most requests one worker had submitted and not reaped; ``refills``:
    submissions made while requests of the same worker were still in flight (``overlap_events``);
    ``direct_bytes`` / ``buffered_bytes``: bytes moved each way; ``threads``: idents of the threads
    that did I/O.
    """

    def __init__(self) -> None:
        self.requests = 0
        self.sizes: dict[int, int] = {}
        self.submit_calls = 0
        self.max_in_flight = 0
        self.refills = 0
        self.direct_bytes = 0
        self.buffered_bytes = 0
        self.threads: set[int] = set()

    def request(self, nbytes: int, direct: bool) -> None:
        """Count one request of ``nbytes``."""
        self.requests += 1
        self.sizes[nbytes] = self.sizes.get(nbytes, 0) + 1
        if direct:
            self.direct_bytes += nbytes
        else:
            self.buffered_bytes += nbytes

    def merge(self, other: IoStats) -> None:
        """Add ``other``'s counts to these."""
        self.requests += other.requests
        for size, count in other.sizes.items():
            self.sizes[size] = self.sizes.get(size, 0) + count
        self.submit_calls += other.submit_calls
        self.max_in_flight = max(self.max_in_flight, other.max_in_flight)
        self.refills += other.refills
        self.direct_bytes += other.direct_bytes
        self.buffered_bytes += other.buffered_bytes
        self.threads |= other.threads

    def __repr__(self) -> str:
        return (f"IoStats(requests={self.requests}, sizes={self.sizes}, submit_calls={self.submit_calls}, "
                f"max_in_flight={self.max_in_flight}, refills={self.refills}, direct={self.direct_bytes}, "
                f"buffered={self.buffered_bytes}, threads={len(self.threads)})")


# -- Linux kernel AIO through ctypes ---------------------------------------------------------------

#: io_setup, io_destroy, io_getevents, io_submit system call numbers.
_SYSCALLS = {"x86_64": (206, 207, 208, 209), "amd64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2),
             "arm64": (0, 1, 4, 2)}
_PREAD, _PWRITE = 0, 1


class _IoCb(ctypes.Structure):  # struct iocb, little-endian layout (linux/aio_abi.h)
    _fields_ = [("data", ctypes.c_uint64), ("key", ctypes.c_uint32), ("rw_flags", ctypes.c_int32),
                ("opcode", ctypes.c_uint16), ("reqprio", ctypes.c_int16), ("fildes", ctypes.c_uint32),
                ("buf", ctypes.c_uint64), ("nbytes", ctypes.c_uint64), ("offset", ctypes.c_int64),
                ("reserved2", ctypes.c_uint64), ("flags", ctypes.c_uint32), ("resfd", ctypes.c_uint32)]


class _IoEvent(ctypes.Structure):  # struct io_event
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64),
                ("res2", ctypes.c_int64)]


_libc: Any = None
_UNAVAILABLE: list[str] = []  # the reason, once known
_WARNED: list[bool] = []


def _syscall(nr: int, *args: Any) -> int:
    while True:
        rc = _libc.syscall(ctypes.c_long(nr), *args)
        if rc >= 0:
            return rc
        code = ctypes.get_errno()
        if code != errno.EINTR:
            raise OSError(code, os.strerror(code))


def kernel_aio_unavailable() -> str | None:
    """``None`` when Linux kernel AIO can be used here, else why not (the workers then use ``pread``/``pwrite``)."""
    global _libc
    if _UNAVAILABLE:
        return _UNAVAILABLE[0] or None
    reason = ""
    machine = platform.machine().lower()
    if not sys.platform.startswith("linux"):
        reason = f"kernel AIO is Linux's; this is {sys.platform}"
    elif machine not in _SYSCALLS or sys.byteorder != "little":
        reason = f"no kernel AIO system call table for {machine}"
    else:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.syscall.restype = ctypes.c_long
            AioContext(1).close()
        except (OSError, AttributeError) as exc:
            reason = f"io_setup failed: {exc}"
    _UNAVAILABLE.append(reason)
    return reason or None


class AioContext:
    """One kernel AIO context (``io_setup``) with ``depth`` request slots, used by one worker thread."""

    def __init__(self, depth: int) -> None:
        self.depth = int(depth)
        self._nr = _SYSCALLS[platform.machine().lower()]
        self._ctx = ctypes.c_ulong(0)
        _syscall(self._nr[0], ctypes.c_long(self.depth), ctypes.byref(self._ctx))
        self._iocbs = (_IoCb * self.depth)()
        self._events = (_IoEvent * self.depth)()
        self._base = ctypes.addressof(self._iocbs)
        self._size = ctypes.sizeof(_IoCb)

    def close(self) -> None:
        """``io_destroy`` (idempotent); only with nothing in flight."""
        if self._ctx.value:
            _syscall(self._nr[1], self._ctx)
            self._ctx = ctypes.c_ulong(0)

    def _submit(self, slots: list[int], single: bool, stats: IoStats) -> None:
        """Submit ``slots``; on a failure the :class:`OSError` carries ``unsubmitted``, the slots not in flight."""
        groups = [[s] for s in slots] if single else [slots]
        submitted = 0
        for group in groups:
            ptrs = (ctypes.c_void_p * len(group))(*[self._base + s * self._size for s in group])
            done = 0
            while done < len(group):
                stats.submit_calls += 1
                try:
                    done += _syscall(self._nr[3], self._ctx, ctypes.c_long(len(group) - done),
                                     ctypes.byref(ptrs, done * ctypes.sizeof(ctypes.c_void_p)))
                except OSError as exc:
                    exc.unsubmitted = slots[submitted + done:]  # type: ignore[attr-defined]
                    raise
            submitted += done

    def _reap(self, least: int, most: int) -> list[tuple[int, int]]:
        got = _syscall(self._nr[2], self._ctx, ctypes.c_long(least), ctypes.c_long(most), self._events, None)
        return [(int(self._events[k].data), int(self._events[k].res)) for k in range(got)]

    def run(self, fd: int, write: bool, address: int, requests: list[tuple[int, int]], single_submit: bool,
            overlap_events: bool, stats: IoStats, file_base: int = 0) -> None:
        """Move ``requests`` (``(start, stop)`` byte ranges from ``address`` in memory, from ``file_base + start``
        in the file) through ``fd``, with up to ``depth`` in flight; raise :class:`OSError` for the first failure,
        after every submitted request completed (the memory is quiet when this returns or raises)."""
        free = list(range(self.depth - 1, -1, -1))
        expected: dict[int, tuple[int, int]] = {}
        error: OSError | None = None
        i, n = 0, len(requests)
        try:
            while (i < n and error is None) or expected:
                if i < n and error is None and (overlap_events or not expected):
                    batch = []
                    while i < n and free:
                        slot = free.pop()
                        start, stop = requests[i]
                        cb = self._iocbs[slot]
                        ctypes.memset(ctypes.byref(cb), 0, self._size)
                        cb.data, cb.opcode, cb.fildes = slot, _PWRITE if write else _PREAD, fd
                        cb.buf, cb.nbytes, cb.offset = address + start, stop - start, file_base + start
                        expected[slot] = (start, stop)
                        batch.append(slot)
                        stats.request(stop - start, True)
                        i += 1
                    stats.refills += len(expected) > len(batch)
                    stats.max_in_flight = max(stats.max_in_flight, len(expected))
                    try:
                        self._submit(batch, single_submit, stats)
                    except OSError as exc:
                        for slot in exc.unsubmitted:  # type: ignore[attr-defined]  # not in flight: retire them
                            expected.pop(slot, None)
                            free.append(slot)
                        raise
                least = 1 if overlap_events else len(expected)
                for slot, res in self._reap(least, len(expected)):
                    start, stop = expected.pop(slot)
                    free.append(slot)
                    if error is not None:
                        continue
                    if res < 0:
                        error = OSError(-res, os.strerror(-res))
                    elif res != stop - start:
                        error = short_transfer(write, file_base + start + res, file_base + stop)
        except BaseException:
            while expected:  # never leave the kernel writing into (or reading from) memory we give back
                for slot, _ in self._reap(len(expected), len(expected)):
                    expected.pop(slot, None)
            raise
        if error is not None:
            raise error


def short_transfer(write: bool, at: int, end: int) -> OSError:
    """The ``EIO`` error of a read that met the end of the file at byte ``at`` (``end`` expected), or a short write."""
    if write:
        return OSError(errno.EIO, f"short write at byte {at} (of {end})")
    return OSError(errno.EIO, f"unexpected end of file at byte {at} (file shorter than the {end} bytes expected)")


def warn_fallback_once(reason: str) -> None:
    """Log (once per process) that the workers use ``pread``/``pwrite`` instead of kernel AIO, and why."""
    if not _WARNED:
        _WARNED.append(True)
        _log.warning("microspeed-zero NVMe swap: %s; I/O threads issue one request at a time, so aio.queue_depth, "
                     "aio.single_submit and aio.overlap_events have no effect", reason)
