"""``microspeed run --hostfile``: torchrun on every host of a hostfile (over ssh, pdsh or slurm), as DeepSpeed's runner.

Every selected host runs ``python -u -m microspeed.cli run --nnodes N --node-rank R --nproc-per-node S
--master-addr A --master-port P script.py args`` in the launcher's working directory, with the launcher's
exported environment (see :func:`collect_exports`). So each node is an ordinary ``microspeed run`` (torchrun
with microspeed's short failure report), and the ranks of node R follow those of nodes 0..R-1 as torchrun
numbers them.

Launchers (``--launcher``; default pdsh where installed, else ssh, as "ssh or pdsh, whichever the host has"):

* ``ssh``: one ``ssh HOST 'cd DIR && exec env K=V ... python -u -m microspeed.cli run ...'`` per host, started
  and watched by this process. Lines are printed prefixed with ``HOST:``. When a node fails, the others are
  stopped (their ssh's stdin is closed: the node's ``microspeed run --exit-with-stdin`` stops its ranks), and the
  report names the host that failed first, with its own failure summary.
* ``pdsh``: one ``pdsh -S -f 1024 -w h1,h2 ...`` (``--node-rank %n``); stopping runs
  ``pdsh -w HOSTS 'python -m microspeed.cli run --stop-job JOB'``, which signals the pid each node wrote in its
  user's private folder (:mod:`microspeed.cli.pidfile`).
* ``slurm``: one ``srun --nodes N --ntasks-per-node 1 --nodelist h1,h2 --kill-on-bad-exit=1 bash -c '...'``
  (``--node-rank $SLURM_NODEID``).

Before ssh/pdsh launches, every host is checked with ``ssh -o BatchMode=yes -o ConnectTimeout=5 -- HOST true``; a
host that does not answer is an error naming it.

What lands in a remote shell is checked or quoted: hosts are host names or IP addresses
(:func:`microspeed.cli.hostfile.check_host`) and every ssh argv has ``--`` before the host (pdsh and srun take
the hosts as one ``-w``/``--nodelist`` value, which the check keeps free of options and pdsh syntax); environment
variable names are ``[A-Za-z_][A-Za-z0-9_]*`` (:func:`check_env_name`); every value, the folder and each argument
is ``shlex``-quoted. ``--launcher_args`` are the user's own ssh/pdsh/srun options and are passed as given.

:class:`NodeCommand` builds one node's argv; its ``rendezvous`` and ``max_restarts`` fields give the elastic form
(``--nnodes MIN:MAX --rdzv-backend c10d``), which ``--elastic MIN:MAX [--max_restarts N]`` selects
(:mod:`microspeed.cli.elastic`): every host joins one c10d rendezvous at ``--master_addr:--master_port`` with the
launch's job id, and a node that fails no longer stops the others.

Elastic ssh launches also (see :func:`run_ssh_nodes`): run ssh with keep-alives (``ServerAliveInterval``
:data:`ELASTIC_SSH_ALIVE_S` × ``ServerAliveCountMax`` :data:`ELASTIC_SSH_ALIVE_COUNT`), so a host whose link is cut
counts as lost within about 10 s instead of at TCP's timeout; probe a lost host every :data:`REJOIN_PROBE_S`
seconds with the ssh check and, when it answers again, start its node again (at most ``--max_restarts`` times per
host): its agent joins the rendezvous and the running agents restart the job at the larger size, which resumes from
the newest complete checkpoint (``checkpoint.auto_resume_dir``); and, once a node finished the job, stop the nodes
still running after :data:`STOP_GRACE_S` (an agent that joined late would wait in the rendezvous for a job that
ended).

An elastic ssh launch without ``--master_addr`` hosts the c10d rendezvous store in the launcher itself (a
``TCPStore`` at the launcher's address that reaches node 0, :func:`microspeed.netaddr.source_address`, port
``--master_port``), so no training node is special: any of them may be lost and come back. The launcher's
machine must then stay up for the whole job (as with ssh, it holds every node's session). With
``--master_addr`` the rendezvous is there and the node at that address hosts it (its loss ends the job, as
with torchrun's c10d backend).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

from microspeed.cli.hostfile import HostfileError, check_host, read_hostfile, select_resources
from microspeed.netaddr import source_address

EXPORT_PREFIXES = ("NCCL", "PYTHON", "MLFLOW", "MV2", "UCX", "GLOO_", "MICROSPEED_")
"""Variables of the launcher's environment sent to every node: DeepSpeed's (NCCL, PYTHON*, MLFLOW, MV2, UCX) and
microspeed's additions (GLOO_ for the CPU backend's interface choice, MICROSPEED_)."""

ENV_FILE_NAMES = (".deepspeed_env", ".microspeed_env")
"""Files of ``KEY=VALUE`` lines sent to every node, read from the home folder, then the working directory (later
ones win). ``DS_ENV_FILE`` replaces the first name, as in DeepSpeed."""

DEFAULT_MASTER_PORT = 29500
SSH_CHECK_TIMEOUT = 5
PDSH_FAN_OUT = 1024
STOP_GRACE_S = 20.0
"""Seconds the other nodes get to stop their ranks after a failure before their ssh is terminated."""
ELASTIC_SSH_ALIVE_S = 2
ELASTIC_SSH_ALIVE_COUNT = 5
"""Elastic ssh launches: keep-alive interval (s) and unanswered keep-alives after which ssh ends (a cut link)."""
REJOIN_PROBE_S = 3.0
"""Elastic ssh launches: seconds between two reachability checks of a lost host."""

_OWN_FLAGS = frozenset({"--no_ssh_check", "--no-ssh-check", "--force_multi", "--force-multi"})
_SET_HERE = ("--nnodes", "--node-rank", "--node_rank", "--nproc-per-node", "--nproc_per_node", "--master-addr",
             "--master_addr", "--master-port", "--master_port", "--standalone", "--rdzv-backend", "--rdzv_backend",
             "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-id", "--rdzv_id")


class LaunchError(RuntimeError):
    """The hostfile launcher cannot start the job (a host unreachable, a launcher missing, an env file line)."""


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_env_name(name: str, where: str) -> str:
    """``name`` when it is a portable environment variable name (``[A-Za-z_][A-Za-z0-9_]*``), else a
    :class:`LaunchError` naming it and ``where`` it came from: it is written unquoted before ``=`` in the
    remote shell line, where anything else (``A$(cmd)``, ``A;cmd``) would be run by the node's shell."""
    if not _ENV_NAME.fullmatch(name):
        raise LaunchError(f"{where}: environment variable name {name!r} is not [A-Za-z_][A-Za-z0-9_]*, so it cannot "
                          f"be sent to the nodes' shells: rename or unset it")
    return name


