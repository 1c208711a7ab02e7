"""Hang diagnosis: a per-rank watchdog that turns a hang into a report naming the stragglers.

On by default for multi-rank jobs (:data:`DEFAULT_TIMEOUT_S`, 10 minutes): every rank runs a daemon
thread that watches what the main thread is doing, through the same instrumentation as tracing (its
engine's :class:`~microspeed.observe.trace.Probe`):
the hook call (and the plugin running in it) or the collective of :mod:`microspeed.comm` in
progress, and since when. Code outside hooks and collectives (the model's forward, the user's
loop) is never timed.

When a rank has been in one collective or one hook for more than ``timeout_s`` seconds:

1. it raises an alarm through the c10d store (not through a collective, which would hang too):
   ``<prefix>alarms`` is incremented and ``<prefix>alarm/<n>`` set;
2. every other rank's watchdog thread, which polls for alarms, publishes its own state under
   ``<prefix>state/<n>/<rank>``: what it is in and for how long, its step, how many collectives
   it issued per group, and its main thread's Python stack (``sys._current_frames()``). It also
   writes a ``watchdog`` event to its trace and one line to stderr, and goes on. A rank whose
   process ended published ``<prefix>exited/<rank>`` at exit;
3. the detecting rank waits briefly for the answers, names the stragglers (the ranks that did
   not join the collective the others wait in: those in a hook, outside microspeed, in another
   collective, exited, or silent), prints a one-screen report to stderr, writes the full report
   (every rank's stack) to ``<trace dir>/watchdog_rank<N>.txt`` when tracing is on, and ends the
   process with exit code :data:`EXIT_CODE` (``os._exit``: the main thread is stuck in C++).

The launcher (torchrun) then stops the other ranks. Set ``timeout_s`` above the longest hook of
a healthy step (the ``backward`` hook runs the whole backward pass) and its longest collective.
Ranks that did not answer are named as lost or silent (their process or host is gone, their network
link is cut, or their Python threads are blocked). Every store exchange is bounded: a store behind a
cut link does not keep the report from being printed.

**A lost rank.** When a rank's process dies, the survivors' next collective does not hang: the
transport raises (gloo: ``Connection closed by peer [address]:port``), naming an address. A collective
of :mod:`microspeed.comm` that fails so is shown to the watchdog (:meth:`Watchdog.explain_failure`):
it raises the same alarm, asking ``why`` (``"failed"``), waits at most ``answer_timeout_s`` (its
``gather_s``) for the answers, and the error raised instead is a :class:`microspeed.comm.LostRanksError`
naming the ranks that exited or did not answer, with their last heartbeat.

**Heartbeats.** Each rank's thread also publishes ``<prefix>beat/<rank>`` (a counter, the step, the
time) every ``beat_s``. :meth:`Watchdog.peer_watch` reads them: a rank whose counter has not moved
for ``stale_s`` (or that published ``exited``) is gone. Rank 0 uses it while it waits for the other
ranks to finish writing an asynchronous checkpoint (:mod:`microspeed.checkpoint.saving`).

Changing it: ``"watchdog": {"timeout_s": 120}`` (any world size, one rank included),
``"watchdog": {"enabled": false}`` (off), ``"watchdog": {"answer_timeout_s": 2}`` (how long a rank waits
for the others' answers), or the environment variable ``MICROSPEED_WATCHDOG_TIMEOUT``
(seconds; ``0`` or ``off``: off), which wins over the config. The same timeout bounds how long
``initialize()``'s rank agreement waits for a rank that never comes (:func:`microspeed.comm.wait_for_ranks`).
Each engine has its own watchdog (its context's ``watchdog``), stopped when the engine is collected.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import re
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from microspeed import comm
from microspeed.observe import trace

DEFAULT_TIMEOUT_S = 600.0
"""The default timeout: torch's own for NCCL collectives (``default_pg_nccl_timeout``), so no healthy job
that runs on NCCL today is stopped, while a hang on gloo (30 minutes) or in a hook ends three times sooner,
with a report naming the stragglers. Long single operations (checkpoint writes of very large models, a first
JIT compile on one rank) fit in it; set it higher for jobs with longer ones."""

ENV_VAR = "MICROSPEED_WATCHDOG_TIMEOUT"
"""Environment variable: the timeout in seconds (wins over the config); ``0``/``off``/``false``: off."""

EXIT_CODE = 86
"""Exit code of a rank that the watchdog stopped."""

STORE_PREFIX = "microspeed/watchdog/"
"""Prefix of the watchdog's keys in the c10d store."""

_PEER_LOSS = re.compile(r"peer|connection|broken pipe|socket|timed out|timeout|abort|remote (worker|process)|"
                        r"ECONNRESET|EPIPE|ENOTCONN", re.IGNORECASE)  # the transports' words for a lost peer
