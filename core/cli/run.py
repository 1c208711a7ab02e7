"""``microspeed run``: launch a training script on N processes through torchrun, with quiet, useful failures.

Each rank runs under :mod:`microspeed.cli.worker`, which keeps a failing rank's traceback off the console and
writes it to that rank's folder under torchrun's ``--log-dir`` (``traceback.log``, and torchelastic's
``error.json``). When the job fails, torchrun's agent raises its ``ChildFailedError``; instead of its traceback
and box, this prints the error of the rank that failed first (its last frames and message), one line for the
other ranks, and the paths of the per-rank files. The exit status is the failing rank's.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

HELP = """\
usage: microspeed run [--as-deepspeed] [torchrun options] script.py [script args]
       microspeed run [--as-deepspeed] [torchrun options] -m module [module args]

Launch a training script on N processes with torchrun (torch.distributed.run). Every torchrun option
works; the script's own arguments follow it, untouched.

microspeed's options (before the script):
  --as-deepspeed        `import deepspeed` in the launched processes gets microspeed's stand-in (its
                        folder goes first on their PYTHONPATH), even where real DeepSpeed is installed
  --elastic MIN:MAX     elastic job of MIN to MAX nodes: torchrun's --nnodes MIN:MAX with a c10d rendezvous
                        at --rdzv-endpoint (default --master-addr:--master-port, 127.0.0.1:29400) and
                        --rdzv-id (default $MICROSPEED_JOB_ID, $SLURM_JOB_ID, or a hash of this folder and the
                        script line): agents started with the same endpoint and id form one job; a lost node
                        restarts the workers on the survivors (checkpoint.auto_resume_dir resumes them)
  --max_restarts N      with --elastic: restarts after failures (default 3; alias --max-restarts)
  -h, --help            show this help and exit

