"""NVMe swap storage for ZeRO-Infinity-style offload: CPU tensors kept in files, moved asynchronously.

:class:`TensorFileStore` keeps named tensors in files under one folder, **one file per key**
(``<folder>/<number>-<sanitised key>.swp``, raw bytes in native byte order, no header; the
metadata — numel and dtype — lives in the store object, so the files are swap space, not a
checkpoint format). Any file system path works; no GPU. I/O runs on ``threads`` worker threads; each
transfer is cut into ``block_size`` requests, dealt in contiguous stripes to the workers so that
several threads move one large tensor in parallel, straight into or out of the memory of a
contiguous CPU tensor (so bf16 and every other dtype work alike). With ``direct=True`` (what the
swappers pass, from DeepSpeed's ``aio`` section: :mod:`microspeed_zero.aio`) the whole pages of a
page-aligned transfer move with ``O_DIRECT`` through Linux kernel AIO, up to ``queue_depth`` requests
in flight per worker; everything else (the last partial page, an unaligned tensor or file offset, a
file system refusing ``O_DIRECT``) uses ``os.pread``/``os.pwrite`` (the GIL is released during the
system call). Swap files are not fsynced. :attr:`TensorFileStore.stats` counts the requests.

A transfer may cover part of a key: ``offset`` (in elements) places a smaller tensor inside the key's
elements, so one file can be filled piece by piece (the gradient pieces of :mod:`microspeed_zero.swap`).
:attr:`TensorFileStore.bytes_read` / :attr:`~TensorFileStore.bytes_written` count the bytes requested.

Ordering: operations on the same key keep their submission order (a read waits for an earlier
write of that key, a write for earlier reads and writes of it); operations on different keys run
concurrently unless ordered explicitly with ``after=``.

Errors of asynchronous operations are raised by :meth:`SwapHandle.wait` as :class:`SwapError`
(an :class:`OSError` keeping the ``errno``) whose message names the key and the file. Files are
removed by :meth:`TensorFileStore.close`, when the store is garbage-collected, or at interpreter
exit (``weakref.finalize``), whichever comes first.

The swap files are the store's own: each is created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (a file or
symbolic link already at its name is refused, naming the file) and reopened with ``O_NOFOLLOW``. The
offload code keeps them in a fresh private folder per rank and engine (:func:`private_folder`, used by
:meth:`TensorFileStore.private`): ``<nvme_path>/microspeed_zero/rank<r>-<purpose>-<random>``, mode 0700,
made with :func:`tempfile.mkdtemp`, so nobody else can predict its name or plant anything in it.

:class:`Prefetcher` streams groups of equal-layout tensors (e.g. ``[master_i, exp_avg_i,
exp_avg_sq_i]``) through a fixed number of in-memory slots: reads of the next groups overlap the
caller's work on the current one, and finished groups are written back asynchronously.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno as errno_mod
import os
import re
import stat
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from microspeed_zero.aio import (
    ALIGN,
    AioContext,
    IoStats,
    aligned_empty,
    direct_io_supported,
    kernel_aio_unavailable,
    short_transfer,
    warn_fallback_once,
)
from microspeed_zero.host_memory import anonymous_pages

__all__ = ["Prefetcher", "SwapError", "SwapHandle", "TensorFileStore", "private_folder", "remove_private_folder"]

#: Sub-folder of ``nvme_path`` that holds the private swap folders (mode 0700, made if missing).
SWAP_SUBDIR = "microspeed_zero"

# the flags that create a swap file (refusing whatever is at its name) and that reopen it (never through a link)
_CREATE = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
_REOPEN = os.O_NOFOLLOW


def _swap_root(nvme_path: str) -> str:
    """``<nvme_path>/microspeed_zero``, made 0700 if missing; refused if it is a link, not a folder, another
    user's, or writable by others (who could then replace the folders in it)."""
    root = os.path.join(os.path.abspath(nvme_path), SWAP_SUBDIR)
    try:
        os.makedirs(os.path.dirname(root), exist_ok=True)
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise OSError(exc.errno, f"cannot create the NVMe swap folder {root!r}: {exc.strerror or exc}; give an "
                                 f"nvme_path you can write to") from exc
    info = os.lstat(root)
    problem = None
    if stat.S_ISLNK(info.st_mode):
        problem = "is a symbolic link (swap files are never written through a link)"
    elif not stat.S_ISDIR(info.st_mode):
        problem = "is not a folder"
    elif info.st_uid != os.geteuid():
        problem = f"belongs to user id {info.st_uid}, not to this user ({os.geteuid()})"
    elif info.st_mode & 0o022:
        problem = f"is writable by other users (mode {stat.S_IMODE(info.st_mode):o})"
    if problem is not None:
        raise PermissionError(errno_mod.EACCES, f"the NVMe swap folder {root!r} {problem}; remove it (microspeed "
                                                f"makes it again, mode 700) or give another nvme_path")
    return root