_SCREEN_FRAMES = 6  # innermost frames shown per straggler on screen
_SCREEN_STRAGGLER_STACKS = 4  # stragglers whose frames are shown on screen


@dataclass
class RankState:
    """Where one rank is, as its watchdog saw it.

    ``kind`` is ``"collective"`` (in ``name`` = the op, ``seq``-th on ``group``), ``"hook"`` (in
    hook ``name``, implementation of ``plugin`` running), ``"idle"`` (outside hooks and
    collectives; ``last`` is what it finished last, ``seconds`` ago), ``"exited"`` (the process
    ended) or ``"no answer"``. ``seconds`` is the time in the current activity; ``launched_s``
    the time since an asynchronous collective was launched. ``hook``/``plugin`` of a collective
    say where it was called from. ``counts`` are the collectives issued per group label.
    """

    rank: int
    kind: str
    name: str = ""
    seconds: float = 0.0
    hook: str | None = None
    plugin: str | None = None
    nbytes: int = 0
    group: str = ""
    group_ranks: list[int] = field(default_factory=list)
    seq: int = 0
    launched_s: float | None = None
    counts: dict[str, int] = field(default_factory=dict)
    step: int | None = None
    micro_step: int | None = None
    last: str = ""
    stack: str = ""

    def where(self) -> str:
        """One phrase: ``in all_reduce #7 on world (16 B) for 3.0 s [hook before_step, plugin fault]``."""
        if self.kind == "collective":
            size = comm.convert_size(self.nbytes)
            text = f"in {self.name} #{self.seq} on {self.group} ({size}) for {self.seconds:.1f} s"
            if self.launched_s is not None:
                text += f" (waiting; launched {self.launched_s:.1f} s ago)"
            context = ", ".join(x for x in (self.hook and f"hook {self.hook}", self.plugin and f"plugin {self.plugin}")
                                if x)
            return text + (f" [{context}]" if context else "")
        if self.kind == "hook":
            return f"in hook {self.name}" + (f" (plugin {self.plugin})" if self.plugin else "") + \
                f" for {self.seconds:.1f} s"
        if self.kind == "idle":
            last = f"; last finished: {self.last}" if self.last else ""
            return f"outside hooks and collectives (idle or finished) for {self.seconds:.1f} s{last}"
        if self.kind == "exited":
            return "exited (its process ended)"
        return "lost or silent: did not answer (its process or host is gone, its link is cut, or its Python " \
               "threads are blocked)"

    def position(self) -> str:
        """``step 3 (micro 6)`` or ``""``."""
        if self.step is None:
            return ""
        return f"step {self.step}" + (f" (micro {self.micro_step})" if self.micro_step is not None else "")

    def to_json(self) -> str:
        """JSON text (what goes through the store)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> RankState:
        """Parse :meth:`to_json`'s output (unknown keys ignored)."""
        data = json.loads(text)
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def env_timeout() -> float | None:
    """The timeout :data:`ENV_VAR` sets: seconds, ``0.0`` for off, ``None`` when unset.

    Raises ``ValueError`` naming the variable for anything else.
    """
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value == "":
        return None
    if value in ("0", "off", "false", "no"):
        return 0.0
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{ENV_VAR}={value!r}: expected a number of seconds, or 0/off to turn the watchdog off") \
            from None
    if seconds < 0:
        raise ValueError(f"{ENV_VAR}={value!r}: expected a positive number of seconds, or 0/off")
    return seconds


def resolve_timeout(enabled: bool = True, timeout_s: float | None = None, world_size: int = 1) -> float | None:
    """The timeout the watchdog runs with, or ``None`` (off).

    :data:`ENV_VAR` wins; else off when ``enabled`` is false; else ``timeout_s`` when given (any world
    size); else :data:`DEFAULT_TIMEOUT_S` when there is more than one rank (one rank cannot wait for another).
    """
    env = env_timeout()
    if env is not None:
        return env or None
    if not enabled:
        return None
    if timeout_s is not None:
        return float(timeout_s)
    return DEFAULT_TIMEOUT_S if world_size > 1 else None


# --------------------------------------------------------------------------------------------
# Capturing and judging states
# --------------------------------------------------------------------------------------------


def _filtered_stack(frame: Any) -> str:
    """The Python stack ending at ``frame``, without pluggy's and the probe's own frames."""
    if frame is None:
        return ""
    skip = (os.path.dirname(__import__("pluggy").__file__), trace.__file__, os.path.dirname(comm.__file__))
    entries = [e for e in traceback.format_stack(frame) if not any(s in e for s in skip)]
    return "".join(entries[-40:])