# ------------------------------------------------------------------------------------------------------
# Environment propagation.


def read_env_file(path: str) -> dict[str, str]:
    """``KEY=VALUE`` lines of an environment file (blank lines and ``#`` comments skipped)."""
    out: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f.read().splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.partition("=")
            key = key.strip().removeprefix("export ").strip()
            if not sep:
                raise LaunchError(f"{path}:{number}: bad line {raw!r}: expected KEY=VALUE")
            out[check_env_name(key, f"{path}:{number}")] = value.strip()
    return out


def env_files(cwd: str | None = None, home: str | None = None, environ: Mapping[str, str] | None = None) -> list[str]:
    """The environment files that exist, in reading order (home first, then the working directory)."""
    environ = os.environ if environ is None else environ
    names = (environ.get("DS_ENV_FILE", ENV_FILE_NAMES[0]), *ENV_FILE_NAMES[1:])
    folders = [home or os.path.expanduser("~"), cwd or os.getcwd()]
    seen, found = set(), []
    for folder in folders:
        for name in names:
            path = os.path.abspath(os.path.join(folder, name))
            if path not in seen and os.path.isfile(path):
                seen.add(path)
                found.append(path)
    return found


def collect_exports(environ: Mapping[str, str] | None = None, cwd: str | None = None,
                    home: str | None = None) -> dict[str, str]:
    """What every node gets: the exported prefixes of ``environ``, the working directory first on ``PYTHONPATH``
    (as DeepSpeed), then the environment files' lines."""
    environ = dict(os.environ if environ is None else environ)
    cwd = os.path.abspath(cwd or os.getcwd())
    environ["PYTHONPATH"] = cwd + (os.pathsep + environ["PYTHONPATH"] if environ.get("PYTHONPATH") else "")
    exports = {check_env_name(k, "the launcher's environment"): v for k, v in environ.items()
               if k.startswith(EXPORT_PREFIXES)}
    for path in env_files(cwd, home, environ):
        exports.update(read_env_file(path))
    return exports


# ------------------------------------------------------------------------------------------------------
# Command lines.


