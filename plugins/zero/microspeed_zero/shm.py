"""Gathers and all-to-alls between the ranks of one host through shared memory instead of gloo's TCP loopback.

On gloo every byte a rank sends to a rank of the same host is copied into the kernel, through the TCP stack, and out
again by gloo's network thread: for stage 3's gathers on 2 ranks here that thread took 48 ms of CPU per forward of a
45M-parameter GPT, on a machine whose two cores the ranks' own compute already fills. A :class:`LocalExchange` moves
the same bytes through one shared mapping: each rank copies its piece into a slot of its own, and every peer copies it
from there into its destination, two ``memcpy`` per byte and no system call but a few pipe signals per slot.

Protocol. The exchange's operations (a gather of a segment's slices, an ``all_to_all_single``) are issued by every
rank in the same order, as collectives are; each is cut into *rounds* of at most one slot. Round ``n`` uses slot
``n % SLOTS`` of every rank. A worker thread per rank runs the rounds in order:

1. before writing slot ``n % SLOTS`` it waits for every peer's acknowledgement of round ``n - SLOTS`` (so no peer
   still reads what it overwrites);
2. it copies its piece into the slot and posts ``n``, the operation's kind and the round's size to every peer (a
   named pipe per ordered pair of ranks: the kernel's lock on the pipe orders the slot's stores before the peer's
   reads that follow its read of the post);
3. for each peer it waits for that peer's post of ``n``, checks that it names the same operation (ranks that issued
   different gathers or reductions fail, naming each other, where gloo would hang or mix the data), copies the
   peer's piece out of the peer's slot, and acknowledges ``n`` to it.

The waits block in ``poll`` (no spinning, the cores stay with the compute) and fail after :data:`TIMEOUT_S`, or at
once when a peer's pipe closes (the peer exited), with the peer's rank in the message. The mapping's pages are
reserved when it is made (a full ``/dev/shm`` refuses then, instead of killing a rank with ``SIGBUS`` at its first
write), and the mapping and the pipes are unlinked from the file system once every rank has opened them, so
nothing outlives the processes. Where any rank cannot set the exchange up, every rank keeps gloo's transport
(rank 0 logs why).

The end of the process. Stages 1-2 gather the stepped parameters asynchronously, and nothing waits for the last
step's gathers before a script returns: the worker may still be copying when the interpreter exits. It is a daemon
thread (it must not keep a failed job alive), and a daemon thread inside a torch operation (which releases the GIL)
when the interpreter finalises is ended by ``pthread_exit`` as it takes the GIL back; the forced unwinding through
torch's C++ GIL guard calls ``std::terminate`` and the rank aborts ("terminate called without an active exception")
after the job's work is done, failing the job. So every exchange is stopped at exit (:func:`stop_all`, registered
with ``atexit`` when this module is imported, so it runs before the handlers registered earlier: torch's among them):
the operations issued finish (every rank issues the same ones, so its peers' workers serve them), the worker ends,
and only then does the interpreter finalise. ``engine.destroy()`` waits for them too (:func:`drain_all`).

It serves a gloo process group whose ranks all run on this host (same host name, boot id, network and mount
namespaces);
``MICROSPEED_ZERO_SHM=0`` keeps gloo's transport. Its shared memory (``world x SLOTS x SLOT_BYTES``: 8 MiB on 2
ranks, 16 on 4) counts in each rank's RSS as far as touched (:func:`~microspeed_zero.chunking.shm_touched_bytes`, a
term of the peak-RSS prediction).
"""

from __future__ import annotations

import atexit
import logging
import mmap
import os
import queue
import select
import socket
import struct
import sys
import threading
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from microspeed_zero.chunking import SHM_ENV, SHM_SLOT_BYTES, SHM_SLOTS, shm_enabled

SLOT_BYTES, SLOTS = SHM_SLOT_BYTES, SHM_SLOTS  # (microspeed_zero.chunking: the peak-RSS prediction reads them)

TIMEOUT_S = 600.0
"""Seconds a round waits for a peer before it fails."""

EXIT_TIMEOUT_S = 60.0
"""Seconds the end of the process (and ``engine.destroy()``) waits for the operations in flight (a peer still
finishing its last step) before it abandons them with a warning."""

ENV = SHM_ENV  # (microspeed_zero.chunking, read by the peak-RSS prediction too)

SHM_DIR = "/dev/shm"
"""Where the slots' file and the pipes are made (and unlinked once every rank opened them)."""