def capture(rank: int | None = None, probe: trace.Probe | None = None, now_ns: int | None = None) -> RankState:
    """The state of this process's main thread now (what the watchdog publishes)."""
    probe = probe or trace.probe_for()
    rank = comm.get_rank() if rank is None else rank
    now = time.perf_counter_ns() if now_ns is None else now_ns
    stack = list(probe.main_stack)
    if stack and stack[-1].kind == "collective":
        top = stack[-1]
        call = top.call
        hook, plugin = call.context or (None, None)
        state = RankState(rank, "collective", call.op, (now - top.t0) / 1e9, hook=hook, plugin=plugin,
                          nbytes=call.nbytes, group=call.label, group_ranks=comm.group_label(call.group)[1],
                          seq=call.seq, launched_s=(now - call.t0) / 1e9 if top.waiting else None)
    elif stack:
        top = stack[-1]
        state = RankState(rank, "hook", trace.short_hook_name(top.name), (now - top.t0) / 1e9, plugin=top.plugin)
    else:
        last = probe.last
        state = RankState(rank, "idle", seconds=(now - last[1]) / 1e9 if last else 0.0,
                          last=trace.short_hook_name(last[0]) if last else "")
    engine = probe.engine
    state.step = getattr(engine, "global_steps", None)
    state.micro_step = getattr(engine, "micro_steps", None)
    state.counts = comm.collective_counts(probe.context)
    main = threading.main_thread().ident
    state.stack = _filtered_stack(sys._current_frames().get(main))
    return state


def _signature(s: RankState) -> tuple[Any, ...]:
    return (s.name, s.seq, s.group, s.hook, s.plugin, s.nbytes)


def find_stragglers(states: list[RankState]) -> tuple[list[tuple[int, str]], str]:
    """``([(rank, why), ...], summary)``: the ranks holding the others up, and what the others wait in.

    The reference is the collective most waiting ranks are in (ties: the one waited in longest).
    A rank of that collective's group is a straggler when it is not in that same call: in a hook,
    idle, in another collective, exited or silent. With nobody waiting in a collective, the ranks
    stuck in hooks are the stragglers.
    """
    waiting = [s for s in states if s.kind == "collective"]
    if not waiting:
        hooked = sorted((s for s in states if s.kind == "hook"), key=lambda s: -s.seconds)
        if hooked:
            return ([(s.rank, f"stuck in hook {s.name}" + (f" (plugin {s.plugin})" if s.plugin else "")
                      + f" for {s.seconds:.1f} s") for s in hooked], "no rank is in a collective")
        return [], "no rank is in a hook or a collective"
    by_sig: dict[tuple[Any, ...], list[RankState]] = {}
    for s in waiting:
        by_sig.setdefault(_signature(s), []).append(s)
    ref_sig, ref_ranks = max(by_sig.items(), key=lambda kv: (len(kv[1]), max(s.seconds for s in kv[1])))
    ref = max(ref_ranks, key=lambda s: s.seconds)
    members = set(ref.group_ranks) if ref.group_ranks else {s.rank for s in states}
    what = f"{ref.name} #{ref.seq} on {ref.group}"
    out: list[tuple[int, str]] = []
    for s in sorted(states, key=lambda s: s.rank):
        if s.rank not in members or (s.kind == "collective" and _signature(s) == ref_sig):
            continue
        issued = s.counts.get(ref.group)
        issued_text = f"; it issued {issued} collectives on {ref.group}" if issued is not None else ""
        if s.kind == "collective" and s.group == ref.group and s.seq == ref.seq:
            why = f"in {s.name} #{s.seq} from {s.hook or '?'} / {s.plugin or '?'}: mismatched with {what}"
        elif s.kind == "collective":
            why = f"in {s.name} #{s.seq} on {s.group}, not in {what}"
        elif s.kind == "hook":
            why = f"in hook {s.name}" + (f" (plugin {s.plugin})" if s.plugin else "") + f", has not reached {what}"
        elif s.kind == "idle":
            why = f"outside hooks and collectives, did not join {what}{issued_text}"
        elif s.kind == "exited":
            why = f"exited without joining {what}"
        else:
            why = f"lost or silent (did not answer); not known to be in {what}"
        out.append((s.rank, why))
    summary = f"{_ranks_text([s.rank for s in ref_ranks])} wait in {what}"
    if not out:
        summary += ": every rank of the group is in it (none missing: a slow or broken transport, " \
                   "or a rank calling torch.distributed directly)"
    return out, summary


def _ranks_text(ranks: list[int]) -> str:
    """``[0, 1, 2, 5] -> "ranks 0-2,5"``; ``[3] -> "rank 3"``."""
    ranks = sorted(set(ranks))
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    parts, start, prev = [], None, None
    for r in ranks + [None]:
        if start is None:
            start = prev = r
        elif r is not None and r == prev + 1:
            prev = r
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = r
    return "ranks " + ",".join(parts)