@dataclass
class NodeCommand:
    """One node's ``microspeed run`` (torchrun) argv; the same for every node but for the node rank and slots.

    ``rendezvous="static"``: ``--nnodes N --node-rank R --master-addr A --master-port P``;
    ``rendezvous="c10d"``: ``--nnodes MIN:MAX --rdzv-backend c10d --rdzv-endpoint A:P --rdzv-id ID`` (elastic: every
    node the same, no node rank). ``max_restarts`` adds ``--max-restarts``; ``torchrun_args`` other torchrun options.
    """

    nnodes: str
    master_addr: str
    master_port: int = DEFAULT_MASTER_PORT
    script: Sequence[str] = ()
    torchrun_args: Sequence[str] = ()
    rendezvous: str = "static"
    rdzv_id: str = ""
    max_restarts: int = 0
    python: str = sys.executable
    stop_with_stdin: bool = False
    pid_job: str | None = None
    run_flags: Sequence[str] = field(default_factory=tuple)

    def argv(self, node_rank: int | str, nproc: int) -> list[str]:
        """The argv that node ``node_rank`` runs (``node_rank`` may be a placeholder such as ``%n``)."""
        out = [self.python, "-u", "-m", "microspeed.cli", "run", *self.run_flags]
        if self.stop_with_stdin:
            out.append("--exit-with-stdin")
        if self.pid_job:
            out += ["--pid-job", self.pid_job]
        out += ["--nnodes", str(self.nnodes), "--nproc-per-node", str(nproc)]
        if self.rendezvous == "static":
            out += ["--node-rank", str(node_rank), "--master-addr", self.master_addr,
                    "--master-port", str(self.master_port)]
        elif self.rendezvous == "c10d":
            out += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.master_addr}:{self.master_port}",
                    "--rdzv-id", self.rdzv_id or "microspeed"]
        else:
            raise ValueError(f"rendezvous={self.rendezvous!r}: expected 'static' or 'c10d'")
        if self.max_restarts:
            out += ["--max-restarts", str(self.max_restarts)]
        return out + list(self.torchrun_args) + list(self.script)


def shell_line(argv: Sequence[str], cwd: str, exports: Mapping[str, str], node_rank_token: str | None = None) -> str:
    """``cd CWD && exec env K=V ... argv`` for a remote shell; ``node_rank_token`` (``$SLURM_NODEID``) is unquoted."""
    def q(a: str) -> str:
        return a if node_rank_token is not None and a == node_rank_token else shlex.quote(a)

    env = " ".join(f"{check_env_name(k, 'exports')}={shlex.quote(v)}" for k, v in exports.items())
    return f"cd {shlex.quote(cwd)} && exec env {env + ' ' if env else ''}{' '.join(q(a) for a in argv)}"


def ssh_base(ssh_args: Sequence[str] = (), port: int | None = None) -> list[str]:
    """``ssh`` with the user's options and port."""
    return ["ssh", *(["-p", str(port)] if port else []), *ssh_args]


def ssh_check_argv(host: str, ssh_args: Sequence[str] = (), port: int | None = None,
                   timeout: int = SSH_CHECK_TIMEOUT) -> list[str]:
    """The reachability check: ``ssh -o BatchMode=yes -o ConnectTimeout=5 -- HOST true``."""
    return [*ssh_base(ssh_args, port), "-o", "BatchMode=yes", "-o", f"ConnectTimeout={timeout}", "--",
            check_host(host, "ssh"), "true"]


def ssh_argvs(hosts: Mapping[str, list[int]], node: NodeCommand, cwd: str, exports: Mapping[str, str],
              ssh_args: Sequence[str] = (), port: int | None = None) -> dict[str, list[str]]:
    """``{host: ssh argv}``: node rank = the host's position; ``CUDA_VISIBLE_DEVICES`` where slots were chosen."""
    out = {}
    for rank, (host, slots) in enumerate(hosts.items()):
        env = dict(exports)
        if slots != list(range(len(slots))):
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
        out[host] = [*ssh_base(ssh_args, port), "--", check_host(host, "ssh"),
                     shell_line(node.argv(rank, len(slots)), cwd, env)]
    return out


def _uniform_slots(hosts: Mapping[str, list[int]], launcher: str) -> list[int]:
    slot_lists = {tuple(s) for s in hosts.values()}
    if len(slot_lists) != 1:
        detail = ", ".join(f"{h}: {len(s)}" for h, s in hosts.items())
        raise LaunchError(f"--launcher {launcher} starts the same command on every host, but the hosts have different "
                          f"slots ({detail}); use --launcher ssh, or --num_gpus to give every host the same")
    return list(next(iter(slot_lists)))


