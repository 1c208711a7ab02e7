"""Network namespaces for tests and benchmarks: one namespace per rank (a "machine"), a bridge, ``tc`` on every link.

Used by ``benchmarks/slow_network.py`` (rate-shaped links) and the two-machine launcher test (``rate=None``: no
shaping, ``host_addr=True``: the root namespace gets an address on the bridge, so it can ssh into every
namespace); needs root and ``ip`` (iproute2), and ``tc`` when shaping::

    from microspeed.testing.netns import SlowNetwork

    with SlowNetwork(2, rate="1gbit") as net:       # set up, shaped, connectivity checked
        argv = net.exec_argv(0, ["python", "worker.py"])   # ["ip", "netns", "exec", <ns of rank 0>, ...]
        net.addr(0), net.ifname(0)                  # "10.77.0.1", the veth inside rank 0's namespace
    # torn down here: processes left in the namespaces killed, namespaces, veths and bridge deleted

Topology: a bridge ``<prefix><id>br`` in the root namespace (address ``<subnet>.254`` with ``host_addr=True``,
else none) and, per rank ``r``,
a namespace ``<prefix><id>-r<r>`` joined to it by a veth pair, ``<prefix><id>h<r>`` on the bridge and
``<prefix><id>n<r>`` inside the namespace (or ``inner_ifname``, the same name in every namespace) with address
``<subnet>.<r+1>/24``. ``<id>`` is 6 random hex
digits, so a run never collides with the leftovers of a crashed one (nor with a concurrent run: the ranks'
addresses live in their own namespaces, and the bridges are separate layer-2 domains).

Shaping: the EGRESS of both ends of every veth pair gets a root qdisc at ``rate``, so each direction of
each link is shaped on its own (full duplex, like a switch port): a packet from rank a to rank b passes
a's namespace-side veth and b's bridge-side veth, both at ``rate``. The qdisc is ``tbf`` (``burst``:
1 ms at ``rate``, at least 96 KiB so that a 64 KiB GSO packet from the veth passes whole;
``latency``: ``queue_ms`` of queue before drops), or ``netem rate`` (with ``delay``: ``delay_ms`` is the
one-way rank-to-rank delay, half on each of the two hops). ``qdisc="auto"`` picks tbf (netem if a
delay is asked for) and falls back to the other kind if the kernel refuses it.

Tear-down is idempotent and runs on leaving the ``with`` block, on an exception in set-up, at
interpreter exit (``atexit``) and on SIGTERM/SIGHUP (turned into ``SystemExit`` while inside the
block, so ``finally`` clauses run). :func:`cleanup_leftovers` removes what a killed run (SIGKILL,
power loss) left behind, by name prefix.
"""

from __future__ import annotations

import atexit
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from typing import Any

DEFAULT_PREFIX = "msnet"
"""Name prefix of everything created (namespaces, links); :func:`cleanup_leftovers` matches on it."""

_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)(bit|bps)?\s*$", re.IGNORECASE)

# One process: listens on its address, connects to every other rank's, then accepts one connection
# from each; prints the connect times (one round trip each). Exit status 0 when every pair talks.
_PROBE = r"""
import socket, sys, time
me, port, timeout = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]); addrs = sys.argv[4:]
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((addrs[me], port)); srv.listen(len(addrs)); srv.settimeout(timeout)
deadline = time.monotonic() + timeout
rtts = []
for i, a in enumerate(addrs):
    if i == me:
        continue
    while True:
        try:
            t0 = time.perf_counter(); c = socket.create_connection((a, port), timeout=1.0)
            rtts.append(time.perf_counter() - t0); c.close(); break
        except OSError as exc:
            if time.monotonic() > deadline:
                sys.exit(f"rank {me} ({addrs[me]}): cannot reach {a}:{port}: {exc}")
            time.sleep(0.05)
for _ in range(len(addrs) - 1):
    srv.accept()[0].close()
print(" ".join(f"{r * 1e3:.3f}" for r in rtts))
"""


