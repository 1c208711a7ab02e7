"""``microspeed run --elastic MIN:MAX [--max_restarts N]``: the torchrun lines it builds, locally and per host, and
its errors (no process is launched here)."""

from __future__ import annotations

import re
import shlex
import sys
import time

import pytest

from microspeed.cli import elastic, multinode
from microspeed.cli import run as run_cli
from microspeed.errors import ConfigError
from microspeed.testing import free_port


@pytest.fixture
def launched(monkeypatch):
    """``microspeed run``'s local path with torchrun replaced: the argument list it would have been given."""
    seen: list[list[str]] = []
    monkeypatch.setattr(run_cli, "launch", lambda args: seen.append(list(args)) or 0)
    monkeypatch.delenv("MICROSPEED_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    return seen


def _value(argv, option):
    return argv[argv.index(option) + 1]


def test_local_elastic_becomes_torchruns_c10d_form(launched):
    assert run_cli.main(["--elastic", "1:2", "--max_restarts", "5", "--nproc-per-node", "2", "train.py", "--x",
                         "1"]) == 0
    (args,) = launched
    job = elastic.default_job_id(["train.py", "--x", "1"])
    assert args == ["--nnodes", "1:2", "--max-restarts", "5", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                    "127.0.0.1:29400", "--rdzv-id", job, "--nproc-per-node", "2", "train.py", "--x", "1"]
    # every torchrun option we set parses as torchrun parses it
    from torch.distributed import run as torchrun

    opts = torchrun.get_args_parser().parse_args(args)
    assert (opts.nnodes, opts.max_restarts, opts.rdzv_backend, opts.rdzv_endpoint, opts.rdzv_id) == (
        "1:2", 5, "c10d", "127.0.0.1:29400", job)
    assert opts.training_script == "train.py" and opts.training_script_args == ["--x", "1"]


def test_local_elastic_defaults_and_given_rendezvous(launched, monkeypatch):
    run_cli.main(["--elastic=2:4", "--max-restarts=0", "--master-addr", "10.1.1.1", "--master-port", "7000",
                  "-m", "pkg.train"])
    run_cli.main(["--elastic", "1:1", "--rdzv-endpoint", "h:9", "--rdzv-id", "mine", "t.py"])
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    run_cli.main(["--elastic", "1:3", "t.py"])
    a, b, c = launched
    assert _value(a, "--nnodes") == "2:4" and _value(a, "--max-restarts") == "0"
    assert _value(a, "--rdzv-endpoint") == "10.1.1.1:7000" and "--master-addr" not in a and "--master-port" not in a
    assert a[-2:] == ["-m", "pkg.train"]
    assert _value(b, "--rdzv-endpoint") == "h:9" and _value(b, "--rdzv-id") == "mine" and b.count("--rdzv-id") == 1
    assert _value(c, "--max-restarts") == str(elastic.DEFAULT_MAX_RESTARTS) and _value(c, "--rdzv-id") == "4242"
    assert c[:2] == ["--nproc-per-node", "1"] and c[-1] == "t.py"


def test_same_command_same_folder_same_job_id(tmp_path):
    env = {}
    one = elastic.default_job_id(["t.py", "--a"], str(tmp_path), env)
    assert one == elastic.default_job_id(["t.py", "--a"], str(tmp_path), env)
    assert one != elastic.default_job_id(["t.py", "--b"], str(tmp_path), env)
    assert one != elastic.default_job_id(["t.py", "--a"], str(tmp_path / "x"), env)
    assert elastic.default_job_id(["t.py"], str(tmp_path), {"MICROSPEED_JOB_ID": "j1", "SLURM_JOB_ID": "9"}) == "j1"


def test_without_elastic_max_restarts_goes_to_torchrun_unchanged(launched):
    run_cli.main(["--max_restarts", "2", "t.py"])
    assert launched == [["--nproc-per-node", "1", "--max_restarts", "2", "t.py"]]


@pytest.mark.parametrize("spec, needle", [
    ("2:1", r"MIN \(2\) is larger than MAX \(1\)"),
    ("a:b", "expected MIN:MAX, two whole numbers"),
    ("1.5:2", "expected MIN:MAX"),
    ("2", "expected MIN:MAX"),
    ("0:2", "MIN must be at least 1"),
])
def test_bad_min_max_is_a_clear_error(launched, capsys, spec, needle):
    assert run_cli.main(["--elastic", spec, "t.py"]) == 2
    err = capsys.readouterr().err
    assert "microspeed run: error: --elastic" in err and re.search(needle, err), err
    assert not launched
    with pytest.raises(ConfigError, match=needle):
        elastic.parse_nodes(spec)


@pytest.mark.parametrize("args, needle", [
    (["--elastic", "1:2", "--max_restarts", "-1"], "--max_restarts '-1': expected a whole number >= 0"),
    (["--elastic", "1:2", "--nnodes", "2"], "--nnodes: --elastic sets it"),
    (["--elastic", "1:2", "--standalone"], "--standalone: --elastic sets it"),
    (["--elastic", "1:2", "--rdzv-endpoint", "h:1", "--master-port", "3"], "both name the rendezvous"),
])
def test_bad_elastic_arguments(launched, capsys, args, needle):
    assert run_cli.main([*args, "t.py"]) == 2
    assert needle in capsys.readouterr().err and not launched


# ---------------------------------------------------------------------------------------- with a hostfile


def _plan(tmp_path, *args, text="n0 slots=2\nn1 slots=2\n"):
    hf = tmp_path / "hostfile"
    hf.write_text(text)
    return multinode.plan(["--hostfile", str(hf), *args, "train.py", "--lr", "1"], cwd=str(tmp_path),
                          environ={"HOME": str(tmp_path / "h")}, check=False)


def _node_argv(ssh_argv):
    words = shlex.split(ssh_argv[-1])
    return words[words.index(sys.executable):]


def test_every_host_joins_the_same_c10d_rendezvous(tmp_path):
    p = _plan(tmp_path, "--launcher", "ssh", "--master_addr", "10.0.0.1", "--master_port", "4321", "--elastic",
              "1:2", "--max_restarts", "4")
    node = p["node"]
    assert (node.rendezvous, node.nnodes, node.max_restarts) == ("c10d", "1:2", 4) and node.rdzv_id
    cmds = [_node_argv(a) for a in p["argvs"].values()]
    assert cmds[0] == cmds[1]  # no node rank: the rendezvous assigns them
    assert cmds[0] == [sys.executable, "-u", "-m", "microspeed.cli", "run", "--exit-with-stdin", "--nnodes", "1:2",
                       "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:4321",
                       "--rdzv-id", node.rdzv_id, "--max-restarts", "4", "train.py", "--lr", "1"]
    assert p["elastic"] == elastic.ElasticSpec(1, 2, 4)


def test_elastic_slurm_and_pdsh_lines_use_the_rendezvous(tmp_path):
    srun = _plan(tmp_path, "--launcher", "slurm", "--elastic", "2:2")["argv"][-1]
    pdsh = _plan(tmp_path, "--launcher", "pdsh", "--master_addr", "m", "--elastic", "1:2")["argv"][-1]
    for line in (srun, pdsh):
        assert "--rdzv-backend c10d" in line and "--node-rank" not in line
        assert f"--max-restarts {elastic.DEFAULT_MAX_RESTARTS} " in line
    assert "--nnodes 2:2" in srun and "--rdzv-endpoint n0:29500" in srun and "--nnodes 1:2" in pdsh


def test_elastic_max_above_the_hostfile_is_refused(tmp_path):
    with pytest.raises(elastic.ElasticError, match=r"MAX \(3\) is more than the 2 node\(s\) the hostfile selects"):
        _plan(tmp_path, "--launcher", "ssh", "--master_addr", "m", "--elastic", "1:3")
    with pytest.raises(elastic.ElasticError, match=r"MAX \(2\) is more than the 1 node"):
        _plan(tmp_path, "--num_nodes", "1", "--elastic", "1:2")
    with pytest.raises(elastic.ElasticError, match="is larger than MAX"):
        _plan(tmp_path, "--elastic", "2:1")


def test_elastic_on_one_selected_host_runs_the_local_elastic_form(tmp_path):
    p = _plan(tmp_path, "--include", "n1", "--elastic", "1:1", "--max-restarts", "2")
    assert p["launcher"] == "local"
    assert p["argv"][:4] == ["--elastic", "1:1", "--max-restarts", "2"]
    args = elastic.local_args(p["argv"][4:], elastic.ElasticSpec(1, 1, 2), str(tmp_path), {})
    assert _value(args, "--rdzv-endpoint") == "127.0.0.1:29500" and _value(args, "--nnodes") == "1:1"


def test_bad_elastic_from_the_hostfile_command_line(tmp_path, capsys):
    (tmp_path / "hostfile").write_text("a slots=1\nb slots=1\n")
    code = multinode.main(["--hostfile", str(tmp_path / "hostfile"), "--no_ssh_check", "--master_addr", "m",
                           "--elastic", "1:5", "t.py"])
    assert code == 2 and "microspeed run: error: --elastic 1:5: MAX (5) is more than the 2" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- the ssh watcher

_FAILS = "import sys, time; time.sleep(0.3); sys.exit(3)"
_WORKS = "import time; time.sleep(1.5); print('done', flush=True)"


@pytest.mark.timeout(60)
def test_elastic_watcher_keeps_the_others_running(capsys):
    """A node that fails does not stop the others; the job succeeds when a surviving node finishes it."""
    code = multinode.run_ssh_nodes({"a": [sys.executable, "-c", _FAILS], "b": [sys.executable, "-c", _WORKS]},
                                   elastic=True)
    out = capsys.readouterr()
    assert code == 0, out
    assert "node 0 (a) ended with exit code 3; the other nodes continue (elastic)" in out.err and "b: done" in out.out


@pytest.mark.timeout(60)
def test_elastic_watcher_fails_when_every_node_failed(capsys):
    code = multinode.run_ssh_nodes({"a": [sys.executable, "-c", _FAILS], "b": [sys.executable, "-c", _FAILS]},
                                   elastic=True)
    err = capsys.readouterr().err
    assert code == 3 and "no node finished the job (elastic)" in err and "stopped the other" not in err


def _once_then(tmp_path, first_code: int, then: str) -> str:
    """A node command that exits ``first_code`` the first time it runs and runs ``then`` the next time."""
    marker = tmp_path / "ran-once"
    return (f"import pathlib, sys, time; m = pathlib.Path({str(marker)!r})\n"
            f"if not m.exists():\n    m.touch(); time.sleep(0.2); sys.exit({first_code})\n{then}")


@pytest.mark.timeout(60)
def test_elastic_watcher_starts_a_lost_host_again_when_it_answers(tmp_path, capsys):
    """A lost host whose ssh check passes again is started again (its agent would rejoin the rendezvous)."""
    b = _once_then(tmp_path, 255, "print('back', flush=True)")
    code = multinode.run_ssh_nodes({"a": [sys.executable, "-c", "import time; time.sleep(4)"],
                                    "b": [sys.executable, "-c", b]}, elastic=True,
                                   probes={"a": [sys.executable, "-c", "0"], "b": [sys.executable, "-c", "0"]},
                                   rejoins=1, probe_interval_s=0.1)
    out = capsys.readouterr()
    assert code == 0, out
    assert "node 1 (b) ended with exit code 255; the other nodes continue (elastic)" in out.err
    assert "node 1 (b) answers again: starting it again to rejoin the job (elastic, 1 of 1)" in out.err
    assert "b: back" in out.out


@pytest.mark.timeout(60)
def test_elastic_watcher_waits_while_a_lost_host_does_not_answer(tmp_path, capsys):
    """No restart while the host's check fails, and at most ``rejoins`` restarts per host."""
    b = _once_then(tmp_path, 3, "print('back', flush=True)")
    code = multinode.run_ssh_nodes({"a": [sys.executable, "-c", "import time; time.sleep(2)"],
                                    "b": [sys.executable, "-c", b]}, elastic=True,
                                   probes={"b": [sys.executable, "-c", "import sys; sys.exit(255)"]},
                                   rejoins=3, probe_interval_s=0.1)
    out = capsys.readouterr()
    assert code == 0 and "answers again" not in out.err and "back" not in out.out, out
    code = multinode.run_ssh_nodes({"a": [sys.executable, "-c", "import time; time.sleep(2)"],
                                    "b": [sys.executable, "-c", "import sys; sys.exit(3)"]}, elastic=True,
                                   probes={"b": [sys.executable, "-c", "0"]}, rejoins=2, probe_interval_s=0.1)
    err = capsys.readouterr().err
    assert code == 0 and err.count("answers again") == 2 and "(elastic, 2 of 2)" in err, err


@pytest.mark.timeout(60)
def test_elastic_watcher_stops_late_nodes_once_the_job_finished(capsys):
    """A node still running (an agent that joined late waits in the rendezvous) is stopped after the grace time."""
    start = time.monotonic()
    code = multinode.run_ssh_nodes({"a": [sys.executable, "-c", "print('done')"],
                                    "b": [sys.executable, "-c", "import time; time.sleep(60)"]},
                                   grace_s=1.0, elastic=True)
    err = capsys.readouterr().err
    assert code == 0, err
    assert "the job finished; stopping the node(s) still running: node 1 (b)" in err
    assert time.monotonic() - start < 20


def test_elastic_ssh_launch_has_keepalives_and_probes(tmp_path):
    p = _plan(tmp_path, "--elastic", "1:2", "--launcher", "ssh", "--launcher_args", "-F cfg")
    for host, argv in p["argvs"].items():
        assert argv[:3] == ["ssh", "-F", "cfg"] and "ServerAliveInterval=2" in argv and "ServerAliveCountMax=5" in argv
        assert p["probes"][host][:3] == ["ssh", "-F", "cfg"] and p["probes"][host][-2:] == [host, "true"]
    plain = _plan(tmp_path, "--launcher", "ssh")
    assert "probes" not in plain and not any("ServerAlive" in a for v in plain["argvs"].values() for a in v)


def test_rendezvous_host_is_found_by_binding_when_torch_does_not_see_it(monkeypatch):
    """torch matches the endpoint against the host name only: an address of another interface (a namespace, a
    cluster network) hosts nothing. microspeed adds is_host=1 where the address binds and the port is free."""
    import socket

    from torch.distributed.elastic.rendezvous import utils

    monkeypatch.setattr(utils, "_matches_machine_hostname", lambda host: False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free = s.getsockname()[1]
        assert elastic.rendezvous_conf(f"127.0.0.1:{free}", "") == "is_host=1"
        assert elastic.rendezvous_conf(f"127.0.0.1:{free}", "last_call_timeout=5") == "last_call_timeout=5,is_host=1"
        assert elastic.rendezvous_conf(f"127.0.0.1:{taken}", "a=1") == "a=1"  # served here already: a client
    assert elastic.rendezvous_conf("192.0.2.1:29400", "") == ""  # not this machine's address
    assert elastic.rendezvous_conf("127.0.0.1:29400", "is_host=0") == "is_host=0"  # the user's word wins
    monkeypatch.setattr(utils, "_matches_machine_hostname", lambda host: True)
    assert elastic.rendezvous_conf(f"127.0.0.1:{free}", "") == ""  # torch sees it itself (and keeps its fallback)


def test_rendezvous_local_address_is_not_localhost(monkeypatch):
    """torch tells the other nodes socket.getfqdn() as the workers' store address; where that is localhost (a
    machine without a resolvable name) microspeed gives torchrun the address that reaches the rendezvous."""
    import ipaddress
    import socket

    monkeypatch.setattr(socket, "getfqdn", lambda *a: "localhost")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 29400))
            expected = s.getsockname()[0]
        except OSError:
            pytest.skip("no route to a non-local address on this machine")
    assert elastic.rendezvous_local_addr("192.0.2.1:29400") == expected
    assert not ipaddress.ip_address(expected).is_loopback
    assert elastic.rendezvous_local_addr("127.0.0.1:29400") is None  # all on one machine: localhost is right
    monkeypatch.setattr(socket, "getfqdn", lambda *a: "127.0.0.1")
    assert elastic.rendezvous_local_addr("192.0.2.1:29400") == expected
    monkeypatch.setattr(socket, "getfqdn", lambda *a: "")
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(2, 1, 6, "", ("10.1.2.3", 0))])
    assert elastic.rendezvous_local_addr("192.0.2.1:29400") is None  # a real name: torch's choice