def pdsh_argv(hosts: Mapping[str, list[int]], node: NodeCommand, cwd: str, exports: Mapping[str, str],
              launcher_args: Sequence[str] = ()) -> list[str]:
    """One ``pdsh`` line for every host (pdsh replaces ``%n`` by the node's rank)."""
    slots = _uniform_slots(hosts, "pdsh")
    env = dict(exports)
    if slots != list(range(len(slots))):
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
    line = shell_line(node.argv("%n", len(slots)), cwd, env, node_rank_token="%n")
    return ["pdsh", "-S", "-f", str(PDSH_FAN_OUT), "-w", host_list(hosts, "pdsh -w"), *launcher_args, line]


def host_list(hosts: Iterable[str], option: str) -> str:
    """``h1,h2`` for pdsh's ``-w`` or srun's ``--nodelist``, each host checked (:func:`check_host`): these tools
    take no ``--``, and pdsh reads ``^file``, ``user@host`` and ``-`` prefixes in that list."""
    return ",".join(check_host(h, option) for h in hosts)


def pdsh_kill_argv(hosts: Sequence[str], job: str, launcher_args: Sequence[str] = (),
                   python: str = sys.executable) -> list[str]:
    """Stops every node's ``microspeed run`` (``microspeed run --stop-job JOB``: SIGTERM to the pid it wrote in its
    user's private folder, :mod:`microspeed.cli.pidfile`; it stops its ranks)."""
    line = " ".join(shlex.quote(a) for a in (python, "-m", "microspeed.cli", "run", "--stop-job", job))
    return ["pdsh", "-f", str(PDSH_FAN_OUT), "-w", host_list(hosts, "pdsh -w"), *launcher_args, line]


def srun_argv(hosts: Mapping[str, list[int]], node: NodeCommand, cwd: str, exports: Mapping[str, str],
              launcher_args: Sequence[str] = ()) -> list[str]:
    """One ``srun`` step: one task per host, each a node's ``microspeed run`` with ``--node-rank $SLURM_NODEID``."""
    slots = _uniform_slots(hosts, "slurm")
    env = dict(exports)
    if slots != list(range(len(slots))):
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
    n = len(hosts)
    line = shell_line(node.argv("$SLURM_NODEID", len(slots)), cwd, env, node_rank_token="$SLURM_NODEID")
    return ["srun", "--nodes", str(n), "--ntasks", str(n), "--ntasks-per-node", "1", "--nodelist",
            host_list(hosts, "srun --nodelist"),
            "--kill-on-bad-exit=1", *launcher_args, "--export=ALL", "bash", "-c", line]


# ------------------------------------------------------------------------------------------------------
# Checks before the launch.


def check_reachable(hosts: Sequence[str], ssh_args: Sequence[str] = (), port: int | None = None,
                    timeout: int = SSH_CHECK_TIMEOUT) -> None:
    """Run the ssh check on every host at once; raise :class:`LaunchError` naming each host that does not answer."""
    procs = {h: subprocess.Popen(ssh_check_argv(h, ssh_args, port, timeout), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for h in hosts}
    problems = []
    for host, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=timeout + 15)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            err = f"no answer within {timeout + 15} s"
        if proc.returncode != 0:
            last = next((ln.strip() for ln in reversed(err.splitlines()) if ln.strip()), f"exit code {proc.returncode}")
            problems.append(f"host {host!r} is not reachable over ssh: {last}")
    if problems:
        raise LaunchError("; ".join(problems) + ". Every host must accept `ssh HOST` without a password (keys; "
                          "BatchMode) from this machine; --launcher_args passes ssh options (-F config, -i key), "
                          "--ssh_port the port; --no_ssh_check skips this check")


def first_address(host: str, ssh_args: Sequence[str] = (), port: int | None = None) -> str:
    """The first address ``hostname -I`` gives on ``host`` (over ssh), as DeepSpeed finds the master address."""
    argv = [*ssh_base(ssh_args, port), "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_CHECK_TIMEOUT}", "--",
            check_host(host, "ssh"), "hostname -I"]
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=SSH_CHECK_TIMEOUT + 15,
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        res = None
    words = res.stdout.split() if res is not None and res.returncode == 0 else []
    if not words:
        raise LaunchError(f"cannot find {host}'s address with `hostname -I` over ssh: give --master_addr (an "
                          f"address of the first host that every host can reach)")
    return check_host(words[0], f"{host}'s `hostname -I`")


