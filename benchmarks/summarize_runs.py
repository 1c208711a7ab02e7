"""Median of several benchmark runs: read the ``--json-out`` files of repeated runs, print one summary.

    python benchmarks/summarize_runs.py run1.json run2.json run3.json

Works for both ``bench_data_parallel.py`` and ``bench_hook_overhead.py`` results (not mixed in one
call). For every key metric it prints each run's value and the median over the runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from typing import Any


def load(paths: list[str]) -> list[dict[str, Any]]:
    """The JSON results in ``paths`` (one object per file; a ``BENCH_JSON`` prefix is accepted)."""
    out = []
    for path in paths:
        with open(path) as f:
            text = f.read().strip()
        out.append(json.loads(text.removeprefix("BENCH_JSON ")))
    kinds = {r.get("benchmark") for r in out}
    if len(kinds) != 1:
        raise SystemExit(f"mixed benchmarks in one summary: {sorted(map(str, kinds))}")
    return out


def _row(label: str, runs: list[dict[str, Any]], get: Callable[[dict[str, Any]], float | None], fmt: str) -> None:
    """Print ``label``, each run's value and their median (runs without the value are left out)."""
    values = [get(r) for r in runs]
    shown = "  ".join("-" if v is None else format(v, fmt) for v in values)
    present = [v for v in values if v is not None]
    median = format(statistics.median(present), fmt) if present else "-"
    print(f"{label:<60}{shown:<40}median {median}")


def _get(*keys: str) -> Callable[[dict[str, Any]], float | None]:
    """A getter for the nested value at ``keys`` (``None`` where missing)."""

    def get(r: dict[str, Any]) -> float | None:
        """The value at ``keys`` in ``r``, or ``None``."""
        node: Any = r
        for k in keys:
            if not isinstance(node, dict) or k not in node:
                return None
            node = node[k]
        return node

    return get


def summarize_data_parallel(runs: list[dict[str, Any]]) -> None:
    """Medians over runs of step times, ratios and loss agreement of ``bench_data_parallel.py``."""
    names = [k for k, v in runs[0].items() if isinstance(v, dict) and ("median_step_s" in v or "failed" in v)]
    print(f"{len(runs)} runs, model={runs[0]['model']}, clip={runs[0]['clip']}, schedule={runs[0]['schedule']}, "
          f"load avg 1 min before the runs: {[round(r['loadavg_1m'][0], 2) for r in runs]}")
    for name in names:
        _row(f"{name}: median wall ms/step", runs, lambda r, n=name: None if _get(n, "median_step_s")(r) is None
             else 1e3 * _get(n, "median_step_s")(r), ".2f")
        _row(f"{name}: median CPU ms/step/rank", runs, lambda r, n=name: None if _get(n, "median_cpu_s")(r) is None
             else 1e3 * _get(n, "median_cpu_s")(r), ".2f")
    for name in names:
        if name == "microspeed":
            continue
        _row(f"microspeed / {name}: ratio of medians", runs, _get(f"ratio_microspeed_over_{name}"), ".3f")
        _row(f"microspeed / {name}: median per-step ratio", runs, _get(f"paired_ratio_microspeed_over_{name}"), ".3f")
        _row(f"microspeed / {name}: CPU-time ratio", runs, _get(f"cpu_ratio_microspeed_over_{name}"), ".3f")
        _row(f"microspeed vs {name}: max rel loss diff", runs, _get(f"loss_max_rel_diff_vs_{name}"), ".2e")


def summarize_hook_overhead(runs: list[dict[str, Any]]) -> None:
    """Medians over runs of the measured and predicted hook overhead of ``bench_hook_overhead.py``."""
    print(f"{len(runs)} runs, model={runs[0]['model']}, plugins={runs[0]['plugins']}, "
          f"load avg 1 min before the runs: {[round(r['loadavg_1m'][0], 2) for r in runs]}")
    for clock in ("wall", "cpu"):
        _row(f"{clock}: A (built-ins) median ms/step", runs,
             lambda r, c=clock: 1e3 * r[c]["median_step_s_0_plugins"], ".3f")
        _row(f"{clock}: B (+ no-op plugins) median ms/step", runs,
             lambda r, c=clock: 1e3 * r[c]["median_step_s_n_plugins"], ".3f")
        _row(f"{clock}: overhead, median paired diff, us", runs, _get(clock, "overhead_us_median_paired"), ".1f")
        _row(f"{clock}: overhead, median paired diff, %", runs, _get(clock, "overhead_pct_median_paired"), ".3f")
        _row(f"{clock}: overhead, diff of medians, %", runs, _get(clock, "overhead_pct_diff_of_medians"), ".3f")
    _row("predicted (timeit x calls), us/step", runs, _get("predicted_overhead_us"), ".1f")
    _row("predicted, % of A's CPU-time step", runs, _get("predicted_overhead_pct"), ".4f")
    n = runs[0]["plugins"]
    for hook in runs[0]["per_call_us_n_impls"]:
        _row(f"{hook.removeprefix('microspeed_')}: us/call 0 -> {n} impl", runs,
             lambda r, h=hook: r["per_call_us_n_impls"][h] - r["per_call_us_0_impls"][h], ".2f")


def main(argv: list[str] | None = None) -> None:
    """Parse the file names and print the summary."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="JSON files written with --json-out")
    runs = load(p.parse_args(argv).files)
    if runs[0]["benchmark"] == "data_parallel":
        summarize_data_parallel(runs)
    else:
        summarize_hook_overhead(runs)


if __name__ == "__main__":
    main()
