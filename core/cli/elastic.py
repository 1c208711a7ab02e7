"""``microspeed run --elastic MIN:MAX [--max_restarts N]``: torchrun's elastic form, on one c10d rendezvous.

Locally, ``--elastic MIN:MAX`` becomes torchrun's ``--nnodes MIN:MAX --max-restarts N --rdzv-backend c10d
--rdzv-endpoint HOST:PORT --rdzv-id ID``: every agent started with the same endpoint and job id (on this machine
or others) joins one job of MIN to MAX nodes, and torchrun's agent restarts the worker group at the new size when
a node leaves or joins (up to N failures). With ``--hostfile`` every host's command uses that same rendezvous
(:class:`microspeed.cli.multinode.NodeCommand`'s elastic form).

* ``HOST:PORT``: ``--rdzv-endpoint`` when given, else ``--master-addr`` (default ``127.0.0.1``) and
  ``--master-port`` (default :data:`DEFAULT_RDZV_PORT`, torchrun's own c10d default).
* ``ID``: ``--rdzv-id`` when given, else ``$MICROSPEED_JOB_ID``, else ``$SLURM_JOB_ID``, else
  ``microspeed-<hash of the working directory and the script line>`` (so the same command started twice from
  the same folder joins the same job).
* ``N``: ``--max_restarts``/``--max-restarts``, default :data:`DEFAULT_MAX_RESTARTS` (torchrun's default, 0,
  would end an elastic job at its first lost node).
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from microspeed.errors import ConfigError

DEFAULT_RDZV_PORT = 29400
"""The c10d rendezvous port when neither ``--rdzv-endpoint`` nor ``--master-port`` is given (torchrun's default)."""

DEFAULT_MAX_RESTARTS = 3
"""Restarts of the worker group an elastic job allows when ``--max_restarts`` is not given."""

_OPTION = "--elastic"
_RESTARTS = ("--max_restarts", "--max-restarts")
_REFUSED = ("--nnodes", "--node-rank", "--node_rank", "--standalone", "--rdzv-backend", "--rdzv_backend")
"""torchrun options ``--elastic`` sets itself (giving them too is an error)."""


class ElasticError(ConfigError):
    """A bad ``--elastic`` / ``--max_restarts`` argument (names the argument, the value and the fix)."""


@dataclass(frozen=True)
class ElasticSpec:
    """What ``--elastic MIN:MAX [--max_restarts N]`` asked for."""

    min_nodes: int
    max_nodes: int
    max_restarts: int = DEFAULT_MAX_RESTARTS

    @property
    def nnodes(self) -> str:
        """torchrun's ``--nnodes`` value: ``MIN:MAX``."""
        return f"{self.min_nodes}:{self.max_nodes}"


def parse_nodes(spec: str, node_limit: int | None = None) -> tuple[int, int]:
    """``"MIN:MAX"`` -> ``(MIN, MAX)``; :class:`ElasticError` unless ``1 <= MIN <= MAX (<= node_limit)``."""
    lo, sep, hi = str(spec).partition(":")
    try:
        if not sep:
            raise ValueError(spec)
        low, high = int(lo), int(hi)
    except ValueError:
        raise ElasticError(f"--elastic {spec!r}: expected MIN:MAX, two whole numbers of nodes (e.g. --elastic 1:2: "
                           f"the job runs on 1 to 2 nodes)") from None
    if low < 1:
        raise ElasticError(f"--elastic {spec}: MIN must be at least 1 node, got {low}")
    if low > high:
        raise ElasticError(f"--elastic {spec}: MIN ({low}) is larger than MAX ({high}); give MIN:MAX with "
                           f"MIN <= MAX (e.g. --elastic {high}:{low})")
    if node_limit is not None and high > node_limit:
        raise ElasticError(f"--elastic {spec}: MAX ({high}) is more than the {node_limit} node(s) the hostfile "
                           f"selects; lower MAX to at most {node_limit} or add hosts")
    return low, high


def parse_restarts(value: str) -> int:
    """``--max_restarts`` value -> a count >= 0; :class:`ElasticError` otherwise."""
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        raise ElasticError(f"--max_restarts {value!r}: expected a whole number >= 0 (restarts of the worker group "
                           f"after failures)")
    return count


def _launcher_end(args: Sequence[str]) -> int:
    """Index of the first argument after the launcher options (the script, or len(args))."""
    from microspeed.cli.multinode import split_launcher_args

    return len(split_launcher_args(args)[0])


def take_option(args: list[str], names: Sequence[str]) -> str | None:
    """Remove ``NAME VALUE`` / ``NAME=VALUE`` (any of ``names``) from the launcher options; the last value."""
    value = None
    i = 0
    while i < _launcher_end(args):
        arg = args[i]
        name = arg.split("=", 1)[0]
        if name in names:
            if "=" in arg:
                value = arg.split("=", 1)[1]
                del args[i]
            elif i + 1 < len(args):
                value = args[i + 1]
                del args[i:i + 2]
            else:
                raise ElasticError(f"{arg}: give its value")
            continue
        i += 1
    return value


def take_elastic(args: list[str], node_limit: int | None = None) -> ElasticSpec | None:
    """Remove ``--elastic MIN:MAX`` and ``--max_restarts N`` from ``args``' launcher options when ``--elastic`` is
    there (``None`` and ``args`` untouched otherwise)."""
    if not any(a.split("=", 1)[0] == _OPTION for a in args[:_launcher_end(args)]):
        return None
    spec = take_option(args, (_OPTION,))
    low, high = parse_nodes(spec or "", node_limit)
    restarts = take_option(args, _RESTARTS)
    return ElasticSpec(low, high, DEFAULT_MAX_RESTARTS if restarts is None else parse_restarts(restarts))


def default_job_id(script: Sequence[str], cwd: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The rendezvous id when ``--rdzv-id`` is not given (see the module's docstring)."""
    environ = os.environ if environ is None else environ
    for key in ("MICROSPEED_JOB_ID", "SLURM_JOB_ID"):
        if environ.get(key):
            return environ[key]
    text = "\0".join([os.path.abspath(cwd or os.getcwd()), *script])
    return "microspeed-" + hashlib.sha1(text.encode()).hexdigest()[:12]


def local_args(args: Sequence[str], spec: ElasticSpec, cwd: str | None = None,
               environ: Mapping[str, str] | None = None) -> list[str]:
    """The torchrun arguments of a local elastic agent: ``args`` (without ``--elastic``/``--max_restarts``) with
    ``--nnodes MIN:MAX --max-restarts N --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID`` first."""
    rest = list(args)
    for arg in rest[:_launcher_end(rest)]:
        name = arg.split("=", 1)[0]
        if name in _REFUSED:
            raise ElasticError(f"{name}: --elastic sets it (--nnodes MIN:MAX, a c10d rendezvous with no node "
                               f"rank); remove {name}")
    endpoint = take_option(rest, ("--rdzv-endpoint", "--rdzv_endpoint"))
    addr = take_option(rest, ("--master-addr", "--master_addr"))
    port = take_option(rest, ("--master-port", "--master_port"))
    if endpoint and (addr or port):
        raise ElasticError("--rdzv-endpoint and --master-addr/--master-port both name the rendezvous; keep one")
    if not endpoint:
        endpoint = f"{addr or '127.0.0.1'}:{port or DEFAULT_RDZV_PORT}"
    job = take_option(rest, ("--rdzv-id", "--rdzv_id"))
    if not job:
        job = default_job_id(rest[_launcher_end(rest):], cwd, environ)
    return ["--nnodes", spec.nnodes, "--max-restarts", str(spec.max_restarts), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", job, *rest]


def rendezvous_conf(endpoint: str, conf: str) -> str:
    """torchrun's ``--rdzv-conf`` for a c10d rendezvous at ``endpoint``, with ``is_host=1`` added when this machine
    must host the store but torch would not see it.

    torch decides who hosts the c10d store by matching the endpoint against this machine's host name and the
    addresses it resolves to; an address of a second interface (a cluster network, a network namespace) does not
    match, and every agent then waits for a store nobody serves. Here: when ``conf`` does not say ``is_host``,
    torch's match fails, and binding to the endpoint's address and port works (the address is this machine's and
    nobody serves the port yet), ``is_host=1`` is added. Otherwise ``conf`` is returned unchanged (torch's own
    decision, including its fallback to a client when a second agent on the same machine finds the port taken).
    """
    if "is_host" in conf or not endpoint:
        return conf
    host, _, port_text = endpoint.rpartition(":")
    if not host or not port_text.isdigit():
        return conf
    host = host.strip("[]")
    try:
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

        if _matches_machine_hostname(host):
            return conf
    except Exception:  # a private torch helper: when it moves, the bind test alone decides
        pass
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.bind((host, int(port_text)))
    except OSError:  # not an address of this machine, or the store is served here already
        return conf
    return f"{conf},is_host=1" if conf else "is_host=1"


def _is_loopback(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    import ipaddress

    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def rendezvous_local_addr(endpoint: str) -> str | None:
    """torchrun's ``--local-addr`` for a c10d rendezvous at ``endpoint`` when torch's default would be unreachable.

    The node that starts the workers' store tells the others its address; torch uses ``socket.getfqdn()``, which on
    machines without a resolvable name is ``localhost``: every other node would then look for the store on itself.
    When the name resolves to a loopback address but ``endpoint`` is not a loopback address, this returns the
    address this machine uses to reach ``endpoint`` (the source address of a UDP socket connected to it: nothing is
    sent), which the other nodes reach too. Otherwise ``None`` (torch's own choice).
    """
    host, _, port_text = endpoint.rpartition(":")
    host = host.strip("[]")
    if not host or not port_text.isdigit() or _is_loopback(host) or not _is_loopback(socket.getfqdn()):
        return None
    from microspeed.netaddr import source_address

    return source_address(host, int(port_text))