def private_folder(nvme_path: str, rank: int, purpose: str) -> str:
    """A fresh private swap folder for one rank and one user of it (an engine's optimizer, its parameters).

    ``<nvme_path>/microspeed_zero/rank<r>-<purpose>-<random>``, made by :func:`tempfile.mkdtemp` (mode 0700, a
    name nobody can predict, never an existing folder), inside ``<nvme_path>/microspeed_zero`` (made 0700 if
    missing; refused if it is a symbolic link, another user's or writable by others, with an error naming it).
    Remove it with :func:`remove_private_folder` once its files are gone.
    """
    if not re.fullmatch(r"[A-Za-z0-9_]+", purpose):
        raise ValueError(f"private_folder purpose must be letters, digits and '_', got {purpose!r}")
    for _ in range(5):  # another store of this user may remove an empty microspeed_zero between the two calls
        root = _swap_root(nvme_path)
        try:
            return tempfile.mkdtemp(prefix=f"rank{int(rank)}-{purpose}-", dir=root)
        except FileNotFoundError:
            continue
    raise FileNotFoundError(errno_mod.ENOENT, f"the NVMe swap folder {root!r} keeps disappearing")


def remove_private_folder(folder: str) -> None:
    """Remove a folder made by :func:`private_folder` if it is empty, then ``microspeed_zero`` if empty too."""
    for path in (folder, os.path.dirname(folder)):
        try:
            os.rmdir(path)
        except OSError:
            return


class SwapError(OSError):
    """A failed swap read or write; the message names the key and the file.

    ``errno`` is the one of the underlying :class:`OSError` (``None`` for other failures), the
    original exception is chained as ``__cause__``; ``key``, ``path`` and ``op`` say what failed.
    """

    def __init__(self, op: str, key: str, path: str, cause: BaseException) -> None:
        code = getattr(cause, "errno", None) if isinstance(cause, OSError) else None
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause)
        reason = reason or type(cause).__name__
        if code in (errno_mod.EEXIST, errno_mod.ELOOP):
            reason += (" -- a file or link this store did not create is at that name (swap files are never written "
                       "through a link nor over a file already there)")
        message = f"NVMe swap {op} of key {key!r} (file {path!r}) failed: {reason}"
        if code is None:
            super().__init__(message)
        else:
            super().__init__(code, message)
        self.op = op
        self.key = key
        self.path = path


def _byte_view(tensor: torch.Tensor, what: str) -> memoryview:
    """A writable byte memoryview sharing memory with a contiguous CPU tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{what} must be a CPU tensor (got device {tensor.device}); copy it to the host first")
    if not tensor.is_contiguous():
        raise ValueError(f"{what} must be contiguous; call .contiguous() first")
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(bytearray())
    return memoryview(flat.view(torch.uint8).numpy())


@dataclass(frozen=True)
class _Entry:
    key: str
    path: str
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * _element_size(self.dtype)


def _element_size(dtype: torch.dtype) -> int:
    return dtype.itemsize


class SwapHandle:
    """One asynchronous read or write, as returned by :meth:`TensorFileStore.read_async` / ``write_async``.

    The tensor passed to the call must stay untouched (and alive — the handle keeps a reference)
    until :meth:`wait` returns.
    """

    def __init__(self, op: str, key: str, path: str, keepalive: object) -> None:
        self.op = op
        self.key = key
        self.path = path
        self._keepalive: object = keepalive
        self._futures: list[cf.Future[None]] = []
        self._remaining = 0
        self._lock = threading.Lock()
        self._on_done: list[Callable[[SwapHandle], None]] = []

    def _attach(self, futures: list[cf.Future[None]]) -> None:
        self._futures = futures
        self._remaining = len(futures)
        for future in futures:
            future.add_done_callback(self._chunk_done)

    def _chunk_done(self, _future: cf.Future[None]) -> None:
        with self._lock:
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            self._keepalive = None
            for callback in self._on_done:
                callback(self)

    def done(self) -> bool:
        """Whether every chunk of the transfer has finished (successfully or not)."""
        return all(f.done() for f in self._futures)

    def _join(self, timeout: float | None = None) -> bool:
        """Wait for completion without raising the transfer's error; False on timeout."""
        _, not_done = cf.wait(self._futures, timeout=timeout)
        return not not_done

    def exception(self) -> SwapError | None:
        """The error of a finished transfer (``None`` when it succeeded); waits for it to finish."""
        self._join()
        for future in self._futures:
            exc = future.exception()
            if exc is not None:
                err = SwapError(self.op, self.key, self.path, exc)
                err.__cause__ = exc
                return err
        return None

    def wait(self, timeout: float | None = None) -> None:
        """Block until the transfer finished; raise :class:`SwapError` naming the key and file if it failed.

        All chunks are waited for before an error is raised, so the tensor is quiet afterwards.
        A :class:`TimeoutError` is raised when ``timeout`` seconds pass first.
        """
        if not self._join(timeout):
            raise TimeoutError(f"NVMe swap {self.op} of key {self.key!r} (file {self.path!r}) "
                               f"not finished after {timeout} s")
        err = self.exception()
        if err is not None:
            raise err

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"SwapHandle({self.op} {self.key!r}, {state})"


