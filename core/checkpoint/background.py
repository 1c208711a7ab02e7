"""The background half of an asynchronous save: one writer thread per engine, waited for before the next.

:func:`saver_for` gives an engine's :class:`Saver`: its staging buffer (:class:`~microspeed.checkpoint.storage.
Staging`) and the save in flight. ``save_checkpoint`` with ``checkpoint.async_save`` copies the tensors into
the buffer, starts :meth:`Saver.start` and returns; the writer thread writes this rank's file (and, on rank
0, waits for every rank's completion marker, writes the index and manifest, and publishes ``latest``).
The next ``save_checkpoint``, ``load_checkpoint``, ``engine.wait_for_checkpoint()`` and the end of the
process wait for it (:meth:`Saver.wait`); an error of the writer comes back there, naming the file. The
thread runs no collective, so it never interleaves with the training's.
"""

from __future__ import annotations

import atexit
import queue
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from microspeed.checkpoint.errors import CheckpointError
from microspeed.checkpoint.storage import Staging

_SAVERS: weakref.WeakKeyDictionary[Any, Saver] = weakref.WeakKeyDictionary()
_ALL: weakref.WeakSet[Saver] = weakref.WeakSet()


class Saver:
    """One engine's checkpoint writer: the staging buffer and the background save in flight (if any)."""

    def __init__(self) -> None:
        self.staging = Staging()
        self.thread: threading.Thread | None = None
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.pending: threading.Event | None = None
        self.error: str | None = None
        self.path: str | None = None
        self.plan: tuple[list[int], set[tuple[str, tuple[int, ...]]]] | None = None  # items' fingerprints, mine

    def start(self, write: Callable[[], None], what: str) -> None:
        """Hand ``write`` to this saver's writer thread and return at once; ``what`` names the save in errors.

        The thread is made once and reused (no thread start per save, which would make the caller wait
        for the new thread to be scheduled); it is a daemon, and :func:`_wait_all_at_exit` waits for its
        work when the interpreter exits.
        """
        self.wait_quietly()
        done = threading.Event()
        self.pending = done
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._work, name="microspeed-checkpoint-writer", daemon=True)
            self.thread.start()
        self.jobs.put((write, what, done))

    def _work(self) -> None:
        while True:
            write, what, done = self.jobs.get()
            try:
                write()
            except BaseException as exc:  # noqa: BLE001 - reported at the next wait
                path = getattr(exc, "path", None) or what
                self.error, self.path = f"{path}: {type(exc).__name__}: {exc}", path
            finally:
                done.set()

    def busy(self) -> bool:
        """Whether a background save is still writing."""
        return self.pending is not None and not self.pending.is_set()

    def wait_quietly(self) -> str | None:
        """Wait for the save in flight; return its error message (and forget it), or ``None``."""
        return self._join()[0]

    def _join(self) -> tuple[str | None, str | None]:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        found = (self.error, self.path)
        self.error = self.path = None
        return found

    def wait(self) -> None:
        """Wait for the save in flight; raise :class:`CheckpointError` (naming the file) if it failed."""
        error, path = self._join()
        if error is not None:
            raise CheckpointError(f"the asynchronous checkpoint save failed: {error}", path)


def saver_for(engine: Any) -> Saver:
    """The :class:`Saver` of ``engine`` (made on first use)."""
    saver = _SAVERS.get(engine)
    if saver is None:
        saver = _SAVERS[engine] = Saver()
        _ALL.add(saver)
    return saver


def pending(engine: Any) -> Saver | None:
    """``engine``'s saver if it has one (no new one is made)."""
    return _SAVERS.get(engine)


@atexit.register
def _wait_all_at_exit() -> None:
    """At interpreter exit (writer threads are daemons, still alive here): finish every save in flight.

    A failed one is reported on stderr.
    """
    for saver in list(_ALL):
        error = saver.wait_quietly()
        if error is not None:
            print(f"microspeed: the asynchronous checkpoint save failed: {error}", file=sys.stderr, flush=True)
