"""This machine's network addresses, as other machines see them."""

from __future__ import annotations

import os
import socket


def source_address(peer: str, port: int = 9) -> str | None:
    """This machine's address on the route to ``peer``: the source address of a UDP socket connected to it (nothing
    is sent). In a multi-machine job it is the address ``peer`` and the machines beside it reach this one at, where
    the host name may resolve to ``localhost``. ``None`` when ``peer`` does not resolve or there is no route."""
    try:
        family = socket.AF_INET6 if ":" in peer else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((peer, port))
            return probe.getsockname()[0]
    except (OSError, ValueError, OverflowError):
        return None


STORE_BIND_ENV = "MICROSPEED_STORE_BIND"
"""``MICROSPEED_STORE_BIND=all``: c10d store servers listen on every interface, as torch's own do (see
:func:`listen_address`)."""


def _bindable(family: int, addr: str) -> bool:
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((addr, 0))
        return True
    except OSError:
        return False


def listen_address(host: str, spans_machines: bool = True) -> str | None:
    """The one local address a c10d store server that its clients reach as ``host`` should listen on; ``None``:
    every interface (torch's default), or ``MICROSPEED_STORE_BIND=all``.

    An IP address of this machine is itself (the clients dial exactly it; ``127.0.0.1`` keeps a job on one
    machine off the network). A name is the first local address it resolves to here, unless that is a loopback
    address in a job that ``spans_machines``: the other machines may resolve the name to another address of
    this one (``/etc/hosts`` often maps a machine's own name to ``127.0.1.1``), so the server keeps torch's
    every-interface default there. A name or address that is not this machine's gives ``None`` too.
    """
    import ipaddress

    if os.environ.get(STORE_BIND_ENV, "").strip().lower() == "all":
        return None
    host = host.strip().strip("[]")
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None:
        family = socket.AF_INET6 if literal.version == 6 else socket.AF_INET
        return host if _bindable(family, host) else None
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    for family, _, _, _, sockaddr in infos:
        addr = str(sockaddr[0])
        if family in (socket.AF_INET, socket.AF_INET6) and _bindable(family, addr):
            if spans_machines and ipaddress.ip_address(addr.split("%")[0]).is_loopback:
                return None
            return addr
    return None