def host_rendezvous(addr: str, port: int) -> object:
    """Start the c10d rendezvous store of an elastic launch in this process (a ``TCPStore`` server listening on
    ``addr:port`` only, :class:`microspeed.store_server.BoundTCPStore`; it serves as long as the returned object
    lives); :class:`LaunchError` when the port is taken."""
    import datetime

    from microspeed.store_server import BoundTCPStore

    try:
        return BoundTCPStore(addr, port, is_master=True, wait_for_workers=False, multi_tenant=True,
                             timeout=datetime.timedelta(seconds=60))
    except Exception as exc:  # RuntimeError / DistNetworkError from the C++ side
        raise LaunchError(f"cannot host the rendezvous at {addr}:{port} ({exc}): give a free --master_port, or "
                          f"--master_addr to have that node host it") from None


# ------------------------------------------------------------------------------------------------------
# Running and watching the nodes (ssh launcher).


class _Node:
    """One host's ssh process, its output pumped to the console with a ``HOST:`` prefix."""

    def __init__(self, rank: int, host: str, argv: list[str]) -> None:
        self.rank, self.host = rank, host
        self.summary: list[str] = []  # the node's own "microspeed run: ..." lines
        self.last_err: list[str] = []
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True)
        self.pumps = [threading.Thread(target=self._pump, args=(s, t, e), daemon=True)
                      for s, t, e in ((self.proc.stdout, sys.stdout, False), (self.proc.stderr, sys.stderr, True))]
        for t in self.pumps:
            t.start()

    def _pump(self, stream: IO[bytes], out: IO[str], is_err: bool) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            if is_err:
                self.last_err = [*self.last_err[-19:], line]
                if line.startswith("microspeed run:") or self.summary and not line.startswith("microspeed"):
                    self.summary.append(line)
            print(f"{self.host}: {line}", file=out, flush=True)

    def stop(self) -> None:
        """Ask the node to stop: closing stdin ends the remote ``--exit-with-stdin`` watch (SIGTERM to its agent)."""
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
        except OSError:
            pass

    def kill(self) -> None:
        """Terminate the local ssh (after the grace period)."""
        if self.proc.poll() is None:
            self.proc.terminate()


def _describe_node_failure(node: _Node, code: int) -> str:
    head = f"microspeed run: node {node.rank} ({node.host}) failed first"
    if code == 255 and not node.summary:
        last = node.last_err[-1] if node.last_err else ""
        return f"{head}: ssh to {node.host} failed (exit code 255){': ' + last if last else ''}"
    lines = [f"{head} (exit code {code})" + (":" if node.summary else "")]
    lines += [f"  {node.host}: {ln}" for ln in node.summary[:20]]
    if not node.summary and node.last_err:
        lines += [f"  {node.host}: {ln}" for ln in node.last_err[-5:]]
    return "\n".join(lines)


