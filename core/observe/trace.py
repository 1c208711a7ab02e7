"""Hook-level tracing: one JSON line per hook call, collective and step, one file per rank.

Off by default, and then free: nothing is attached to the plugin manager or to
:mod:`microspeed.comm`, so hook dispatch and collectives take their plain paths. It is turned on
by ``MICROSPEED_TRACE=<dir>`` (read when the plugins are loaded, so ``initialize()`` itself is
traced) or by the config section ``"trace": {"enabled": true, "output_path": "<dir>"}`` (from
``configure`` on); the built-in ``tracing`` plugin does that (:mod:`microspeed.builtin.tracing`).

Each engine has its own :class:`Probe` (:func:`probe_for` its :class:`~microspeed.comm.CommContext`), so
two engines in one process trace (or not) independently; code outside engines uses the default
context's (:data:`probe`). The module-level :func:`start`, :func:`stop`, :func:`active` and
:func:`instrument` act on the current context's probe (:func:`microspeed.comm.current`). When on, a probe:

* watches every hook call of the engine's plugin manager (pluggy's ``add_hookcall_monitoring``;
  chain hooks run through pluggy's call loop too) and times each implementation (its function is
  wrapped while tracing is on);
* observes every collective of its context (:class:`microspeed.comm.CollectiveObserver`);
* keeps, per thread, the stack of hook calls and collectives in progress: what the watchdog
  (:mod:`microspeed.observe.watchdog`) reads to say where a rank hangs.

The :class:`Tracer` writes the events through a structlog logger of its own (``wrap_logger`` with
a JSON renderer; structlog's global configuration is never touched) to ``<dir>/rank<N>.jsonl``,
flushed line by line so that a killed run keeps its last events. Every event carries ``event``,
``rank``, ``step`` (``engine.global_steps``), ``micro_step``, ``t_ns`` (``perf_counter_ns`` at its
start) and ``wall`` (epoch seconds at its start). The events:

* ``trace_start``: ``world_size``, ``pid``, ``host``, ``perf_ns0`` / ``wall_ns0`` (one instant on
  both clocks), ``version``;
* ``hook``: ``hook`` (name without ``microspeed_``), ``dur_ns``, ``plugins`` (those that ran, in
  order), ``plugin_ns`` (each one's time), ``plugin_off_ns`` (its start after the hook's),
  ``depth`` (nesting), ``chain`` (true for a chain hook, whose plugins each passed the value on), ``exc``
  (``"Type: message"`` or null) and ``exc_plugin``;
* ``collective``: ``op``, ``bytes``, ``group``, ``group_size``, ``seq``, ``async``, ``dur_ns``
  (call to completion), ``launch_ns``, ``wait_ns`` (time blocked in ``wait()``) and ``wait_off_ns``
  (its start after the call) for asynchronous ops, ``hook`` /
  ``plugin`` (where it was called from), ``exc``; written when the op completes. A blocking op
  also writes ``collective_begin`` when it starts, an asynchronous one ``collective_launch`` when
  its work is returned: an op that never completes (a hang) leaves that event without its
  ``collective``, so the files show which rank waits in which collective;
* ``step``: one per optimizer step, at ``after_global_step``: ``dur_ns`` from the step's first
  ``before_forward``, ``samples``, ``skipped``, ``comm_bytes`` and ``wire_bytes`` (payload and
  bytes sent over the network by :mod:`microspeed.comm` collectives since the previous step event);
* ``watchdog``: what the watchdog found (see :mod:`microspeed.observe.watchdog`).

Times are the host's: on CUDA a collective's duration is its launch (NCCL returns at once) unless
the comms logger is on, which synchronizes the device around observed collectives, as DeepSpeed's
does; on CPU (gloo) an asynchronous op's completion is taken from its work's future.

``microspeed trace summary DIR`` and ``microspeed trace export DIR -o trace.json`` read them
(:mod:`microspeed.cli.trace`).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import weakref
from typing import Any

import structlog

from microspeed import comm
from microspeed.hookspecs import CHAINS

ENV_VAR = "MICROSPEED_TRACE"
"""Environment variable: a directory turns tracing on (``0``, ``false`` or empty: off)."""

DEFAULT_DIR = "microspeed_trace"
"""Where the config's ``trace`` section writes when it gives no ``output_path``."""

