"""Suite-wide pytest set-up: DeepSpeed's JIT-built CPU ops are built once, in a private folder, before the tests.

Real DeepSpeed (the reference of the parity tests, run with ``DS_ACCELERATOR=cpu``) compiles C++ ops the first
time they are used: ``deepspeed.comm`` builds ``deepspeed_shm_comm`` when it starts (``TorchBackend`` calls
``build_shm_op()``), and its Adam builds ``fused_adam`` / ``cpu_adam``. Left to the tests, that build happens
inside a rank of the first parity test, on top of the test's own timeout, and under load it made the test time
out with nothing saying why. So here:

* ``TORCH_EXTENSIONS_DIR`` is set for the whole session (unless the environment already sets it) to
  ``build/torch_extensions`` in the repository (git-ignored), so every process the tests start — ranks of
  ``run_distributed``, ``subprocess`` runs that pass ``os.environ`` on — uses the same private cache;
* after collection, when a selected test module runs real DeepSpeed (its source sets ``DS_ACCELERATOR``),
  one child process builds (or, when already built, just loads) those ops, with :data:`BUILD_TIMEOUT` seconds
  per op. A build that fails or takes longer fails the tests that need it with a message naming the op, the
  folder and the time, instead of a timeout inside a rank. ``MICROSPEED_DS_OPS_TIMEOUT`` changes the limit.
* the build runs in the background on one core (``MAX_JOBS=1``; on a fresh checkout it takes minutes) while the
  tests that do not run DeepSpeed go first: the modules that do are moved to the end of the run (their own
  order kept), and the first of them waits for the build before its timeout starts.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import pytest

ROOT = Path(__file__).resolve().parent
EXTENSIONS_DIR = ROOT / "build" / "torch_extensions"
"""The private ``TORCH_EXTENSIONS_DIR`` of the suite (git-ignored; reused by later sessions)."""

DS_OPS = (("ShareMemCommBuilder", "deepspeed_shm_comm"), ("FusedAdamBuilder", "fused_adam"),
          ("CPUAdamBuilder", "cpu_adam"))
"""DeepSpeed's CPU op builders the parity tests end up using: (builder class, op name)."""

BUILD_TIMEOUT = float(os.environ.get("MICROSPEED_DS_OPS_TIMEOUT", "600"))
"""Seconds one op may take to build (a build on 2 busy cores takes a minute or two)."""

_MARKER = "DS_ACCELERATOR"  # a test module that runs real DeepSpeed on CPU sets this variable

# Runs in a child process, so the pytest process never imports real DeepSpeed (the stand-in tests need it
# unloaded). It prints "building <op>" before each op, so a timeout can name the op it was waiting for.
_BUILD_SCRIPT = """
import os, signal, sys, threading, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job starts with SIGINT ignored
parent = os.getppid()
def watch_parent():  # pytest gone (killed by a timeout, say): stop like Ctrl-C, so torch releases its build lock
    while os.getppid() == parent:
        time.sleep(1)
    os.kill(os.getpid(), signal.SIGINT)
threading.Thread(target=watch_parent, daemon=True).start()
from deepspeed.accelerator import get_accelerator
for builder_name, op in [tuple(pair.split(":")) for pair in sys.argv[1:]]:
    print("building", op, flush=True)
    builder = get_accelerator().create_op_builder(builder_name)
    if builder is None or not builder.is_compatible(False):
        print("skipped", op, flush=True)
        continue
    builder.load(verbose=False)
    print("built", op, flush=True)
"""

_failure: str | None = None  # why the ops could not be built; tests that need them fail with it
_needs_ops: set[str] = set()  # files of the selected test modules that run real DeepSpeed


def pytest_configure(config: pytest.Config) -> None:
    """Point every process of the session at the private extensions folder."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(EXTENSIONS_DIR))


def _runs_real_deepspeed(path: Path, seen: dict[Path, bool]) -> bool:
    if path not in seen:
        try:
            seen[path] = _MARKER in path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            seen[path] = False
    return seen[path]


def _lock_files(folder: Path, op: str) -> list[Path]:
    return [*folder.glob(f"{op}/lock"), *folder.glob(f"*/{op}/lock")]


def _lock_hint(folder: Path, op: str) -> str:
    locks = _lock_files(folder, op)
    if not locks:
        return ""
    return (f"; {locks[0]} exists: another build holds it, or an interrupted one left it (delete it when no other "
            f"build runs)")


def _remove_stale_locks(folder: Path, ops: tuple[tuple[str, str], ...], older_than: float) -> list[Path]:
    """torch's build lock of an interrupted build is never removed and makes every later build wait forever."""
    removed = []
    for _, op in ops:
        for lock in _lock_files(folder, op):
            try:
                if time.time() - lock.stat().st_mtime > older_than:
                    lock.unlink()
                    removed.append(lock)
            except OSError:
                pass
    return removed


