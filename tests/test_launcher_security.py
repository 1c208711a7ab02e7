"""A hostfile is not a command: the attacks on ``microspeed run --hostfile`` that the launcher refuses, and the
network exposure of the stores it starts (quick: no sshd, no ranks).

Each test is the attack it stops: a hostfile host that is an ssh option (``-F/evil/config`` ran a local
``ProxyCommand`` from the reachability check), pdsh list syntax or a shell word; an environment variable *name*
that is a shell command when the node's shell reads ``env NAME=value``; a predictable pid file in ``/tmp``; and a
rendezvous store listening on every interface where the job is on one machine.
"""

from __future__ import annotations

import os
import shlex
import signal
import stat
import subprocess
import sys

import pytest

from microspeed.cli import multinode, pidfile
from microspeed.cli.hostfile import HostfileError, parse_hostfile_text


def _hostfile(tmp_path, text):
    path = tmp_path / "hostfile"
    path.write_text(text)
    return str(path)


def _plan(tmp_path, *args, text="n0 slots=2\nn1 slots=2\n", environ=None, check=False):
    return multinode.plan(["--hostfile", _hostfile(tmp_path, text), *args, "train.py"], cwd=str(tmp_path),
                          environ={"HOME": str(tmp_path / "home"), **(environ or {})}, check=check)


# ---------------------------------------------------------------------------------------- hosts


def test_ssh_option_as_hostfile_host_is_refused_before_any_ssh_runs(tmp_path, monkeypatch):
    """``-F/path/evil_config slots=2`` made ``ssh -o BatchMode=yes -F/path/evil_config true`` read that config."""
    ran = []

    def no_process(argv, *a, **k):
        ran.append(list(argv))
        raise AssertionError(f"a process ran before the hostfile was checked: {argv}")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    monkeypatch.setattr(subprocess, "run", no_process)
    text = "n0 slots=2\n-F/path/evil_config slots=2\n"
    for launcher in ("ssh", "pdsh"):
        with pytest.raises(HostfileError) as err:
            _plan(tmp_path, "--launcher", launcher, text=text, check=True)
        assert f"{tmp_path / 'hostfile'}:2: host '-F/path/evil_config' is not a host name" in str(err.value)
        assert "option" in str(err.value)
    assert ran == []


@pytest.mark.skipif(not multinode.shutil.which("ssh"), reason="needs the ssh client (no server)")
@pytest.mark.timeout(60)
def test_evil_ssh_config_in_a_hostfile_runs_no_proxy_command(tmp_path):
    """The attack as it ran: the config's ``ProxyCommand`` (here: create a marker file) ran on the launcher's
    machine from the reachability check. Now the hostfile is refused and ssh never starts."""
    marker = tmp_path / "pwned"
    (tmp_path / "evil_config").write_text(f"Host *\n  ProxyCommand touch {marker}\n")
    with pytest.raises(HostfileError, match="is not a host name"):
        _plan(tmp_path, "--launcher", "ssh", text=f"n0 slots=1\n-F{tmp_path / 'evil_config'} slots=1\n", check=True)
    assert not marker.exists()


@pytest.mark.parametrize("host", ["-Jjump.example", "-F/tmp/cfg", "user@n1", "^/etc/hosts_list",
                                  "n[1-4]", "n1;touch_x", "$(touch_x)", "`touch_x`", "n1|x", "a..b", "-n1"])
def test_hostfile_hosts_that_are_not_host_names_are_refused(host):
    with pytest.raises(HostfileError) as err:
        parse_hostfile_text(["n0 slots=1", f"{host} slots=1"], "hf")
    assert f"hf:2: host {host!r} is not a host name or an IP address" in str(err.value)


@pytest.mark.parametrize("host", ["worker-0", "gpu_node1", "n0.cluster.example.org", "10.0.0.7", "fd00::7",
                                  "node1."])
def test_host_names_and_addresses_are_accepted(host):
    assert list(parse_hostfile_text([f"{host} slots=2"], "hf")) == [host]


def test_master_addr_that_is_not_a_host_is_refused(tmp_path):
    with pytest.raises(HostfileError, match=r"--master_addr: host '-oProxyCommand=x' is not a host name"):
        _plan(tmp_path, "--launcher", "slurm", "--master_addr=-oProxyCommand=x")