Failures: when a rank raises, the console gets that rank's error once (last frames and message) and one
line for the other ranks; every rank's full traceback goes to <log dir>/<run>/attempt_<n>/<rank>/
traceback.log (torchelastic's error.json beside it), and those paths are printed. Without --log-dir a
temporary folder is used, removed again when the run succeeds. The exit status is the failing rank's.

torchrun options used most (`torchrun --help` lists all of them):
  --nproc-per-node N    processes on this node (default here: 1)
  --nnodes N | MIN:MAX  number of nodes (default 1)
  --node-rank R         this node's rank, with --master-addr/--master-port (static rendezvous)
  --master-addr ADDR    address of node 0 (default 127.0.0.1)
  --master-port PORT    port on node 0 (default 29500)
  --standalone          single node, free port chosen automatically
  --rdzv-backend B      rendezvous backend (c10d, etcd, static)
  --rdzv-endpoint H:P   rendezvous address, --rdzv-id ID the job's id
  --max-restarts N      restart the worker group up to N times on failure (default 0)
  --log-dir DIR         where the per-rank folders go (kept)
  -r, --redirects SPEC  also send std streams to <rank>/stdout.log, stderr.log (0 none, 1 out, 2 err, 3 both,
                        or per rank: 0:1,1:2)
  -t, --tee SPEC        as --redirects, and still print them on the console (lines prefixed by rank)
  --local-ranks-filter L  show only these local ranks' output on the console (e.g. 0)
  -m, --module          the script is a Python module name (python -m)
  --no-python           run the script as a program, not through python (its failures are not shortened)

Several machines (DeepSpeed's launcher): with --hostfile, torchrun starts on every host over ssh (or pdsh,
or as one srun step), in this working directory, with this environment's NCCL*/PYTHON*/GLOO_*/MICROSPEED_*
variables and the KEY=VALUE lines of ~/.deepspeed_env, ./.deepspeed_env, ./.microspeed_env:
  -H, --hostfile FILE   lines `HOST slots=N` (# comments); the first host is node 0
  -i, --include SPEC    hosts/slots to use: HOST[:SLOT,SLOT][@HOST...]   (-e, --exclude SPEC: not to use)
  --num_nodes N         the first N hosts       --num_gpus, --nproc-per-node N: N processes per host
  --master_addr ADDR    node 0's address (default: its first `hostname -I` address)   --master_port PORT
  --launcher L          ssh, pdsh (the default where installed, else ssh) or slurm (srun)
  --launcher_args "..." options for ssh (-F config, -i key), pdsh or srun   --ssh_port P
  --no_ssh_check        skip the check that every host answers `ssh -o BatchMode=yes HOST true`
  --elastic MIN:MAX     every host joins one c10d rendezvous at --master_addr:--master_port (MAX at most the
                        hosts selected); a failing node no longer stops the others
When a node fails, the others are stopped and the report names the host.

examples:
  microspeed run --nproc-per-node 2 train.py --deepspeed_config ds_config.json
  microspeed run --hostfile hostfile --num_gpus 8 train.py --deepspeed_config ds_config.json
  microspeed run --elastic 1:2 --max_restarts 5 --nproc-per-node 2 train.py --deepspeed_config ds_config.json
"""

#: torchrun options (long spelling) that HELP describes; a test checks each exists in torchrun's parser.
HELP_OPTIONS = ("--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--standalone",
                "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--max-restarts", "--log-dir", "--redirects",
                "--tee", "--local-ranks-filter", "--module", "--no-python")

WORKER_MODULE = "microspeed.cli.worker"
"""The module each rank runs (``python -u -m microspeed.cli.worker script.py args``)."""

_QUIET_LOGGERS = ("torch.distributed.elastic.multiprocessing.api",)
"""torchrun loggers whose failure lines ("failed (exitcode: 1) local_rank: 1", "Sending process ... SIGTERM") the
summary replaces."""


_FLAGS = frozenset({"-h", "--help", "--as-deepspeed", "--exit-with-stdin", "--standalone", "-m", "--module",
                    "--no-python", "--no_python",
                    "--run-path", "--run_path", "--virtual-local-rank", "--virtual_local_rank"})
"""Launcher options that take no value; every other torchrun option takes one (``--opt V`` or ``--opt=V``)."""


def _launcher_part(args: Sequence[str]) -> list[str]:
    """The arguments before the script: the launcher's own options (and their values)."""
    out: list[str] = []
    i = 0
    while i < len(args) and args[i].startswith("-"):
        takes_value = args[i] not in _FLAGS and "=" not in args[i]
        out += args[i:i + 1 + takes_value]
        i += 1 + takes_value
    return out


def _wants_help(args: Sequence[str]) -> bool:
    launcher = _launcher_part(args)
    return any(a in ("-h", "--help") for a in launcher)


def _uses_hostfile(args: Sequence[str]) -> bool:
    """Whether the launcher options name a hostfile (``--hostfile``/``-H``): the multi-node launcher's job."""
    from microspeed.cli.multinode import split_launcher_args

    return any(a in ("-H", "--hostfile") or a.startswith("--hostfile=") for a in split_launcher_args(args)[0])


def _take_value(args: list[str], option: str) -> str | None:
    """Remove ``option VALUE`` (or ``option=VALUE``) from the launcher options; return the value."""
    for i, arg in enumerate(_launcher_part(args)):
        if arg == option and i + 1 < len(args):
            value = args[i + 1]
            del args[i:i + 2]
            return value
        if arg.startswith(option + "="):
            del args[i]
            return arg.split("=", 1)[1]
    return None


def _exit_with_stdin() -> None:
    """Stop this node (SIGTERM to itself: torchrun's agent stops its ranks) when its stdin closes.

    The ssh launcher runs each node's ``microspeed run`` with this: when the launcher stops the job or dies,
    its ssh ends and the node's stdin reaches its end. The ranks get ``/dev/null`` as stdin instead.
    """
    import threading

    watched = os.dup(0)  # not inherited by the ranks
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)

    def watch() -> None:
        while os.read(watched, 65536):
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="microspeed-stdin-watch", daemon=True).start()


def main(argv: Sequence[str]) -> int:
    """``microspeed run [--as-deepspeed] [torchrun options] script.py [args]``; returns the exit status."""
    from microspeed.cli import _take_flag

    args = list(argv)
    if _wants_help(args):
        print(HELP, end="")
        return 0
    if _uses_hostfile(args):
        from microspeed.cli.multinode import main as multinode_main

        return multinode_main(args)
    as_deepspeed = _take_flag(args, "--as-deepspeed")
    if _take_flag(args, "--exit-with-stdin"):
        _exit_with_stdin()
    from microspeed.cli import pidfile

    stop = _take_value(args, "--stop-job")
    if stop is not None:  # pdsh's stop command on each node: SIGTERM to the node's run (see multinode)
        try:
            pidfile.stop_job(stop)
        except pidfile.PidFileError as exc:
            print(f"microspeed run --stop-job: error: {exc}", file=sys.stderr)
            return 1
        return 0
    pid_job = _take_value(args, "--pid-job")
    if pid_job is not None:
        try:
            pidfile.write_pid(pid_job)
        except pidfile.PidFileError as exc:
            print(f"microspeed run: error: {exc}", file=sys.stderr)
            return 2
    try:
        return _main(args, as_deepspeed)
    finally:
        if pid_job is not None:
            pidfile.remove_pid(pid_job)