def _pump(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)


def _stop(proc: subprocess.Popen[str]) -> None:
    """End the build like Ctrl-C (torch then removes its build lock), and kill it if that takes too long."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()


def build_deepspeed_ops(folder: Path, ops: tuple[tuple[str, str], ...] = DS_OPS,
                        timeout: float = BUILD_TIMEOUT, jobs: int | None = None,
                        cancel: threading.Event | None = None) -> str | None:
    """Build (or load, when built) DeepSpeed's CPU ``ops`` in ``folder``; None on success, else why not.

    The build runs in a child process with ``DS_ACCELERATOR=cpu`` and ``TORCH_EXTENSIONS_DIR=folder`` (and
    ``MAX_JOBS=jobs`` compilers at once when given); each op gets ``timeout`` seconds; setting ``cancel`` stops it.
    A missing DeepSpeed is not a failure (the tests that need it skip themselves).
    """
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(folder)}
    if jobs:
        env["MAX_JOBS"] = str(jobs)
    folder.mkdir(parents=True, exist_ok=True)
    _remove_stale_locks(folder, ops, older_than=2 * timeout)  # no build takes that long: its owner is gone
    args = [sys.executable, "-c", _BUILD_SCRIPT, *(f"{b}:{op}" for b, op in ops)]
    proc = subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
    output: list[str] = []
    current, deadline = "", time.monotonic() + timeout
    try:
        while True:
            try:
                line = lines.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if cancel is not None and cancel.is_set():
                    return "the build of DeepSpeed's ops was stopped (the test session ended)"
                if time.monotonic() < deadline:
                    continue
                what = f"building DeepSpeed's {current} op" if current else "importing deepspeed to build its ops"
                return (f"{what} in {folder} took more than {timeout:.0f} s (MICROSPEED_DS_OPS_TIMEOUT sets the "
                        f"limit){_lock_hint(folder, current) if current else ''}")
            if line is None:
                break
            output.append(line)
            if line.startswith("building "):
                current, deadline = line.split()[1], time.monotonic() + timeout
    finally:
        _stop(proc)
    if proc.returncode == 0:
        return None
    tail = "\n".join(output[-30:])
    if "No module named 'deepspeed'" in tail:
        return None
    return f"building DeepSpeed's {current or 'CPU'} op in {folder} failed (exit code {proc.returncode}):\n{tail}"


class _Build:
    """The background build of DeepSpeed's ops for this session."""

    thread: threading.Thread | None = None
    cancel = threading.Event()
    started = 0.0
    took: float | None = None


def _needing_ops(items: list[pytest.Item]) -> set[str]:
    seen: dict[Path, bool] = {}
    return {str(item.path) for item in items if _runs_real_deepspeed(item.path, seen)}


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the modules that need DeepSpeed's ops last (their order kept), so the build overlaps the others."""
    needs = _needing_ops(items)
    items[:] = [i for i in items if str(i.path) not in needs] + [i for i in items if str(i.path) in needs]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Before any test runs: start building DeepSpeed's ops (once, in the background) when a selected test module
    runs real DeepSpeed."""
    if session.config.option.collectonly:
        return
    _needs_ops.update(_needing_ops(session.items))
    if not _needs_ops:
        return
    folder = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"building DeepSpeed's CPU ops {', '.join(op for _, op in DS_OPS)} in {folder} in the "
                            f"background (once; {len(_needs_ops)} test modules run real DeepSpeed, last)")

    def build() -> None:
        global _failure
        _failure = build_deepspeed_ops(folder, jobs=1, cancel=_Build.cancel)
        _Build.took = time.monotonic() - _Build.started

    _Build.started = time.monotonic()
    _Build.thread = threading.Thread(target=build, name="deepspeed-ops-build", daemon=True)
    _Build.thread.start()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """A test that runs real DeepSpeed waits for the build first (outside its timeout, which starts inside)."""
    thread = _Build.thread
    if thread is not None and str(item.path) in _needs_ops:
        reporter = item.config.pluginmanager.get_plugin("terminalreporter")
        if thread.is_alive() and reporter is not None:
            reporter.write_line(f"waiting for the build of DeepSpeed's CPU ops ({time.monotonic() - _Build.started:.0f}"
                                f" s so far)")
        thread.join()
        _Build.thread = None
        if reporter is not None:
            outcome = "ready" if _failure is None else "FAILED"
            reporter.write_line(f"DeepSpeed's CPU ops {outcome} after {_Build.took or 0:.1f} s")
    yield


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop a build still running (a session that ended before its DeepSpeed tests)."""
    if _Build.thread is not None and _Build.thread.is_alive():
        _Build.cancel.set()
        _Build.thread.join(timeout=30)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test that runs real DeepSpeed fails at once, with the reason, when its ops could not be built."""
    if _failure is not None and str(item.path) in _needs_ops:
        pytest.fail(_failure, pytrace=False)
