"""This machine's network addresses, as other machines see them."""

from __future__ import annotations

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