def format_report(states: list[RankState], detector: int, timeout_s: float, full: bool = False,
                  report_path: str | None = None, answer_s: float | None = None, note: str = "") -> str:
    """The watchdog's report: one screen (``full=False``) or with every rank's stack.

    Lists what each rank is in (ranks in the same place share a line), names the stragglers, the
    ranks lost or silent (no answer within ``answer_s``) and shows where they are (innermost frames).
    ``note`` is one more line (why the exchange could not finish, for one).
    """
    states = sorted(states, key=lambda s: s.rank)
    me = next((s for s in states if s.rank == detector), None)
    stragglers, summary = find_stragglers(states)
    bar = "=" * 100
    lines = [bar, f"microspeed watchdog: rank {detector} "
                  + (f"has been {me.where()}" if me is not None else "detected a hang")
                  + f" (timeout_s={timeout_s:g}); stopping the job"]
    groups: dict[str, list[RankState]] = {}
    for s in states:
        key = s.where() if s.kind not in ("collective", "hook", "idle") else \
            f"{s.kind}|{_signature(s)}|{s.name}|{s.plugin}|{s.position()}"
        groups.setdefault(key, []).append(s)
    for members in groups.values():
        first = members[0]
        span = [m.seconds for m in members]
        where = first.where()
        if len(members) > 1 and first.kind in ("collective", "hook", "idle"):
            where = where.replace(f"for {first.seconds:.1f} s", f"for {min(span):.1f}-{max(span):.1f} s")
        pos = first.position()
        lines.append(f"  {_ranks_text([m.rank for m in members]):<12} {pos + ': ' if pos else ''}{where}")
    lines.append(summary)
    if stragglers:
        names = _ranks_text([r for r, _ in stragglers])
        lines.append(f"straggler{'s' if len(stragglers) > 1 else ''}: {names}")
        for rank, why in stragglers[:16]:
            lines.append(f"  rank {rank}: {why}")
        if len(stragglers) > 16:
            lines.append(f"  ... and {len(stragglers) - 16} more")
    else:
        lines.append("stragglers: none identified")
    silent = [s.rank for s in states if s.kind == "no answer"]
    if silent:
        within = f" within {answer_s:g} s" if answer_s else ""
        lines.append(f"lost or silent: {_ranks_text(silent)} did not answer{within} (process or host gone, "
                     "network link cut, or Python threads blocked)")
    if note:
        lines.append(note)
    by_rank = {s.rank: s for s in states}
    shown = [r for r, _ in stragglers if by_rank[r].stack][:_SCREEN_STRAGGLER_STACKS]
    if not shown and me is not None and me.stack:
        shown = [detector]
    for rank in shown:
        frames = _frames(by_rank[rank].stack)
        lines.append(f"where rank {rank} is (innermost frames):")
        lines.extend("  " + line for f in frames[-_SCREEN_FRAMES:] for line in f.rstrip("\n").splitlines())
    if report_path:
        lines.append(f"full report with every rank's stack: {report_path}")
    if full:
        for s in states:
            lines.append(f"--- rank {s.rank}: {s.position()} {s.where()}")
            lines.append(s.stack.rstrip("\n") if s.stack else "  (no stack)")
    lines.append(bar)
    return "\n".join(lines) + "\n"


def _frames(stack_text: str) -> list[str]:
    """Split ``traceback.format_stack`` text back into one entry per frame."""
    entries: list[str] = []
    for line in stack_text.splitlines(keepends=True):
        if line.startswith("  File ") or not entries:
            entries.append(line)
        else:
            entries[-1] += line
    return entries


# --------------------------------------------------------------------------------------------
# The watchdog
# --------------------------------------------------------------------------------------------