_PREFIX = "microspeed_"
_perf = time.perf_counter_ns


def env_directory() -> str | None:
    """The directory ``MICROSPEED_TRACE`` names, or ``None`` when it is unset or says off."""
    value = os.environ.get(ENV_VAR, "").strip()
    if value.lower() in ("", "0", "false", "no", "off"):
        return None
    return value


def short_hook_name(name: str) -> str:
    """``microspeed_before_forward -> before_forward``."""
    return name[len(_PREFIX):] if name.startswith(_PREFIX) else name


class Frame:
    """One hook call or collective in progress on a thread (an entry of the probe's stacks).

    ``kind`` is ``"hook"`` or ``"collective"``; ``name`` the full hook name or the op; ``t0`` its
    start (``perf_counter_ns``); ``plugin`` the implementation running right now (hooks);
    ``impls`` the ``(plugin, start_ns, dur_ns)`` of the implementations that ran; ``call`` the
    :class:`microspeed.comm.Collective` (collectives); ``waiting``: blocked in ``wait()`` of an
    asynchronous op.
    """

    __slots__ = ("kind", "name", "t0", "chain", "plugin", "impls", "call", "depth", "exc_plugin", "waiting")

    def __init__(self, kind: str, name: str, t0: int, depth: int, chain: bool = False, call: Any = None,
                 waiting: bool = False) -> None:
        self.kind, self.name, self.t0, self.depth, self.chain = kind, name, t0, depth, chain
        self.call, self.waiting = call, waiting
        self.plugin: str | None = None
        self.impls: list[tuple[str, int, int]] = []
        self.exc_plugin: str | None = None

    def __repr__(self) -> str:
        return f"Frame({self.kind} {self.name}, plugin={self.plugin})"


class _Attachment:
    """What the probe changed on one plugin manager, to undo it."""

    __slots__ = ("undo", "wrapped", "on")

    def __init__(self, undo: Any, wrapped: list[tuple[Any, Any]]) -> None:
        self.undo, self.wrapped, self.on = undo, wrapped, True


