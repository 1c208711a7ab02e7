"""Private sshd's inside network namespaces: "machines" that ``microspeed run --hostfile`` can ssh into, for tests.

    from microspeed.testing.netns import SlowNetwork
    from microspeed.testing.sshd import SshCluster, sshd_unavailable

    with SlowNetwork(2, rate=None, host_addr=True) as net, SshCluster(net, folder) as ssh:
        subprocess.run(["ssh", "-F", ssh.client_config, net.addr(1), "true"])  # key auth, no prompts

Everything is the test's own: host keys and a client key generated with ``ssh-keygen`` into ``folder``, one
``sshd -D`` per namespace on a high port with a private ``sshd_config`` (keys only, no PAM, ``StrictModes no``),
and an ssh client config (``-F``) with ``StrictHostKeyChecking no`` and that key. The sshd's are stopped on leaving
the block (the namespaces' tear-down kills whatever they started).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from typing import Any

SSHD = "/usr/sbin/sshd"
DEFAULT_PORT = 2222


def sshd_unavailable() -> str | None:
    """Why the sshd's cannot run here (a reason for ``pytest.skip``), or ``None``."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, sshd)"
    for tool in ("ip", "ssh", "ssh-keygen"):
        if not shutil.which(tool):
            return f"needs `{tool}` (apt-get install iproute2 openssh-client)"
    if not (shutil.which("sshd") or os.path.exists(SSHD)):
        return "needs sshd (apt-get install openssh-server)"
    return None


class SshCluster:
    """One sshd per namespace of ``net`` (a :class:`~microspeed.testing.netns.SlowNetwork`), keys in ``folder``."""

    def __init__(self, net: Any, folder: str, port: int = DEFAULT_PORT, start_timeout: float = 20.0) -> None:
        self.net, self.folder, self.port, self.start_timeout = net, os.path.abspath(folder), port, start_timeout
        self.key = os.path.join(self.folder, "id_ed25519")
        self.client_config = os.path.join(self.folder, "ssh_config")
        self.procs: list[subprocess.Popen[bytes]] = []

    def _keys(self) -> None:
        os.makedirs(self.folder, exist_ok=True)
        for path in (self.key, os.path.join(self.folder, "host_ed25519")):
            if not os.path.exists(path):
                subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", path], check=True,
                               capture_output=True, timeout=30)
        shutil.copyfile(self.key + ".pub", os.path.join(self.folder, "authorized_keys"))
        with open(self.client_config, "w", encoding="utf-8") as f:
            f.write(f"Host *\n  Port {self.port}\n  User root\n  IdentityFile {self.key}\n  IdentitiesOnly yes\n"
                    f"  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
                    f"  BatchMode yes\n  ConnectTimeout 5\n")

    def sshd_config(self, rank: int) -> str:
        """Write and return the path of rank ``rank``'s sshd_config."""
        path = os.path.join(self.folder, f"sshd_config_{rank}")
        with open(path, "w", encoding="utf-8") as f:
            f.write(f"Port {self.port}\nListenAddress {self.net.addr(rank)}\n"
                    f"HostKey {os.path.join(self.folder, 'host_ed25519')}\n"
                    f"AuthorizedKeysFile {os.path.join(self.folder, 'authorized_keys')}\n"
                    f"PidFile {os.path.join(self.folder, f'sshd_{rank}.pid')}\n"
                    "StrictModes no\nUsePAM no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                    "PermitRootLogin prohibit-password\nPubkeyAuthentication yes\nLogLevel ERROR\n"
                    "MaxStartups 100\n")
        return path

    def start(self) -> SshCluster:
        """Generate the keys, start every sshd and wait until each accepts connections (else raise)."""
        self._keys()
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation folder
        try:
            self.procs = [self._spawn(r) for r in range(self.net.n)]
            for r in range(self.net.n):
                self._wait_listening(r)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, rank: int) -> subprocess.Popen[bytes]:
        sshd = shutil.which("sshd") or SSHD
        with open(os.path.join(self.folder, f"sshd_{rank}.log"), "ab") as log:
            return subprocess.Popen(self.net.exec_argv(rank, [sshd, "-D", "-e", "-f", self.sshd_config(rank)]),
                                    stdout=log, stderr=log, stdin=subprocess.DEVNULL)

    def restart(self, rank: int) -> None:
        """Start namespace ``rank``'s sshd again (after the machine died: :meth:`SlowNetwork.kill_machine` killed
        it) and wait until it accepts connections."""
        old = self.procs[rank]
        if old.poll() is None:
            old.kill()
        old.wait()
        self.procs[rank] = self._spawn(rank)
        self._wait_listening(rank)

    def _wait_listening(self, rank: int) -> None:
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.procs[rank].poll() is not None:
                raise RuntimeError(f"sshd in namespace {rank} exited ({self.procs[rank].returncode}): "
                                   f"{self.log(rank)}")
            try:
                socket.create_connection((self.net.addr(rank), self.port), timeout=1.0).close()
                return
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sshd of namespace {rank} not reachable at {self.net.addr(rank)}:{self.port} "
                                       f"within {self.start_timeout} s: {exc}; log: {self.log(rank)}") from exc
                time.sleep(0.1)

    def log(self, rank: int) -> str:
        """The sshd's own log (errors only)."""
        try:
            with open(os.path.join(self.folder, f"sshd_{rank}.log"), encoding="utf-8", errors="replace") as f:
                return f.read().strip()
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop every sshd (idempotent)."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self) -> SshCluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
