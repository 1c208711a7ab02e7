"""The ``microspeed`` command's surface: ``--help`` of every sub-command, ``--version``, unknown commands, a light
start-up (no torch for help), and ``microspeed run``'s short failure report with per-rank traceback files."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from importlib import metadata

import pytest

import microspeed
from microspeed import cli
from microspeed.cli import run as run_cli
from microspeed.cli import worker
from microspeed.testing import free_port

BUILTIN = list(cli.COMMANDS)


@pytest.mark.parametrize("command", BUILTIN)
def test_every_subcommand_has_its_own_help(command, capsys):
    assert cli.main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: microspeed {command}"), out[:200]
    assert len(out.splitlines()) >= 3  # a description or options, not only the usage line


def test_config_keys_help_is_help_not_the_table(capsys):
    assert cli.main(["config-keys", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--disable" in out and "| key" not in out.lower() and "train_batch_size" not in out


def test_run_help_is_ours_and_names_torchrun_options(capsys):
    assert cli.main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: microspeed run [--as-deepspeed] [torchrun options] script.py")
    assert "--as-deepspeed" in out and "torchrun --help" in out and "traceback.log" in out
    for option in run_cli.HELP_OPTIONS:
        assert option in out, option
    # the script's own --help is the script's: only options before the script are the launcher's
    assert run_cli._wants_help(["--nproc-per-node", "2", "train.py", "--help"]) is False
    assert run_cli._wants_help(["--nproc-per-node", "2", "--help"]) is True


def test_run_help_options_exist_in_torchrun():
    from torch.distributed import run as torchrun

    known = {s for action in torchrun.get_args_parser()._actions for s in action.option_strings}
    assert set(run_cli.HELP_OPTIONS) <= known, set(run_cli.HELP_OPTIONS) - known


def test_version_lists_microspeed_and_installed_plugins(capsys):
    assert cli.main(["--version"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"microspeed {microspeed.__version__}"
    eps = metadata.entry_points(group="microspeed.plugins")
    assert eps, "the repository's plugins are installed in the test environment"
    for ep in eps:
        assert f"  plugin {ep.name} {ep.dist.version} ({ep.dist.name})" in lines
    assert lines[-1].startswith(f"torch {metadata.version('torch')}, python ")


@pytest.mark.parametrize("typo, closest", [("plugns", "plugins"), ("checkpont", "checkpoint"), ("rnu", "run")])
def test_unknown_command_names_the_closest_and_exits_2(typo, closest, capsys):
    assert cli.main([typo]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"unknown command {typo!r}; did you mean {closest!r}?" in captured.err


def test_unknown_command_without_a_close_one(capsys):
    assert cli.main(["xyzzy-frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'xyzzy-frobnicate'" in err and "did you mean" not in err


def test_help_and_version_do_not_import_torch():
    """``microspeed --help``, ``--version`` and every ``<cmd> --help`` answer without importing torch or plugins."""
    probe = textwrap.dedent(f"""
        import contextlib, io, json, sys
        from microspeed.cli import main
        seen = {{}}
        for argv in [["--help"], ["--version"]] + [[c, "--help"] for c in {BUILTIN!r}]:
            with contextlib.redirect_stdout(io.StringIO()):
                code = main(argv)
            heavy = sorted(m for m in ("torch", "microspeed_zero", "microspeed.engine") if m in sys.modules)
            seen[" ".join(argv)] = [code, heavy]
        print(json.dumps(seen))
    """)
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {k: [0, []] for k in seen} and len(seen) == len(BUILTIN) + 2, seen


# ------------------------------------------------------------------------------ the rank wrapper


PROBE = """
import json, os, sys
print(json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0], "file": __file__}))
"""


def test_worker_runs_the_script_as_python_does(tmp_path):
    script = tmp_path / "sub" / "probe.py"
    script.parent.mkdir()
    script.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_ERROR_FILE"}
    plain = subprocess.run([sys.executable, "sub/probe.py", "a", "--b"], capture_output=True, text=True,
                           cwd=tmp_path, env=env, check=True)
    wrapped = subprocess.run([sys.executable, "-m", "microspeed.cli.worker", "sub/probe.py", "a", "--b"],
                             capture_output=True, text=True, cwd=tmp_path, env=env, check=True)
    plain, wrapped = json.loads(plain.stdout), json.loads(wrapped.stdout)
    # runpy puts the path it runs (absolute, like __file__ and the traceback frames) in sys.argv[0]
    assert wrapped["argv"][0] == os.path.abspath(tmp_path / plain["argv"][0])
    wrapped["argv"][0] = plain["argv"][0]
    assert wrapped == plain and plain["name"] == "__main__"


FAILING = """
import sys

def deep(n):
    if n == 0:
        raise ValueError("boom")
    deep(n - 1)

if sys.argv[1] == "exit":
    sys.exit(7)
try:
    deep(int(sys.argv[1]))
except ValueError as exc:
    raise RuntimeError("wrapped") from exc