def parse_rate(rate: str) -> float:
    """Bits per second of a ``tc`` rate (``1gbit``, ``100mbit``, ``500kbit``, ``12.5mbps`` = bytes, ``1gibit``)."""
    m = _RATE_RE.match(rate)
    if not m:
        raise ValueError(f"rate {rate!r}: expected a tc rate such as 1gbit, 100mbit or 500kbit")
    value, prefix, binary, unit = m.groups()
    base = 1024 if binary else 1000
    scale = base ** " kmgt".index(prefix.lower() or " ")
    return float(value) * scale * (8 if (unit or "bit").lower() == "bps" else 1)


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(argv, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({res.returncode}): {res.stderr.strip() or res.stdout.strip()}")
    return res


def _kill_namespace_processes(ns: str) -> None:
    """SIGKILL every process still in namespace ``ns`` (all were started there by this module's user)."""
    res = _run(["ip", "netns", "pids", ns], check=False)
    for pid in res.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _link_names() -> set[str]:
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    return {line.split(":", 2)[1].strip().split("@", 1)[0] for line in out.splitlines() if line.count(":") >= 2}


def _netns_names() -> set[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def cleanup_leftovers(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Delete every namespace and link named like this module's (``<prefix><6 hex>...``); the names removed.

    Processes still inside those namespaces are killed first. A concurrent run with the same prefix
    loses its network too: run this only when no other benchmark is running.
    """
    ns_re = re.compile(rf"^{re.escape(prefix)}[0-9a-f]{{6}}-r\d+$")
    link_re = re.compile(rf"^{re.escape(prefix)}[0-9a-f]{{6}}(br|h\d+|n\d+)$")
    removed = []
    for link in sorted(n for n in _link_names() if link_re.match(n) and not n.endswith("br")):
        if _run(["ip", "link", "del", link], check=False).returncode == 0:
            removed.append(link)
    for ns in sorted(n for n in _netns_names() if ns_re.match(n)):
        _kill_namespace_processes(ns)
        if _run(["ip", "netns", "del", ns], check=False).returncode == 0:
            removed.append(f"netns {ns}")
    for link in sorted(n for n in _link_names() if link_re.match(n) and n.endswith("br")):
        if _run(["ip", "link", "del", link], check=False).returncode == 0:
            removed.append(link)
    return removed


class SlowNetwork:
    """``n`` network namespaces on one bridge, every link shaped to ``rate`` (``None``: not shaped; see the module
    docstring).

    Use as a context manager (or call :meth:`setup` and :meth:`teardown`). ``qdisc`` is ``"auto"``,
    ``"tbf"`` or ``"netem"``; ``burst`` a tc size (``"125kb"``) or ``None`` for the default.
    """

    def __init__(self, n: int, rate: str | None = "1gbit", delay_ms: float = 0.0, qdisc: str = "auto",
                 burst: str | None = None, queue_ms: float = 10.0, subnet: str = "10.77.0",
                 prefix: str = DEFAULT_PREFIX, verbose: bool = True, host_addr: bool = False,
                 inner_ifname: str | None = None) -> None:
        if not 1 <= n <= 99:
            raise ValueError(f"n={n}: 1..99 namespaces")
        if qdisc not in ("auto", "tbf", "netem"):
            raise ValueError(f"qdisc={qdisc!r}: expected auto, tbf or netem")
        if rate is None and delay_ms:
            raise ValueError("a delay needs shaping: give a rate")
        if delay_ms and qdisc == "tbf":
            raise ValueError("a delay needs netem (qdisc auto or netem), tbf only limits the rate")
        self.n, self.rate, self.delay_ms, self.burst, self.queue_ms = n, rate, float(delay_ms), burst, queue_ms
        self.rate_bps = parse_rate(rate) if rate is not None else None
        self.host_addr = host_addr
        self.subnet, self.prefix, self.verbose = subnet, prefix, verbose
        self.qdisc_wanted = qdisc
        self.qdisc: str | None = None  # the kind in use once set up
        self.qdisc_args: list[str] = []
        self.id = secrets.token_hex(3)
        base = f"{prefix}{self.id}"
        if len(base) + 3 > 15:
            raise ValueError(f"prefix {prefix!r} too long for Linux interface names (15 characters)")
        self.bridge = f"{base}br"
        self.namespaces = [f"{base}-r{r}" for r in range(n)]
        self.host_veths = [f"{base}h{r}" for r in range(n)]
        self.ns_veths = [inner_ifname or f"{base}n{r}" for r in range(n)]
        self.rtt_ms: list[list[float]] = []
        self._up = False
        self._down = False
        self._old_handlers: dict[int, Any] = {}

    # -- accessors ---------------------------------------------------------------------------------

    def addr(self, rank: int) -> str:
        """IPv4 address of ``rank`` (in its namespace)."""
        return f"{self.subnet}.{rank + 1}"

    @property
    def bridge_addr(self) -> str | None:
        """The root namespace's address on the bridge (``host_addr=True``), else ``None``."""
        return f"{self.subnet}.254" if self.host_addr else None

    def ifname(self, rank: int) -> str:
        """The veth inside ``rank``'s namespace (for ``GLOO_SOCKET_IFNAME``)."""
        return self.ns_veths[rank]

    def exec_argv(self, rank: int, argv: list[str]) -> list[str]:
        """``argv`` run inside ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[rank], *argv]

    def describe(self) -> dict[str, Any]:
        """What was built, for reports."""
        return {"ranks": self.n, "rate": self.rate, "rate_bps": self.rate_bps, "delay_ms": self.delay_ms,
                "qdisc": self.qdisc, "qdisc_args": " ".join(self.qdisc_args), "bridge": self.bridge,
                "namespaces": list(self.namespaces), "addrs": [self.addr(r) for r in range(self.n)],
                "connect_rtt_ms": self.rtt_ms}

    # -- set-up ------------------------------------------------------------------------------------

    def _log(self, msg: str) -> None:
        if self.verbose:
            print(f"[netns {self.id}] {msg}", flush=True)

    def _qdisc_args(self, kind: str) -> list[str]:
        if kind == "tbf":
            burst = self.burst or f"{max(96 * 1024, int(self.rate_bps / 8 * 1e-3))}b"
            return ["tbf", "rate", self.rate, "burst", burst, "latency", f"{self.queue_ms:g}ms"]
        args = ["netem", "rate", self.rate]
        if self.delay_ms:
            args += ["delay", f"{self.delay_ms / 2:g}ms"]
        # netem's limit is in packets; keep about queue_ms of full-size (1514-byte) frames, at least 1000.
        return args + ["limit", str(max(1000, int(self.rate_bps / 8 * (self.queue_ms + self.delay_ms) / 1e3 / 1514)))]

    def _shape(self, dev: str, ns: str | None) -> None:
        tc = ["tc"] + (["-n", ns] if ns else [])
        kinds = [self.qdisc] if self.qdisc else (
            [self.qdisc_wanted] if self.qdisc_wanted != "auto"
            else (["netem"] if self.delay_ms else ["tbf", "netem"]))
        errors = []
        for kind in kinds:
            args = self._qdisc_args(kind)
            res = _run([*tc, "qdisc", "replace", "dev", dev, "root", *args], check=False)
            if res.returncode == 0:
                if self.qdisc is None:
                    self.qdisc, self.qdisc_args = kind, args
                    if errors:
                        self._log(f"fell back to {kind}: {'; '.join(errors)}")
                return
            errors.append(f"{kind}: {res.stderr.strip()}")
        raise RuntimeError(f"cannot shape {dev}: " + "; ".join(errors))

    def setup(self) -> SlowNetwork:
        """Build, shape and check the network; on any failure, tear down what was built and raise."""
        if os.geteuid() != 0:
            raise PermissionError("network namespaces need root")
        self._up = True
        atexit.register(self.teardown)
        try:
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            _run(["ip", "link", "set", self.bridge, "up"])
            if self.host_addr:
                _run(["ip", "addr", "add", f"{self.bridge_addr}/24", "dev", self.bridge])
            for r in range(self.n):
                ns, host, inner = self.namespaces[r], self.host_veths[r], self.ns_veths[r]
                _run(["ip", "netns", "add", ns])
                _run(["ip", "link", "add", host, "type", "veth", "peer", "name", inner, "netns", ns])
                _run(["ip", "link", "set", host, "master", self.bridge, "up"])
                _run(["ip", "-n", ns, "addr", "add", f"{self.addr(r)}/24", "dev", inner])
                _run(["ip", "-n", ns, "link", "set", inner, "up"])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
                if self.rate is not None:
                    self._shape(host, None)   # bridge -> rank
                    self._shape(inner, ns)    # rank -> bridge
            shaped = f"every link {' '.join(self.qdisc_args)}" if self.rate is not None else "links not shaped"
            self._log(f"{self.n} namespaces on bridge {self.bridge}, {shaped}")
            self.check_connectivity()
        except BaseException:
            self.teardown()
            raise
        return self

    def check_connectivity(self, port: int = 5199, timeout: float = 15.0) -> None:
        """Every rank opens a TCP connection to every other one (no ``ping`` needed); raises if one can't."""
        addrs = [self.addr(r) for r in range(self.n)]
        if self.n < 2:
            return
        procs = [subprocess.Popen(self.exec_argv(r, [sys.executable, "-c", _PROBE, str(r), str(port), str(timeout),
                                                     *addrs]), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for r in range(self.n)]
        errors, self.rtt_ms = [], []
        for r, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=timeout + 10)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
            if p.returncode != 0:
                errors.append(err.strip() or f"rank {r}: probe exited {p.returncode}")
            else:
                self.rtt_ms.append([float(x) for x in out.split()])
        if errors:
            raise RuntimeError("connectivity check failed: " + "; ".join(errors))
        worst = max(max(r) for r in self.rtt_ms)
        self._log(f"connectivity ok: all {self.n * (self.n - 1)} ordered pairs connect (TCP connect <= {worst:.2f} ms)")

    # -- faults ------------------------------------------------------------------------------------

    def kill_machine(self, rank: int) -> list[int]:
        """SIGKILL every process in ``rank``'s namespace (the machine dies: its peers see connections reset); the
        pids killed. The namespace and its link stay, so the machine can come back (start its processes again)."""
        res = _run(["ip", "netns", "pids", self.namespaces[rank]], check=False)
        pids = [int(p) for p in res.stdout.split() if p.isdigit()]
        _kill_namespace_processes(self.namespaces[rank])
        self._log(f"killed the {len(pids)} process(es) of namespace {rank} ({self.addr(rank)})")
        return pids

    def set_link(self, rank: int, up: bool) -> None:
        """Cut (``up=False``) or restore ``rank``'s link to the bridge: its bridge-side veth goes down or up. A cut
        link drops packets silently (no reset): peers' connections to it hang until a timeout notices."""
        _run(["ip", "link", "set", self.host_veths[rank], "up" if up else "down"])
        self._log(f"link of namespace {rank} ({self.addr(rank)}) {'restored' if up else 'cut'}")

    # -- tear-down ---------------------------------------------------------------------------------

    def teardown(self) -> None:
        """Kill what runs in the namespaces, delete veths, namespaces and bridge (idempotent, never raises)."""
        if not self._up or self._down:
            return
        self._down = True
        blocked = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)  # a second Ctrl-C must not cut it short
        try:
            self._teardown()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    def _teardown(self) -> None:
        problems = []
        for ns in self.namespaces:
            _kill_namespace_processes(ns)
        existing = _link_names()
        for host in self.host_veths:  # deleting one end deletes its peer in the namespace
            if host in existing and _run(["ip", "link", "del", host], check=False).returncode != 0:
                problems.append(host)
        names = _netns_names()
        for ns in self.namespaces:
            if ns in names and _run(["ip", "netns", "del", ns], check=False).returncode != 0:
                problems.append(ns)
        if self.bridge in existing and _run(["ip", "link", "del", self.bridge], check=False).returncode != 0:
            problems.append(self.bridge)
        ours = {self.bridge, *self.host_veths}
        deadline = time.monotonic() + 5.0  # the kernel deletes a namespace's devices asynchronously
        while ours & _link_names() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = sorted((ours & _link_names()) | (set(self.namespaces) & _netns_names()))
        if problems or left:
            print(f"[netns {self.id}] tear-down left {left or problems}: run with --cleanup", file=sys.stderr,
                  flush=True)
        else:
            self._log("torn down")
        try:
            atexit.unregister(self.teardown)
        except Exception:  # interpreter shutting down
            pass

    # -- context manager ---------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    def __enter__(self) -> SlowNetwork:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            return self.setup()
        except BaseException:
            self._restore_handlers()
            raise

    def _restore_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()

    def __exit__(self, *exc: Any) -> None:
        try:
            self.teardown()
        finally:
            self._restore_handlers()
