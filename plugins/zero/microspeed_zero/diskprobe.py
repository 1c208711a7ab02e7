"""How fast a folder's disk moves bytes, how fast this CPU multiplies, and what that means for a step.

``microspeed estimate-memory --probe-disk PATH`` calls :func:`probe_disk` (sequential write, then
read, of one file with direct I/O), :func:`matmul_flops` (a second of ``torch.matmul``) and
:func:`step_time` (the bytes the NVMe swappers move per step, from
:func:`microspeed_zero.estimator.nvme_traffic`, over those bandwidths, next to 6·Ψ·tokens FLOPs over
the measured rate).

Direct I/O: the file is opened with ``O_DIRECT`` and written and read in ``request``-byte requests
from one page-aligned buffer, as ``dd bs=16M oflag=direct`` / ``iflag=direct`` does; the write is
timed up to and including ``fsync``. Where the file system refuses ``O_DIRECT`` (tmpfs, some network
and overlay file systems) the probe falls back to buffered I/O: the write is timed through
``fsync``, then ``posix_fadvise(DONTNEED)`` drops the file from the page cache before the read, and
:attr:`DiskBandwidth.direct` is ``False`` (the command prints a note; a tmpfs "disk" is memory).
The file is removed afterwards, also on failure.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import time
from dataclasses import dataclass

__all__ = ["MIN_PROBE_BYTES", "DiskBandwidth", "StepTime", "matmul_flops", "probe_disk", "step_time"]

MIN_PROBE_BYTES = 1 << 20
"""Smallest probe file accepted (1 MiB): below it the figures are timer noise."""

_ALIGN = 4096  # O_DIRECT needs buffers, offsets and lengths aligned to the logical block size (<= a page)


@dataclass(frozen=True)
class DiskBandwidth:
    """What :func:`probe_disk` measured.

    Attributes:
        path: the folder probed.
        size: bytes written and read.
        request: bytes per read/write call.
        write_seconds: seconds of the sequential write, ``fsync`` included.
        read_seconds: seconds of the sequential read.
        direct: ``True`` when ``O_DIRECT`` was used; ``False`` for the buffered fallback.
    """

    path: str
    size: int
    request: int
    write_seconds: float
    read_seconds: float
    direct: bool

    @property
    def write_bps(self) -> float:
        """Write bandwidth, bytes per second."""
        return self.size / self.write_seconds

    @property
    def read_bps(self) -> float:
        """Read bandwidth, bytes per second."""
        return self.size / self.read_seconds


def _check_folder(path: str) -> str:
    if not path:
        raise ValueError("--probe-disk: give a folder to probe (e.g. the nvme_path you will use)")
    if not os.path.exists(path):
        raise ValueError(f"--probe-disk: {path!r} does not exist; give an existing folder (the nvme_path)")
    if not os.path.isdir(path):
        raise ValueError(f"--probe-disk: {path!r} is not a directory; give the folder the swap files will live in")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--probe-disk: {path!r} is not writable by this user; give a folder you can write to")
    return path


def probe_disk(path: str, size: int = 1 << 30, request: int = 16 << 20) -> DiskBandwidth:
    """Measure the sequential write and read bandwidth of the disk under folder ``path``.

    Writes ``size`` bytes (rounded up to whole pages) to a new file in ``path`` with ``O_DIRECT`` in
    ``request``-byte requests, ``fsync`` s it, reads it back the same way and removes it. Falls back
    to buffered I/O + ``fsync`` + ``posix_fadvise(DONTNEED)`` where ``O_DIRECT`` is refused (see the
    module docstring). ``size`` should exceed the disk's own cache to measure the medium.

    Raises:
        ValueError: naming ``--probe-disk`` (missing, not a directory, not writable) or
            ``--probe-size`` (below 1 MiB, or more than the free space).
        OSError: the I/O itself failed (the file is removed first).
    """
    _check_folder(path)
    if isinstance(size, bool) or not isinstance(size, int) or size < MIN_PROBE_BYTES:
        raise ValueError(f"--probe-size: {size!r} bytes is below the minimum of 1 MiB; give e.g. 64M or 1G "
                         f"(larger than the disk's cache measures the medium, not the cache)")
    if isinstance(request, bool) or not isinstance(request, int) or request < _ALIGN:
        raise ValueError(f"request: {request!r} bytes; give at least {_ALIGN}")
    size = -(-size // _ALIGN) * _ALIGN
    request = -(-min(request, size) // _ALIGN) * _ALIGN
    name = os.path.join(path, f".microspeed-probe-{os.getpid()}-{time.monotonic_ns()}")
    fd, direct = _create(name, path)
    buf = None
    try:
        try:
            stat = os.statvfs(path)
            free = stat.f_bavail * stat.f_frsize
            if size > free:
                raise ValueError(f"--probe-size: {size} bytes do not fit in the {free} bytes free under {path!r}; "
                                 f"give a smaller size")
            buf = mmap.mmap(-1, request)  # page-aligned, as O_DIRECT needs
            chunk = os.urandom(min(request, 1 << 20))  # incompressible: a compressing disk cannot cheat
            for at in range(0, request, len(chunk)):
                buf[at:at + len(chunk)] = chunk[:request - at]
            write_s = _timed(fd, buf, size, request, write=True)
        finally:
            os.close(fd)
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | (os.O_DIRECT if direct else 0))  # never through a link
        try:
            if not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            read_s = _timed(fd, buf, size, request, write=False)
        finally:
            os.close(fd)
    finally:
        if buf is not None:
            buf.close()
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass
    return DiskBandwidth(path, size, request, write_s, read_s, direct)


def _create(name: str, folder: str) -> tuple[int, bool]:
    """Create the probe file: ``(fd, True)`` with ``O_DIRECT``, ``(fd, False)`` where the file system refuses it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    direct = hasattr(os, "O_DIRECT")
    try:
        try:
            return os.open(name, flags | (os.O_DIRECT if direct else 0), 0o600), direct
        except OSError as exc:
            if not direct or exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            return os.open(name, flags, 0o600), False
    except OSError as exc:
        raise ValueError(f"--probe-disk: {folder!r} is not writable (creating a file: {exc.strerror}); give a "
                         f"folder you can write to") from exc