class Probe(comm.CollectiveObserver):
    """The instrumentation of one context (one engine), shared by its tracing and its watchdog.

    :meth:`attach` instruments a plugin manager; :meth:`observe_comm` subscribes to collectives.
    ``tracer`` (a :class:`Tracer` or ``None``) receives events; ``main_stack`` is the main
    thread's stack of :class:`Frame` (read by the watchdog from its own thread); ``last`` is
    ``(name, end_ns)`` of the last hook or collective the main thread finished; ``training``
    turns true at the first ``before_forward`` (the watchdog times hooks from then on).
    """

    def __init__(self, context: comm.CommContext | None = None) -> None:
        self.tracer: Tracer | None = None
        self.watching = False
        self._context = weakref.ref(context or comm.default_context())  # the context owns the probe
        self._engine: Any = None
        self.main_stack: list[Frame] = []
        self.last: tuple[str, int] | None = None
        self.training = False
        self._local = threading.local()
        self._main_ident = threading.main_thread().ident
        self._attached: weakref.WeakKeyDictionary[Any, _Attachment] = weakref.WeakKeyDictionary()
        self._step_t0: int | None = None

    # -- state -----------------------------------------------------------------------------

    @property
    def context(self) -> comm.CommContext:
        """The communication context whose collectives this probe observes (the default one once it is gone)."""
        return self._context() or comm.default_context()

    @property
    def engine(self) -> Any:
        """The engine whose hooks the probe saw last (held weakly), or ``None``."""
        return self._engine() if self._engine is not None else None

    @engine.setter
    def engine(self, engine: Any) -> None:
        self._engine = weakref.ref(engine) if engine is not None else None

    @property
    def active(self) -> bool:
        """Whether tracing or the watchdog uses the probe."""
        return self.tracer is not None or self.watching

    def _stack(self) -> list[Frame]:
        try:
            return self._local.stack
        except AttributeError:
            stack = self.main_stack if threading.get_ident() == self._main_ident else []
            self._local.stack = stack
            return stack

    def is_attached(self, pm: Any) -> bool:
        """Whether ``pm`` is instrumented."""
        return pm in self._attached

    # -- plugin managers -------------------------------------------------------------------

    def attach(self, pm: Any) -> None:
        """Instrument ``pm`` (idempotent): hook-call monitoring, timed implementations, chain listener.

        Implementations registered after this call run untimed (their hook calls are still seen).
        """
        if pm in self._attached:
            return
        undo = pm.add_hookcall_monitoring(self._before, self._after)
        wrapped = []
        for caller in list(vars(pm.hook).values()):
            get_impls = getattr(caller, "get_hookimpls", None)
            if get_impls is None:
                continue
            for impl in get_impls():
                if impl.hookwrapper or impl.wrapper:
                    continue
                wrapped.append((impl, impl.function))
                impl.function = self._timed(impl, caller.name)
        self._attached[pm] = _Attachment(undo, wrapped)

    def detach(self, pm: Any) -> None:
        """Undo :meth:`attach` on ``pm``."""
        attachment = self._attached.pop(pm, None)
        if attachment is None:
            return
        attachment.on = False
        attachment.undo()
        for impl, fn in attachment.wrapped:
            impl.function = fn

    def detach_all(self) -> None:
        """Undo :meth:`attach` on every plugin manager."""
        for pm in list(self._attached.keys()):
            self.detach(pm)

    def observe_comm(self, on: bool) -> None:
        """Subscribe to (or leave) the collectives of the probe's context."""
        if on:
            self.context.add_observer(self)
        else:
            self.context.remove_observer(self)

    def release_if_unused(self) -> None:
        """Detach everything when neither tracing nor the watchdog needs the probe any more."""
        if not self.active:
            self.detach_all()
            self.observe_comm(False)
            self.main_stack.clear()
            self._step_t0 = None

    # -- hooks -----------------------------------------------------------------------------

    def _timed(self, impl: Any, hook_name: str) -> Any:
        fn, plugin, stack_of = impl.function, impl.plugin_name, self._stack

        def timed_impl(*args: Any, **kwargs: Any) -> Any:
            stack = stack_of()
            top = stack[-1] if stack else None
            if kwargs or top is None or top.kind != "hook" or top.name != hook_name:
                return fn(*args, **kwargs)  # called directly, not through the hook
            top.plugin = plugin
            t = _perf()
            try:
                result = fn(*args)
            except BaseException:
                top.impls.append((plugin, t, _perf() - t))
                top.plugin, top.exc_plugin = None, plugin
                raise
            top.impls.append((plugin, t, _perf() - t))
            top.plugin = None
            return result

        timed_impl.__wrapped__ = fn  # type: ignore[attr-defined]
        timed_impl.__name__ = getattr(fn, "__name__", "timed_impl")
        return timed_impl

    def _before(self, hook_name: str, hook_impls: Any, kwargs: Any) -> None:
        engine = kwargs.get("engine")
        if engine is not None and (self._engine is None or self._engine() is not engine):
            self.engine = engine
        stack = self._stack()
        t = _perf()
        if hook_name == "microspeed_before_forward":
            self.training = True
            if self._step_t0 is None:
                self._step_t0 = t
        stack.append(Frame("hook", hook_name, t, len(stack), chain=hook_name in CHAINS))

    def _after(self, outcome: Any, hook_name: str, hook_impls: Any, kwargs: Any) -> None:
        t_end = _perf()
        stack = self._stack()
        frame = None
        while stack:
            f = stack.pop()
            if f.kind == "hook" and f.name == hook_name:
                frame = f
                break
        if frame is None:
            return
        if stack is self.main_stack:
            self.last = (hook_name, t_end)
        tracer = self.tracer
        if tracer is not None:
            tracer.hook(frame, t_end, outcome.exception)
            if hook_name == "microspeed_after_global_step":
                tracer.step(kwargs.get("engine"), self._step_t0 or frame.t0, t_end)
                self._step_t0 = None

    # -- collectives -------------------------------------------------------------------------

    def collective_start(self, call: comm.Collective) -> None:
        """Push the collective; remember the hook (and plugin) it was called from."""
        stack = self._stack()
        for f in reversed(stack):
            if f.kind == "hook":
                call.context = (short_hook_name(f.name), f.plugin)
                break
        stack.append(Frame("collective", call.op, call.t0, len(stack), call=call))
        if self.tracer is not None and not call.async_op:
            self.tracer.collective_begin(call)

    def collective_launched(self, call: comm.Collective) -> None:
        """An asynchronous op was launched: pop it (its ``wait()`` pushes it again)."""
        self._pop_call(call, call.t_launched)
        if self.tracer is not None:
            self.tracer.collective_launch(call)

    def collective_wait(self, call: comm.Collective) -> None:
        """The thread blocks on an asynchronous op's work."""
        stack = self._stack()
        stack.append(Frame("collective", call.op, call.t_wait, len(stack), call=call, waiting=True))

    def collective_end(self, call: comm.Collective, exc: BaseException | None) -> None:
        """Pop the collective and write its event."""
        self._pop_call(call, call.t_end)
        if self.tracer is not None:
            self.tracer.collective(call, exc)

    def _pop_call(self, call: comm.Collective, t_end: int) -> None:
        stack = self._stack()
        if stack and stack[-1].call is call:
            stack.pop()
            if stack is self.main_stack:
                self.last = (call.op, t_end)


