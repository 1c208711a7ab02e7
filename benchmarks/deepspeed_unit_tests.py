"""DeepSpeed's own unit tests for the features microspeed claims, run against real DeepSpeed and the stand-in.

Usage (CPU, gloo; needs a fetched copy of DeepSpeed's git repository, so this is not part of CI)::

    python benchmarks/deepspeed_unit_tests.py                      # both modes, every file in FEATURE_FILES
    python benchmarks/deepspeed_unit_tests.py --mode real          # only real DeepSpeed (the baseline)
    python benchmarks/deepspeed_unit_tests.py --mode microspeed --features lr_schedules,comm
    python benchmarks/deepspeed_unit_tests.py --files tests/unit/comm/test_dist.py -k TestInit
    python benchmarks/deepspeed_unit_tests.py --report-only        # re-render the Markdown from the JSON
    python benchmarks/deepspeed_unit_tests.py --check-imports      # every deepspeed name the stand-in lacks

What it does:

* **Tests**: ``git archive <ref> tests`` from ``--deepspeed-repo`` (a git directory, default the mirror
  ``/work/.mirror/deepspeedai+DeepSpeed/repo``; ``--ref``, default ``HEAD``) into a temporary directory.
  Nothing of DeepSpeed's test code is copied into this repository; the list of files run is
  :data:`FEATURE_FILES` (feature name -> test files), the features microspeed claims.
* **Modes**: ``real`` runs them with the installed DeepSpeed (0.19.8); ``microspeed`` puts the stand-in
  (``--standin``, default ``compat/deepspeed/src``: a package named ``deepspeed`` that re-exports microspeed)
  first on ``PYTHONPATH``. A small pytest plugin written next to the tests checks, before any test runs, that
  ``deepspeed.__file__`` lies in the stand-in (else the run stops), records which ``deepspeed`` was imported,
  and at the end lists any module of the real DeepSpeed installation found loaded in the process.
* **Harness**: DeepSpeed's ``DistributedTest`` (``tests/unit/common.py``) forks ``world_size`` processes per
  test (``forkserver`` pool, ``deepspeed.init_distributed`` with the accelerator's backend: ``gloo`` for
  ``DS_ACCELERATOR=cpu``) and skips a test when ``get_accelerator().device_count()`` is below its world size;
  the CPU accelerator's count is ``LOCAL_SIZE``, set here to ``--max-world-size`` (4: the largest world size
  these files use), so every world size up to it runs. ``OMP_NUM_THREADS=1`` in every process.
* **Start-up**: the plugin sets ``multiprocessing.set_forkserver_preload`` to torch, ``deepspeed`` and the
  harness modules (and ``torch._dynamo``, which the first torch optimizer imports), so each rank forks from a
  server that imported them once (without it every rank of
  every test imports torch and deepspeed again: about 20 s a test on a busy 2-core machine).
* **Timeouts**: each test gets ``--timeout`` seconds (pytest-timeout, ``thread`` method: a hung test dumps
  its stacks and ends the pytest process, since DeepSpeed's pool teardown would wait forever on a hung
  worker). The runner then kills the process group (the forked ranks included), records that test as
  ``timeout`` and restarts the file without the tests already done. A file whose pytest shows no progress
  for ``--timeout`` + 120 s is handled the same way.
* **Ops**: before a real run, DeepSpeed's CPU ops the tests load (:data:`PREBUILD_OPS`) are JIT-built once,
  outside any test's timeout (``--no-prebuild`` skips it); a build killed half-way leaves a ``lock`` file in
  ``~/.cache/torch_extensions/py311_cpu/<op>/`` that makes every later load wait forever: delete it.
* **Files run one by one** (``-p no:cacheprovider``, no ``-x``); per-test outcomes come from the plugin's
  log (``passed``, ``failed``, ``error`` = setup/teardown failure, ``skipped``, ``timeout``, ``xfailed``,
  ``xpassed``; a file that fails to import counts as one ``collect-error``).

Output: a side-by-side table of per-file counts on stdout, and ``benchmarks/results/deepspeed_unit_tests.json``
(every test's outcome and first error line per mode; running one mode keeps the other mode's last results)
and ``.md`` (the table, then every test that passes under real DeepSpeed and not under microspeed, with its
error line).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DS_REPO = "/work/.mirror/deepspeedai+DeepSpeed/repo"
DEFAULT_STANDIN = REPO_ROOT / "compat" / "deepspeed" / "src"
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "deepspeed_unit_tests"

#: The features microspeed claims -> DeepSpeed's test files for them (paths inside DeepSpeed's repository).
FEATURE_FILES: dict[str, list[str]] = {
    "lr_schedules": ["tests/unit/runtime/test_lr_schedulers.py"],
    "pipe_schedule": ["tests/unit/runtime/pipe/test_pipe_schedule.py"],
    "topology": ["tests/unit/runtime/pipe/test_topology.py"],
    "partitioning": ["tests/unit/runtime/utils/test_partition.py", "tests/unit/utils/test_partition_balanced.py"],
    "config_models": [
        "tests/unit/runtime/test_ds_config_model.py",
        "tests/unit/runtime/test_ds_config_dict.py",
        "tests/unit/runtime/zero/test_zero_config.py",
    ],
    "comm": ["tests/unit/comm/test_dist.py"],
    "moe": ["tests/unit/v1/moe/test_moe.py", "tests/unit/utils/test_groups.py"],
    "activation_checkpointing": [
        "tests/unit/runtime/activation_checkpointing/test_activation_checkpointing.py",
        "tests/unit/runtime/activation_checkpointing/test_activation_checkpointing_non_reentrant.py",
    ],
    "monitor": ["tests/unit/monitor/test_monitor.py"],
    "zero_context": [
        "tests/unit/runtime/zero/test_zero_context.py",
        "tests/unit/runtime/zero/test_zero_context_ancestry.py",
        "tests/unit/runtime/zero/test_zero_context_return.py",
    ],
    "initialize": ["tests/unit/runtime/test_ds_initialize.py"],
    "no_sync": ["tests/unit/runtime/test_no_sync_ctxt.py"],
}

#: Outcomes in the order the tables show them.
OUTCOMES = ("passed", "failed", "error", "skipped", "timeout", "crashed", "xfailed", "xpassed", "collect-error")

# The pytest plugin written beside the extracted tests (our code, not DeepSpeed's): it appends one JSON line per
# event to $MSDS_LOG, flushed at once, so a test that hangs or kills the process is still known.
_PLUGIN = r'''
"""Records test outcomes for benchmarks/deepspeed_unit_tests.py (one JSON line per event)."""
import json
import os
import sys

import pytest

_LOG = open(os.environ["MSDS_LOG"], "a", buffering=1)


def _emit(**rec):
    _LOG.write(json.dumps(rec) + "\n")
    _LOG.flush()


def _first_line(report):
    rep = report.longrepr
    if rep is None:
        return ""
    if isinstance(rep, tuple):  # skip: (file, line, reason)
        return str(rep[2])
    crash = getattr(rep, "reprcrash", None)
    if crash is not None and crash.message:
        return crash.message
    return str(rep).strip().splitlines()[-1] if str(rep).strip() else ""


def pytest_configure(config):
    import multiprocessing

    import deepspeed

    # DeepSpeed's DistributedTest forks every rank from a forkserver that by default imports only __main__:
    # each rank of each test would import torch and deepspeed afresh (about 20 s a test on a busy 2-core
    # machine). Preloading them in the forkserver makes a rank's start a fork; what the ranks run is unchanged.
    multiprocessing.set_forkserver_preload(["torch", "torch._dynamo", "deepspeed", "deepspeed.comm", "unit.common",
                                            "unit.simple_model", "unit.util"])

    file = os.path.realpath(deepspeed.__file__ or "")
    _emit(event="deepspeed", file=file, version=getattr(deepspeed, "__version__", "?"))
    expect = os.environ.get("MSDS_EXPECT_DEEPSPEED_DIR")
    if expect and not file.startswith(os.path.realpath(expect) + os.sep):
        raise pytest.UsageError(f"`import deepspeed` gave {file}, not the stand-in under {expect}")


def pytest_collectreport(report):
    if report.failed:
        _emit(event="collect-error", nodeid=report.nodeid, message=_first_line(report)[:2000])


def pytest_runtest_logstart(nodeid, location):
    _emit(event="start", nodeid=nodeid)


def pytest_runtest_logreport(report):
    outcome = None
    if report.when == "call":
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        else:
            outcome = report.outcome
    elif report.failed:
        outcome = "error"
    elif report.skipped:
        outcome = "xfailed" if hasattr(report, "wasxfail") else "skipped"
    if outcome is not None:
        _emit(event="result", nodeid=report.nodeid, when=report.when, outcome=outcome,
              duration=round(report.duration, 3), message=_first_line(report)[:2000])


def pytest_sessionfinish(session, exitstatus):
    real_dir = os.environ.get("MSDS_REAL_DEEPSPEED_DIR")
    loaded = []
    if real_dir:
        for name, mod in list(sys.modules.items()):
            f = getattr(mod, "__file__", None)
            if f and os.path.realpath(f).startswith(real_dir + os.sep):
                loaded.append(name)
    _emit(event="finish", exitstatus=int(exitstatus), real_deepspeed_modules=sorted(loaded))
'''


def _git(ds_repo: str, *args: str) -> str:
    return subprocess.run(["git", f"--git-dir={ds_repo}", *args], check=True, capture_output=True,
                          text=True).stdout


def extract_tests(ds_repo: str, ref: str, dest: Path) -> str:
    """Extract ``tests/`` of ``ref`` from the git directory ``ds_repo`` into ``dest``; return the commit id."""
    commit = _git(ds_repo, "rev-parse", f"{ref}^{{commit}}").strip()
    archive = subprocess.run(["git", f"--git-dir={ds_repo}", "archive", commit, "tests"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "x", "-C", str(dest)], input=archive, check=True)
    (dest / "_msds_plugin").mkdir()
    (dest / "_msds_plugin" / "_msds_report.py").write_text(_PLUGIN)
    return commit


def real_deepspeed_dir() -> str:
    """The installed (real) DeepSpeed's package folder, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin is None:
        return ""
    return os.path.realpath(os.path.dirname(spec.origin))