def test_every_ssh_argv_has_the_host_after_double_dash(tmp_path, monkeypatch):
    """The launch, the elastic probes, the reachability check and the master-address query: the host follows
    ``--``, so even a host that got past the hostfile check could never be an ssh option."""
    seen = []

    class Done:
        returncode, stdout, stderr = 0, "10.0.0.9\n", ""

        def __init__(self, argv, *a, **k):
            seen.append(list(argv))

        def communicate(self, timeout=None):
            return "", ""

    monkeypatch.setattr(subprocess, "Popen", Done)
    monkeypatch.setattr(subprocess, "run", Done)
    p = _plan(tmp_path, "--launcher", "ssh", "--elastic", "1:2", "--launcher_args", "-F cfg", check=True)
    seen += [*p["argvs"].values(), *p["probes"].values()]
    assert len(seen) == 2 + 1 + 2 + 2  # two checks, the address query, two launches, two probes
    for argv in seen:
        host = next(h for h in ("n0", "n1") if h in argv)
        assert "--" in argv and argv.index("--") == argv.index(host) - 1, argv
        assert argv.index("-F") < argv.index("--")  # the user's own options stay options


def test_master_address_answered_by_node_0_must_be_an_address(monkeypatch):
    """``hostname -I`` on node 0 gives the master address every node is started with; an answer that is an
    option is refused, naming where it came from."""
    answer = type("Done", (), {"returncode": 0, "stdout": "-oProxyCommand=x 10.0.0.1\n", "stderr": ""})
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: answer)
    with pytest.raises(HostfileError, match=r"n0's `hostname -I`: host '-oProxyCommand=x' is not a host name"):
        multinode.first_address("n0")


# ---------------------------------------------------------------------------------------- environment


def _export_and_run(environ, tmp_path):
    """Collect the nodes' exports from ``environ`` and the env files in ``tmp_path`` as the launcher does, build
    the remote shell line with them and run it here under ``sh -c`` (the program is ``true``); the
    :class:`LaunchError` text when the exports or the line are refused instead."""
    try:
        exports = multinode.collect_exports(environ, str(tmp_path), str(tmp_path / "home"))
        line = multinode.shell_line(["true"], str(tmp_path), exports)
    except multinode.LaunchError as exc:
        return str(exc)
    subprocess.run(["sh", "-c", line], cwd=tmp_path, capture_output=True, check=False, timeout=30)
    return None


def test_hostile_variable_name_in_the_environment_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    name = f"MICROSPEED_$(touch {marker})"
    environ = {"NCCL_DEBUG": "INFO", name: "v"}
    error = _export_and_run(environ, tmp_path)
    assert not marker.exists()
    assert error is not None and f"the launcher's environment: environment variable name {name!r}" in error
    with pytest.raises(multinode.LaunchError, match="MICROSPEED_"):  # the whole launch, too
        _plan(tmp_path, "--launcher", "ssh", "--master_addr", "10.0.0.1", environ=environ)


@pytest.mark.parametrize("name", ["MICROSPEED_$(touch {marker})", "MICROSPEED_\u00e9", "NCCL_X;touch {marker};Y"])
def test_hostile_variable_name_in_a_deepspeed_env_file_is_refused(tmp_path, name):
    """A ``.deepspeed_env`` line's name is checked as strictly: ASCII ``[A-Za-z_][A-Za-z0-9_]*``, named with
    the file and line in the error (``str.isidentifier`` let non-ASCII names through)."""
    marker = tmp_path / "pwned"
    name = name.format(marker=marker)
    (tmp_path / ".deepspeed_env").write_text(f"GOOD=1\n{name}=v\n")
    error = _export_and_run({}, tmp_path)
    assert not marker.exists()
    assert error is not None and f".deepspeed_env:2: environment variable name {name!r}" in error


@pytest.mark.parametrize("value", ["$(touch {marker})", "`touch {marker}`", "'; touch {marker}; '",
                                   "a\ntouch {marker}", '" $HOME \\', "%n ${{IFS}} * ?"])
def test_hostile_values_reach_the_node_unchanged_and_never_run(tmp_path, value):
    """Regression guard (values were already ``shlex``-quoted): every value arrives byte for byte."""
    marker = tmp_path / "pwned"
    value = value.format(marker=marker)
    line = multinode.shell_line([sys.executable, "-c", "import os, sys; sys.stdout.write(os.environ['MICROSPEED_V'])"],
                                str(tmp_path), {"MICROSPEED_V": value})
    out = subprocess.run(["sh", "-c", line], capture_output=True, text=True, check=True, timeout=60).stdout
    assert out == value and not marker.exists()


