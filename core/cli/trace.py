"""``microspeed trace``: read the per-rank trace files (:mod:`microspeed.observe.trace`), summarise, export.

* ``microspeed trace summary DIR`` prints, per rank, each hook's calls, total and mean time, the
  same per plugin within the hook, exceptions, the collectives (calls, bytes, time), steps, the
  last completed event and the collectives that started but never completed (where a hung rank
  waits);
* ``microspeed trace export DIR -o trace.json`` writes a Chrome trace-event file (JSON object
  format) that opens in Perfetto (ui.perfetto.dev) or ``chrome://tracing``: one process per rank
  (``pid`` = rank) with a ``steps`` track, a ``hooks`` track (hooks, the plugins inside them and
  the blocking collectives, nested) and an ``async collectives`` track (launch to completion).
  Ranks are aligned on wall-clock time.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys
from collections.abc import Sequence
from typing import Any


def convert_size(size_bytes: int) -> str:
    """``1536`` -> ``"1.5 KB"``: the comms logger's size format (imported on use; it needs torch)."""
    from microspeed.comm import convert_size as convert

    return convert(size_bytes)


TID_STEPS, TID_HOOKS, TID_ASYNC = 0, 1, 2
_TRACKS = {TID_STEPS: "steps", TID_HOOKS: "hooks", TID_ASYNC: "async collectives"}


def load(directory: str) -> dict[int, list[dict[str, Any]]]:
    """``{rank: [event, ...]}`` from ``DIR/rank<N>.jsonl`` (a truncated last line is skipped)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for path in glob.glob(os.path.join(directory, "rank*.jsonl")):
        match = re.fullmatch(r"rank(\d+)\.jsonl", os.path.basename(path))
        if match is None:
            continue
        events = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut short by a killed process
        out[int(match.group(1))] = events
    return dict(sorted(out.items()))


def summarize(events_by_rank: dict[int, list[dict[str, Any]]]) -> dict[int, dict[str, Any]]:
    """Per rank: ``hooks`` ``{hook: {calls, total_ns, errors, plugins: {plugin: {calls, total_ns}}}}``,
    ``collectives`` ``{(op, group): {calls, bytes, total_ns, wait_ns}}``, ``steps`` (durations, ns)."""
    out: dict[int, dict[str, Any]] = {}
    for rank, events in events_by_rank.items():
        hooks: dict[str, dict[str, Any]] = {}
        colls: dict[tuple[str, str], dict[str, int]] = {}
        steps: list[int] = []
        started: dict[tuple[str, int], dict[str, Any]] = {}
        last: dict[str, Any] | None = None
        for e in events:
            kind = e.get("event")
            if kind in ("hook", "collective", "step") and "wall" in e:
                end = e["wall"] + e.get("dur_ns", 0) / 1e9
                if last is None or end >= last["wall_end"]:
                    last = {"what": _describe(e), "wall_end": end, "step": e.get("step")}
            if kind in ("collective_begin", "collective_launch"):
                started[(e.get("group", "?"), e.get("seq", -1))] = e
            elif kind == "collective":
                started.pop((e.get("group", "?"), e.get("seq", -1)), None)
            if kind == "hook":
                h = hooks.setdefault(e["hook"], {"calls": 0, "total_ns": 0, "errors": 0, "plugins": {}})
                h["calls"] += 1
                h["total_ns"] += e.get("dur_ns", 0)
                h["errors"] += e.get("exc") is not None
                for plugin, ns in zip(e.get("plugins", []), e.get("plugin_ns", []), strict=False):
                    p = h["plugins"].setdefault(plugin, {"calls": 0, "total_ns": 0})
                    p["calls"] += 1
                    p["total_ns"] += ns
            elif kind == "collective":
                c = colls.setdefault((e["op"], e.get("group", "?")), {"calls": 0, "bytes": 0, "total_ns": 0,
                                                                       "wait_ns": 0, "errors": 0})
                c["calls"] += 1
                c["bytes"] += e.get("bytes", 0)
                c["total_ns"] += e.get("dur_ns", 0)
                c["wait_ns"] += e.get("wait_ns", 0) if e.get("async") else e.get("dur_ns", 0)
                c["errors"] += e.get("exc") is not None
            elif kind == "step":
                steps.append(e.get("dur_ns", 0))
        out[rank] = {"hooks": hooks, "collectives": colls, "steps": steps, "last": last,
                     "unfinished": sorted(started.values(), key=lambda e: e.get("t_ns", 0))}
    return out


def _describe(e: dict[str, Any]) -> str:
    """``hook before_step`` / ``all_reduce #12 on world (16 B) [hook before_step, plugin fault]`` / ``step 3``."""
    kind = e.get("event")
    if kind == "hook":
        return f"hook {e.get('hook')}"
    if kind == "step":
        return f"step {e.get('step')}"
    where = ", ".join(x for x in (e.get("hook") and f"hook {e['hook']}", e.get("plugin") and f"plugin {e['plugin']}")
                      if x)
    return (f"{e.get('op')} #{e.get('seq')} on {e.get('group')} ({convert_size(e.get('bytes', 0))})"
            + (f" [{where}]" if where else ""))


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.3f}"