def mode_env(mode: str, workdir: Path, standin: Path, max_world_size: int) -> dict[str, str]:
    """The environment of one mode's pytest processes."""
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cpu", LOCAL_SIZE=str(max_world_size), OMP_NUM_THREADS="1",
               DS_UNITTEST_TIMEOUT="3600", PYTHONDONTWRITEBYTECODE="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    path = [str(workdir / "_msds_plugin")]
    env.pop("MSDS_EXPECT_DEEPSPEED_DIR", None)
    if mode == "microspeed":
        path.insert(0, str(standin))
        env["MSDS_EXPECT_DEEPSPEED_DIR"] = str(standin)
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(path)
    env["MSDS_REAL_DEEPSPEED_DIR"] = real_deepspeed_dir()
    return env


#: DeepSpeed ops the tests JIT-compile on CPU; built once before a real run, outside any test's timeout.
PREBUILD_OPS = ("FusedAdamBuilder", "CPUAdamBuilder")


def prebuild_ops(env: dict[str, str], timeout: int = 1800) -> None:
    """Build DeepSpeed's CPU ops once (torch cpp-extension cache) so no test spends its timeout compiling.

    A build killed half-way (a test timed out while compiling) leaves ``~/.cache/torch_extensions/py311_cpu/
    <op>/lock`` behind and every later load of that op waits on it forever: this step then times out and
    says which lock to delete.
    """
    code = ("import time\nfrom deepspeed.accelerator import get_accelerator\n"
            f"for name in {PREBUILD_OPS!r}:\n"
            "    t = time.time(); get_accelerator().create_op_builder(name).load()\n"
            "    print(f'{name} ready in {time.time() - t:.0f} s', flush=True)\n")
    try:
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
        print("\n".join(ln for ln in res.stdout.splitlines() if "ready in" in ln) or res.stderr[-2000:], flush=True)
    except subprocess.TimeoutExpired:
        cache = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
        locks = sorted(str(p) for p in cache.glob("*/*/lock"))
        print(f"building DeepSpeed's ops took over {timeout} s; a stale lock from a killed build? {locks}", flush=True)