class Watchdog:
    """The per-rank watchdog thread (see the module docstring).

    ``store`` is a c10d store client the thread may use (``None``: one rank, or no exchange);
    ``on_timeout(report)`` is called once with the one-screen report when this rank detects a
    hang (default: flush, ``os._exit(EXIT_CODE)``). ``poll_s`` is how often the thread looks at the
    main thread and for alarms; ``gather_s`` how long a rank waits for the others' answers (a hang
    report, a failed collective; the config's ``answer_timeout_s``); ``beat_s`` how often it publishes
    its heartbeat.
    """

    def __init__(self, timeout_s: float, *, rank: int | None = None, world_size: int | None = None,
                 store: Any = None, on_timeout: Callable[[str], None] | None = None, poll_s: float | None = None,
                 gather_s: float | None = None, probe: trace.Probe | None = None,
                 beat_s: float | None = None) -> None:
        self.timeout_s = float(timeout_s)
        self.rank = comm.get_rank() if rank is None else rank
        self.world_size = comm.get_world_size() if world_size is None else world_size
        self.store = store
        self.on_timeout = on_timeout or _exit_process
        self.poll_s = poll_s if poll_s is not None else max(0.05, min(0.5, self.timeout_s / 5))
        self.gather_s = gather_s if gather_s is not None else max(1.0, min(5.0, 4 * self.poll_s + 0.5))
        self.beat_s = beat_s if beat_s is not None else max(self.poll_s, 0.5)
        self._probe = weakref.ref(probe or trace.probe_for())  # its context owns the probe: no cycle through us
        self.report: str | None = None
        self._next_alarm = 1
        self._beats = 0
        self._next_beat = 0.0
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._errors = 0
        self.address = route_address()
        self.addresses: dict[int, str] = {}  # rank -> its address (from the heartbeats, read once all are there)

    @property
    def probe(self) -> trace.Probe:
        """The probe watched (the default context's once the engine's is gone)."""
        return self._probe() or trace.probe

    # -- life cycle ---------------------------------------------------------------------------

    def start(self) -> Watchdog:
        """Publish a first heartbeat, start the thread (and publish ``exited`` at interpreter exit)."""
        if self.store is not None:
            try:  # alarms of an earlier watchdog on this store are not ours to answer
                self._next_alarm = int(self.store.add(STORE_PREFIX + "alarms", 0)) + 1
                self.beat()  # here, not on the thread: peers see this rank from its start on
            except Exception:
                pass
        self._thread = threading.Thread(target=self._run, name="microspeed-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self.publish_exit)
        return self

    def stop(self) -> None:
        """Stop the thread."""
        self._stopped.set()
        atexit.unregister(self.publish_exit)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(1.0, 2 * self.poll_s))

    def _run(self) -> None:
        while True:
            try:
                self.beat()  # every beat_s
            except Exception as exc:
                self._say_once(exc)
            if self._stopped.wait(self.poll_s):
                return
            if self._probe() is None:  # its engine is gone
                self._stopped.set()
                return
            try:
                state = self.overdue()
                if state is not None:
                    self.fire(state)
                    return
                self.answer_alarms()
            except Exception as exc:  # a broken store must not kill training; say it once
                self._say_once(exc)

    def _say_once(self, exc: BaseException) -> None:
        self._errors += 1
        if self._errors == 1:
            print(f"microspeed watchdog (rank {self.rank}): {type(exc).__name__}: {exc}", file=sys.stderr)

    def beat(self) -> None:
        """Publish this rank's heartbeat (``beat/<rank>``: a counter, its step, the time) if ``beat_s`` passed."""
        now = time.monotonic()
        if self.store is None or now < self._next_beat:
            return
        self._next_beat = now + self.beat_s
        self._beats += 1
        engine = self.probe.engine
        payload = json.dumps({"n": self._beats, "step": getattr(engine, "global_steps", None), "wall": time.time(),
                              "addr": self.address})
        with self._lock:
            self.store.set(STORE_PREFIX + f"beat/{self.rank}", payload)
            if not self.addresses and self.world_size > 1:
                self._learn_addresses()

    def _learn_addresses(self) -> None:
        """Remember every rank's address once every rank has published a heartbeat (one read of them all), so a
        failure that also takes the store away can still be mapped from the peer's address to its ranks."""
        keys = [STORE_PREFIX + f"beat/{r}" for r in range(self.world_size)]
        if not self.store.check(keys):
            return
        for r, raw in enumerate(self.store.multi_get(keys)):
            try:
                addr = json.loads(raw).get("addr")
            except (ValueError, AttributeError):
                addr = None
            if addr:
                self.addresses[r] = addr

    # -- detecting ------------------------------------------------------------------------------

    def overdue(self) -> RankState | None:
        """This rank's state if its main thread has been in one hook or collective past the timeout."""
        top = self.probe.main_stack[-1:]
        if not top or (top[0].kind == "hook" and not self.probe.training):
            return None  # set-up hooks (optimizer builds, JIT compiles, checkpoint loads) may take long
        if (time.perf_counter_ns() - top[0].t0) / 1e9 <= self.timeout_s:
            return None
        return capture(self.rank, self.probe)

    def fire(self, state: RankState) -> str:
        """Raise the alarm, gather every rank's state, report, then call ``on_timeout``."""
        states = {self.rank: state}
        note = ""
        if self.store is not None and self.world_size > 1:
            got, error = self.ask(state.where(), "hang")
            states.update(got)
            if error is not None:
                note = f"the c10d store: {error} (the ranks that did answer are shown)"
        for r in range(self.world_size):
            states.setdefault(r, RankState(r, "no answer"))
        tracer = self.probe.tracer
        path = os.path.join(tracer.directory, f"watchdog_rank{self.rank}.txt") if tracer is not None else None
        ordered = [states[r] for r in sorted(states)]
        self.report = format_report(ordered, self.rank, self.timeout_s, report_path=path, answer_s=self.gather_s,
                                    note=note)
        if path is not None:
            try:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(format_report(ordered, self.rank, self.timeout_s, full=True, answer_s=self.gather_s,
                                          note=note))
            except OSError:
                pass
        if tracer is not None:
            stragglers, summary = find_stragglers(ordered)
            tracer.emit("watchdog", time.perf_counter_ns(), role="detector", state=asdict(state),
                        stragglers=[r for r, _ in stragglers], summary=summary, timeout_s=self.timeout_s)
            tracer.flush()
        self.on_timeout(self.report)
        return self.report

    def ask(self, where: str, why: str) -> tuple[dict[int, RankState], str | None]:
        """Raise an alarm (``where`` this rank is, ``why``: ``"hang"`` or ``"failed"``) and collect the answers.

        Returns ``({rank: state}, error)``: the states of the other ranks that answered (or had published
        ``exited``) within ``gather_s``, and ``None``, or the reason the exchange stopped (the store raised,
        or did not answer: a store behind a cut link blocks until its own timeout, so the exchange runs on a
        helper thread that is waited for ``gather_s`` + 1 s at most).
        """
        got: dict[int, RankState] = {}
        _, error = _bounded(lambda: self._gather(where, why, got), self.gather_s + 1.0)
        return dict(got), None if error is None else f"{error} (its host may be lost too)"

    def _gather(self, where: str, why: str, got: dict[int, RankState]) -> None:
        store = self.store
        with self._lock:
            n = int(store.add(STORE_PREFIX + "alarms", 1))
            store.set(STORE_PREFIX + f"alarm/{n}", json.dumps({"rank": self.rank, "where": where, "why": why}))
        # _next_alarm stays: another rank's alarm raised just before this one (its collective failed too) still
        # needs this rank's answer; answer_alarms passes over this rank's own
        deadline = time.monotonic() + self.gather_s
        pending = [r for r in range(self.world_size) if r != self.rank]
        while pending and time.monotonic() < deadline:
            for r in list(pending):
                with self._lock:
                    key = STORE_PREFIX + f"state/{n}/{r}"
                    if store.check([key]):
                        got[r] = RankState.from_json(store.get(key))
                    elif store.check([STORE_PREFIX + f"exited/{r}"]):
                        got[r] = RankState.from_json(store.get(STORE_PREFIX + f"exited/{r}"))
                if r in got:
                    pending.remove(r)
            if pending:
                self.answer_alarms()  # another rank may be asking too
                time.sleep(0.05)

    # -- a failed collective ---------------------------------------------------------------------

    def explain_failure(self, call: comm.Collective, exc: BaseException) -> comm.LostRanksError | None:
        """A :class:`~microspeed.comm.LostRanksError` naming the ranks that are gone, for a collective that failed.

        ``exc`` must be a transport error about a peer (connection closed or reset, broken pipe, a
        timeout); the other ranks are asked (:meth:`ask`, at most ``gather_s`` + 1 s). ``None`` (raise
        ``exc`` as it is) for another error, on one rank, or when every rank answered.
        """
        if self.store is None or self.world_size <= 1 or isinstance(exc, comm.LostRanksError) \
                or not isinstance(exc, RuntimeError) or not _PEER_LOSS.search(str(exc)):
            return None
        what = f"collective {call.op} (group {call.label}, seq {call.seq})"
        failed_at = time.time()
        first_line = (str(exc).strip().splitlines() or [""])[0]
        got, error = self.ask(f"its {call.op} #{call.seq} on {call.label} failed: {first_line[:200]}", "failed")
        head = f"microspeed: {what} failed on rank {self.rank}"
        if error is not None and not got:
            suspects = self.ranks_at_peer(str(exc))
            if suspects:
                peer, ranks = suspects
                verb = "is" if len(ranks) == 1 else "are"
                return comm.LostRanksError(
                    f"{head}: {_ranks_text(ranks)} (at {peer}, the failed connection's peer) {verb} lost, presumably "
                    f"with their host: the c10d store did not answer either ({error}). Original error: {exc}",
                    ranks, [])
            return comm.LostRanksError(
                f"{head}; which ranks are lost is unknown: the c10d store {error}. Original error: {exc}", [], [])
        lost = [r for r in range(self.world_size) if r != self.rank and got.get(r, RankState(r, "no answer")).kind
                in ("no answer", "exited")]
        if not lost:
            return None
        answered = sorted(r for r in got if r not in lost) + [self.rank]
        details = []
        for r in lost:
            state = got.get(r)
            why = (f"exited at step {state.step}" if state is not None and state.step is not None else "exited") \
                if state is not None else f"no answer within {self.gather_s:g} s"
            details.append(f"rank {r}: {why}; {self.last_seen(r, failed_at)}")
        verb = "is" if len(lost) == 1 else "are"
        message = (f"{head}: {_ranks_text(lost)} {verb} lost ({'; '.join(details)}); "
                   f"{_ranks_text(answered)} answered. Original error: {exc}")
        return comm.LostRanksError(message, lost, sorted(answered))

    def ranks_at_peer(self, message: str) -> tuple[str, list[int]] | None:
        """``(address, ranks)``: the ranks (other than this one's host's) at the peer address a transport error
        names (gloo: ``[10.0.0.2]:41234``), from the addresses learnt from the heartbeats; ``None`` when the
        address is unknown, or is this rank's own (all ranks on one machine: it tells nothing)."""
        for peer in _PEER_ADDR.findall(message):
            if peer == self.address:
                continue
            ranks = sorted(r for r, a in self.addresses.items() if a == peer and r != self.rank)
            if ranks:
                return peer, ranks
        return None

    def last_seen(self, rank: int, at: float | None = None) -> str:
        """``last seen 1.2 s ago (heartbeat at step 7)`` from ``rank``'s heartbeat (the hosts' clocks), or why not.

        With ``at`` (a ``time.time()``): ``last seen 0.3 s before the failure`` (``at`` is when it failed).
        """
        text, _ = _bounded(lambda: self._read(STORE_PREFIX + f"beat/{rank}"), max(1.0, self.gather_s))
        if not text:
            return "no heartbeat seen"
        try:
            beat = json.loads(text)
            ago = max(0.0, (time.time() if at is None else at) - float(beat["wall"]))
        except (ValueError, KeyError, TypeError):
            return "no heartbeat seen"
        step = beat.get("step")
        return f"last seen {ago:.1f} s {'ago' if at is None else 'before the failure'}" + \
            (f" (heartbeat at step {step})" if step is not None else "")

    def _read(self, key: str) -> bytes | None:
        with self._lock:
            return self.store.get(key) if self.store.check([key]) else None

    def peer_watch(self, stale_s: float | None = None) -> PeerWatch:
        """A :class:`PeerWatch` over this watchdog's store (``stale_s``: default ``max(3, 2 gather_s, 4 beat_s)``)."""
        return PeerWatch(self, stale_s if stale_s is not None else max(3.0, 2 * self.gather_s, 4 * self.beat_s))

    # -- answering -------------------------------------------------------------------------------

    def answer_alarms(self) -> None:
        """Publish this rank's state for every alarm raised since the last look."""
        store = self.store
        if store is None:
            return
        while True:
            with self._lock:  # claimed under the lock: the thread and an asking main thread answer each once
                n = self._next_alarm
                key = STORE_PREFIX + f"alarm/{n}"
                if not store.check([key]):
                    return
                alarm = json.loads(store.get(key))
                self._next_alarm = n + 1
            if alarm.get("rank") == self.rank:
                continue
            state = capture(self.rank, self.probe)
            with self._lock:
                store.set(STORE_PREFIX + f"state/{n}/{self.rank}", state.to_json())
            asked = "reported a hang" if alarm.get("why", "hang") == "hang" else "asks which ranks are alive"
            print(f"microspeed watchdog: rank {alarm.get('rank')} {asked} ({alarm.get('where')}); "
                  f"rank {self.rank} is {state.where()}", file=sys.stderr, flush=True)
            tracer = self.probe.tracer
            if tracer is not None:
                tracer.emit("watchdog", time.perf_counter_ns(), role="answer", alarm_from=alarm.get("rank"),
                            state=asdict(state))

    def publish_exit(self) -> None:
        """Tell the store this rank's process is ending (an ``exited`` state; called at exit).

        The thread is joined first: a daemon thread still inside a store call when the interpreter
        finalises is ended by ``pthread_exit`` through pybind's GIL guard, which aborts the process
        (``terminate called without an active exception``) after training succeeded.
        """
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(1.0, 2 * self.poll_s))
        if self.store is None:
            return
        state = RankState(self.rank, "exited")
        engine = self.probe.engine
        state.step = getattr(engine, "global_steps", None)
        state.micro_step = getattr(engine, "micro_steps", None)
        state.counts = comm.collective_counts(self.probe.context)
        try:
            if self._lock.acquire(timeout=1.0):
                try:
                    self.store.set(STORE_PREFIX + f"exited/{self.rank}", state.to_json())
                finally:
                    self._lock.release()
        except Exception:
            pass