def run_ssh_nodes(argvs: Mapping[str, list[str]], grace_s: float = STOP_GRACE_S, elastic: bool = False,
                  probes: Mapping[str, list[str]] | None = None, rejoins: int = 0,
                  probe_interval_s: float = REJOIN_PROBE_S) -> int:
    """Start every node, wait; when one fails, stop the others and print a report naming the host; the exit status.

    ``elastic`` (``--elastic``): a failing node is reported and the others keep running (their torchrun agents
    restart the workers at the smaller size). A lost host with a ``probes`` argv (the ssh check) is checked every
    ``probe_interval_s`` while the job runs, and started again when the check passes, up to ``rejoins`` times per
    host. Once a node finished (exit 0), the others get ``grace_s`` to finish and are then stopped. The status is 0
    when a node finished the job, else the first failure's.
    """
    nodes = [_Node(rank, host, argv) for rank, (host, argv) in enumerate(argvs.items())]
    failed: tuple[_Node, int] | None = None
    interrupted: int | None = None
    lost: list[tuple[_Node, int]] = []
    checks: dict[int, tuple[subprocess.Popen[bytes] | None, float]] = {}  # node rank -> (running check, next at)
    started = dict.fromkeys(range(len(nodes)), 0)
    finished_at: float | None = None

    def on_signal(signum: int, frame: object) -> None:
        nonlocal interrupted
        interrupted = signum

    def rejoin(index: int) -> None:
        node = nodes[index]
        check, next_at = checks.get(node.rank, (None, 0.0))
        if check is None:
            if time.monotonic() >= next_at:
                checks[node.rank] = (subprocess.Popen(list((probes or {})[node.host]), stdin=subprocess.DEVNULL,
                                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                      start_new_session=True), 0.0)
            return
        if check.poll() is None:
            return
        checks[node.rank] = (None, time.monotonic() + probe_interval_s)
        if check.returncode != 0:
            return
        started[node.rank] += 1
        print(f"microspeed run: node {node.rank} ({node.host}) answers again: starting it again to rejoin the job "
              f"(elastic, {started[node.rank]} of {rejoins})", file=sys.stderr, flush=True)
        nodes[index] = _Node(node.rank, node.host, argvs[node.host])
        lost[:] = [(n, c) for n, c in lost if n is not node]

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)} \
        if threading.current_thread() is threading.main_thread() else {}
    try:
        while failed is None and interrupted is None:
            codes = [n.proc.poll() for n in nodes]
            bad = [(n, c) for n, c in zip(nodes, codes, strict=True) if c not in (None, 0)]
            if elastic:
                for n, c in bad:
                    if all(n is not m for m, _ in lost):
                        lost.append((n, c))
                        print(f"microspeed run: node {n.rank} ({n.host}) ended with exit code {c}; the other nodes "
                              f"continue (elastic)", file=sys.stderr, flush=True)
                if all(c is not None for c in codes):
                    if not any(c == 0 for c in codes):
                        failed = lost[0]
                    break
                if 0 in codes:
                    finished_at = finished_at or time.monotonic()
                    if time.monotonic() - finished_at > grace_s:
                        late = [n for n, c in zip(nodes, codes, strict=True) if c is None]
                        print(f"microspeed run: the job finished; stopping the node(s) still running: "
                              f"{', '.join(f'node {n.rank} ({n.host})' for n in late)}", file=sys.stderr, flush=True)
                        interrupted = 0
                        break
                elif probes:
                    for i, (n, c) in enumerate(zip(nodes, codes, strict=True)):
                        if c not in (None, 0) and n.host in probes and started[n.rank] < rejoins:
                            rejoin(i)
            elif bad:
                failed = bad[0]
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(0.1)
        for check, _ in checks.values():
            if check is not None and check.poll() is None:
                check.kill()
        if failed is not None or interrupted is not None:
            for n in nodes:
                n.stop()
            deadline = time.monotonic() + grace_s
            while any(n.proc.poll() is None for n in nodes) and time.monotonic() < deadline:
                time.sleep(0.1)
            for n in nodes:
                n.kill()
        for n in nodes:
            try:
                n.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                n.proc.kill()
                n.proc.wait()
            for t in n.pumps:
                t.join(timeout=5)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if interrupted == 0:  # the job finished on some node; late ones were stopped
        return 0
    if interrupted is not None:
        print(f"microspeed run: stopped by {signal.Signals(interrupted).name}; every node was stopped", file=sys.stderr)
        return 128 + interrupted
    if failed is not None:
        node, code = failed
        others = [f"node {n.rank} ({n.host})" for n in nodes if n is not node]
        text = _describe_node_failure(node, code)
        if others and not elastic:
            text += f"\nmicrospeed run: stopped the other node(s): {', '.join(others)}"
        elif elastic:
            text += "\nmicrospeed run: no node finished the job (elastic)"
        print(text, file=sys.stderr, flush=True)
        return code if 0 < code < 255 else 1
    return 0


def run_one(argv: Sequence[str], env: Mapping[str, str] | None = None, kill_argv: Sequence[str] | None = None) -> int:
    """Run one launcher process (pdsh, srun) to its end; on SIGINT/SIGTERM stop it (and run ``kill_argv``).

    srun ends the whole step when a task fails (``--kill-on-bad-exit=1``); pdsh waits for every host, whose
    ranks end when their peers' connections close (or at the collectives' timeout).
    """
    env = dict(env) if env is not None else None
    proc = subprocess.Popen(list(argv), env=env)
    stopped: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        stopped.append(signum)
        proc.send_signal(signal.SIGINT)  # srun: cancels the step; pdsh: ends its ssh's
        if kill_argv:
            subprocess.run(list(kill_argv), env=env, check=False, timeout=60)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)} \
        if threading.current_thread() is threading.main_thread() else {}
    try:
        while True:
            try:
                code = proc.wait(timeout=STOP_GRACE_S if stopped else None)
                break
            except subprocess.TimeoutExpired:
                proc.kill()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if stopped:
        print(f"microspeed run: stopped by {signal.Signals(stopped[0]).name}", file=sys.stderr)
        return 128 + stopped[0]
    return code


# ------------------------------------------------------------------------------------------------------
# The command.