# Run in a process with the stand-in first on sys.path: every `deepspeed` name the given files import, tried one
# by one (module-level and function-level imports alike), so a file's missing names are all listed, not the first.
_IMPORT_CHECK = r'''
import ast, importlib, json, sys
out = {}
for path in sys.argv[1:]:
    missing = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            pairs = [(a.name, None) for a in node.names if a.name.split(".")[0] == "deepspeed"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "deepspeed":
            pairs = [(node.module, a.name) for a in node.names]
        else:
            continue
        for mod, name in pairs:
            try:
                m = importlib.import_module(mod)
            except Exception as exc:
                missing.append(f"{mod} ({type(exc).__name__}: {str(exc)[:120]})")
                continue
            if name and name != "*" and not hasattr(m, name):
                try:
                    importlib.import_module(f"{mod}.{name}")
                except Exception:
                    missing.append(f"{mod}.{name}")
    out[path] = sorted(set(missing))
print(json.dumps(out))
'''


def check_imports(files: list[str], workdir: Path, env: dict[str, str]) -> dict[str, list[str]]:
    """Every ``deepspeed`` module/name the test files (and DeepSpeed's test helpers) import that is missing."""
    helpers = ["tests/unit/common.py", "tests/unit/util.py", "tests/unit/simple_model.py"]
    paths = [str(workdir / f) for f in helpers + files if (workdir / f).exists()]
    res = subprocess.run([sys.executable, "-c", _IMPORT_CHECK, *paths], env=env, capture_output=True, text=True,
                         cwd=workdir / "tests", timeout=600)
    if res.returncode != 0:
        raise RuntimeError(f"import check failed: {res.stderr[-2000:]}")
    found = json.loads(res.stdout.strip().splitlines()[-1])
    return {str(Path(p).relative_to(workdir)): names for p, names in found.items()}


