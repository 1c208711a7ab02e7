"""c10d ``TCPStore`` servers that listen on one address, not on every interface.

A ``TCPStore`` server (the rendezvous store, the workers' store that ``init_process_group`` and the watchdog's
heartbeat use) has no authentication: whoever reaches its port can read and write the job's keys. torch's server,
libuv and legacy backends alike, listens on every interface (``*:PORT``) whatever ``host_name`` it is given; it
does take a socket that is already bound (``master_listen_fd``, which it then owns and closes). So the servers
microspeed starts, and those torch starts in a ``microspeed run`` (torchrun's agent: static and c10d rendezvous)
and in its ranks (``init_process_group``'s ``env://`` store), get a socket bound to
:func:`microspeed.netaddr.listen_address` of the host their clients dial: ``127.0.0.1`` for a job on one machine,
the node's address on the peers' route for a job across machines. Where no one address fits (a name that
resolves to loopback in a job across machines, an address not of this machine, ``MICROSPEED_STORE_BIND=all``)
the server keeps torch's every-interface default: firewall its port to the peers (README, "Security").

:func:`install` puts :class:`BoundTCPStore` where torch's rendezvous code creates its servers; a client
(``is_master=False``) is created exactly as before.
"""

from __future__ import annotations

import os
import socket
import weakref
from typing import Any

from torch.distributed import TCPStore

from microspeed.netaddr import listen_address

_ARGS = ("host_name", "port", "world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant",
         "master_listen_fd", "use_libuv")
_SPANS_MACHINES = [True]
_SERVING: dict[int, weakref.WeakSet] = {}  # port -> live servers this process bound (multi-tenant reuse)
_PATCHED: dict[tuple[Any, str], Any] = {}


def listening_socket(addr: str, port: int) -> socket.socket:
    """A TCP socket bound to ``addr:port`` (``port`` 0: a free one) and listening, as torch binds its own."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    return sock


class BoundTCPStore(TCPStore):
    """``torch.distributed.TCPStore`` (same arguments) whose server listens on one address only.

    A server (``is_master=True`` without ``master_listen_fd``) gets a socket bound to
    :func:`microspeed.netaddr.listen_address` of ``host_name``; when there is none, or that address and port
    cannot be bound (the port is taken: torch then reports it, or reuses its own multi-tenant server), torch
    binds as it always does. A client is torch's own.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        given = dict(zip(_ARGS, args, strict=False)) | kwargs
        port = int(given.get("port", 0))
        fd = None
        reused = given.get("multi_tenant") and any(True for _ in _SERVING.get(port, ()))
        if given.get("is_master") and given.get("master_listen_fd") is None and not reused:
            addr = listen_address(str(given.get("host_name", "")), _SPANS_MACHINES[0])
            if addr is not None:
                try:
                    sock = listening_socket(addr, port)
                except OSError:
                    pass
                else:
                    given["port"] = sock.getsockname()[1]
                    fd = given["master_listen_fd"] = sock.detach()  # the server owns and closes it
        try:
            super().__init__(**given)
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        if fd is not None:
            _SERVING.setdefault(self.port, weakref.WeakSet()).add(self)


def install(spans_machines: bool) -> None:
    """Have torch's rendezvous code in this process start :class:`BoundTCPStore` servers (idempotent).

    ``spans_machines``: whether the job may have ranks on other machines (a name that resolves to loopback then
    keeps the every-interface default). Covers torchrun's static and c10d rendezvous stores, the dynamic
    rendezvous' shared store and ``init_process_group``'s ``env://``/``tcp://`` store; :func:`uninstall` undoes it.
    """
    import importlib

    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous, static_tcp_rendezvous

    pg_rendezvous = importlib.import_module("torch.distributed.rendezvous")  # not the function of that name

    _SPANS_MACHINES[0] = bool(spans_machines)
    for module in (pg_rendezvous, c10d_rendezvous_backend, static_tcp_rendezvous):
        if getattr(module, "TCPStore", None) is TCPStore:
            _PATCHED.setdefault((module, "TCPStore"), TCPStore)
            module.TCPStore = BoundTCPStore
    handler = dynamic_rendezvous.DynamicRendezvousHandler
    if hasattr(handler, "_create_tcp_store_server") and (handler, "_create_tcp_store_server") not in _PATCHED:
        _PATCHED[(handler, "_create_tcp_store_server")] = handler.__dict__["_create_tcp_store_server"]

        def _create_tcp_store_server(self: Any, master_addr: str, master_port: int) -> TCPStore:
            return BoundTCPStore(host_name=master_addr, port=master_port, is_master=True, multi_tenant=True)

        handler._create_tcp_store_server = _create_tcp_store_server


def uninstall() -> None:
    """Give torch's rendezvous code back its own ``TCPStore`` servers."""
    for (owner, name), original in _PATCHED.items():
        setattr(owner, name, original)
    _PATCHED.clear()


def spans_machines_from_env(environ: dict[str, str] | None = None) -> bool:
    """Whether a rank's job may span machines, from torchrun's variables: ``WORLD_SIZE`` larger than
    ``LOCAL_WORLD_SIZE`` (``True`` when either is missing: only addresses are bound then, not names)."""
    environ = dict(os.environ if environ is None else environ)
    world, local = environ.get("WORLD_SIZE", ""), environ.get("LOCAL_WORLD_SIZE", "")
    return not (world.isdigit() and local.isdigit() and int(world) <= int(local))