def _us(ns: float) -> str:
    return f"{ns / 1e3:.1f}"


def format_summary(summary: dict[int, dict[str, Any]], directory: str = "") -> str:
    """The text ``microspeed trace summary`` prints."""
    lines = [f"trace {directory}: {len(summary)} rank{'s' if len(summary) != 1 else ''}"]
    ends = [s["last"]["wall_end"] for s in summary.values() if s.get("last")]
    ends += [e["wall"] for s in summary.values() for e in s.get("unfinished", [])]
    trace_end = max(ends, default=0.0)
    for rank, s in summary.items():
        hooks, colls, steps = s["hooks"], s["collectives"], s["steps"]
        n_hook = sum(h["calls"] for h in hooks.values())
        n_coll = sum(c["calls"] for c in colls.values())
        nbytes = sum(c["bytes"] for c in colls.values())
        step_text = f"{len(steps)} steps" + (f" (median {_ms(statistics.median(steps))} ms)" if steps else "")
        lines.append("")
        lines.append(f"rank {rank}: {step_text}, {n_hook} hook calls, {n_coll} collectives ({convert_size(nbytes)})")
        lines.append(f"  {'hook / plugin':<40}{'calls':>8}{'total ms':>12}{'mean us':>12}{'errors':>8}")
        for name, h in sorted(hooks.items(), key=lambda kv: -kv[1]["total_ns"]):
            errors = str(h["errors"]) if h["errors"] else ""
            lines.append(f"  {name:<40}{h['calls']:>8}{_ms(h['total_ns']):>12}{_us(h['total_ns'] / h['calls']):>12}"
                         f"{errors:>8}")
            for plugin, p in sorted(h["plugins"].items(), key=lambda kv: -kv[1]["total_ns"]):
                lines.append(f"    {plugin:<38}{p['calls']:>8}{_ms(p['total_ns']):>12}"
                             f"{_us(p['total_ns'] / p['calls']):>12}")
        if colls:
            lines.append(f"  {'collective':<26}{'group':<14}{'calls':>8}{'bytes':>12}{'total ms':>12}"
                         f"{'mean ms':>10}{'blocked ms':>12}")
            for (op, group), c in sorted(colls.items(), key=lambda kv: -kv[1]["total_ns"]):
                mean_ms = c["total_ns"] / c["calls"] / 1e6
                lines.append(f"  {op:<26}{group:<14}{c['calls']:>8}{convert_size(c['bytes']):>12}"
                             f"{_ms(c['total_ns']):>12}{mean_ms:>10.3f}{_ms(c['wait_ns']):>12}")
        if s["last"] is not None:
            ago = trace_end - s["last"]["wall_end"]
            lines.append(f"  last completed: {s['last']['what']} (step {s['last']['step']}), "
                         f"{ago:.3f} s before the end of the trace")
        for e in s["unfinished"]:
            ago = trace_end - e["wall"]
            lines.append(f"  UNFINISHED: {_describe(e)} at step {e.get('step')}, started {ago:.3f} s before the end "
                         "of the trace (never completed: a hang, or the process was stopped)")
    return "\n".join(lines) + "\n"


