"""The distributed test harness: :func:`run_distributed` runs a function on N local gloo ranks, :func:`distributed`
runs a whole test body on them; failures come back as :class:`DistributedTestError` with every rank's report.

Import it as ``microspeed.testing`` (which re-exports every public name here); the package docstring
describes the behaviour and shows usage.
"""

from __future__ import annotations

import datetime
import faulthandler
import functools
import importlib
import importlib.util
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, overload

__all__ = [
    "DEFAULT_GRACE_PERIOD",
    "DEFAULT_TIMEOUT",
    "DistributedTestError",
    "START_METHOD_ENV",
    "RankFailure",
    "distributed",
    "free_port",
    "in_distributed_worker",
    "run_distributed",
    "start_context",
]

DEFAULT_TIMEOUT = 120.0
"""Seconds all ranks together may take, start-up included, before the run fails as a hang."""

DEFAULT_GRACE_PERIOD = 5.0
"""Seconds the other ranks get to finish after the first rank failed, before they are killed."""

_ORIGINAL_ATTR = "__microspeed_distributed_original__"  # set on @distributed wrappers
_EXIT_WAIT = 10.0  # seconds ranks that reported get to exit on their own before they are killed
_PORT_ATTEMPTS = 3  # runs retried when the rendezvous port was taken between probing and binding
_STACK_SIGNAL = getattr(signal, "SIGUSR1", None)  # asks a rank to write its Python stacks
_STACK_WAIT = 1.0
_MAX_STACK_CHARS = 6000

START_METHOD_ENV = "MICROSPEED_TEST_START_METHOD"
"""Environment variable choosing how ranks start: ``forkserver`` (the default where available) or ``spawn``."""

_PRELOAD = ("torch", "torch.distributed")  # what the fork server imports once for every rank it starts

_in_worker = False
_stack_file: Any = None  # keeps the faulthandler target open for the life of a rank


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankFailure:
    """Why one rank did not return a value.

    ``kind`` is ``"raised"`` (the function raised; ``exc_type``, ``message`` and ``traceback`` are
    set), ``"died"`` (the process ended without reporting; ``exitcode`` is set), ``"terminated"``
    (killed after another rank failed or skipped; ``cause_rank`` is that rank) or ``"timed_out"``
    (still running at the deadline). ``stack`` holds the Python stacks a killed rank was in, when
    it could write them.
    """

    rank: int
    kind: Literal["raised", "died", "terminated", "timed_out"]
    exc_type: str = ""
    message: str = ""
    traceback: str = ""
    exitcode: int | None = None
    cause_rank: int | None = None
    cause: str = ""
    stack: str = ""

    def describe(self) -> str:
        """The human-readable report for this rank, as it appears in the error message."""
        if self.kind == "raised":
            message = self.message.rstrip("\n").replace("\n", "\n    ")
            head = f"rank {self.rank} raised {self.exc_type}: {message}"
            body = self.traceback
        elif self.kind == "died":
            head = f"rank {self.rank} died without reporting a result ({_describe_exitcode(self.exitcode)})"
            body = ""
        elif self.kind == "terminated":
            head = f"rank {self.rank}: terminated after rank {self.cause_rank} {self.cause}"
            body = f"Python stack when terminated:\n{self.stack}" if self.stack else ""
        else:
            head = f"rank {self.rank}: had not finished at the timeout, killed"
            body = f"Python stack at the timeout:\n{self.stack}" if self.stack else ""
        return head + ("\n" + _indent(body.rstrip("\n")) if body else "")