def _timed(fd: int, buf: mmap.mmap, size: int, request: int, write: bool) -> float:
    """Seconds to move ``size`` bytes through ``fd`` sequentially in ``request``-byte calls (write: + fsync)."""
    view = memoryview(buf)
    start = time.perf_counter()
    offset = 0
    while offset < size:
        n = min(request, size - offset)
        done = os.pwrite(fd, view[:n], offset) if write else os.preadv(fd, [view[:n]], offset)
        if done <= 0:
            raise OSError(errno.EIO, f"{'write' if write else 'read'} of the probe file stopped at byte {offset}")
        offset += done
    if write:
        os.fsync(fd)
    seconds = time.perf_counter() - start
    view.release()
    return max(seconds, 1e-9)


def matmul_flops(dtype: object = None, seconds: float = 1.0, n: int = 1024) -> float:
    """FLOP/s of ``torch.matmul`` on this CPU: ``n x n`` products (2n³ FLOPs each) for about ``seconds``.

    ``dtype``: a torch dtype (default float32) — measure in the model's compute dtype; torch's
    current intra-op thread count is used, as training would.
    """
    import torch

    dtype = dtype or torch.float32
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.matmul(a, b)  # warm-up (thread pool, kernels)
    count, start = 0, time.perf_counter()
    while True:
        torch.matmul(a, b)
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2.0 * n ** 3 * count / elapsed


@dataclass(frozen=True)
class StepTime:
    """Expected time of one optimizer step with NVMe offload, per rank (see :func:`step_time`).

    Attributes:
        read_bytes: bytes the swappers read per step.
        write_bytes: bytes the swappers write per step.
        io_seconds: ``read_bytes / read bandwidth + write_bytes / write bandwidth`` (one disk: they add up).
        flops: 6·Ψ·tokens, the forward and backward FLOPs of the rank's tokens.
        compute_seconds: ``flops`` over the measured matmul FLOP rate.
    """

    read_bytes: int
    write_bytes: int
    io_seconds: float
    flops: float
    compute_seconds: float

    @property
    def seconds(self) -> float:
        """The step if I/O and compute overlap fully: the larger bound."""
        return max(self.io_seconds, self.compute_seconds)

    @property
    def serial_seconds(self) -> float:
        """The step if they do not overlap at all: the sum."""
        return self.io_seconds + self.compute_seconds

    @property
    def bound(self) -> str:
        """``"I/O"`` or ``"compute"``: which bound dominates."""
        return "I/O" if self.io_seconds >= self.compute_seconds else "compute"


def step_time(read_bytes: int, write_bytes: int, num_params: int, tokens: int, disk: DiskBandwidth,
              flops_per_second: float) -> StepTime:
    """Expected step time: bytes moved over the measured bandwidths, next to 6·``num_params``·``tokens`` FLOPs.

    ``read_bytes``/``write_bytes``: what the swappers move per step on this rank
    (:func:`microspeed_zero.estimator.nvme_traffic`); ``tokens``: the tokens this rank processes per
    optimizer step (micro-batch × sequence × accumulation steps).
    """
    if not (flops_per_second > 0 and math.isfinite(flops_per_second)):
        raise ValueError(f"flops_per_second must be a positive number; got {flops_per_second!r}")
    io = read_bytes / disk.read_bps + write_bytes / disk.write_bps
    flops = 6.0 * num_params * tokens
    return StepTime(int(read_bytes), int(write_bytes), io, flops, flops / flops_per_second)