def _main(args: list[str], as_deepspeed: bool) -> int:
    if not args:
        print(HELP, end="", file=sys.stderr)
        print("microspeed run: error: give the training script to launch", file=sys.stderr)
        return 2
    if as_deepspeed:
        from microspeed.compat import standin

        if not standin.installed_standin():
            try:
                folder = str(standin.source_folder())
            except FileNotFoundError as exc:
                print(f"microspeed run --as-deepspeed: {exc}", file=sys.stderr)
                return 2
            rest = os.environ.get("PYTHONPATH")
            os.environ["PYTHONPATH"] = folder + (os.pathsep + rest if rest else "")
    from microspeed.cli.elastic import ElasticError, local_args, take_elastic

    try:
        elastic = take_elastic(args)
        if elastic is not None:
            args = local_args(args, elastic)
    except ElasticError as exc:
        print(f"microspeed run: error: {exc}", file=sys.stderr)
        return 2
    if not any(a.startswith("--nproc") for a in _launcher_part(args)):
        args = ["--nproc-per-node", "1", *args]
    return launch(args)


def launch(args: Sequence[str]) -> int:
    """Parse ``args`` as torchrun does, run every rank under :mod:`microspeed.cli.worker`, summarise a failure."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    parser = torchrun.get_args_parser()
    parser.prog = "microspeed run"
    opts = parser.parse_args(list(args))
    if opts.rdzv_backend == "c10d":
        from microspeed.cli.elastic import rendezvous_conf, rendezvous_local_addr

        opts.rdzv_conf = rendezvous_conf(opts.rdzv_endpoint, opts.rdzv_conf)
        opts.local_addr = opts.local_addr or rendezvous_local_addr(opts.rdzv_endpoint)
        # torch's default shares one workers' store across rounds and publishes its address only in the first
        # round: a node that joins a later round (a job growing back) waits for that address forever. The
        # opt-out publishes it every round (the workers' rank 0 serves their store).
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if not opts.no_python and not opts.run_path:
        opts.training_script_args = [*(["-m"] if opts.module else []), opts.training_script,
                                     *opts.training_script_args]
        opts.training_script, opts.module = WORKER_MODULE, True
    own_log_dir = opts.log_dir is None
    if own_log_dir:
        opts.log_dir = tempfile.mkdtemp(prefix="microspeed-run-")
    quiet = {name: logging.getLogger(name).level for name in _QUIET_LOGGERS}
    for name in quiet:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    restore = _report_restarts() if opts.max_restarts > 0 else None
    from microspeed import store_server

    store_server.install(spans_machines=_spans_machines(opts))  # the agent's stores listen on one address
    try:
        torchrun.run(opts)
    except ChildFailedError as exc:
        text, code = describe_failure(exc.failures)
        print(text, file=sys.stderr, flush=True)
        return code
    except SignalException as exc:
        print(f"microspeed run: stopped by {exc.sigval.name}; the ranks were stopped too", file=sys.stderr)
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:
        print("microspeed run: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # the launcher itself failed (rendezvous, port in use, bad option value)
        print(f"microspeed run: torchrun could not run the job: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        for name, level in quiet.items():
            logging.getLogger(name).setLevel(level)
        if restore is not None:
            restore()
    if own_log_dir:
        shutil.rmtree(opts.log_dir, ignore_errors=True)
    return 0


def _spans_machines(opts: Any) -> bool:
    """Whether torchrun's ``--nnodes`` (``N`` or ``MIN:MAX``) allows more than one machine (``--standalone``: no)."""
    if getattr(opts, "standalone", False):
        return False
    try:
        return max(int(n) for n in str(opts.nnodes).split(":")) > 1
    except ValueError:
        return True


def _report_restarts() -> Any:
    """Print the failure summary each time torchrun's agent restarts failed workers (``--max-restarts``): without
    it an elastic job restarts silently (the summary is printed only when no restart is left). Wraps the agent's
    ``_monitor_workers``; returns the function that unwraps it (``None`` where torch's agent has no such method)."""
    try:
        from torch.distributed.elastic.agent.server.api import WorkerState
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    except ImportError:
        return None
    original = getattr(LocalElasticAgent, "_monitor_workers", None)
    if original is None:
        return None

    def monitor(self: Any, worker_group: Any) -> Any:
        result = original(self, worker_group)
        left = getattr(self, "_remaining_restarts", 0)
        if result.state == WorkerState.FAILED and result.failures and left > 0:
            text, _ = describe_failure(result.failures)
            print(f"microspeed run: the workers failed; the agent restarts them ({left} restart(s) left):\n{text}",
                  file=sys.stderr, flush=True)
        return result

    LocalElasticAgent._monitor_workers = monitor

    def restore() -> None:
        LocalElasticAgent._monitor_workers = original

    return restore