class PeerWatch:
    """Which ranks are gone, from the store: those that published ``exited``, and those whose heartbeat
    counter has not moved for ``stale_s`` seconds of this watch (made by :meth:`Watchdog.peer_watch`).

    Keep one watch for the whole wait: a rank is judged on what this watch saw change.
    """

    def __init__(self, watchdog: Watchdog, stale_s: float) -> None:
        self.watchdog = watchdog
        self.stale_s = float(stale_s)
        self._seen: dict[int, tuple[bytes | None, float]] = {}  # rank -> (its last heartbeat, when it changed)

    def lost(self, ranks: list[int]) -> dict[int, str]:
        """``{rank: why}`` for the ranks of ``ranks`` that are gone now (empty: all alive, as far as one can tell).

        Raises ``ConnectionError`` when the store raised or did not answer within the watchdog's
        ``gather_s`` + 1 s (its host may be gone too: nobody can tell).
        """
        wd = self.watchdog
        if wd.store is None:
            return {}
        found, error = _bounded(lambda: self._scan(ranks), wd.gather_s + 1.0)
        if error is not None:
            raise ConnectionError(f"the c10d store {error}; the ranks' liveness cannot be read")
        return found

    def _scan(self, ranks: list[int]) -> dict[int, str]:
        wd, now, out = self.watchdog, time.monotonic(), {}
        for r in ranks:
            exited = wd._read(STORE_PREFIX + f"exited/{r}")
            if exited is not None:
                step = RankState.from_json(exited).step
                out[r] = "exited (its process ended" + (f" at step {step})" if step is not None else ")")
                continue
            beat = wd._read(STORE_PREFIX + f"beat/{r}")
            seen = self._seen.get(r)
            if seen is None or seen[0] != beat:
                self._seen[r] = (beat, now)
            elif now - seen[1] > self.stale_s:
                out[r] = (f"no heartbeat for {now - seen[1]:.1f} s (its process or host is gone, or its link "
                          f"is cut); {wd.last_seen(r)}")
        return out