def split_launcher_args(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(launcher options, script and its arguments)``."""
    from microspeed.cli.run import _FLAGS

    flags = _FLAGS | _OWN_FLAGS
    i, out = 0, []
    args = list(args)
    while i < len(args) and args[i].startswith("-"):
        takes_value = args[i] not in flags and "=" not in args[i]
        out += args[i:i + 1 + takes_value]
        i += 1 + takes_value
    return out, args[i:]


def parser() -> argparse.ArgumentParser:
    """The hostfile launcher's own options (the rest of the launcher options go to every node's torchrun)."""
    p = argparse.ArgumentParser(prog="microspeed run --hostfile", add_help=False, allow_abbrev=False)
    p.add_argument("-H", "--hostfile", required=True)
    p.add_argument("-i", "--include", default="")
    p.add_argument("-e", "--exclude", default="")
    p.add_argument("--num_nodes", "--num-nodes", type=int, default=-1)
    p.add_argument("--num_gpus", "--num-gpus", "--num_accelerators", "--nproc-per-node", "--nproc_per_node",
                   dest="num_gpus", type=int, default=-1)
    p.add_argument("--master_addr", "--master-addr", default="")
    p.add_argument("--master_port", "--master-port", type=int, default=DEFAULT_MASTER_PORT)
    p.add_argument("--launcher", default=None, choices=["ssh", "pdsh", "slurm"], type=str.lower)
    p.add_argument("--launcher_args", "--launcher-args", default="")
    p.add_argument("--ssh_port", "--ssh-port", type=int, default=None)
    p.add_argument("--no_ssh_check", "--no-ssh-check", action="store_true")
    p.add_argument("--force_multi", "--force-multi", action="store_true")
    p.add_argument("--elastic", default=None)
    return p


def plan(args: Sequence[str], cwd: str | None = None, environ: Mapping[str, str] | None = None,
         check: bool = True) -> dict:
    """Parse ``args`` and build the launch: ``{"launcher", "hosts", "argvs" | "argv", "kill_argv", "env"}``.

    ``check=False`` skips everything that talks to the hosts (the ssh check, finding the master address).
    """
    launcher_part, script = split_launcher_args(args)
    opts, passthrough = parser().parse_known_args(launcher_part)
    for a in passthrough:
        if a.split("=", 1)[0] in _SET_HERE:
            raise HostfileError(f"{a.split('=', 1)[0]}: the hostfile launcher sets it from the hostfile (use "
                                f"--num_nodes/--num_gpus/--include/--exclude and --master_addr/--master_port)")
    if not script:
        raise HostfileError("give the training script to launch (microspeed run --hostfile FILE [options] script.py)")
    if opts.master_addr:
        check_host(opts.master_addr, "--master_addr")
    pool = read_hostfile(opts.hostfile)
    hosts = select_resources(pool, opts.include, opts.exclude, opts.num_nodes, opts.num_gpus, source=opts.hostfile)
    elastic = None
    if opts.elastic is not None:
        from microspeed.cli.elastic import DEFAULT_MAX_RESTARTS, ElasticSpec, parse_nodes, parse_restarts, take_option

        low, high = parse_nodes(opts.elastic, node_limit=len(hosts))
        restarts = take_option(passthrough, ("--max_restarts", "--max-restarts"))
        elastic = ElasticSpec(low, high, DEFAULT_MAX_RESTARTS if restarts is None else parse_restarts(restarts))
    cwd = os.path.abspath(cwd or os.getcwd())
    launcher = opts.launcher or ("pdsh" if shutil.which("pdsh") else "ssh")
    launcher_args = shlex.split(opts.launcher_args)
    environ = dict(os.environ if environ is None else environ)
    run_flags = [a for a in passthrough if a == "--as-deepspeed"]
    torchrun_args = [a for a in passthrough if a != "--as-deepspeed"]
    result: dict = {"launcher": launcher, "hosts": hosts}
    if len(hosts) == 1 and not opts.force_multi:  # DeepSpeed: one host runs here, without ssh
        host, slots = next(iter(hosts.items()))
        local = [*run_flags, "--nproc-per-node", str(len(slots)), "--master-port", str(opts.master_port),
                 *torchrun_args, *script]
        if elastic is not None:
            local = ["--elastic", elastic.nnodes, "--max-restarts", str(elastic.max_restarts), *local]
        result.update(launcher="local", argv=local, env=environ)
        if slots != list(range(len(slots))):
            result["env"] = {**environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, slots))}
        return result
    if launcher in ("ssh", "pdsh"):
        ssh_args = launcher_args if launcher == "ssh" else shlex.split(environ.get("PDSH_SSH_ARGS_APPEND", ""))
        if check and not opts.no_ssh_check:
            check_reachable(list(hosts), ssh_args, opts.ssh_port)
        master = opts.master_addr or (first_address(next(iter(hosts)), ssh_args, opts.ssh_port) if check else "")
    else:
        master = opts.master_addr or next(iter(hosts))
    exports = collect_exports(environ, cwd)
    job = uuid.uuid4().hex[:12]
    node = NodeCommand(nnodes=str(len(hosts)), master_addr=master, master_port=opts.master_port,
                       script=script, torchrun_args=torchrun_args, run_flags=run_flags,
                       stop_with_stdin=launcher == "ssh",
                       pid_job=job if launcher == "pdsh" else None)
    if elastic is not None:  # one c10d rendezvous; no node ranks
        node.nnodes, node.rendezvous, node.rdzv_id, node.max_restarts = elastic.nnodes, "c10d", job, \
            elastic.max_restarts
        here = source_address(master) if launcher == "ssh" and not opts.master_addr and master else None
        if here:  # the launcher hosts it: no node is special
            node.master_addr = here
            result["rendezvous"] = (here, opts.master_port)
    result["node"], result["elastic"] = node, elastic
    if launcher == "ssh":
        ssh_args = launcher_args
        if elastic is not None:  # a cut link ends the host's ssh within ~10 s; the user's -o options come first (win)
            ssh_args = [*launcher_args, "-o", f"ServerAliveInterval={ELASTIC_SSH_ALIVE_S}", "-o",
                        f"ServerAliveCountMax={ELASTIC_SSH_ALIVE_COUNT}"]
            result["probes"] = {h: ssh_check_argv(h, launcher_args, opts.ssh_port) for h in hosts}
        result["argvs"] = ssh_argvs(hosts, node, cwd, exports, ssh_args, opts.ssh_port)
    elif launcher == "pdsh":
        env = {**environ, "PDSH_RCMD_TYPE": "ssh"}
        if opts.ssh_port:
            env["PDSH_SSH_ARGS_APPEND"] = f"{environ.get('PDSH_SSH_ARGS_APPEND', '')} -p {opts.ssh_port}".strip()
        result.update(argv=pdsh_argv(hosts, node, cwd, exports, launcher_args), env=env,
                      kill_argv=pdsh_kill_argv(list(hosts), job, launcher_args, node.python))
    else:
        result.update(argv=srun_argv(hosts, node, cwd, exports, launcher_args), env=environ)
    return result


def main(args: Sequence[str]) -> int:
    """``microspeed run --hostfile FILE [options] script.py [args]``; returns the exit status."""
    from microspeed.cli.elastic import ElasticError

    try:
        launch = plan(args)
    except (HostfileError, ElasticError, LaunchError) as exc:
        print(f"microspeed run: error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, LaunchError) else 2
    launcher = launch["launcher"]
    if launcher == "local":
        print(f"microspeed run: one host selected ({next(iter(launch['hosts']))}): running here without ssh "
              f"(--force_multi to go through the launcher)", file=sys.stderr)
        from microspeed.cli.run import main as run_main

        os.environ.update(launch["env"])
        return run_main(launch["argv"])
    tool = {"ssh": "ssh", "pdsh": "pdsh", "slurm": "srun"}[launcher]
    if not shutil.which(tool):
        print(f"microspeed run: error: --launcher {launcher} needs `{tool}`, which is not installed here",
              file=sys.stderr)
        return 1
    hosts = ", ".join(f"{h} ({len(s)})" for h, s in launch["hosts"].items())
    store = None
    if "rendezvous" in launch:
        try:
            store = host_rendezvous(*launch["rendezvous"])
        except LaunchError as exc:
            print(f"microspeed run: error: {exc}", file=sys.stderr)
            return 1
        where = "rendezvous hosted here (elastic: any node may be lost)"
    else:
        where = "master"
    print(f"microspeed run: {launcher} launch on {len(launch['hosts'])} nodes: {hosts}; {where} "
          f"{launch['node'].master_addr}:{launch['node'].master_port}", file=sys.stderr, flush=True)
    if launcher == "ssh":
        elastic = launch["elastic"]
        try:
            return run_ssh_nodes(launch["argvs"], elastic=elastic is not None, probes=launch.get("probes"),
                                 rejoins=elastic.max_restarts if elastic is not None else 0)
        finally:
            del store
    return run_one(launch["argv"], launch["env"], launch.get("kill_argv"))