"""


def _worker(tmp_path, arg, rank=1):
    folder = tmp_path / "logs" / str(rank)
    folder.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(folder / "error.json")}
    proc = subprocess.run([sys.executable, "-m", "microspeed.cli.worker", str(script), arg], capture_output=True,
                          text=True, env=env, timeout=120)
    return proc, folder


def test_worker_records_a_failure_instead_of_printing_it(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    proc, folder = _worker(tmp_path, "12")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "boom" not in proc.stderr
    full = (folder / "traceback.log").read_text()
    assert full.count('raise ValueError("boom")') == 1 and full.count("deep(n - 1)") == 3  # 12 calls, as Python
    assert "[Previous line repeated 9 more times]" in full  # prints them: 3 lines, then the rest counted
    assert "The above exception was the direct cause" in full and "RuntimeError: wrapped" in full
    assert "worker.py" not in full and "runpy" not in full  # the wrapper's frames are cut
    failure = ProcessFailure(local_rank=1, pid=proc.returncode, exitcode=1, error_file=str(folder / "error.json"))
    assert failure.message["message"] == "RuntimeError: wrapped"  # torch reads our error file as its own
    assert failure.message["extraInfo"]["py_callstack"] == full
    short = failure.message["extraInfo"]["microspeed"]["short"]
    assert short.endswith("RuntimeError: wrapped\n(raised while handling another exception: the whole chain is in "
                          f"{folder / 'traceback.log'})\n")

    proc, folder = _worker(tmp_path, "exit", rank=0)
    assert proc.returncode == 7 and not (folder / "error.json").exists()


def test_short_traceback_keeps_the_last_frames():
    def deep(n):
        if n == 0:
            raise ValueError("boom")
        deep(n - 1)

    try:
        deep(20)
    except ValueError as exc:
        text = worker.short_traceback(exc, frames=4, full_text_at="/x/traceback.log")
    lines = text.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[1] == "  ... 18 earlier frame(s): /x/traceback.log"
    assert lines[-1] == "ValueError: boom" and text.count("deep(n - 1)") == 3 and len(lines) == 11


class _Failure:
    """What describe_failure reads of torch's ProcessFailure."""

    def __init__(self, exitcode, time=None, message="", error_file="<N/A>"):
        self.exitcode, self.error_file, self.timestamp = exitcode, error_file, 0
        self.message = ({"message": message, "extraInfo": {"microspeed": {"time": time, "short": f"T\n{message}\n"}}}
                        if time is not None else message)


def test_describe_failure_picks_the_first_error_and_groups_the_rest():
    failures = {0: _Failure(-15), 1: _Failure(1, 10.0, "ValueError: boom"), 2: _Failure(-15),
                3: _Failure(1, 11.0, "RuntimeError: Connection closed by peer"), 4: _Failure(-15)}
    text, code = run_cli.describe_failure(failures)
    assert code == 1
    assert text.splitlines() == ["microspeed run: rank 1 failed (exit code 1):", "T", "ValueError: boom",
                                 "microspeed run: ranks 0, 2, 4: stopped by SIGTERM after rank 1 failed",
                                 "microspeed run: rank 3: RuntimeError: Connection closed by peer (after rank 1 "
                                 "failed)"]
    text, code = run_cli.describe_failure({0: _Failure(-15), 1: _Failure(7)})
    assert code == 7 and text.splitlines()[0].startswith("microspeed run: rank 1 failed (exit code 7) without")
    text, code = run_cli.describe_failure({0: _Failure(-11)})
    assert code == 128 + 11 and text == "microspeed run: rank 0 was killed by SIGSEGV"
    assert run_cli._ranges([7, 0, 1, 2, 5]) == "ranks 0-2, 5, 7" and run_cli._ranges([3]) == "rank 3"


# ------------------------------------------------------------------------------ microspeed run, for real


RAISES = """
import torch.distributed as dist

def load_batch(step):
    raise ValueError("boom")

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    load_batch(3)
dist.barrier()
"""


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_run_failure_prints_the_error_once_and_names_the_traceback_files(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(RAISES)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "microspeed.cli", "run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         "--log-dir", str(tmp_path / "logs"), str(script)],
        capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert out.count("ValueError: boom") == 1, out
    assert len(out.strip().splitlines()) <= 15, out
    assert "microspeed run: rank 1 failed (exit code 1):" in out and 'raise ValueError("boom")' in out
    assert re.search(r"microspeed run: rank 0: .*after rank 1 failed", out), out
    for needle in ("torch/distributed/run.py", "microspeed/cli", "ChildFailedError", "Root Cause", "[rank1]"):
        assert needle not in out, (needle, out)
    files = dict(re.findall(r"rank (\d+) full traceback: (\S+)", out))
    assert "1" in files, out
    text = open(files["1"]).read()
    assert text.startswith("Traceback (most recent call last):") and "load_batch(3)" in text
    assert text.rstrip().endswith("ValueError: boom") and str(tmp_path / "logs") in files["1"]
