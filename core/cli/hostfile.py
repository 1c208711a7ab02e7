"""Hostfiles and resource filters of ``microspeed run --hostfile``, with DeepSpeed's syntax and selection rules.

A hostfile names the machines of a job and how many processes ("slots", one per GPU) each may run::

    # comment lines and blank lines are ignored
    worker-0 slots=4
    worker-1 slots=4   # a comment after the entry too

``--include`` / ``--exclude`` take ``NODE_SPEC[@NODE_SPEC ...]`` with ``NODE_SPEC = NAME[:SLOT[,SLOT ...]]``:
``--include "worker-0@worker-1:0,2"`` keeps all slots of worker-0 and slots 0 and 2 of worker-1;
``--exclude "worker-1:0"`` keeps everything but slot 0 of worker-1. ``--num_nodes N`` keeps the first N hosts,
``--num_gpus N`` runs N processes on each (slots 0..N-1). The result is an ordered ``{host: [slot, ...]}``
(hostfile order = node rank order). Every mistake is a :class:`HostfileError` naming the file and line, the
host or the slot.

A host is a host name (RFC 1123 labels of letters, digits, ``-`` and ``_``, none starting or ending with ``-``)
or an IPv4/IPv6 address, nothing else (:func:`check_host`): the name lands in ``ssh``/``pdsh``/``srun`` command
lines, where ``-F/evil/config`` would be an option and ``user@host`` or ``^file`` pdsh syntax.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping

from microspeed.errors import ConfigError

_ENTRY = re.compile(r"^(?P<host>[^\s#=]+)\s+slots\s*=\s*(?P<slots>\d+)\s*$")
_LABEL = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")


class HostfileError(ConfigError):
    """A hostfile line, an ``--include``/``--exclude`` spec or a ``--num_nodes``/``--num_gpus`` value is wrong."""


def host_problem(host: str) -> str | None:
    """Why ``host`` is not a host name or an IP address (``None`` when it is one).

    Host names are RFC 1123 (labels of at most 63 letters, digits and ``-``, not starting or ending with ``-``;
    ``_`` is admitted too, as ssh aliases and container names use it), at most 253 characters; addresses are
    IPv4 (``10.0.0.1``) or IPv6 (``fd00::1``, without brackets).
    """
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    if host.startswith("-"):
        return "it starts with '-', so ssh and pdsh would read it as an option"
    if "@" in host:
        return ("'user@host' is not accepted ('@' separates hosts in --include/--exclude): set the user in "
                "~/.ssh/config (User) or pass --launcher_args '-l USER'")
    if len(host) > 253 or not all(_LABEL.match(label) for label in host.removesuffix(".").split(".")):
        return ("a host name is letters, digits, '-' and '_' in dot-separated labels (none starting or ending "
                "with '-', at most 63 characters each), or an IPv4/IPv6 address")
    return None


def check_host(host: str, where: str) -> str:
    """``host`` when it is a host name or an IP address (see :func:`host_problem`); else a
    :class:`HostfileError` that starts with ``where`` (the file and line, or the option)."""
    problem = host_problem(host)
    if problem is not None:
        raise HostfileError(f"{where}: host {host!r} is not a host name or an IP address: {problem}")
    return host


def parse_hostfile_text(lines: Iterable[str], source: str = "<hostfile>") -> dict[str, int]:
    """``{host: slots}`` in file order from the lines of a hostfile; ``source`` names it in errors."""
    pool: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _ENTRY.match(line)
        if match is None:
            raise HostfileError(f"{source}:{number}: bad hostfile line {raw.strip()!r}: expected 'HOST slots=N' "
                                f"(for example 'worker-0 slots=4'); comments start with '#'")
        host, slots = check_host(match["host"], f"{source}:{number}"), int(match["slots"])
        if host in pool:
            raise HostfileError(f"{source}:{number}: host {host!r} is listed twice (first at line "
                                f"{first_line[host]}): give each host one line with its total slots")
        if slots < 1:
            raise HostfileError(f"{source}:{number}: host {host!r} has slots={slots}: give at least 1")
        pool[host], first_line[host] = slots, number
    if not pool:
        raise HostfileError(f"{source}: no hosts: the hostfile is empty or only has comments; write one "
                            f"'HOST slots=N' line per machine")
    return pool


def read_hostfile(path: str) -> dict[str, int]:
    """``{host: slots}`` from the hostfile at ``path`` (see the module docstring for the syntax)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise HostfileError(f"--hostfile {path}: cannot read it: {exc.strerror or exc}") from exc
    return parse_hostfile_text(lines, source=path)