def _bounded(fn: Callable[[], Any], seconds: float) -> tuple[Any, str | None]:
    """``(fn(), None)``, run on a helper thread waited for ``seconds`` at most; else ``(None, why)``.

    A c10d store whose host is gone behind a cut link blocks a call until the store's own timeout
    (minutes); the helper thread is left to it (a daemon) and the caller goes on.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    helper = threading.Thread(target=run, name="microspeed-watchdog-store", daemon=True)
    helper.start()
    helper.join(seconds)
    if helper.is_alive():
        return None, f"did not answer within {seconds:g} s"
    if "error" in box:
        return None, f"raised {type(box['error']).__name__}: {box['error']}"
    return box.get("result"), None


_PEER_ADDR = re.compile(r"\[([0-9A-Fa-f:.]+)\]:\d+")  # gloo's "Connection closed by peer [10.0.0.2]:41234"


def route_address() -> str | None:
    """This rank's address on the route to the job's store (``MASTER_ADDR``; see
    :func:`microspeed.netaddr.source_address`): in a multi-machine job, the address its peers' errors name. ``None``
    when ``MASTER_ADDR`` is unset or unroutable."""
    from microspeed.netaddr import source_address

    host = os.environ.get("MASTER_ADDR")
    port = os.environ.get("MASTER_PORT") or "9"
    return source_address(host, int(port)) if host and port.isdigit() else None


def _exit_process(report: str) -> None:
    """Print the report, flush, and end the process (the main thread is stuck in C++)."""
    try:
        sys.stderr.write(report)
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(EXIT_CODE)


def _make_store(world_size: int, timeout_s: float) -> Any:
    """A store client of the watchdog's own (a clone of the default group's store), or ``None``."""
    if world_size <= 1:
        return None
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return None
    base = c10d._get_default_store()
    try:
        store = base.clone()  # its own connection: a blocked main thread does not hold it
    except Exception:
        store = base
    try:
        store.set_timeout(datetime.timedelta(seconds=max(10.0, 2 * timeout_s)))
    except Exception:
        pass
    return store


def start(timeout_s: float, context: comm.CommContext | None = None, **kwargs: Any) -> Watchdog:
    """Start the watchdog of ``context`` (default: the current one), or set its running one's timeout (and
    ``gather_s``, when given).

    Marks the context's probe as needed; the caller instruments its plugin manager with
    :func:`microspeed.observe.trace.instrument`. The thread stops when the context is collected.
    """
    context = context or comm.current()
    running = context.watchdog
    if running is not None and not running._stopped.is_set():
        running.timeout_s = float(timeout_s)
        if kwargs.get("gather_s") is not None:
            running.gather_s = float(kwargs["gather_s"])
        return running
    probe = trace.probe_for(context)
    probe.watching = True
    probe.observe_comm(True)
    world = comm.get_world_size()
    kwargs.setdefault("store", _make_store(world, timeout_s))
    wd = context.watchdog = Watchdog(timeout_s, world_size=world, probe=probe, **kwargs).start()
    weakref.finalize(context, wd._stopped.set)
    return wd


def stop(context: comm.CommContext | None = None) -> None:
    """Stop the watchdog of ``context`` (default: the current one); detach its probe unless tracing needs it."""
    context = context or comm.current()
    if context.watchdog is not None:
        context.watchdog.stop()
        context.watchdog = None
    probe = trace.probe_for(context)
    probe.watching = False
    probe.release_if_unused()


def current(context: comm.CommContext | None = None) -> Watchdog | None:
    """The running watchdog of ``context`` (default: the current one), or ``None``."""
    wd = (context or comm.current()).watchdog
    return wd if wd is not None and not wd._stopped.is_set() else None