def _read_log(log: Path) -> list[dict]:
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by a kill
    return out


def _tail(path: Path) -> str:
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_file(test_file: str, workdir: Path, env: dict[str, str], timeout: int, keyword: str | None,
             log_dir: Path) -> dict:
    """Run one test file (restarting after hangs); return its per-test outcomes and collection errors."""
    tests: dict[str, dict] = {}
    collect_errors: list[dict] = []
    info: dict = {}
    rel = test_file.removeprefix("tests/")
    attempt = 0
    t0 = time.time()
    while True:
        attempt += 1
        log = log_dir / (rel.replace("/", "__") + f".{attempt}.jsonl")
        cmd = [sys.executable, "-m", "pytest", "-c", "pytest.ini", "-p", "no:cacheprovider", "-p", "_msds_report",
               "-q", "--no-header", "-rN", "--color=no", f"--timeout={timeout}", "--timeout-method=thread", rel]
        if keyword:
            cmd += ["-k", keyword]
        for nodeid in tests:
            cmd += ["--deselect", nodeid]
        penv = dict(env, MSDS_LOG=str(log))
        out_path = log_dir / (rel.replace("/", "__") + f".{attempt}.out")
        with open(out_path, "w") as out:
            proc = subprocess.Popen(cmd, cwd=workdir / "tests", env=penv, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            last_size, last_change, stalled = -1, time.time(), False
            while proc.poll() is None:
                time.sleep(2)
                size = log.stat().st_size if log.exists() else 0
                if size != last_size:
                    last_size, last_change = size, time.time()
                elif time.time() - last_change > timeout + 120:
                    stalled = True
                    break
            _kill_group(proc)  # the forked ranks and the forkserver, whatever pytest left behind
        events = _read_log(log)
        started, finish = None, None
        for ev in events:
            kind = ev["event"]
            if kind == "deepspeed":
                info.setdefault("deepspeed_file", ev["file"])
                info.setdefault("deepspeed_version", ev["version"])
            elif kind == "collect-error":
                collect_errors.append({"nodeid": ev["nodeid"], "message": ev["message"].removeprefix("E   ")})
            elif kind == "start":
                started = ev["nodeid"]
            elif kind == "result":
                prev = tests.get(ev["nodeid"])
                # keep the worst phase: a teardown error after a passed call makes the test an error
                if prev is None or prev["outcome"] in ("passed", "skipped", "xfailed"):
                    if prev is None or ev["outcome"] not in ("passed",):
                        tests[ev["nodeid"]] = {k: ev[k] for k in ("outcome", "message", "duration")}
                if ev["when"] == "teardown" and started == ev["nodeid"]:
                    started = None
            elif kind == "finish":
                finish = ev
        if finish is not None:
            info["real_deepspeed_modules"] = finish["real_deepspeed_modules"][:50]
            info["exitstatus"] = finish["exitstatus"]
        if finish is not None or started is None:
            if finish is None and not events:
                collect_errors.append({"nodeid": rel, "message": f"pytest ended with {proc.returncode} and no log"})
            break
        # the process died or stalled inside `started`: record it and go on with the rest of the file
        timed_out = stalled or "+++ Timeout +++" in out_path.read_text(errors="replace")
        if timed_out:
            why = "no progress, killed" if stalled else "pytest-timeout ended the process"
            tests[started] = {"outcome": "timeout", "message": f"timeout after {timeout}s ({why})",
                              "duration": timeout}
        else:
            tests[started] = {"outcome": "crashed", "message": f"pytest process ended ({proc.returncode}) inside "
                              f"the test: {_tail(out_path)}", "duration": 0.0}
        if attempt > 200:
            break
    info["wall_s"] = round(time.time() - t0, 1)
    return {"tests": tests, "collect_errors": collect_errors, **info}


def counts(file_result: dict | None) -> Counter:
    """Outcome counts of one file's result (a collection error counts once)."""
    c: Counter = Counter()
    if not file_result:
        return c
    for t in file_result["tests"].values():
        c[t["outcome"]] += 1
    c["collect-error"] += len(file_result["collect_errors"])
    return c


_ABBREV = {"passed": "p", "failed": "f", "error": "e", "skipped": "s", "timeout": "t", "crashed": "c",
           "xfailed": "xf", "xpassed": "xp", "collect-error": " collect-error"}


def _fmt(c: Counter) -> str:
    if not c:
        return "-"
    shown = ["passed", "failed"] + [k for k in OUTCOMES[2:] if c[k]]
    return " ".join(f"{c[k]}{_ABBREV[k]}" for k in shown)


def regressions(data: dict, test_file: str) -> list[tuple[str, str, str]]:
    """Tests of ``test_file`` that pass under real DeepSpeed and not under microspeed: (nodeid, outcome, msg)."""
    real = data["modes"].get("real", {}).get("files", {}).get(test_file)
    ms = data["modes"].get("microspeed", {}).get("files", {}).get(test_file)
    if not real or not ms:
        return []
    out = []
    for nodeid, t in sorted(real["tests"].items()):
        if t["outcome"] != "passed":
            continue
        m = ms["tests"].get(nodeid)
        if m is None:
            msg = ms["collect_errors"][0]["message"] if ms["collect_errors"] else "not run"
            out.append((nodeid, "collect-error" if ms["collect_errors"] else "not-run", msg))
        elif m["outcome"] != "passed":
            out.append((nodeid, m["outcome"], m["message"]))
    return out


def _first_error_line(msg: str) -> str:
    lines = [ln.strip() for ln in msg.strip().splitlines() if ln.strip()]
    return (lines[0] if lines else "")[:240].replace("|", "\\|")


def feature_file_pairs(data: dict) -> list[tuple[str, str]]:
    """(feature, file) for every listed file, then ("other", file) for files run by ``--files`` beyond the list."""
    pairs = [(feat, f) for feat, files in data["feature_files"].items() for f in files]
    listed = {f for _, f in pairs}
    extra = sorted({f for m in data["modes"].values() for f in m.get("files", {})} - listed)
    return pairs + [("other", f) for f in extra]


def table_rows(data: dict) -> list[tuple[str, str, str, str, str]]:
    """(feature, file, real counts, microspeed counts, real-pass-but-microspeed-not) per file, then totals."""
    rows = []
    tot = {"real": Counter(), "microspeed": Counter()}
    lost_total = 0
    for feature, f in feature_file_pairs(data):
        cs = {}
        for mode in ("real", "microspeed"):
            cs[mode] = counts(data["modes"].get(mode, {}).get("files", {}).get(f))
            tot[mode] += cs[mode]
        lost = len(regressions(data, f))
        lost_total += lost
        rows.append((feature, f.removeprefix("tests/unit/"), _fmt(cs["real"]), _fmt(cs["microspeed"]), str(lost)))
    rows.append(("TOTAL", "", _fmt(tot["real"]), _fmt(tot["microspeed"]), str(lost_total)))
    return rows


def print_table(data: dict) -> None:
    """Per-file counts of both modes side by side on stdout."""
    rows = [("feature", "file", "real", "microspeed", "lost")] + table_rows(data)
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    print("(p passed, f failed, e error, s skipped, t timeout, c crashed; "
          "lost = passes under real, not under microspeed)")


def write_markdown(data: dict, path: Path) -> None:
    """The summary table and the list of tests lost under microspeed."""
    lines = ["# DeepSpeed's unit tests: real DeepSpeed vs the microspeed stand-in", "",
             "Generated by `python benchmarks/deepspeed_unit_tests.py` (see its docstring); DeepSpeed tests from "
             f"`{data['deepspeed_repo']}` at `{data['commit'][:12]}`, CPU, gloo, `DS_ACCELERATOR=cpu`, "
             f"`LOCAL_SIZE={data['max_world_size']}`.", ""]
    for mode in ("real", "microspeed"):
        m = data["modes"].get(mode)
        if not m:
            lines.append(f"- **{mode}**: not run yet")
            continue
        real_mods = sorted({x for f in m["files"].values() for x in f.get("real_deepspeed_modules", [])}
                           if mode == "microspeed" else [])
        extra = ""
        if mode == "microspeed":
            extra = (f"; modules of real DeepSpeed loaded: {', '.join(real_mods[:8])}" if real_mods
                     else "; no module of real DeepSpeed loaded")
        dates = sorted({f.get("date", m["date"]) for f in m["files"].values()} | {m["date"]})
        when = dates[0] if len(dates) == 1 else f"files run {dates[0]} to {dates[-1]}"
        timeouts = sorted({f.get("timeout", data["timeout"]) for f in m["files"].values()})
        wall = sum(f.get("wall_s", 0) for f in m["files"].values())
        limit = "/".join(map(str, timeouts))
        lines.append(f"- **{mode}** ({when}, {wall:.0f} s of pytest, per-test timeout {limit} s, "
                     f"microspeed core {m.get('microspeed', '?')}): "
                     f"`deepspeed` = `{m.get('deepspeed_file', '?')}` ({m.get('deepspeed_version', '?')}){extra}")
    lines += ["", "| feature | file | real | microspeed | lost |", "|---|---|---|---|---|"]
    for r in table_rows(data):
        lines.append("| " + " | ".join(r) + " |")
    lines += ["", "Counts: p passed, f failed, e error (setup/teardown), s skipped, t timeout, "
              "c crashed (the process died); *lost*: passes under real DeepSpeed, not under microspeed.", ""]
    lost_any = False
    for _, f in feature_file_pairs(data):
        reg = regressions(data, f)
        if not reg:
            continue
        if not lost_any:
            lines += ["## Passing under real DeepSpeed, not under microspeed", ""]
            lost_any = True
        lines += [f"### {f.removeprefix('tests/unit/')} ({len(reg)})", ""]
        groups: dict[tuple[str, str], list[str]] = {}
        for nodeid, outcome, msg in reg:  # one bullet per distinct error line
            groups.setdefault((outcome, _first_error_line(msg)), []).append(nodeid.split("::", 1)[-1])
        for (outcome, msg), names in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            shown = ", ".join(f"`{n}`" for n in names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
            lines.append(f"- {len(names)} {outcome}: {msg or '(no message)'} — {shown}")
        lines.append("")
    path.write_text("\n".join(lines) + "\n")


def _microspeed_fingerprint() -> str:
    try:
        sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
        from common import core_fingerprint

        return core_fingerprint()
    except Exception as exc:  # noqa: BLE001 - the fingerprint is informative only
        return f"unknown ({type(exc).__name__})"


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("real", "microspeed", "both"), default="both")
    ap.add_argument("--deepspeed-repo", default=DEFAULT_DS_REPO, help="git directory of DeepSpeed's repository")
    ap.add_argument("--ref", default="HEAD", help="commit/tag of DeepSpeed's repository to take tests/ from")
    ap.add_argument("--standin", type=Path, default=DEFAULT_STANDIN, help="folder holding the stand-in `deepspeed`")
    ap.add_argument("--features", default="", help="comma-separated subset of: " + ",".join(FEATURE_FILES))
    ap.add_argument("--files", nargs="*", default=None, help="test files (paths in DeepSpeed's repo) instead")
    ap.add_argument("-k", dest="keyword", default=None, help="pytest -k expression (results merge per test)")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per test before it counts as a hang")
    ap.add_argument("--max-world-size", type=int, default=4, help="LOCAL_SIZE: tests needing more ranks skip")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output path without suffix (.json, .md)")
    ap.add_argument("--report-only", action="store_true", help="only re-render the Markdown from the JSON")
    ap.add_argument("--check-imports", action="store_true",
                    help="only list the deepspeed names the test files import that the stand-in lacks (fast)")
    ap.add_argument("--no-prebuild", action="store_true", help="do not build DeepSpeed's CPU ops first")
    ap.add_argument("--keep-tmp", action="store_true", help="keep the extracted tests and the pytest logs")
    args = ap.parse_args(argv)

    json_path, md_path = args.out.with_suffix(".json"), args.out.with_suffix(".md")
    data = json.loads(json_path.read_text()) if json_path.exists() else {"modes": {}}
    for f in data["modes"].get("real", {}).get("files", {}).values():  # expected there: keep only how many
        if isinstance(f.get("real_deepspeed_modules"), list):
            f["real_deepspeed_modules"] = len(f["real_deepspeed_modules"])
    data["feature_files"] = FEATURE_FILES
    if args.report_only:
        print_table(data)
        write_markdown(data, md_path)
        return 0

    if args.files:
        files = list(args.files)
    else:
        feats = [f for f in args.features.split(",") if f] or list(FEATURE_FILES)
        unknown = [f for f in feats if f not in FEATURE_FILES]
        if unknown:
            ap.error(f"unknown feature(s) {unknown}; choose from {sorted(FEATURE_FILES)}")
        files = [f for feat in feats for f in FEATURE_FILES[feat]]
    modes = ["real", "microspeed"] if args.mode == "both" else [args.mode]
    if "microspeed" in modes and not (args.standin / "deepspeed" / "__init__.py").exists():
        ap.error(f"no stand-in package at {args.standin / 'deepspeed'}")

    tmp = Path(tempfile.mkdtemp(prefix="ds_unit_tests_"))
    commit = extract_tests(args.deepspeed_repo, args.ref, tmp)
    print(f"DeepSpeed tests from {args.deepspeed_repo} @ {commit[:12]} extracted to {tmp}", flush=True)
    if args.check_imports:
        env = mode_env("microspeed" if args.mode != "real" else "real", tmp, args.standin.resolve(),
                       args.max_world_size)
        for path, names in check_imports(files, tmp, env).items():
            print(f"{path}: {'ok' if not names else ''}")
            for name in names:
                print(f"    missing {name}")
        subprocess.run(["rm", "-rf", str(tmp)], check=False)
        return 0
    data.update(deepspeed_repo=args.deepspeed_repo, commit=commit, timeout=args.timeout,
                max_world_size=args.max_world_size)
    status = 0
    for mode in modes:
        env = mode_env(mode, tmp, args.standin.resolve(), args.max_world_size)
        if mode == "real" and not args.no_prebuild:
            prebuild_ops(env)
        log_dir = tmp / f"logs_{mode}"
        log_dir.mkdir()
        prev = data["modes"].get(mode, {})
        mdata = {"date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                 "microspeed": _microspeed_fingerprint(), "files": dict(prev.get("files", {}))}
        t0 = time.time()
        ran: list[str] = []
        for f in files:
            print(f"[{mode}] {f} ...", flush=True)
            res = run_file(f, tmp, env, args.timeout, args.keyword, log_dir)
            if args.keyword and f in mdata["files"]:  # a -k run updates only the tests it ran
                merged = dict(mdata["files"][f])
                merged["tests"] = {**merged["tests"], **res["tests"]}
                merged["collect_errors"] = res["collect_errors"]
                res = {**merged, **{k: v for k, v in res.items() if k not in ("tests",)}, "tests": merged["tests"]}
            res["date"] = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
            res["timeout"] = args.timeout
            if mode == "real" and isinstance(res.get("real_deepspeed_modules"), list):
                res["real_deepspeed_modules"] = len(res["real_deepspeed_modules"])  # expected: keep the count
            mdata["files"][f] = res
            for key in ("deepspeed_file", "deepspeed_version"):
                if key in res:
                    mdata[key] = res[key]
            c = counts(res)
            print(f"[{mode}] {f}: {_fmt(c)} ({res['wall_s']:.0f} s)", flush=True)
            if mode == "microspeed" and res.get("real_deepspeed_modules"):
                print(f"[{mode}]   real DeepSpeed modules loaded: {res['real_deepspeed_modules'][:8]}", flush=True)
                status = 1
            # save after every file: a long run interrupted keeps what it measured
            mdata["wall_s"] = round(time.time() - t0, 1)
            # another run may have written meanwhile: keep its results, replace only the files this run ran
            ran.append(f)
            if json_path.exists():
                disk = json.loads(json_path.read_text())["modes"]
                mdata["files"] = {**disk.get(mode, {}).get("files", {}), **{r: mdata["files"][r] for r in ran}}
                data["modes"] = disk
            data["modes"][mode] = mdata
            args.out.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
            write_markdown(data, md_path)
        print(f"[{mode}] deepspeed imported from {mdata.get('deepspeed_file')} ({mdata.get('deepspeed_version')})")
    print_table(data)
    print(f"wrote {json_path} and {md_path}")
    if not args.keep_tmp:
        subprocess.run(["rm", "-rf", str(tmp)], check=False)
    else:
        print(f"kept {tmp}")
    return status


if __name__ == "__main__":
    sys.exit(main())