def probe_for(context: comm.CommContext | None = None) -> Probe:
    """The probe of ``context`` (default: the current one), made on first use."""
    context = context or comm.current()
    if context.probe is None:
        context.probe = Probe(context)
    return context.probe


probe = probe_for(comm.default_context())
"""The default context's probe: tracing and the watchdog of code outside engines."""


_ENCODER = json.JSONEncoder(default=repr, separators=(",", ":"))


def _encode(event_dict: dict[str, Any], **_: Any) -> str:
    """JSON for one event, with one encoder made once (``json.dumps`` with options makes one per call)."""
    return _ENCODER.encode(event_dict)


class Tracer:
    """Writes trace events as JSON lines to ``<directory>/rank<rank>.jsonl`` through structlog."""

    def __init__(self, directory: str, rank: int | None = None, world_size: int | None = None,
                 probe: Probe | None = None) -> None:
        from microspeed import __version__

        self.probe = probe or globals()["probe"]

        self.directory = os.path.abspath(directory)
        self.rank = comm.get_rank() if rank is None else rank
        self.world_size = comm.get_world_size() if world_size is None else world_size
        os.makedirs(self.directory, exist_ok=True)
        self.path = os.path.join(self.directory, f"rank{self.rank}.jsonl")
        self._file = open(self.path, "w", encoding="utf-8")
        self.log = structlog.wrap_logger(
            structlog.WriteLogger(self._file),
            processors=[structlog.processors.JSONRenderer(serializer=_encode)],
            wrapper_class=structlog.BoundLogger,
            context_class=dict,
        ).bind()  # the bound logger itself, not the lazy proxy that binds again on every call
        self.perf_ns0, self.wall_ns0 = _perf(), time.time_ns()
        self.closed = False
        stats = self.probe.context.stats
        self._bytes_seen = (stats.total_bytes(), stats.total_wire_bytes())
        self.emit("trace_start", self.perf_ns0, world_size=self.world_size, pid=os.getpid(),
                  host=socket.gethostname(), perf_ns0=self.perf_ns0, wall_ns0=self.wall_ns0, version=__version__)

    def emit(self, event: str, t_ns: int, **fields: Any) -> None:
        """Write one event that started at ``t_ns`` (``perf_counter_ns``), with rank and step numbers added."""
        if self.closed:
            return
        engine = self.probe.engine
        self.log.msg(
            event, rank=self.rank,
            step=getattr(engine, "global_steps", None), micro_step=getattr(engine, "micro_steps", None),
            t_ns=t_ns, wall=round((self.wall_ns0 + t_ns - self.perf_ns0) / 1e9, 6), **fields,
        )

    def hook(self, frame: Frame, t_end: int, exc: BaseException | None) -> None:
        """Write a ``hook`` event for a finished hook call (or one implementation of a chain)."""
        t0 = frame.t0
        impls = frame.impls
        fields: dict[str, Any] = {
            "hook": short_hook_name(frame.name), "dur_ns": t_end - t0,
            "plugins": [p for p, _, _ in impls], "plugin_ns": [d for _, _, d in impls],
            "plugin_off_ns": [s - t0 for _, s, _ in impls], "depth": frame.depth,
            "exc": None if exc is None else f"{type(exc).__name__}: {exc}",
        }
        if frame.chain:
            fields["chain"] = True
        if frame.exc_plugin is not None:
            fields["exc_plugin"] = frame.exc_plugin
        self.emit("hook", t0, **fields)

    def collective(self, call: comm.Collective, exc: BaseException | None) -> None:
        """Write a ``collective`` event for a finished (or failed) collective."""
        done = call.t_done or call.t_end
        hook, plugin = call.context or (None, None)
        fields: dict[str, Any] = {
            "op": call.op, "bytes": call.nbytes, "group": call.label, "group_size": call.group_size,
            "seq": call.seq, "async": call.async_op, "dur_ns": done - call.t0, "hook": hook, "plugin": plugin,
            "exc": None if exc is None else f"{type(exc).__name__}: {exc}",
        }
        if call.async_op:
            fields["launch_ns"] = (call.t_launched or call.t_end) - call.t0
            fields["wait_ns"] = call.t_end - call.t_wait if call.t_wait else 0
            fields["wait_off_ns"] = call.t_wait - call.t0 if call.t_wait else None
        self.emit("collective", call.t0, **fields)

    def collective_begin(self, call: comm.Collective) -> None:
        """Write a ``collective_begin`` event: a blocking collective starts (a hang leaves it without its end)."""
        hook, plugin = call.context or (None, None)
        self.emit("collective_begin", call.t0, op=call.op, bytes=call.nbytes, group=call.label,
                  group_size=call.group_size, seq=call.seq, hook=hook, plugin=plugin)

    def collective_launch(self, call: comm.Collective) -> None:
        """Write a ``collective_launch`` event: an asynchronous op returned its work."""
        hook, plugin = call.context or (None, None)
        self.emit("collective_launch", call.t0, op=call.op, bytes=call.nbytes, group=call.label,
                  group_size=call.group_size, seq=call.seq, dur_ns=call.t_launched - call.t0, hook=hook, plugin=plugin)

    def step(self, engine: Any, t0: int, t_end: int) -> None:
        """Write a ``step`` event (the optimizer step that just ended), with the bytes it moved."""
        stats = self.probe.context.stats
        payload, wire = stats.total_bytes(), stats.total_wire_bytes()
        last_payload, last_wire = self._bytes_seen
        if payload < last_payload or wire < last_wire:  # the stats were reset meanwhile
            last_payload = last_wire = 0
        self._bytes_seen = (payload, wire)
        self.emit("step", t0, dur_ns=t_end - t0, samples=getattr(engine, "global_samples", None),
                  skipped=getattr(engine, "skipped_steps", None), comm_bytes=payload - last_payload,
                  wire_bytes=wire - last_wire)

    def flush(self) -> None:
        """Flush the file (events are flushed as written; this is for safety before an exit)."""
        if not self.closed:
            try:
                self._file.flush()
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        """Write a ``trace_end`` event and close the file."""
        if self.closed:
            return
        self.emit("trace_end", _perf())
        self.closed = True
        self._file.close()