def to_chrome(events_by_rank: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """A Chrome trace-event document: ``{"traceEvents": [...], "displayTimeUnit": "ms"}``.

    Complete events (``"ph": "X"``, ``ts``/``dur`` in microseconds) with ``pid`` = rank and the
    tracks of the module docstring as ``tid``; ``process_name`` / ``thread_name`` metadata name
    them; watchdog findings are instant events.
    """
    base = None
    for events in events_by_rank.values():
        for e in events:
            if e.get("event") == "trace_start":
                base = e["wall_ns0"] if base is None else min(base, e["wall_ns0"])
    base = base or 0
    out: list[dict[str, Any]] = []
    for rank, events in events_by_rank.items():
        out.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for tid, name in _TRACKS.items():
            out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid, "args": {"sort_index": tid}})
        offset = 0

        def us(t_ns: int, offset_ns: int) -> float:
            return round((t_ns + offset_ns - base) / 1e3, 3)

        for e in events:
            kind = e.get("event")
            if kind == "trace_start":
                offset = e["wall_ns0"] - e["perf_ns0"]
                continue
            t = e.get("t_ns")
            if t is None:
                continue
            pos = {"step": e.get("step"), "micro_step": e.get("micro_step")}
            if kind == "hook":
                args = {**pos, "plugins": e.get("plugins", [])}
                if e.get("exc"):
                    args["exc"] = e["exc"]
                    args["exc_plugin"] = e.get("exc_plugin")
                if e.get("chain"):
                    args["chain"] = True
                out.append({"ph": "X", "name": e["hook"], "cat": "hook", "ts": us(t, offset),
                            "dur": e["dur_ns"] / 1e3, "pid": rank, "tid": TID_HOOKS, "args": args})
                for plugin, ns, off in zip(e.get("plugins", []), e.get("plugin_ns", []), e.get("plugin_off_ns", []),
                                           strict=False):
                    out.append({"ph": "X", "name": plugin, "cat": "plugin", "ts": us(t + off, offset),
                                "dur": ns / 1e3, "pid": rank, "tid": TID_HOOKS, "args": {"hook": e["hook"], **pos}})
            elif kind == "collective":
                args = {**pos, "bytes": e.get("bytes"), "size": convert_size(e.get("bytes", 0)),
                        "group": e.get("group"), "seq": e.get("seq"), "hook": e.get("hook"), "plugin": e.get("plugin")}
                if e.get("exc"):
                    args["exc"] = e["exc"]
                if e.get("async"):
                    out.append({"ph": "X", "name": e["op"], "cat": "collective", "ts": us(t, offset),
                                "dur": e["dur_ns"] / 1e3, "pid": rank, "tid": TID_ASYNC, "args": args})
                    if e.get("wait_ns") and e.get("wait_off_ns") is not None:
                        out.append({"ph": "X", "name": f"wait {e['op']}", "cat": "collective",
                                    "ts": us(t + e["wait_off_ns"], offset), "dur": e["wait_ns"] / 1e3, "pid": rank,
                                    "tid": TID_HOOKS, "args": args})
                else:
                    out.append({"ph": "X", "name": e["op"], "cat": "collective", "ts": us(t, offset),
                                "dur": e["dur_ns"] / 1e3, "pid": rank, "tid": TID_HOOKS, "args": args})
            elif kind == "collective_begin":
                continue  # drawn from its completion; unfinished ones are added below
            elif kind == "collective_launch":
                out.append({"ph": "X", "name": f"launch {e['op']}", "cat": "collective", "ts": us(t, offset),
                            "dur": e.get("dur_ns", 0) / 1e3, "pid": rank, "tid": TID_HOOKS,
                            "args": {**pos, "bytes": e.get("bytes"), "group": e.get("group"), "seq": e.get("seq")}})
            elif kind == "step":
                out.append({"ph": "X", "name": f"step {e.get('step')}", "cat": "step", "ts": us(t, offset),
                            "dur": e["dur_ns"] / 1e3, "pid": rank, "tid": TID_STEPS,
                            "args": {**pos, "samples": e.get("samples"), "skipped": e.get("skipped")}})
            elif kind == "watchdog":
                out.append({"ph": "i", "s": "p", "name": f"watchdog ({e.get('role')})", "cat": "watchdog",
                            "ts": us(t, offset), "pid": rank, "tid": TID_HOOKS,
                            "args": {k: v for k, v in e.items() if k in ("summary", "stragglers", "state")}})
        for e in summarize({rank: events})[rank]["unfinished"]:
            out.append({"ph": "i", "s": "t", "name": f"UNFINISHED {e['op']} #{e.get('seq')}", "cat": "collective",
                        "ts": us(e["t_ns"], offset), "pid": rank, "tid": TID_HOOKS,
                        "args": {"step": e.get("step"), "group": e.get("group"), "bytes": e.get("bytes"),
                                 "hook": e.get("hook"), "plugin": e.get("plugin")}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def main(argv: Sequence[str] | None = None) -> int:
    """``microspeed trace {summary,export}``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="microspeed trace", description="Summarise or export microspeed traces.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_sum = sub.add_parser("summary", help="per rank: hooks and plugins (calls, total, mean), collectives, steps")
    p_sum.add_argument("directory", help="the trace directory (MICROSPEED_TRACE / trace.output_path)")
    p_exp = sub.add_parser("export", help="write a Chrome/Perfetto trace-event JSON file")
    p_exp.add_argument("directory", help="the trace directory")
    p_exp.add_argument("-o", "--output", default="trace.json", help="output file (default trace.json)")
    opts = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    events = load(opts.directory)
    if not events:
        print(f"microspeed trace: no rank<N>.jsonl files in {opts.directory!r}", file=sys.stderr)
        return 1
    if opts.command == "summary":
        sys.stdout.write(format_summary(summarize(events), opts.directory))
        return 0
    doc = to_chrome(events)
    with open(opts.output, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    n = sum(1 for e in doc["traceEvents"] if e["ph"] != "M")
    print(f"wrote {opts.output}: {n} events from {len(events)} ranks (open it in https://ui.perfetto.dev)")
    return 0