def _cleanup(workers: list[cf.ThreadPoolExecutor], contexts: list[AioContext], entries: dict[str, _Entry],
             dirs: list[str], remove: bool) -> None:
    """Finalizer of a :class:`TensorFileStore`: stop the workers and their AIO contexts, then delete its files
    and the folders it made."""
    for pool in workers:
        pool.shutdown(wait=True, cancel_futures=False)
    for ctx in contexts:
        ctx.close()
    contexts.clear()
    if not remove:
        return
    for entry in list(entries.values()):
        try:
            os.unlink(entry.path)
        except OSError:
            pass
    entries.clear()
    for folder in dirs:  # deepest first; only folders this store created, only when empty
        try:
            os.rmdir(folder)
        except OSError:
            break


class TensorFileStore:
    """Named tensors in files under ``folder``, one file per key, moved by a thread pool.

    ``folder`` is used as given and created (mode 0700) if missing; the offload code uses :meth:`private`, a
    fresh private folder per rank and engine (:func:`private_folder`). Files are named ``<n>-<key>.swp`` (the key
    sanitised to a safe file name, ``n`` making it unique) and hold raw tensor bytes; they and the
    folders this store created are removed on :meth:`close` (or when the store is collected, or at
    interpreter exit). ``threads`` workers move ``block_size``-byte requests; a tensor larger than
    one block is transferred by several workers at once, each moving one contiguous stripe.
    ``direct=True``: page-aligned transfers move with ``O_DIRECT`` and kernel AIO where the folder's
    file system allows it (:attr:`direct` says whether it does), ``queue_depth`` requests in flight
    per worker, submitted one per call with ``single_submit``, the queue refilled as requests complete
    with ``overlap_events`` (else batch by batch); ``block_size`` must then be a multiple of 4096.
    """

    def __init__(self, folder: str, threads: int = 2, block_size: int = 1 << 20, queue_depth: int = 8,
                 single_submit: bool = False, overlap_events: bool = True, direct: bool = False) -> None:
        if int(threads) < 1:
            raise ValueError(f"TensorFileStore threads must be >= 1, got {threads}")
        if int(block_size) < 1:
            raise ValueError(f"TensorFileStore block_size must be >= 1 byte, got {block_size}")
        if int(queue_depth) < 1:
            raise ValueError(f"TensorFileStore queue_depth must be >= 1, got {queue_depth}")
        if direct and int(block_size) % ALIGN:
            raise ValueError(f"TensorFileStore block_size must be a multiple of {ALIGN} with direct I/O, "
                             f"got {block_size}")
        self.folder = os.path.abspath(folder)
        self.threads = int(threads)
        self.block_size = int(block_size)
        self.queue_depth = int(queue_depth)
        self.single_submit = bool(single_submit)
        self.overlap_events = bool(overlap_events)
        created: list[str] = []
        probe = self.folder
        while probe and not os.path.exists(probe):
            created.append(probe)
            parent = os.path.dirname(probe)
            if parent == probe:
                break
            probe = parent
        try:
            os.makedirs(self.folder, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot create the NVMe swap folder {self.folder!r}: {exc.strerror or exc}") \
                from exc
        self._entries: dict[str, _Entry] = {}
        self.bytes_read = 0
        """Bytes requested by reads so far (whole or partial transfers, counted when submitted)."""
        self.bytes_written = 0
        """Bytes requested by writes so far (counted when submitted)."""
        self._pending: dict[str, list[tuple[SwapHandle, bool]]] = {}
        self._lock = threading.Lock()
        self._counter = 0
        self._next_worker = 0
        self._closed = False
        self.direct = bool(direct) and direct_io_supported(self.folder)
        """Whether page-aligned transfers use ``O_DIRECT`` (asked for, and the file system accepts it)."""
        self.stats = IoStats()
        """Counts of the requests issued so far (:class:`~microspeed_zero.aio.IoStats`)."""
        self._local = threading.local()
        self._contexts: list[AioContext] = []
        self._workers = [cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"microspeed-nvme{i}")
                         for i in range(self.threads)]
        self._owned = created  # the folders close() removes when empty, deepest first
        self._finalizer = weakref.finalize(self, _cleanup, self._workers, self._contexts, self._entries, created,
                                           True)

    @classmethod
    def private(cls, nvme_path: str, rank: int, purpose: str, **options: object) -> TensorFileStore:
        """A store in a fresh private folder under ``nvme_path`` (:func:`private_folder`), removed with its files
        on :meth:`close`; ``options`` are the constructor's."""
        folder = private_folder(nvme_path, rank, purpose)
        try:
            store = cls(folder, **options)  # type: ignore[arg-type]
        except BaseException:
            remove_private_folder(folder)
            raise
        store._owned.extend((folder, os.path.dirname(folder)))  # removed when empty, deepest first
        return store

    # -- metadata -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the NVMe swap store at {self.folder!r} is closed")

    def _entry(self, key: str) -> _Entry:
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(f"no tensor {key!r} in the NVMe swap store at {self.folder!r}; "
                           f"allocate() or write it first") from None

    def _new_entry(self, key: str, numel: int, dtype: torch.dtype) -> _Entry:
        if not isinstance(key, str) or not key:
            raise TypeError(f"swap keys are non-empty strings, got {key!r}")
        if int(numel) < 0:
            raise ValueError(f"numel of {key!r} must be >= 0, got {numel}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype of {key!r} must be a torch.dtype, got {dtype!r}")
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", key)[:100]
        with self._lock:
            self._counter += 1
            path = os.path.join(self.folder, f"{self._counter:06d}-{safe}.swp")
            entry = _Entry(key, path, int(numel), dtype)
            self._entries[key] = entry
        return entry

    def _matching(self, key: str, tensor: torch.Tensor, what: str, offset: int | None = None) -> _Entry:
        entry = self._entry(key)
        if offset is not None:
            if int(offset) < 0 or int(offset) + tensor.numel() > entry.numel or tensor.dtype != entry.dtype:
                raise ValueError(f"{what} for swap key {key!r} at offset {offset} has numel {tensor.numel()} and "
                                 f"dtype {tensor.dtype}; the key holds numel {entry.numel} and dtype {entry.dtype} "
                                 f"(offset + numel must not pass its end)")
        elif tensor.numel() != entry.numel or tensor.dtype != entry.dtype:
            raise ValueError(f"{what} for swap key {key!r} has numel {tensor.numel()} and dtype {tensor.dtype}; "
                             f"the key holds numel {entry.numel} and dtype {entry.dtype}")
        return entry

    def allocate(self, key: str, numel: int, dtype: torch.dtype) -> None:
        """Reserve a (sparse, zero-reading) file for ``numel`` elements of ``dtype`` under ``key``.

        Raises :class:`ValueError` if the key exists with another size or dtype, :class:`SwapError`
        naming the key and file if the file cannot be created.
        """
        self._check_open()
        if key in self._entries:
            entry = self._entries[key]
            if entry.numel != int(numel) or entry.dtype != dtype:
                raise ValueError(f"swap key {key!r} already holds numel {entry.numel} dtype {entry.dtype}; "
                                 f"cannot re-allocate it as numel {numel} dtype {dtype} (remove() it first)")
            return
        self._create(self._new_entry(key, numel, dtype), "allocate", sized=True)

    def _create(self, entry: _Entry, op: str, sized: bool) -> None:
        """Create ``entry``'s file (``O_EXCL | O_NOFOLLOW``: whatever is at its name is refused), ``sized`` to
        its bytes (sparse) or empty; on failure forget the key and raise :class:`SwapError` naming the file."""
        try:
            fd = os.open(entry.path, os.O_WRONLY | _CREATE, 0o600)
            try:
                if sized:
                    os.ftruncate(fd, entry.nbytes)
            finally:
                os.close(fd)
        except OSError as exc:
            with self._lock:
                self._entries.pop(entry.key, None)
            raise SwapError(op, entry.key, entry.path, exc) from exc

    def numel(self, key: str) -> int:
        """The number of elements stored under ``key`` (:class:`KeyError` if unknown)."""
        return self._entry(key).numel

    def dtype(self, key: str) -> torch.dtype:
        """The dtype stored under ``key`` (:class:`KeyError` if unknown)."""
        return self._entry(key).dtype

    def path(self, key: str) -> str:
        """The file that holds ``key`` (:class:`KeyError` if unknown)."""
        return self._entry(key).path

    def keys(self) -> list[str]:
        """The keys of this store, in the order they were first allocated or written."""
        return list(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def bytes_on_disk(self) -> int:
        """Total logical size of the swap files (numel × element size over all keys).

        Allocated-but-unwritten files are sparse on most file systems, so the blocks actually
        used may be fewer.
        """
        return sum(entry.nbytes for entry in self._entries.values())

    # -- transfers ----------------------------------------------------------------------------

    def _read_chunk(self, path: str, view: memoryview, offset: int) -> None:
        """Fill ``view`` from ``path`` at byte ``offset`` (one chunk; runs on a pool thread)."""
        fd = os.open(path, os.O_RDONLY | _REOPEN)
        try:
            done = 0
            while done < len(view):
                n = os.preadv(fd, [view[done:]], offset + done)
                if n == 0:
                    raise OSError(errno_mod.EIO, f"unexpected end of file at byte {offset + done} "
                                                 f"(file shorter than the {offset + len(view)} bytes expected)")
                done += n
        finally:
            os.close(fd)

    def _write_chunk(self, path: str, view: memoryview, offset: int) -> None:
        """Write ``view`` to ``path`` (created by :meth:`_create`) at byte ``offset`` (one chunk; runs on a pool
        thread)."""
        fd = os.open(path, os.O_WRONLY | _REOPEN)
        try:
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
        finally:
            os.close(fd)

    def _context(self) -> AioContext | None:
        """This worker thread's kernel AIO context (made on first use), or ``None`` where there is none."""
        ctx = getattr(self._local, "ctx", False)
        if ctx is False:
            ctx = None
            reason = kernel_aio_unavailable()
            if reason is None:
                try:
                    ctx = AioContext(self.queue_depth)
                    with self._lock:
                        self._contexts.append(ctx)
                except OSError as exc:
                    reason = f"io_setup failed: {exc.strerror or exc}"
            if reason is not None:
                warn_fallback_once(reason)
            self._local.ctx = ctx
        return ctx

    def _direct(self, path: str, write: bool, address: int, view: memoryview, requests: list[tuple[int, int]],
                base: int, stats: IoStats) -> None:
        """Move page-aligned ``requests`` with ``O_DIRECT``: kernel AIO, or one ``pread``/``pwrite`` at a time."""
        fd = os.open(path, (os.O_WRONLY if write else os.O_RDONLY) | os.O_DIRECT | _REOPEN)
        try:
            ctx = self._context()
            if ctx is not None:
                ctx.run(fd, write, address, requests, self.single_submit, self.overlap_events, stats, base)
                return
            for start, stop in requests:
                stats.request(stop - start, True)
                chunk = view[start:stop]
                n = os.pwrite(fd, chunk, base + start) if write else os.preadv(fd, [chunk], base + start)
                if n != stop - start:
                    raise short_transfer(write, base + start + n, base + stop)
        finally:
            os.close(fd)

    def _submit(self, op: str, entry: _Entry, tensor: torch.Tensor, view: memoryview,
                after: Iterable[SwapHandle], base: int = 0) -> SwapHandle:
        is_write = op == "write"
        handle = SwapHandle(op, entry.key, entry.path, tensor)
        with self._lock:
            earlier = [h for h, w in self._pending.get(entry.key, ()) if (w or is_write) and not h.done()]
            self._pending.setdefault(entry.key, []).append((handle, is_write))
            first = self._next_worker
            self._next_worker = (first + 1) % self.threads
        deps = [*earlier, *after]
        io = self._write_chunk if is_write else self._read_chunk
        path = entry.path
        size = len(view)
        address = tensor.data_ptr() if size else 0
        # Direct I/O needs memory and file offset on a page: where the tensor's address and the file offset share
        # their place within a page (always for page-aligned buffers at page-aligned offsets; see staging()), the
        # bytes up to the first page boundary ("head") and after the last one go buffered, the pages between direct.
        phased = self.direct and size > 0 and (address - base) % ALIGN == 0
        head = min((-base) % ALIGN, size) if phased else size
        body = head + (size - head) // ALIGN * ALIGN if phased else size  # [head, body): O_DIRECT
        step = self.block_size
        requests = [(s, min(s + step, body), True) for s in range(head, body, step)]
        requests += [(s, min(s + step, head), False) for s in range(0, head, step)]
        requests += [(s, min(s + step, size), False) for s in range(body, size, step)]
        requests = requests or [(0, 0, False)]
        per = -(-len(requests) // self.threads)
        stripes = [requests[i:i + per] for i in range(0, len(requests), per)]

        def job(stripe: list[tuple[int, int, bool]]) -> None:
            for dep in deps:
                dep._join()
            stats = IoStats()
            stats.threads.add(threading.get_ident())
            try:
                direct = [(start, stop) for start, stop, d in stripe if d]
                if direct:
                    self._direct(path, is_write, address, view, direct, base, stats)
                for start, stop, d in stripe:
                    if d:
                        continue
                    stats.request(stop - start, False)
                    io(path, view[start:stop], base + start)
            finally:
                with self._lock:
                    self.stats.merge(stats)

        handle._on_done.append(self._forget)
        with self._lock:
            if is_write:
                self.bytes_written += size
            else:
                self.bytes_read += size
        handle._attach([self._workers[(first + i) % self.threads].submit(job, stripe)
                        for i, stripe in enumerate(stripes)])
        return handle

    def _forget(self, handle: SwapHandle) -> None:
        with self._lock:
            pending = self._pending.get(handle.key)
            if pending is not None:
                pending[:] = [(h, w) for h, w in pending if h is not handle]
                if not pending:
                    del self._pending[handle.key]

    def write_async(self, key: str, tensor: torch.Tensor, after: Sequence[SwapHandle] = (),
                    offset: int | None = None) -> SwapHandle:
        """Start writing ``tensor`` (contiguous, CPU) under ``key``; allocates the key on first use.

        ``tensor`` must not be modified until the returned handle's :meth:`~SwapHandle.wait`.
        ``after``: handles that must finish before this write starts (e.g. the read that last used
        the buffer). ``offset`` (elements; ``None``: the whole key): write ``tensor`` over the key's elements
        ``[offset, offset + numel)`` only (the key must exist, with the same dtype). Raises :class:`ValueError`
        at once if the key holds another numel or dtype (or the piece does not fit).
        """
        self._check_open()
        view = _byte_view(tensor, f"tensor written to swap key {key!r}")
        if key not in self._entries:
            if offset is not None:
                raise KeyError(f"no tensor {key!r} in the NVMe swap store at {self.folder!r}; allocate() it before "
                               f"writing a piece at offset {offset}")
            # direct: sized first, ext4 serialises direct writes that grow a file (0.3 vs 1.2-1.8 GB/s here)
            self._create(self._new_entry(key, tensor.numel(), tensor.dtype), "write", sized=self.direct)
        entry = self._matching(key, tensor, "tensor written", offset)
        return self._submit("write", entry, tensor, view, after, int(offset or 0) * tensor.element_size())

    def read_async(self, key: str, out: torch.Tensor, after: Sequence[SwapHandle] = (),
                   offset: int | None = None) -> SwapHandle:
        """Start filling ``out`` (contiguous, CPU, the key's numel and dtype, any shape) from ``key``.

        Raises :class:`KeyError` naming the key at once if it was never allocated or written.
        ``after``: handles that must finish before this read starts (e.g. the write-back of the
        buffer ``out`` lives in). ``offset`` (elements; ``None``: the whole key): fill ``out`` from the key's
        elements ``[offset, offset + out.numel())``.
        """
        self._check_open()
        entry = self._entry(key)
        self._matching(key, out, "output tensor", offset)
        view = _byte_view(out, f"output tensor for swap key {key!r}")
        return self._submit("read", entry, out, view, after, int(offset or 0) * out.element_size())

    def staging(self, numel: int, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        """An uninitialised flat CPU tensor of ``numel`` ``dtype`` elements to write at element ``offset`` of a key.

        Its address sits at the same place within a page as the piece's file offset, so :meth:`write_async` moves
        every whole page between them with ``O_DIRECT`` (only the partial pages at either end go buffered); a
        buffer from ``torch.empty`` usually sits elsewhere, and its whole transfer then goes through the page
        cache. Anonymous ``mmap`` memory of at most one page more than the tensor.
        """
        nbytes = int(numel) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(0, dtype=dtype)
        lead = int(offset) * dtype.itemsize % ALIGN
        raw = torch.frombuffer(anonymous_pages(lead + nbytes), dtype=torch.uint8)
        return raw[lead:].view(dtype)

    def write(self, key: str, tensor: torch.Tensor, offset: int | None = None) -> None:
        """Write ``tensor`` under ``key`` (at ``offset`` elements) and wait for it (see :meth:`write_async`)."""
        self.write_async(key, tensor, offset=offset).wait()

    def read(self, key: str, out: torch.Tensor | None = None, offset: int | None = None) -> torch.Tensor:
        """Read ``key`` (from ``offset`` elements, as many as ``out`` holds) into ``out`` (a new flat tensor of
        the rest of the key when ``None``), wait, and return it."""
        if out is None:
            entry = self._entry(key)
            out = torch.empty(entry.numel - int(offset or 0), dtype=entry.dtype)
        self.read_async(key, out, offset=offset).wait()
        return out

    def remove(self, key: str) -> None:
        """Forget ``key`` and delete its file, after its pending transfers finished."""
        entry = self._entry(key)
        with self._lock:
            pending = [h for h, _ in self._pending.get(key, ())]
        for handle in pending:
            handle._join()
        with self._lock:
            self._entries.pop(key, None)
        try:
            os.unlink(entry.path)
        except FileNotFoundError:
            pass

    def synchronize(self) -> None:
        """Wait for every pending transfer; raise the first failure (as :class:`SwapError`)."""
        with self._lock:
            pending = [h for hs in self._pending.values() for h, _ in hs]
        first: SwapError | None = None
        for handle in pending:
            err = handle.exception()
            first = first or err
        if first is not None:
            raise first

    def pending(self) -> int:
        """The number of transfers submitted and not yet finished."""
        with self._lock:
            return sum(1 for hs in self._pending.values() for h, _ in hs if not h.done())

    # -- lifetime -----------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self, remove: bool = True) -> None:
        """Wait for pending I/O (errors not raised here: they belong to their handles), stop the threads,
        and, when ``remove``, delete the files and the folders this store created. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            pending = [h for hs in self._pending.values() for h, _ in hs]
        for handle in pending:
            handle._join()
        if remove:
            self._finalizer()
        else:
            self._finalizer.detach()
            _cleanup(self._workers, self._contexts, self._entries, [], remove=False)

    def __enter__(self) -> TensorFileStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"TensorFileStore({self.folder!r}, keys={len(self._entries)}, bytes={self.bytes_on_disk()}, "
                f"threads={self.threads}, block_size={self.block_size}, queue_depth={self.queue_depth}, "
                f"direct={self.direct}{', closed' if self._closed else ''})")


_ALIGN = 64


class Prefetcher:
    """Streams groups of tensors through ``buffer_count`` in-memory slots: read ahead, hand out, write back.

    ``groups`` lists keys of ``store``; each group is handed out as a list of flat tensors (one per
    key, the key's numel and dtype), viewing one slot. While the caller works on group ``i``, the
    reads of groups ``i+1 .. i+buffer_count-1`` are in flight; when the caller advances, group
    ``i`` is written back asynchronously if it was marked with :meth:`mark_dirty` (or always, with
    ``writeback=True``), and its slot then receives group ``i+buffer_count`` — that read is queued
    behind the write, so a slot is reused only once its write completed. Iterating to the end
    waits for every write-back and raises the first failure; leaving the loop early writes back
    the current group if dirty and waits for all I/O before returning.

    Slots are allocated once, at construction (per position in a group: the largest tensor at
    that position over all groups), and reused by every iteration — the resident memory is
    :meth:`resident_bytes`, at most ``buffer_count`` slots, never the whole store. ``buffers``
    supplies the slots instead (e.g. pinned memory): one list of contiguous CPU tensors per slot,
    one tensor per group position, large enough in bytes for every group; their count overrides
    ``buffer_count``. The handed-out tensors are valid only until the caller advances.
    """

    def __init__(self, store: TensorFileStore, groups: list[list[str]],
                 buffers: list[list[torch.Tensor]] | None = None, buffer_count: int = 2,
                 writeback: bool = False) -> None:
        if buffers is None and int(buffer_count) < 1:
            raise ValueError(f"Prefetcher buffer_count must be >= 1, got {buffer_count}")
        self.store = store
        self.groups = [list(g) for g in groups]
        self.writeback = bool(writeback)
        self._layouts: list[list[tuple[int, torch.dtype, int]]] = []
        for group in self.groups:
            layout = []
            for key in group:
                entry = store._entry(key)
                layout.append((entry.numel, entry.dtype, entry.nbytes))
            self._layouts.append(layout)
        width = max((len(g) for g in self.groups), default=0)
        if buffers is None:
            sizes = [max((lay[j][2] for lay in self._layouts if j < len(lay)), default=0) for j in range(width)]
            sizes = [-(-s // _ALIGN) * _ALIGN for s in sizes]
            count = max(1, min(int(buffer_count), len(self.groups)))
            self._slots = [[aligned_empty(s, torch.uint8) for s in sizes] for _ in range(count)]
        else:
            if not buffers:
                raise ValueError("Prefetcher buffers must hold at least one slot")
            self._slots = []
            for s, slot in enumerate(buffers):
                if len(slot) < width:
                    raise ValueError(f"Prefetcher buffers[{s}] has {len(slot)} tensors; groups need {width}")
                views = []
                for j, buf in enumerate(slot):
                    _byte_view(buf, f"Prefetcher buffers[{s}][{j}]")
                    views.append(buf.detach().reshape(-1).view(torch.uint8))
                for g, lay in enumerate(self._layouts):
                    for j, (_, _, nbytes) in enumerate(lay):
                        if views[j].numel() < nbytes:
                            raise ValueError(f"Prefetcher buffers[{s}][{j}] holds {views[j].numel()} bytes; "
                                             f"group {g} key {self.groups[g][j]!r} needs {nbytes}")
                self._slots.append(views)
        self._current: int | None = None
        self._dirty = False
        self._active = False

    @property
    def buffer_count(self) -> int:
        """The number of slots."""
        return len(self._slots)

    def resident_bytes(self) -> int:
        """Bytes of host memory the slots occupy (constant: they are allocated once)."""
        return sum(t.numel() for slot in self._slots for t in slot)

    def mark_dirty(self) -> None:
        """Mark the group currently handed out as modified: it is written back when the caller advances."""
        if self._current is None:
            raise RuntimeError("Prefetcher.mark_dirty() is called while iterating, on the group handed out")
        self._dirty = True

    def _views(self, slot: int, group: int) -> list[torch.Tensor]:
        buffers = self._slots[slot]
        return [buffers[j][:nbytes].view(dtype) for j, (_, dtype, nbytes) in enumerate(self._layouts[group])]

    def __len__(self) -> int:
        return len(self.groups)

    def __iter__(self) -> Iterator[tuple[int, list[torch.Tensor]]]:
        """Yield ``(group_index, tensors)`` for every group in order (see the class docstring)."""
        return self._run()

    def _run(self) -> Iterator[tuple[int, list[torch.Tensor]]]:
        if self._active:
            raise RuntimeError("this Prefetcher is already being iterated; its slots cannot serve two loops")
        self._active = True
        store, groups = self.store, self.groups
        n, count = len(groups), len(self._slots)
        reads: dict[int, tuple[list[torch.Tensor], list[SwapHandle]]] = {}
        writes: list[list[SwapHandle]] = [[] for _ in range(count)]

        def issue(i: int) -> None:
            slot = i % count
            views = self._views(slot, i)
            after = writes[slot]
            reads[i] = (views, [store.read_async(k, v, after=after) for k, v in zip(groups[i], views, strict=True)])

        try:
            for i in range(min(count, n)):
                issue(i)
            for i in range(n):
                slot = i % count
                views, handles = reads[i]
                for handle in handles:
                    handle.wait()
                del reads[i]  # only now: on a failure above, the drain below waits for its siblings
                for handle in writes[slot]:  # the read waited for it; surface its error now
                    handle.wait()
                writes[slot] = []
                self._current, self._dirty = i, False
                try:
                    yield i, views
                finally:
                    if self._dirty or self.writeback:
                        writes[slot] = [store.write_async(k, v) for k, v in zip(groups[i], views, strict=True)]
                    self._current, self._dirty = None, False
                if i + count < n:
                    issue(i + count)
            for pending in writes:
                for handle in pending:
                    handle.wait()
        except BaseException as exc:
            # Leave no transfer running into or out of the slots, whatever the reason we stop.
            for _, handles in reads.values():
                for handle in handles:
                    handle._join()
            errors = [h.exception() for pending in writes for h in pending]
            first = next((e for e in errors if e is not None), None)
            if isinstance(exc, GeneratorExit) and first is not None:
                raise first from None  # the caller left early: its write-back failed
            raise
        finally:
            self._active = False