# ---------------------------------------------------------------------------------------- pdsh pid file


def test_pdsh_pid_file_is_not_a_predictable_name_in_tmp(tmp_path):
    """The node wrote ``/tmp/microspeed-run-JOB.pid`` (any user of the node could plant it first, and the stop
    command killed the pid it held); it now names a job whose file is in the user's private folder."""
    p = _plan(tmp_path, "--launcher", "pdsh", "--master_addr", "10.0.0.1")
    line, stop = p["argv"][-1], p["kill_argv"][-1]
    assert "--pid-file" not in line and "microspeed-run-" not in line + stop and "kill" not in stop
    job = p["node"].pid_job
    assert f"--pid-job {job}" in line and shlex.split(stop)[1:] == ["-m", "microspeed.cli", "run", "--stop-job", job]


def test_pid_file_is_private_and_the_stop_command_finds_it(tmp_path):
    environ = {"HOME": str(tmp_path), "XDG_RUNTIME_DIR": ""}
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        path = pidfile.write_pid("job1", sleeper.pid, environ)
        folder = os.path.dirname(path)
        assert folder == str(tmp_path / ".cache" / "microspeed" / "run")
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert pidfile.stop_job("job1", environ) == sleeper.pid
        assert sleeper.wait(timeout=30) == -signal.SIGTERM and not os.path.exists(path)
        assert pidfile.stop_job("job1", environ) is None  # nothing left to stop
    finally:
        sleeper.kill()
        sleeper.wait()


def test_planted_pid_file_link_or_foreign_folder_is_refused(tmp_path):
    environ = {"HOME": str(tmp_path), "XDG_RUNTIME_DIR": ""}
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    path = pidfile.pid_path("job2", environ)
    os.symlink(victim, path)
    with pytest.raises(pidfile.PidFileError, match="already exists"):
        pidfile.write_pid("job2", 12345, environ)
    assert victim.read_text() == "keep\n"
    with pytest.raises(pidfile.PidFileError, match=r"cannot read the pid file .*job2"):
        pidfile.stop_job("job2", environ)  # a link is not followed
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    os.symlink(elsewhere, runtime / "microspeed")  # the folder itself planted as a link
    with pytest.raises(pidfile.PidFileError, match="is not a folder of this user"):
        pidfile.pid_path("job3", {"HOME": str(tmp_path), "XDG_RUNTIME_DIR": str(runtime)})


# ---------------------------------------------------------------------------------------- store binding


def _listening(port):
    """The local addresses listening on TCP ``port`` on this machine (from ``/proc/net/tcp`` and ``tcp6``)."""
    import ipaddress

    found = set()
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/net/{name}", encoding="ascii") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            hex_addr, hex_port = local.split(":")
            if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(hex_addr)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word is host-order
            found.add(str(ipaddress.ip_address(raw)))
    return found


pytestmark_linux = pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads /proc/net/tcp")


@pytestmark_linux
def test_launcher_hosted_rendezvous_listens_on_its_address_only():
    """The elastic ssh launch's rendezvous store (in the launcher) listened on every interface."""
    from microspeed.testing.harness import free_port

    port = free_port()
    store = multinode.host_rendezvous("127.0.0.1", port)
    try:
        assert _listening(port) == {"127.0.0.1"}
        store.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        del store