def parse_node_spec(spec: str, option: str = "--include") -> dict[str, list[int]]:
    """``"worker-0:0,1@worker-1"`` -> ``{"worker-0": [0, 1], "worker-1": []}`` (``[]``: every slot)."""
    nodes: dict[str, list[int]] = {}
    for part in spec.split("@"):
        host, sep, slot_text = part.strip().partition(":")
        if not host:
            raise HostfileError(f"{option} {spec!r}: empty host name in {part!r}; the syntax is "
                                f"HOST[:SLOT[,SLOT...]][@HOST...]")
        slots: list[int] = []
        if sep:
            for item in slot_text.split(","):
                if not item.strip().isdigit():
                    raise HostfileError(f"{option} {spec!r}: slot {item!r} of host {host!r} is not a "
                                        f"non-negative integer")
                slots.append(int(item))
        nodes[host] = sorted(set(nodes.get(host, []) + slots))  # DeepSpeed: slots add up; none at all = every slot
    return nodes


def _check_known(pool: Mapping[str, list[int]], nodes: Mapping[str, list[int]], option: str, source: str) -> None:
    for host, slots in nodes.items():
        if host not in pool:
            raise HostfileError(f"{option}: host {host!r} is not in {source} (it lists {', '.join(pool)})")
        missing = [s for s in slots if s not in pool[host]]
        if missing:
            raise HostfileError(f"{option}: host {host!r} has no slot {missing[0]} in {source} (it has slots "
                                f"{_slot_text(pool[host])})")


def _slot_text(slots: list[int]) -> str:
    return f"0-{slots[-1]}" if slots == list(range(len(slots))) and len(slots) > 1 else ",".join(map(str, slots))


def select_resources(pool: Mapping[str, int], include: str = "", exclude: str = "", num_nodes: int = -1,
                     num_gpus: int = -1, source: str = "the hostfile") -> dict[str, list[int]]:
    """The ``{host: [slots]}`` a job runs on: ``pool`` filtered as DeepSpeed's launcher filters it.

    ``include`` and ``exclude`` exclude each other and ``num_nodes``/``num_gpus`` (DeepSpeed's rule); hosts
    left without slots are dropped; the hostfile order is kept. ``num_gpus`` larger than a host's slots is
    an error naming the host (the hostfile says it has fewer).
    """
    if include and exclude:
        raise HostfileError("--include and --exclude exclude each other: give one of them")
    if (include or exclude) and (num_nodes >= 0 or num_gpus >= 0):
        raise HostfileError("--num_nodes/--num_gpus cannot be combined with --include/--exclude: select hosts "
                            "and slots with one or the other")
    full = {host: list(range(n)) for host, n in pool.items()}
    if include:
        nodes = parse_node_spec(include, "--include")
        _check_known(full, nodes, "--include", source)
        chosen = {h: (nodes[h] or full[h]) for h in full if h in nodes}
    elif exclude:
        nodes = parse_node_spec(exclude, "--exclude")
        _check_known(full, nodes, "--exclude", source)
        chosen = {h: [s for s in full[h] if nodes.get(h) and s not in nodes[h]] if h in nodes else full[h]
                  for h in full}
    else:
        chosen = dict(full)
    chosen = {h: s for h, s in chosen.items() if s}
    if not chosen:
        raise HostfileError(f"--exclude {exclude!r} leaves no host to run on")
    if num_nodes == 0 or num_nodes < -1:
        raise HostfileError(f"--num_nodes {num_nodes}: give a positive number of hosts")
    if num_nodes > 0:
        if num_nodes > len(chosen):
            raise HostfileError(f"--num_nodes {num_nodes}: {source} lists only {len(chosen)} host(s) "
                                f"({', '.join(chosen)})")
        chosen = dict(list(chosen.items())[:num_nodes])
    if num_gpus == 0 or num_gpus < -1:
        raise HostfileError(f"--num_gpus {num_gpus}: give a positive number of processes per host")
    if num_gpus > 0:
        for host, slots in chosen.items():
            if num_gpus > len(slots):
                raise HostfileError(f"--num_gpus {num_gpus} does not match {source}: host {host!r} has slots="
                                    f"{len(slots)}; lower --num_gpus or raise that host's slots")
        chosen = {h: list(range(num_gpus)) for h in chosen}
    return chosen
