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
        self.error: str | None = None
        self.path: str | None = None
        self.plan: tuple[list[int], set[tuple[str, tuple[int, ...]]]] | None = None  # items' fingerprints, mine

    def start(self, write: Callable[[], None], what: str, on_error: Callable[[str], None] | None = None) -> None:
        """Run ``write`` in a new (non-daemon) thread; ``what`` names the save in errors."""
        self.wait_quietly()

        def run() -> None:
            try:
                write()
            except BaseException as exc:  # noqa: BLE001 - reported at the next wait
                path = getattr(exc, "path", None) or what
                message = f"{path}: {type(exc).__name__}: {exc}"
                self.error, self.path = message, path
                if on_error is not None:
                    on_error(message)

        self.thread = threading.Thread(target=run, name="microspeed-checkpoint-writer", daemon=False)
        self.thread.start()

    def busy(self) -> bool:
        """Whether a background save is still writing."""
        return self.thread is not None and self.thread.is_alive()

    def wait_quietly(self) -> str | None:
        """Wait for the save in flight; return its error message (and forget it), or ``None``."""
        return self._join()[0]

    def _join(self) -> tuple[str | None, str | None]:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
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
    """At interpreter exit: finish every save in flight, and say on stderr if one failed."""
    for saver in list(_ALL):
        error = saver.wait_quietly()
        if error is not None:
            print(f"microspeed: the asynchronous checkpoint save failed: {error}", file=sys.stderr, flush=True)