@pytestmark_linux
@pytest.mark.parametrize("use_libuv", ["1", "0"])
def test_single_machine_stores_listen_on_loopback_only(monkeypatch, use_libuv):
    """torchrun's static rendezvous store (the agent's, which the ranks and the watchdog's heartbeat use) and
    ``init_process_group``'s ``env://`` store (rank 0's), started as ``microspeed run`` and its ranks start them,
    listen on ``127.0.0.1`` only (torch's own listen on ``*``), with the libuv and the legacy backend."""
    import datetime
    import importlib

    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    from microspeed import store_server
    from microspeed.cli import run
    from microspeed.testing.harness import free_port

    pg_rendezvous = importlib.import_module("torch.distributed.rendezvous")
    monkeypatch.setenv("USE_LIBUV", use_libuv)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.delenv("MICROSPEED_STORE_BIND", raising=False)
    opts = type("Opts", (), {"standalone": False, "nnodes": "1"})()
    store_server.install(spans_machines=run._spans_machines(opts))  # what run.launch does before torchrun
    try:
        agent_port, rank0_port = free_port(), free_port()
        agent = StaticTCPRendezvous("127.0.0.1", agent_port, 0, 1, "job", 30).next_rendezvous()
        rank0 = pg_rendezvous._create_c10d_store("127.0.0.1", rank0_port, 0, 1, datetime.timedelta(seconds=30),
                                                 use_libuv=use_libuv == "1")
        assert _listening(agent_port) == {"127.0.0.1"} and _listening(rank0_port) == {"127.0.0.1"}
        agent.store.set("k", "1")
        rank0.set("k", "2")
        assert agent.store.get("k") == b"1" and rank0.get("k") == b"2"
        del agent, rank0
    finally:
        store_server.uninstall()


@pytestmark_linux
def test_store_of_a_job_across_machines_listens_on_the_route_address_only(monkeypatch):
    """Node 0's agent store in a job across machines (``--master_addr`` = node 0's address, as the hostfile launcher
    finds it with ``hostname -I``): reachable at that address, not on loopback or any other interface."""
    import datetime
    import socket

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    from microspeed import store_server
    from microspeed.netaddr import source_address
    from microspeed.testing.harness import free_port

    here = source_address("192.0.2.1")  # the address on the route out (TEST-NET-1: nothing is sent)
    if here is None or here.startswith("127."):
        pytest.skip("no non-loopback route on this machine")
    monkeypatch.delenv("MICROSPEED_STORE_BIND", raising=False)
    store_server.install(spans_machines=True)
    try:
        port = free_port(here)
        agent = StaticTCPRendezvous(here, port, 0, 1, "job", 30).next_rendezvous()
        assert _listening(port) == {here}
        peer = TCPStore(here, port, is_master=False, timeout=datetime.timedelta(seconds=10))
        peer.set("job/k", "v")
        assert agent.store.get("k") == b"v"
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        del agent, peer
    finally:
        store_server.uninstall()


def test_which_address_a_store_listens_on(monkeypatch):
    from microspeed.netaddr import listen_address

    monkeypatch.delenv("MICROSPEED_STORE_BIND", raising=False)
    assert listen_address("127.0.0.1") == "127.0.0.1"  # an address: always itself
    assert listen_address("localhost", spans_machines=False) == "127.0.0.1"
    assert listen_address("localhost", spans_machines=True) is None  # a name other machines may resolve otherwise
    assert listen_address("192.0.2.123") is None  # not this machine's (TEST-NET-1)
    monkeypatch.setenv("MICROSPEED_STORE_BIND", "all")
    assert listen_address("127.0.0.1") is None


_PROBE = """\
import json, os, sys
sys.path.insert(0, {tests!r})
import torch.distributed as dist
from microspeed.comm import setup
from microspeed.observe import watchdog
from test_launcher_security import _listening
setup.init_distributed(dist_backend="gloo")
wd = watchdog.start(60)
dist.barrier()
if dist.get_rank() == 0:
    wd.store.set("probe", "1")  # the heartbeat store: a client of the same server
    port = int(os.environ["MASTER_PORT"])
    print("RESULT " + json.dumps({{"listen": sorted(_listening(port)), "heartbeat": wd.store.get("probe").decode()}}))
dist.barrier()
watchdog.stop()
dist.destroy_process_group()
"""


@pytestmark_linux
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_two_rank_job_on_one_machine_serves_its_store_on_loopback_only(tmp_path):
    """``microspeed run --nproc-per-node 2``: the agent's store, which the ranks' process group and the
    watchdog's heartbeat use, listens on 127.0.0.1 only (torchrun's listens on every interface)."""
    import json

    from microspeed.testing.harness import free_port

    (tmp_path / "probe.py").write_text(_PROBE.format(tests=os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "MICROSPEED_STORE_BIND"}
    proc = subprocess.run([sys.executable, "-m", "microspeed.cli", "run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), "probe.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=150)
    lines = [ln for ln in proc.stdout.splitlines() if "RESULT " in ln]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    assert json.loads(lines[0].split("RESULT ", 1)[1]) == {"listen": ["127.0.0.1"], "heartbeat": "1"}