_MSG = struct.Struct("<qqq")  # round, operation kind, values in the round
_KINDS = {1: "gather", 2: "all-to-all", 3: "reduce-scatter"}
_REDUCE = 3  # a round whose reads are one sum over every rank's slot (in rank order), then the acknowledgements
_exchanges: dict[Any, LocalExchange | None] = {}


def _sum_rows(target: torch.Tensor, rows: list[torch.Tensor], post: float, accumulate: bool) -> None:
    """``target += row * post`` per row in order (``accumulate``), else ``target = sum(rows) * post``: the reducer's
    own arithmetic (:meth:`microspeed_zero.reduce.GradientReducer._finish`), on one round's columns."""
    if accumulate:
        for row in rows:
            target.add_(row, alpha=post)
        return
    target.copy_(rows[0])
    for row in rows[1:]:
        target.add_(row)
    if post != 1.0:
        target.mul_(post)


class ExchangeUnavailable(RuntimeError):
    """Raised on every rank when a :class:`LocalExchange` could not be set up on some rank (the reason named)."""


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def shm_bytes(world: int) -> int:
    """Bytes of shared memory an exchange over ``world`` ranks maps (and each rank touches, in time, all of it)."""
    return world * SLOTS * SLOT_BYTES if world > 1 else 0


def _host_id() -> str:
    """This process's host as far as sharing memory goes: host name, boot id, and its network and mount namespaces
    (ranks in containers or namespaces of their own, such as the tests' simulated machines, count as other hosts)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    spaces = []
    for ns in ("net", "mnt"):
        try:
            spaces.append(str(os.stat(f"/proc/self/ns/{ns}").st_ino))
        except OSError:
            spaces.append("")
    return "/".join([socket.gethostname(), boot, *spaces])


def _usable() -> bool:
    return shm_enabled() and os.path.isdir(SHM_DIR) and hasattr(os, "mkfifo")


def local_exchange(group: Any, rank: int, world: int) -> LocalExchange | None:
    """The :class:`LocalExchange` of ``group`` (built at the first call, a collective over the group: every rank calls
    it at the same point), or ``None`` where it does not apply: one rank, a backend other than gloo, ranks on several
    hosts, ``MICROSPEED_ZERO_SHM=0``, or no ``/dev/shm``."""
    key = group if group is not None else dist.group.WORLD
    if key in _exchanges:
        return _exchanges[key]
    ex = None
    if world > 1 and dist.is_initialized() and str(dist.get_backend(group)).lower() == "gloo":
        facts = [None] * world
        dist.all_gather_object(facts, (_host_id(), _usable()), group=group)
        if all(f == facts[0] for f in facts) and facts[0][1]:
            try:
                ex = LocalExchange(group, rank, world)
            except ExchangeUnavailable as exc:
                if rank == 0:
                    logging.getLogger("microspeed.zero").warning(
                        "ZeRO's shared-memory exchange is unavailable (%s): its collectives use gloo's transport", exc)
    _exchanges[key] = ex
    return ex


def drain_all(timeout: float = EXIT_TIMEOUT_S) -> bool:
    """Wait for every operation issued so far on every exchange of this process (``engine.destroy()``); whether all
    are done within ``timeout`` seconds each."""
    return all([ex.drain(timeout) for ex in list(_exchanges.values()) if ex is not None])


@atexit.register
def stop_all(timeout: float = EXIT_TIMEOUT_S) -> bool:
    """Stop every exchange of this process (:meth:`LocalExchange.stop`): run at interpreter exit, before it
    finalises (see the module docstring); whether every worker ended."""
    return all([ex.stop(timeout) for ex in list(_exchanges.values()) if ex is not None])


class ExchangeWork:
    """A pending operation of a :class:`LocalExchange`; ``wait()`` returns when its last round is done."""

    __slots__ = ("_done", "_error")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def wait(self) -> None:
        """Block until the operation completed; re-raise the worker's error, if any."""
        self._done.wait()
        if self._error is not None:
            raise self._error

    def is_completed(self) -> bool:
        """Whether the operation is done."""
        return self._done.is_set()