def start(directory: str, context: comm.CommContext | None = None) -> Tracer:
    """Turn tracing on for ``context`` (default: the current one), writing under ``directory``.

    Returns the running tracer if it writes there already; starting with another directory closes
    the previous file. Instrument a plugin manager with :func:`instrument`.
    """
    p = probe_for(context)
    current = p.tracer
    if current is not None and not current.closed and current.directory == os.path.abspath(directory):
        return current
    if current is not None:
        current.close()
    p.tracer = Tracer(directory, probe=p)
    p.observe_comm(True)
    return p.tracer


def instrument(pm: Any, context: comm.CommContext | None = None) -> None:
    """Attach the probe of ``context`` (default: the current one) to a plugin manager (tracing or watchdog on)."""
    p = probe_for(context)
    p.attach(pm)
    p.observe_comm(True)


def stop(context: comm.CommContext | None = None) -> None:
    """Turn tracing off for ``context`` (default: the current one); detach everything unless its watchdog needs it."""
    p = probe_for(context)
    tracer, p.tracer = p.tracer, None
    if tracer is not None:
        tracer.close()
    p.release_if_unused()


def active(context: comm.CommContext | None = None) -> Tracer | None:
    """The tracer of ``context`` (default: the current one), or ``None`` when its tracing is off."""
    return probe_for(context).tracer