class DistributedTestError(AssertionError):
    """A :func:`run_distributed` run failed: a rank raised, died, or the run timed out.

    Subclasses ``AssertionError`` so pytest reports a test failure, not an error. ``failures``
    holds one :class:`RankFailure` per rank that did not return (the first failure first),
    ``timed_out`` tells whether the deadline passed, and ``unfinished`` lists the ranks still
    running at that point.
    """

    def __init__(
        self,
        message: str,
        failures: Sequence[RankFailure] = (),
        timed_out: bool = False,
        unfinished: Sequence[int] = (),
    ) -> None:
        super().__init__(message)
        self.failures: list[RankFailure] = list(failures)
        self.timed_out = timed_out
        self.unfinished: list[int] = list(unfinished)

    @property
    def failed_ranks(self) -> list[int]:
        """Ranks that raised or died (not those killed because of them)."""
        return [f.rank for f in self.failures if f.kind in ("raised", "died")]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now (the OS picks it; bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def in_distributed_worker() -> bool:
    """True inside a rank process started by :func:`run_distributed`."""
    return _in_worker


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
    init_process_group: bool = True,
    grace_period: float = DEFAULT_GRACE_PERIOD,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` local ranks and return each rank's result.

    Every rank is a fresh process (see :func:`start_context`: forked from a server that imported torch once,
    or spawned) with this process's environment as it is at the call, and ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1`` and ``MASTER_PORT`` (a free port) set, plus
    ``OMP_NUM_THREADS=1`` / ``torch.set_num_threads(1)``, then ``env`` applied on top. With
    ``init_process_group`` the rank calls ``torch.distributed.init_process_group(backend,
    init_method="env://", timeout=timeout)`` before ``fn`` (and selects ``cuda:LOCAL_RANK`` first
    when the backend is NCCL); any process group still initialized after ``fn`` is destroyed.

    Args:
        fn: a module-level function (or other picklable callable); a function decorated with
            :func:`distributed` runs its undecorated body.
        world_size: number of ranks.
        args, kwargs: passed to ``fn`` in every rank; must be picklable.
        timeout: seconds for the whole run, start-up included; also the process-group timeout.
        backend: ``torch.distributed`` backend for ``init_process_group``.
        env: extra environment variables for the ranks (override the defaults above).
        init_process_group: start (and finally destroy) the default process group around ``fn``.
        grace_period: seconds the other ranks get after the first failure before they are killed.

    Returns:
        ``[result_of_rank_0, result_of_rank_1, ...]``.

    Raises:
        DistributedTestError: a rank raised or died, or the run passed ``timeout``.
        TypeError: ``fn``, ``args`` or ``kwargs`` cannot be sent to another process.
        ValueError: ``world_size``, ``timeout`` or ``grace_period`` is out of range.
        pytest.skip.Exception: a rank called ``pytest.skip`` and no rank failed (``pytest.xfail``
            likewise raises pytest's xfail exception).
    """
    __tracebackhide__ = True
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_distributed: world_size must be a positive int, got {world_size!r}")
    if not timeout > 0:
        raise ValueError(f"run_distributed: timeout must be > 0 seconds, got {timeout!r}")
    if not grace_period >= 0:
        raise ValueError(f"run_distributed: grace_period must be >= 0 seconds, got {grace_period!r}")
    target = _make_target(fn)
    rank_env = {str(k): str(v) for k, v in (env or {}).items()}
    call: bytes | tuple[tuple[Any, ...], dict[str, Any]] = (tuple(args), dict(kwargs or {}))
    try:
        # Unpickled in the rank after its environment is set and fn's module is imported (with
        # pytest's assert rewriting). Objects that only multiprocessing's spawn pickler can send
        # (its queues, locks, events) make this fail: those travel with the process instead.
        call = pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        pass

    outcome = None
    for attempt in range(_PORT_ATTEMPTS):
        outcome = _run_once(
            target,
            world_size,
            call,
            float(timeout),
            backend,
            rank_env,
            init_process_group,
            float(grace_period),
        )
        if not (outcome.port_conflict and attempt + 1 < _PORT_ATTEMPTS):
            break
    assert outcome is not None
    return outcome.finish()


@overload
def distributed(world_size: Callable[..., Any], /) -> Callable[..., None]: ...


@overload
def distributed(
    world_size: int = 2,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
    init_process_group: bool = True,
    grace_period: float = DEFAULT_GRACE_PERIOD,
) -> Callable[[Callable[..., Any]], Callable[..., None]]: ...


def distributed(
    world_size: int | Callable[..., Any] = 2,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
    init_process_group: bool = True,
    grace_period: float = DEFAULT_GRACE_PERIOD,
) -> Any:
    """Decorator: the decorated module-level test function runs on ``world_size`` ranks.

    ::

        @pytest.mark.parametrize("n", [1, 3])
        @distributed(world_size=2)
        def test_broadcast(n, tmp_path):
            ...  # runs on rank 0 and rank 1, each with n and tmp_path

    Calling the decorated function (pytest does) calls :func:`run_distributed` on the original
    body with the call's arguments as ``args``/``kwargs``; it returns ``None``. The module keeps
    the wrapper under the function's name, and every rank looks the body up through it, so the
    function must be defined at module level (or as a method of a module-level test class).
    pytest sees the body's signature, so ``@pytest.mark.parametrize`` and fixtures work; fixture
    values are created once in the pytest process and must be picklable (``tmp_path`` is, and is
    the same directory for every rank). Inside a rank, calling a decorated function runs the body
    directly. The keyword arguments are those of :func:`run_distributed`; ``@distributed`` with
    no parentheses means ``world_size=2``.

    To vary the world size, parametrize a plain test that calls :func:`run_distributed`.
    """
    if callable(world_size):
        return distributed()(world_size)
    size = world_size

    def decorate(fn: Callable[..., Any]) -> Callable[..., None]:
        if not isinstance(fn, types.FunctionType):
            raise TypeError(f"@distributed decorates functions, got {fn!r}")
        _check_findable(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            if _in_worker:
                return fn(*args, **kwargs)
            run_distributed(
                fn,
                world_size=size,
                args=args,
                kwargs=kwargs,
                timeout=timeout,
                backend=backend,
                env=env,
                init_process_group=init_process_group,
                grace_period=grace_period,
            )
            return None

        setattr(wrapper, _ORIGINAL_ATTR, fn)
        return wrapper

    return decorate


# --------------------------------------------------------------------------------------------
# Finding the function again in a rank
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _FunctionRef:
    """A module-level function named by module and qualified name, resolved inside the rank.

    Pickling the function itself would fail for ``@distributed`` bodies (the module attribute is
    the wrapper, not the body) and would import the test module while the rank unpickles its
    arguments, before its environment is set up. A reference avoids both, and can fall back to
    loading the module from its file (pytest's ``--import-mode=importlib`` names modules that
    ``import`` cannot find). ``rewrite_asserts`` is set when pytest rewrote the module's asserts
    in the parent; the rank then does the same, so a failed ``assert`` shows its values.
    """

    module: str
    qualname: str
    file: str | None
    rewrite_asserts: bool = False

    def resolve(self) -> Callable[..., Any]:
        module = sys.modules.get(self.module)
        if module is None and self.rewrite_asserts and self.file:
            module = _import_with_assert_rewriting(self.module, self.file)
        if module is None:
            if self.file and _find_spec(self.module) is None:
                module = _import_from_file(self.module, self.file)
            else:
                module = importlib.import_module(self.module)
        obj: Any = module
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return _unwrap(obj)


def _find_spec(name: str) -> Any:
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def _import_from_file(name: str, path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load module {name!r} from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _import_with_assert_rewriting(name: str, path: str) -> types.ModuleType | None:
    """Import ``name`` from ``path`` with pytest's assert rewriting; None if pytest cannot rewrite it."""
    try:
        import ast

        from _pytest.assertion.rewrite import rewrite_asserts

        with open(path, "rb") as f:
            source = f.read()
        tree = ast.parse(source, filename=path)
        rewrite_asserts(tree, source, path, None)
        code = compile(tree, path, "exec", dont_inherit=True)
        spec = importlib.util.spec_from_file_location(name, path)
    except Exception:  # pytest missing or its private API changed: import normally instead
        return None
    if spec is None:
        return None
    if "." in name:
        importlib.import_module(name.rpartition(".")[0])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _unwrap(obj: Any) -> Any:
    """The body behind a ``@distributed`` wrapper (also below other ``functools.wraps`` layers)."""
    current, seen = obj, 0
    while current is not None and seen < 100:
        original = getattr(current, _ORIGINAL_ATTR, None)
        if isinstance(original, types.FunctionType):
            return original
        current = getattr(current, "__wrapped__", None)
        seen += 1
    return obj


def _check_findable(fn: types.FunctionType) -> None:
    if "<locals>" in fn.__qualname__ or "<lambda>" in fn.__qualname__:
        raise TypeError(
            f"{fn.__module__}.{fn.__qualname__}: functions run on ranks must be defined at module "
            f"level (each spawned rank imports {fn.__module__!r} and looks the function up by name); "
            f"lambdas and nested functions cannot be found there"
        )


def _make_target(fn: Callable[..., Any]) -> Any:
    """What to send to the ranks for ``fn``: a :class:`_FunctionRef` for plain functions."""
    fn = _unwrap(fn)
    if not isinstance(fn, types.FunctionType):
        if not callable(fn):
            raise TypeError(f"run_distributed: fn must be callable, got {fn!r}")
        return fn
    _check_findable(fn)
    module = sys.modules.get(fn.__module__)
    ref = _FunctionRef(
        fn.__module__,
        fn.__qualname__,
        getattr(module, "__file__", None),
        rewrite_asserts=module is not None and "@pytest_ar" in vars(module),  # pytest rewrote it here
    )
    try:
        found = ref.resolve() if module is not None else fn
    except AttributeError:
        found = None
    if found is not fn:
        raise TypeError(
            f"run_distributed: {fn.__module__}.{fn.__qualname__} is not reachable under that name "
            f"(the module attribute is another object), so a spawned rank cannot find it; define "
            f"the function at module level under its own name"
        )
    return ref


# --------------------------------------------------------------------------------------------
# The rank process
# --------------------------------------------------------------------------------------------


def _our_error_filters() -> list[tuple[str, str, type, str, int]]:
    """The caller's ``error`` warning filters aimed at microspeed's own modules (pytest's ``filterwarnings``).

    Spawned ranks start with Python's default filters; these are re-applied there, so a deprecation warning
    raised by our code inside a rank fails the test as it would in the parent.
    """
    picked = []
    for action, message, category, module, lineno in warnings.filters:
        pattern = getattr(module, "pattern", module) or ""
        if action == "error" and pattern.startswith("microspeed"):
            picked.append((action, getattr(message, "pattern", message) or "", category, pattern, lineno))
    return picked


def start_context() -> Any:
    """The ``multiprocessing`` context ranks start from.

    ``forkserver`` where the platform has it: one server process per test session imports torch once and forks
    every rank from there (starting a rank costs a fork instead of an ``import torch``, seconds on a small
    machine), and ``spawn`` elsewhere or when :data:`START_METHOD_ENV` says ``spawn``. Either way a rank is a
    fresh process that imports the function's module by name, and gets the caller's current environment
    (the server's own, taken when it started, is replaced).
    """
    method = os.environ.get(START_METHOD_ENV, "forkserver").strip().lower() or "forkserver"
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{START_METHOD_ENV}={method!r}: expected 'forkserver' or 'spawn'")
    if method == "forkserver" and "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(_PRELOAD))
        return ctx
    return multiprocessing.get_context("spawn")


class _CallerStdio:
    """Pickles as the caller's current stdout and stderr file descriptors, sent with the rank's start.

    A forked rank would otherwise write to its fork server's descriptors, those of the test that started the
    server (pytest's capture of that test), not the current caller's. ``multiprocessing.reduction.DupFd``
    must run while the process is being started (it hands the descriptors to the start), so here in
    ``__reduce__``; the rank gets :class:`_StdioFds`.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        return (_StdioFds, (reduction.DupFd(1), reduction.DupFd(2)))


class _StdioFds:
    """The caller's stdout and stderr in a rank; :meth:`apply` makes them the rank's descriptors 1 and 2."""

    def __init__(self, out: Any, err: Any) -> None:
        self.out, self.err = out, err

    def apply(self) -> None:
        """``dup2`` them onto descriptors 1 and 2 (Python's ``sys.stdout``/``sys.stderr`` write there)."""
        for target, wrapped in ((1, self.out), (2, self.err)):
            fd = wrapped.detach()
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)


def _worker(
    rank: int,
    world_size: int,
    port: int,
    target: Any,
    call: Any,
    env: dict[str, str],
    backend: str,
    timeout: float,
    init_process_group: bool,
    results: Any,
    stack_dir: str,
    warning_filters: list[Any] = (),
    base_env: dict[str, str] | None = None,
    stdio: _StdioFds | None = None,
) -> None:
    """Entry point of a rank: set up the environment, run the function, report through ``results``."""
    global _in_worker
    _in_worker = True
    if stdio is not None:
        stdio.apply()
    _exit_with_parent()
    for entry in reversed(warning_filters):
        warnings.filterwarnings(entry[0], message=entry[1], category=entry[2], module=entry[3], lineno=entry[4])
    if base_env is not None:  # a forked rank has its fork server's environment: the caller's replaces it
        os.environ.clear()
        os.environ.update(base_env)
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
    )
    os.environ.update(env)
    _enable_stack_dump(os.path.join(stack_dir, f"rank{rank}.stack"))

    phase = "setup"
    try:
        fn = _resolve(target)
        args, kwargs = pickle.loads(call) if isinstance(call, bytes) else call
        if init_process_group or "torch" in sys.modules:
            _limit_torch_threads()
        if init_process_group:
            phase = "init"
            _init_process_group(backend, timeout)
        phase = "run"
        result = fn(*args, **kwargs)
        phase = "return"
        payload = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
        phase = "teardown"
        _destroy_process_group()
        message: tuple[Any, ...] = ("ok", rank, payload)
    except BaseException as exc:  # everything, pytest's outcomes included, is reported
        message = _report_exception(rank, phase, exc)
    results.put(message)
    results.close()
    results.join_thread()


def _resolve(target: Any) -> Callable[..., Any]:
    return target.resolve() if isinstance(target, _FunctionRef) else target


def _limit_torch_threads() -> None:
    import torch

    try:
        threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    except ValueError:
        return
    if threads > 0:
        torch.set_num_threads(threads)


def _init_process_group(backend: str, timeout: float) -> None:
    import torch
    import torch.distributed as dist

    if "nccl" in backend and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout))


def _destroy_process_group() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _report_exception(rank: int, phase: str, exc: BaseException) -> tuple[Any, ...]:
    names = {cls.__name__ for cls in type(exc).__mro__}
    if "Skipped" in names:  # _pytest.outcomes.Skipped, without importing pytest here
        return ("skip", rank, _safe_str(getattr(exc, "msg", None) or exc))
    if "XFailed" in names:
        return ("xfail", rank, _safe_str(getattr(exc, "msg", None) or exc))
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_globals.get("__name__") == __name__:
        tb = tb.tb_next  # the harness's own frames are noise
    try:
        text = "".join(traceback.format_exception(type(exc), exc, tb))
    except Exception:
        text = ""
    message = _safe_str(exc)
    if phase == "return":
        message = f"{message} (while pickling the return value, which must be picklable)"
    return ("error", rank, phase, _type_name(type(exc)), message, text)


def _exit_with_parent() -> None:
    """End this rank when the process that started it goes away (killed test run, CI cancel)."""
    parent = multiprocessing.parent_process()
    sentinel = getattr(parent, "sentinel", None)
    if sentinel is None:
        return

    threading.Thread(
        target=_watch_parent_process, args=(sentinel,), name="microspeed-parent-watch", daemon=True
    ).start()


def _watch_parent_process(sentinel: Any) -> None:
    try:
        multiprocessing.connection.wait([sentinel])
    except Exception:
        return
    os._exit(70)


def _enable_stack_dump(path: str) -> None:
    global _stack_file
    if _STACK_SIGNAL is None:
        return
    try:
        _stack_file = open(path, "w")  # stays open: faulthandler writes to it later
        faulthandler.register(_STACK_SIGNAL, file=_stack_file, all_threads=True, chain=False)
    except (OSError, RuntimeError, ValueError):
        _stack_file = None


# --------------------------------------------------------------------------------------------
# The parent side
# --------------------------------------------------------------------------------------------


@dataclass
class _Outcome:
    world_size: int
    timeout: float
    results: dict[int, Any] = field(default_factory=dict)
    failures: list[RankFailure] = field(default_factory=list)
    skips: dict[int, str] = field(default_factory=dict)
    xfails: dict[int, str] = field(default_factory=dict)
    timed_out: bool = False
    unfinished: list[int] = field(default_factory=list)
    port_conflict: bool = False

    def finish(self) -> list[Any]:
        __tracebackhide__ = True
        broken = [f for f in self.failures if f.kind in ("raised", "died")]
        if broken or self.timed_out:
            raise DistributedTestError(self._message(broken), self.failures, self.timed_out, self.unfinished)
        if self.skips:
            _pytest_outcome("skip", _group_reasons(self.skips))
        if self.xfails:
            _pytest_outcome("xfail", _group_reasons(self.xfails))
        return [self.results[rank] for rank in range(self.world_size)]

    def _message(self, broken: list[RankFailure]) -> str:
        n = self.world_size
        if self.timed_out:
            done = sorted(self.results)
            head = (
                f"run_distributed timed out after {self.timeout:g}s: "
                f"{_ranks(self.unfinished)} had not finished (world_size={n}"
                + (f"; {_ranks(done)} returned" if done else "")
                + ")"
            )
        else:
            head = (
                f"run_distributed: {len(broken)} of {n} rank{'s' if n > 1 else ''} failed "
                f"(world_size={n}; first failure: rank {broken[0].rank})"
            )
        return "\n\n".join([head, *(f.describe() for f in self.failures)])


def _run_once(
    target: Any,
    world_size: int,
    call: Any,
    timeout: float,
    backend: str,
    env: dict[str, str],
    init_process_group: bool,
    grace_period: float,
) -> _Outcome:
    __tracebackhide__ = True
    ctx = start_context()
    base_env = dict(os.environ)
    deadline = time.monotonic() + timeout
    outcome = _Outcome(world_size, timeout)
    results = ctx.Queue()
    procs: list[Any] = []
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="microspeed-ranks-") as stack_dir:
        try:
            for rank in range(world_size):
                proc = ctx.Process(
                    target=_worker,
                    name=f"microspeed-rank-{rank}",
                    args=(
                        rank,
                        world_size,
                        port,
                        target,
                        call,
                        env,
                        backend,
                        timeout,
                        init_process_group,
                        results,
                        stack_dir,
                        _our_error_filters(),
                        base_env,
                        _CallerStdio(),
                    ),
                )
                try:
                    proc.start()
                except (pickle.PicklingError, TypeError, AttributeError) as exc:
                    raise TypeError(
                        f"run_distributed: the function, args and kwargs are sent to each rank by "
                        f"pickle, and pickling failed: {type(exc).__name__}: {exc}"
                    ) from exc
                procs.append(proc)
            unfinished = _collect(procs, results, outcome, deadline, grace_period, stack_dir)
            _reap([procs[rank] for rank in unfinished])
            _join_all(procs, _EXIT_WAIT)  # the others reported: let them exit on their own
        finally:
            _reap(procs)
            for proc in procs:
                if proc.exitcode is not None:
                    proc.close()  # release its pipe file descriptors now, not at garbage collection
            results.close()
            results.join_thread()
    return outcome


def _collect(
    procs: list[Any],
    results: Any,
    outcome: _Outcome,
    deadline: float,
    grace_period: float,
    stack_dir: str,
) -> list[int]:
    """Read the ranks' reports until all reported, one went wrong and the grace ran out, or the deadline.

    Returns the ranks that had not reported by then (recorded as terminated or timed out).
    """
    pending = set(range(len(procs)))
    stop_at = deadline
    first_bad: tuple[int, str] | None = None

    def handle(message: tuple[Any, ...]) -> None:
        nonlocal stop_at, first_bad
        kind, rank = message[0], message[1]
        if rank not in pending:
            return
        pending.discard(rank)
        cause = None
        if kind == "ok":
            try:
                outcome.results[rank] = pickle.loads(message[2])
            except Exception as exc:
                outcome.failures.append(
                    RankFailure(
                        rank,
                        "raised",
                        _type_name(type(exc)),
                        f"{_safe_str(exc)} (while unpickling the return value in the parent)",
                    )
                )
                cause = "failed"
        elif kind == "error":
            _, _, phase, exc_type, text, tb = message
            outcome.failures.append(RankFailure(rank, "raised", exc_type, text, tb))
            lowered = text.lower()
            if phase == "init" and ("address already in use" in lowered or "eaddrinuse" in lowered):
                outcome.port_conflict = True
            cause = "failed"
        elif kind == "skip":
            outcome.skips[rank] = message[2]
            cause = "skipped"
        elif kind == "xfail":
            outcome.xfails[rank] = message[2]
            cause = "xfailed"
        if cause is not None and (first_bad is None or (first_bad[1] != "failed" and cause == "failed")):
            if first_bad is None:
                stop_at = min(deadline, time.monotonic() + grace_period)
            first_bad = (rank, cause)

    while pending:
        now = time.monotonic()
        if now >= stop_at:
            break
        try:
            handle(results.get(timeout=min(0.1, stop_at - now)))
            continue
        except queue.Empty:
            pass
        dead = [rank for rank in sorted(pending) if procs[rank].exitcode is not None]
        if not dead:
            continue
        # A rank that exited has flushed its report into the pipe already; read what is there.
        while True:
            try:
                handle(results.get(timeout=0.1))
            except queue.Empty:
                break
        for rank in dead:
            if rank in pending:
                pending.discard(rank)
                outcome.failures.append(RankFailure(rank, "died", exitcode=procs[rank].exitcode))
                if first_bad is None:
                    stop_at = min(deadline, time.monotonic() + grace_period)
                if first_bad is None or first_bad[1] != "failed":
                    first_bad = (rank, "failed")

    if not pending:
        return []
    left = sorted(pending)
    stacks = _dump_stacks(procs, left, stack_dir)
    if first_bad is None:
        outcome.timed_out = True
        outcome.unfinished = left
        outcome.failures.extend(RankFailure(r, "timed_out", stack=stacks.get(r, "")) for r in left)
    else:
        outcome.failures.extend(
            RankFailure(r, "terminated", cause_rank=first_bad[0], cause=first_bad[1], stack=stacks.get(r, ""))
            for r in left
        )
    return left


def _dump_stacks(procs: list[Any], ranks: list[int], stack_dir: str) -> dict[int, str]:
    """Ask the given ranks for their Python stacks (faulthandler on SIGUSR1) and read them back."""
    if _STACK_SIGNAL is None:
        return {}
    paths: dict[int, str] = {}
    for rank in ranks:
        path = os.path.join(stack_dir, f"rank{rank}.stack")
        pid = procs[rank].pid
        # Only ranks that registered the handler (they created the file); others would just die.
        if pid is not None and procs[rank].exitcode is None and os.path.exists(path):
            try:
                os.kill(pid, _STACK_SIGNAL)
                paths[rank] = path
            except OSError:
                pass
    stacks: dict[int, str] = {}
    end = time.monotonic() + _STACK_WAIT
    while paths and time.monotonic() < end:
        if all(os.path.getsize(p) > 0 for p in paths.values()):
            time.sleep(0.05)  # let the last lines land
            break
        time.sleep(0.02)
    for rank, path in paths.items():
        try:
            with open(path) as f:
                text = f.read()
        except OSError:
            continue
        text = _clean_stack(text)
        if len(text) > _MAX_STACK_CHARS:
            text = text[:_MAX_STACK_CHARS] + "\n... (truncated)"
        if text.strip():
            stacks[rank] = text
    return stacks


def _clean_stack(text: str) -> str:
    """Drop the harness's own parts of a faulthandler dump: its watcher thread, its bootstrap frames."""
    blocks = []
    for block in text.strip().split("\n\n"):
        if " in _watch_parent_process" in block:
            continue
        lines = block.splitlines()
        for i, line in enumerate(lines):
            if line.rstrip().endswith(" in _worker") and "testing.py" in line:
                lines = lines[:i]  # frames below the rank's function: multiprocessing start-up
                break
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def _join_all(procs: list[Any], seconds: float) -> None:
    end = time.monotonic() + seconds
    for proc in procs:
        proc.join(max(0.0, end - time.monotonic()))


def _reap(procs: list[Any]) -> None:
    """Terminate, then kill, every rank still running, and wait for all of them (no zombies)."""
    for proc in procs:
        if proc.exitcode is None:
            proc.terminate()
    _join_all(procs, 2.0)
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()
    _join_all(procs, 5.0)


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def _pytest_outcome(kind: str, reason: str) -> None:
    __tracebackhide__ = True
    try:
        import pytest
    except ImportError:  # pragma: no cover - the harness is meant for pytest, but stays usable
        import unittest

        raise unittest.SkipTest(reason) from None
    if kind == "skip":
        pytest.skip(reason)
    pytest.xfail(reason)


def _group_reasons(reasons: dict[int, str]) -> str:
    by_reason: dict[str, list[int]] = {}
    for rank, reason in sorted(reasons.items()):
        by_reason.setdefault(reason, []).append(rank)
    return "; ".join(f"{_ranks(ranks)}: {reason}" for reason, ranks in by_reason.items())


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _describe_exitcode(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}, exit code {code}"
    return f"exit code {code}"


def _type_name(cls: type) -> str:
    if cls.__module__ in ("builtins", "__main__"):
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def _safe_str(obj: object) -> str:
    try:
        return str(obj)
    except Exception:
        return f"<unprintable {type(obj).__name__}>"


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line if line else line for line in text.splitlines())