class LocalExchange:
    """Shared-memory rounds between the ``world`` ranks of ``group``, all on this host (see the module docstring)."""

    def __init__(self, group: Any, rank: int, world: int) -> None:
        """Map the slots and open the pipes, on every rank of ``group`` at once (collective); raises
        :class:`ExchangeUnavailable` on every rank when any rank could not (then nothing is left behind)."""
        self.group, self.rank, self.world = group, rank, world
        self.global_ranks = [dist.get_global_rank(group, q) if group is not None else q for q in range(world)]
        size = shm_bytes(world)
        names = [None]
        if rank == 0:  # the mapping's file, its pages reserved now (a full /dev/shm refuses here, not by SIGBUS)
            name = f"microspeed-zero-{uuid.uuid4().hex}"
            try:
                fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.posix_fallocate(fd, 0, size)
                    names[0] = name
                finally:
                    os.close(fd)
            except OSError as exc:
                _unlink(os.path.join(SHM_DIR, name))
                names[0] = f"!{exc}"
        dist.broadcast_object_list(names, src=self.global_ranks[0], group=group)
        base = names[0]
        if base.startswith("!"):
            raise ExchangeUnavailable(f"rank {self.global_ranks[0]} could not create it in {SHM_DIR}: {base[1:]}")
        path = os.path.join(SHM_DIR, base)
        self._fds: list[int] = []
        self._post_in: dict[int, int] = {}
        self._ack_in: dict[int, int] = {}
        mine = [os.path.join(SHM_DIR, f"{base}-{kind}-{q}-{rank}") for q in range(world) if q != rank
                for kind in ("post", "ack")]
        error = ""
        try:  # the reader makes and opens (non-blocking) the pipes it reads; every rank maps the slots
            for q in range(world):
                if q != rank:
                    for kind, table in (("post", self._post_in), ("ack", self._ack_in)):
                        fifo = os.path.join(SHM_DIR, f"{base}-{kind}-{q}-{rank}")
                        os.mkfifo(fifo, 0o600)
                        table[q] = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
                        self._fds.append(table[q])
            fd = os.open(path, os.O_RDWR)
            try:
                self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        except OSError as exc:
            error = f"rank {self.global_ranks[rank]}: {exc}"
        errors = [None] * world
        dist.all_gather_object(errors, error, group=group)
        failed = [e for e in errors if e]
        if failed:
            for f in self._fds:
                os.close(f)
            for fifo in mine:
                _unlink(fifo)
            if rank == 0:
                _unlink(path)
            raise ExchangeUnavailable("; ".join(failed))
        self._post_out = {q: os.open(os.path.join(SHM_DIR, f"{base}-post-{rank}-{q}"), os.O_WRONLY)
                          for q in range(world) if q != rank}
        self._ack_out = {q: os.open(os.path.join(SHM_DIR, f"{base}-ack-{rank}-{q}"), os.O_WRONLY)
                         for q in range(world) if q != rank}
        dist.barrier(group=group)  # everyone holds every end: the names can go
        for fifo in mine:
            _unlink(fifo)
        if rank == 0:
            _unlink(path)
        self._begin()

    def _begin(self) -> None:
        """Start the worker over the mapping and pipes set up (``_map``, ``_post_in/out``, ``_ack_in/out``)."""
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._round = 0  # rounds issued (main thread)
        self._acked = {q: -1 for q in self._ack_in}  # last acknowledgement read from each peer (worker)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stopped = False  # no operation is taken any more (main thread)
        self._abandoned = False  # the worker must not start another round: the process is ending (see stop)
        self._worker = threading.Thread(target=self._run, name=f"zero-shm-{self.rank}", daemon=True)
        self._worker.start()

    @property
    def rounds(self) -> int:
        """Rounds issued so far (every operation takes at least one)."""
        return self._round

    # -- the slots ------------------------------------------------------------------------------

    def slot(self, q: int, n: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """Rank ``q``'s slot of round ``n`` as ``numel`` values of ``dtype``."""
        start = (q * SLOTS + n % SLOTS) * SLOT_BYTES
        return self._bytes[start:start + numel * dtype.itemsize].view(dtype)

    # -- operations (main thread, same order on every rank) -------------------------------------

    def gather(self, flat: torch.Tensor, lo: int, hi: int) -> ExchangeWork:
        """Fill elements ``lo:hi`` of every rank's slice of ``flat`` (``world`` equal slices) from that rank's own
        slice, which this rank has written already. Asynchronous: ``wait()`` the returned work; until then ``flat``
        must not change (the worker reads this rank's slice when its round comes, as gloo's sends do)."""
        size = flat.numel() // self.world
        mine = flat[self.rank * size:(self.rank + 1) * size]
        per = max(1, SLOT_BYTES // flat.element_size())
        rounds = []
        for a in range(lo, hi, per):
            b = min(hi, a + per)
            rounds.append((lambda dst, a=a, b=b: dst.copy_(mine[a:b]),
                           lambda q, src, a=a, b=b: flat[q * size + a:q * size + b].copy_(src),
                           flat.dtype, b - a, 1))
        return self._submit(rounds)

    def all_to_all(self, out: torch.Tensor, wire: torch.Tensor) -> ExchangeWork:
        """``all_to_all_single(out, wire)`` with equal rows: row ``q`` of ``out`` gets row ``rank`` of rank ``q``'s
        ``wire``. Asynchronous: ``wait()`` the returned work."""
        rows_in, rows_out = wire.view(self.world, -1), out.view(self.world, -1)
        rows_out[self.rank].copy_(rows_in[self.rank])
        return self._submit(self._column_rounds(
            rows_in, rows_in.shape[1], 2,
            lambda q, src, a, b, w: rows_out[q, a:b].copy_(src.view(self.world, w)[self.rank])))

    def reduce_scatter(self, wire: torch.Tensor, target: torch.Tensor, post: float, accumulate: bool) -> ExchangeWork:
        """Sum row ``rank`` of every rank's ``wire`` (``world`` equal rows; the first ``target.numel()`` columns)
        into ``target`` without a receive buffer: the worker adds each round's columns from the peers' slots.

        ``accumulate``: ``target += row_q * post`` for ``q`` in rank order (ZeRO-2/3's partition); else ``target =
        (row_0 + ... + row_{world-1}) * post`` (ZeRO-1's slice of its accumulator, which may be this rank's own row
        of ``wire``: the sum reads that row from this rank's slot). Element by element the same operations, in the
        same order, as summing the rows an :meth:`all_to_all` delivers, so the result is bit-identical.
        Asynchronous: ``wait()`` the returned work; until then neither ``wire`` nor ``target`` may change."""
        return self._submit(self._column_rounds(
            wire.view(self.world, -1), target.numel(), _REDUCE,
            lambda slots, a, b, w: _sum_rows(target[a:b], [s.view(self.world, w)[self.rank] for s in slots], post,
                                             accumulate)))

    def _column_rounds(self, rows_in: torch.Tensor, cols: int, kind: int, read: Callable) -> list[tuple]:
        """Rounds of ``world x w`` columns of ``rows_in`` each (one slot): the write copies them into this rank's
        slot; ``read(..., a, b, w)`` gets the peer and its slot (or, for a reduction, every rank's slot)."""
        per = max(1, SLOT_BYTES // (rows_in.element_size() * self.world))
        rounds = []
        for a in range(0, cols, per):
            b = min(cols, a + per)
            w = b - a
            rounds.append((lambda dst, a=a, b=b, w=w: dst.view(self.world, w).copy_(rows_in[:, a:b]),
                           lambda *got, a=a, b=b, w=w: read(*got, a, b, w),
                           rows_in.dtype, w * self.world, kind))
        return rounds

    def _submit(self, rounds: list[tuple[Callable, Callable, torch.dtype, int, int]]) -> ExchangeWork:
        if self._stopped:
            raise RuntimeError(f"ZeRO shared-memory exchange: rank {self.global_ranks[self.rank]}'s exchange was "
                               f"stopped (the process is ending); no collective can go through it any more.")
        work = ExchangeWork()
        first = self._round
        self._round += len(rounds)
        self._queue.put((first, rounds, work))
        return work

    # -- the end --------------------------------------------------------------------------------

    def drain(self, timeout: float = EXIT_TIMEOUT_S) -> bool:
        """Wait until every operation issued so far is done (their rounds need the peers to issue them too), at
        most ``timeout`` seconds; whether they are. Issues nothing to the peers (a marker on this rank's queue)."""
        if self._stopped:
            return not self._worker.is_alive()
        marker = self._submit([])
        return marker._done.wait(timeout)

    def stop(self, timeout: float = EXIT_TIMEOUT_S) -> bool:
        """Finish the operations in flight (at most ``timeout`` seconds), then end the worker thread; whether it
        ended. Afterwards the exchange takes no operation. Idempotent.

        Where it did not end in time (a peer that never issued the operation, or hangs), the worker is told to start
        no further round, so that it is never inside a torch operation when the interpreter finalises (see the
        module docstring), and a warning names the exchange.
        """
        if not self._stopped:
            self._stopped = True
            self._queue.put(None)  # behind every operation issued: the worker ends once they are done
        self._worker.join(timeout)
        if not self._worker.is_alive():
            return True
        self._abandoned = True
        print(f"microspeed: ZeRO's shared-memory exchange (rank {self.global_ranks[self.rank]}): operations issued "
              f"before the end of the process were not done within {timeout:g} s (a peer did not issue them, or "
              f"hangs); abandoned.", file=sys.stderr, flush=True)
        return False

    # -- the worker -----------------------------------------------------------------------------

    def _run(self) -> None:
        failed: BaseException | None = None
        while True:
            item = self._queue.get()
            if item is None:  # stop(): every operation before it is done
                return
            first, rounds, work = item
            if failed is None:
                try:
                    for i, (write, read, dtype, numel, kind) in enumerate(rounds):
                        self._one_round(first + i, write, read, dtype, numel, kind)
                except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                    failed = exc
            work._error = failed
            work._done.set()

    def _one_round(self, n: int, write: Callable, read: Callable, dtype: torch.dtype, numel: int, kind: int) -> None:
        for q, fd in self._ack_in.items():  # 1. the slot is free once every peer acknowledged round n - SLOTS
            while self._acked[q] < n - SLOTS:
                self._acked[q] = self._recv(fd, q, "acknowledgement")[0]
        self._go_on()
        write(self.slot(self.rank, n, dtype, numel))  # 2. fill it, post it
        msg = _MSG.pack(n, kind, numel)
        for q, fd in self._post_out.items():
            self._send(fd, q, msg)
        if kind == _REDUCE:  # 3. every slot posted, one sum over all of them in rank order, then the acks
            for q, fd in self._post_in.items():
                self._check(self._recv(fd, q, "slot"), q, n, kind, numel)
            self._go_on()
            read([self.slot(q, n, dtype, numel) for q in range(self.world)])
            for q in self._post_in:
                self._send(self._ack_out[q], q, msg)
            return
        for q, fd in self._post_in.items():  # 3. read each peer's slot once it is posted, acknowledge it
            self._check(self._recv(fd, q, "slot"), q, n, kind, numel)
            self._go_on()
            read(q, self.slot(q, n, dtype, numel))
            self._send(self._ack_out[q], q, msg)

    def _go_on(self) -> None:
        """Before each torch operation of a round: raise when :meth:`stop` gave up on the worker."""
        if self._abandoned:
            raise RuntimeError("ZeRO shared-memory exchange: abandoned at the end of the process")

    def _check(self, got: tuple[int, int, int], q: int, n: int, kind: int, numel: int) -> None:
        if got != (n, kind, numel):
            raise RuntimeError(
                f"ZeRO shared-memory exchange: rank {self.global_ranks[q]} posted round {got[0]} of a "
                f"{_KINDS.get(got[1], '?')} of {got[2]} values where rank {self.global_ranks[self.rank]}'s round "
                f"{n} is a {_KINDS[kind]} of {numel}: the ranks issued different gathers or reductions, or in "
                f"different orders (set {ENV}=0 to compare with gloo's transport).")

    def _send(self, fd: int, q: int, msg: bytes) -> None:
        try:
            os.write(fd, msg)  # 24 bytes: atomic on a pipe
        except BrokenPipeError:
            raise RuntimeError(f"ZeRO shared-memory exchange: rank {self.global_ranks[q]} closed its pipe (the "
                               f"process exited) while this rank still exchanged with it.") from None

    def _recv(self, fd: int, q: int, what: str) -> tuple[int, int, int]:
        buf = b""
        poller = select.poll()  # not select(): a descriptor past 1023 (a process with many files open) is fine
        poller.register(fd, select.POLLIN)
        while len(buf) < _MSG.size:
            if not poller.poll(TIMEOUT_S * 1000):
                raise TimeoutError(f"ZeRO shared-memory exchange: rank {self.global_ranks[q]} sent no {what} in "
                                   f"{TIMEOUT_S:.0f} s (a rank stopped issuing ZeRO's collectives, or hangs).")
            try:
                chunk = os.read(fd, _MSG.size - len(buf))
            except BlockingIOError:
                continue
            if not chunk:
                raise RuntimeError(f"ZeRO shared-memory exchange: rank {self.global_ranks[q]} closed its pipe (the "
                                   f"process exited) while this rank waited for its {what}.")
            buf += chunk
        return _MSG.unpack(buf)