def test_the_launcher_can_host_the_rendezvous():
    """An elastic ssh launch hosts the c10d store in the launcher (no training node is special): its address is the
    one that reaches node 0, and a taken port is an error naming the fix."""
    import datetime

    from torch.distributed import TCPStore

    from microspeed.netaddr import source_address

    assert source_address("127.0.0.1") == "127.0.0.1"
    assert source_address("not a host name") is None
    port = free_port()
    store = multinode.host_rendezvous("127.0.0.1", port)
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("k") == b"v"
    del client, store
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(multinode.LaunchError, match="give a free --master_port, or --master_addr"):
            multinode.host_rendezvous("127.0.0.1", busy.getsockname()[1])


@pytest.mark.timeout(180)
def test_each_restart_prints_the_failure_summary(tmp_path):
    """An elastic agent restarts failed workers silently; microspeed run prints why each time (here: the first
    attempt raises, the second succeeds)."""
    import subprocess

    (tmp_path / "train.py").write_text(
        "import os\nif os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n    raise ValueError('first attempt fails')\n"
        "print('second attempt ran')\n")
    res = subprocess.run([sys.executable, "-m", "microspeed.cli", "run", "--nproc-per-node", "1", "--max-restarts",
                          "1", "--master-port", str(free_port()), "train.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=150, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr
    assert "microspeed run: the workers failed; the agent restarts them (1 restart(s) left):" in res.stderr
    assert "microspeed run: rank 0 failed" in res.stderr and "ValueError: first attempt fails" in res.stderr
    assert "second attempt ran" in res.stdout
