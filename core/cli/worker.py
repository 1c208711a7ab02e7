"""One rank of ``microspeed run``: runs the training script as ``python script.py`` would, and records a failure.

``microspeed run`` launches each rank as ``python -u -m microspeed.cli.worker script.py [args]`` (or
``... worker -m module [args]``). The script runs as ``python script.py`` runs it (``__name__ == "__main__"``,
an absolute ``__file__``, the script's folder first on ``sys.path``, its arguments in ``sys.argv``; only
``sys.argv[0]`` is the absolute path, as runpy sets it). When it raises, the rank does not print its
traceback (with N ranks, the console would get N of them); instead it writes

* the error file of torchelastic's ``@record`` protocol (``TORCHELASTIC_ERROR_FILE``, set by torchrun for every
  rank: ``<log dir>/<run>/attempt_<n>/<local rank>/error.json``), which torchrun's agent reads back into its
  ``ChildFailedError``; next to torch's fields it keeps the exact failure time and the last frames, so that
  ``microspeed run`` can name the rank that failed first and print its error once;
* the full traceback, as Python prints it, to ``traceback.log`` in the same folder (Python's faulthandler
  writes there too, should the rank crash in native code).

Without ``TORCHELASTIC_ERROR_FILE`` (run by hand) the error propagates as usual.
"""

from __future__ import annotations

import faulthandler
import json
import os
import runpy
import sys
import time
import traceback
from typing import IO, Any

SHORT_FRAMES = 6
"""Frames of the failing rank's traceback that ``microspeed run`` prints (all of them are in ``traceback.log``)."""

TRACEBACK_FILE = "traceback.log"
"""Name of the per-rank file, next to torchrun's ``error.json``, that holds the rank's full traceback."""

_OWN_FILES = {os.path.abspath(__file__), "<frozen runpy>", os.path.abspath(runpy.__file__ or "")}


def _user_traceback(exc: BaseException) -> BaseException:
    """``exc`` with the frames of this wrapper and runpy (which lead into the script) cut off its traceback."""
    tb = exc.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename in _OWN_FILES
                              or os.path.abspath(tb.tb_frame.f_code.co_filename) in _OWN_FILES):
        tb = tb.tb_next
    return exc.with_traceback(tb) if tb is not None else exc


def short_traceback(exc: BaseException, frames: int = SHORT_FRAMES, full_text_at: str | None = None) -> str:
    """The last ``frames`` frames of ``exc``'s traceback and its message (chained exceptions left out)."""
    total = len(traceback.extract_tb(exc.__traceback__))
    lines = traceback.format_exception(exc, limit=-frames, chain=False)
    where = f": {full_text_at}" if full_text_at else ""
    if total > frames and lines and lines[0].startswith("Traceback"):
        lines.insert(1, f"  ... {total - frames} earlier frame(s){where}\n")
    chained = exc.__cause__ is not None or (exc.__context__ is not None and not exc.__suppress_context__)
    if chained:
        lines.append(f"(raised while handling another exception: the whole chain is in "
                     f"{full_text_at or 'the full traceback'})\n")
    return "".join(lines)


def _error_handler_class() -> type:
    """torchelastic's :class:`ErrorHandler` with an atomic write and microspeed's extra fields (see module doc)."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    class RankErrorHandler(ErrorHandler):
        """Writes the ``@record`` error file: torch's fields (message, ``py_callstack``, ``timestamp``) plus
        ``extraInfo.microspeed`` = ``{"time", "short", "traceback_file"}``."""

        def record_exception(self, e: BaseException, traceback_file: str | None = None) -> None:  # noqa: D102
            path = self._get_error_file_path()
            if not path:
                return
            now = time.time()
            data: dict[str, Any] = {"message": {
                "message": f"{type(e).__name__}: {e}",
                "extraInfo": {
                    "py_callstack": "".join(traceback.format_exception(e)),
                    "timestamp": str(int(now)),
                    "microspeed": {"time": now, "short": short_traceback(e, full_text_at=traceback_file),
                                   "traceback_file": traceback_file},
                },
            }}
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as f:  # the agent may read it while this rank is stopped
                json.dump(data, f)
            os.replace(tmp, path)

    return RankErrorHandler


def record_failure(exc: BaseException, log: IO[str] | None) -> None:
    """Write ``exc`` (its traceback trimmed to the user's frames) to ``log`` and to the rank's error file."""
    exc = _user_traceback(exc)
    if log is not None:
        log.write("".join(traceback.format_exception(exc)))
        log.flush()
    handler = _error_handler_class()()  # it reads the error file's path from TORCHELASTIC_ERROR_FILE, as torch's does
    handler.record_exception(exc, traceback_file=getattr(log, "name", None))


def _run(argv: list[str]) -> None:
    if argv[0] in ("-m", "--module"):
        if len(argv) < 2:
            raise SystemExit("microspeed.cli.worker: -m needs a module name")
        sys.argv = [argv[1], *argv[2:]]  # run_module puts the module's file in sys.argv[0], as `python -m` does
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` does
    runpy.run_path(os.path.abspath(script), run_name="__main__")  # frames show the absolute path, as Python's


def main(argv: list[str] | None = None) -> int:
    """Run ``script.py args`` or ``-m module args``; return the exit status (1 after a recorded failure)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python -m microspeed.cli.worker (script.py | -m module) [args]", file=sys.stderr)
        return 2
    from microspeed import store_server

    store_server.install(store_server.spans_machines_from_env())  # a store rank 0 serves listens on one address
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        _run(argv)
        return 0
    log: IO[str] | None = None
    try:
        log = open(os.path.join(os.path.dirname(error_file), TRACEBACK_FILE), "w", encoding="utf-8")  # noqa: SIM115
        faulthandler.enable(file=log, all_threads=True)
    except OSError:
        log = None
    try:
        _run(argv)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - every uncaught error of the script is this rank's failure
        record_failure(exc, log)
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