# ------------------------------------------------------------------------------------------------------
# The failure summary.


def _info(failure: Any) -> dict[str, Any]:
    """microspeed's fields of a failure's error file (see :mod:`microspeed.cli.worker`), or ``{}``."""
    message = failure.message
    if isinstance(message, dict):
        return message.get("extraInfo", {}).get("microspeed") or {}
    return {}


def _traceback_file(failure: Any) -> str | None:
    """The rank's ``traceback.log`` when it holds something."""
    from microspeed.cli.worker import TRACEBACK_FILE

    path = _info(failure).get("traceback_file")
    if not path and failure.error_file and os.path.isabs(failure.error_file):
        path = os.path.join(os.path.dirname(failure.error_file), TRACEBACK_FILE)
    return path if path and os.path.isfile(path) and os.path.getsize(path) > 0 else None


def _signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _ranges(ranks: Sequence[int]) -> str:
    """``[0, 2, 3, 4, 7]`` -> ``"ranks 0, 2-4, 7"`` (``"rank 3"`` for one)."""
    ranks = sorted(ranks)
    parts, start = [], ranks[0]
    for prev, cur in zip(ranks, [*ranks[1:], None], strict=True):
        if cur is None or cur != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(parts)


def _first_line(text: str, width: int = 140) -> str:
    line = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")
    return line if len(line) <= width else line[: width - 3] + "..."


def root_cause(failures: dict[int, Any]) -> int:
    """The rank that failed first: the earliest recorded Python error, else the earliest non-signal exit."""
    recorded = {r: _info(f)["time"] for r, f in failures.items() if "time" in _info(f)}
    if recorded:
        return min(recorded, key=recorded.__getitem__)
    exited = [r for r, f in failures.items() if f.exitcode > 0]
    return min(exited or failures, key=lambda r: (failures[r].timestamp, r))


def describe_failure(failures: dict[int, Any]) -> tuple[str, int]:
    """The console text for torchrun's failures (``{global rank: ProcessFailure}``) and the exit status."""
    root = root_cause(failures)
    failure = failures[root]
    info = _info(failure)
    if failure.exitcode > 0:
        code, head = failure.exitcode, f"microspeed run: rank {root} failed (exit code {failure.exitcode})"
    elif info:  # it raised, then torchrun stopped it while it was exiting
        code, head = 1, f"microspeed run: rank {root} failed"
    else:
        code = 128 - failure.exitcode if failure.exitcode < 0 else 1
        head = f"microspeed run: rank {root} was killed by {_signal_name(failure.exitcode)}"
    lines = [head + (":" if info.get("short") else "")]
    if info.get("short"):
        lines.append(info["short"].rstrip("\n"))
    elif failure.exitcode > 0:
        lines[0] += " without a Python traceback (sys.exit, or an error its own code printed above)"
    groups: dict[str, list[int]] = {}
    for rank, other in failures.items():
        if rank == root:
            continue
        other_info = _info(other)
        if other_info:  # it raised too (torchrun may have stopped it while it was exiting)
            what = f"{_first_line(other.message.get('message', ''))} (after rank {root} failed)"
        elif other.exitcode < 0:
            what = f"stopped by {_signal_name(other.exitcode)} after rank {root} failed"
        else:
            what = f"exited with code {other.exitcode}"
        groups.setdefault(what, []).append(rank)
    lines += [f"microspeed run: {_ranges(ranks)}: {what}" for what, ranks in groups.items()]
    files = {r: _traceback_file(f) for r, f in sorted(failures.items())}
    files = {r: p for r, p in files.items() if p}
    if len(files) <= 4:
        lines += [f"microspeed run: rank {r} full traceback: {p}" for r, p in files.items()]
    else:
        folder = os.path.dirname(os.path.dirname(files[root] if root in files else next(iter(files.values()))))
        lines.append(f"microspeed run: full tracebacks of {_ranges(list(files))}: "
                     f"{folder}{os.sep}<local rank>{os.sep}traceback.log")
    outputs = _output_logs(failure)
    if outputs:
        lines.append(f"microspeed run: rank {root} output: {', '.join(outputs)}")
    return "\n".join(lines), code


def _output_logs(failure: Any) -> list[str]:
    """The rank's ``stdout.log``/``stderr.log`` (written with ``--redirects``/``--tee``) when not empty."""
    if not failure.error_file or not os.path.isabs(failure.error_file):
        return []
    folder = os.path.dirname(failure.error_file)
    paths = [os.path.join(folder, name) for name in ("stdout.log", "stderr.log")]
    return [p for p in paths if os.path.isfile(p) and os.path.getsize(p) > 0]
