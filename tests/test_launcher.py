"""``microspeed run --hostfile``: hostfile parsing, --include/--exclude/--num_nodes/--num_gpus, environment
propagation, the ssh/pdsh/srun command lines it builds, and the unreachable-host error (fast, no sshd needed).

The two-machine run over real ssh is ``tests/test_multinode.py``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time

import pytest

from microspeed.cli import hostfile, multinode
from microspeed.cli.hostfile import HostfileError, parse_hostfile_text, select_resources
from microspeed.errors import ConfigError

HOSTFILE = """\
# two workers
worker-0 slots=4
worker-1   slots=4   # trailing comment

worker-2 slots=2
"""


def _pool():
    return parse_hostfile_text(HOSTFILE.splitlines(), "hf")


# ---------------------------------------------------------------------------------------- hostfile


def test_hostfile_parses_hosts_in_order_skipping_comments_and_blank_lines():
    pool = _pool()
    assert list(pool.items()) == [("worker-0", 4), ("worker-1", 4), ("worker-2", 2)]


@pytest.mark.parametrize("text, needle", [
    ("worker-0 slots=4\nworker-1 slots=four\n", "hf:2: bad hostfile line 'worker-1 slots=four'"),
    ("worker-0 4\n", "hf:1: bad hostfile line 'worker-0 4'"),
    ("worker-0 slots=2\n\nworker-0 slots=2\n", "hf:3: host 'worker-0' is listed twice (first at line 1)"),
    ("worker-0 slots=0\n", "hf:1: host 'worker-0' has slots=0"),
    ("# nothing\n\n", "hf: no hosts"),
])
def test_bad_hostfile_names_file_and_line(text, needle):
    with pytest.raises(HostfileError) as err:
        parse_hostfile_text(text.splitlines(), "hf")
    assert needle in str(err.value)
    assert isinstance(err.value, ConfigError)


def test_missing_hostfile_is_a_clear_error(tmp_path):
    with pytest.raises(HostfileError, match=r"--hostfile .*nope: cannot read it"):
        hostfile.read_hostfile(str(tmp_path / "nope"))


# ---------------------------------------------------------------------------------------- filters


@pytest.mark.parametrize("kwargs, expected", [
    ({}, {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3], "worker-2": [0, 1]}),
    ({"include": "worker-1:0,2@worker-0"}, {"worker-0": [0, 1, 2, 3], "worker-1": [0, 2]}),  # hostfile order kept
    ({"include": "worker-0:0,1@worker-0:3"}, {"worker-0": [0, 1, 3]}),
    ({"exclude": "worker-1:0@worker-2"}, {"worker-0": [0, 1, 2, 3], "worker-1": [1, 2, 3]}),
    ({"num_nodes": 2}, {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}),
    ({"num_gpus": 2}, {"worker-0": [0, 1], "worker-1": [0, 1], "worker-2": [0, 1]}),
    ({"num_nodes": 1, "num_gpus": 3}, {"worker-0": [0, 1, 2]}),
])
def test_resource_filters_as_deepspeed(kwargs, expected):
    assert select_resources(_pool(), **kwargs) == expected


@pytest.mark.parametrize("kwargs, needle", [
    ({"include": "worker-9"}, "--include: host 'worker-9' is not in hf"),
    ({"include": "worker-2:5"}, "--include: host 'worker-2' has no slot 5 in hf (it has slots 0-1)"),
    ({"exclude": "worker-3:0"}, "--exclude: host 'worker-3' is not in hf"),
    ({"include": "worker-0:x"}, "slot 'x' of host 'worker-0' is not a non-negative integer"),
    ({"include": "worker-0", "exclude": "worker-1"}, "--include and --exclude exclude each other"),
    ({"include": "worker-0", "num_gpus": 1}, "cannot be combined with --include/--exclude"),
    ({"exclude": "worker-0@worker-1@worker-2"}, "leaves no host to run on"),
    ({"num_nodes": 4}, "--num_nodes 4: hf lists only 3 host(s)"),
    ({"num_gpus": 3}, "--num_gpus 3 does not match hf: host 'worker-2' has slots=2"),
    ({"num_gpus": 0}, "--num_gpus 0: give a positive number"),
])
def test_resource_filter_errors_name_the_host_or_slot(kwargs, needle):
    with pytest.raises(HostfileError) as err:
        select_resources(_pool(), source="hf", **kwargs)
    assert needle in str(err.value)


# ---------------------------------------------------------------------------------------- environment


def test_exports_prefixes_pythonpath_and_env_files(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("FROM_HOME=1\nSHARED=home\n")
    (cwd / ".deepspeed_env").write_text("# comment\n\nSHARED=cwd\nWITH_EQ=a=b c\n")
    (cwd / ".microspeed_env").write_text("export MS_ONLY=yes\n")
    environ = {"NCCL_DEBUG": "INFO", "PYTHONHASHSEED": "0", "GLOO_SOCKET_IFNAME": "eth9", "MICROSPEED_X": "1",
               "UCX_TLS": "tcp", "HOME_SECRET": "no", "PATH": "/bin", "PYTHONPATH": "/opt/lib"}
    exports = multinode.collect_exports(environ, str(cwd), str(home))
    assert exports == {"NCCL_DEBUG": "INFO", "PYTHONHASHSEED": "0", "GLOO_SOCKET_IFNAME": "eth9",
                       "MICROSPEED_X": "1", "UCX_TLS": "tcp", "PYTHONPATH": f"{cwd}{os.pathsep}/opt/lib",
                       "FROM_HOME": "1", "SHARED": "cwd", "WITH_EQ": "a=b c", "MS_ONLY": "yes"}


def test_ds_env_file_renames_deepspeed_env(tmp_path):
    (tmp_path / "my.env").write_text("A=1\n")
    (tmp_path / ".deepspeed_env").write_text("B=2\n")
    exports = multinode.collect_exports({"DS_ENV_FILE": "my.env"}, str(tmp_path), str(tmp_path / "none"))
    assert exports.get("A") == "1" and "B" not in exports


def test_bad_env_file_line_names_file_and_line(tmp_path):
    (tmp_path / ".microspeed_env").write_text("A=1\nnot a pair\n")
    with pytest.raises(multinode.LaunchError, match=r"\.microspeed_env:2: bad line 'not a pair'"):
        multinode.collect_exports({}, str(tmp_path), str(tmp_path / "none"))


# ---------------------------------------------------------------------------------------- command lines


def _plan(tmp_path, *args, text="n0 slots=2\nn1 slots=2\n", environ=None):
    hf = tmp_path / "hostfile"
    hf.write_text(text)
    return multinode.plan(["--hostfile", str(hf), *args, "train.py", "--lr", "a b"], cwd=str(tmp_path),
                          environ=environ or {"NCCL_X": "1", "HOME": str(tmp_path / "h")}, check=False)


def _remote(line):
    """The remote shell line split into (cd folder, env assignments, argv)."""
    words = shlex.split(line)
    assert words[:2] == ["cd", words[1]] and words[2:5] == ["&&", "exec", "env"], words
    rest = words[5:]
    env = {}
    while "=" in rest[0] and not rest[0].startswith("/"):
        k, v = rest.pop(0).split("=", 1)
        env[k] = v
    return words[1], env, rest


def test_ssh_command_lines(tmp_path):
    p = _plan(tmp_path, "--launcher", "ssh", "--master_addr", "10.0.0.1", "--master_port", "4321",
              "--launcher_args", "-F /x/cfg -i key", "--ssh_port", "2200", "--max-restarts", "0")
    assert list(p["argvs"]) == ["n0", "n1"]
    for rank, (host, argv) in enumerate(p["argvs"].items()):
        assert argv[:9] == ["ssh", "-p", "2200", "-F", "/x/cfg", "-i", "key", "--", host]
        cwd, env, cmd = _remote(argv[9])
        assert cwd == str(tmp_path) and env["NCCL_X"] == "1" and env["PYTHONPATH"] == str(tmp_path)
        assert cmd == [sys.executable, "-u", "-m", "microspeed.cli", "run", "--exit-with-stdin", "--nnodes", "2",
                       "--nproc-per-node", "2", "--node-rank", str(rank), "--master-addr", "10.0.0.1",
                       "--master-port", "4321", "--max-restarts", "0", "train.py", "--lr", "a b"]


def test_ssh_include_sets_node_slots_and_visible_devices(tmp_path):
    p = _plan(tmp_path, "--launcher", "ssh", "--master_addr", "m", "--include", "n0:1@n1",
              text="n0 slots=2\nn1 slots=3\n")
    (_, env0, cmd0), (_, env1, cmd1) = (_remote(a[-1]) for a in p["argvs"].values())
    assert env0["CUDA_VISIBLE_DEVICES"] == "1" and "CUDA_VISIBLE_DEVICES" not in env1
    assert cmd0[cmd0.index("--nproc-per-node") + 1] == "1" and cmd1[cmd1.index("--nproc-per-node") + 1] == "3"


def test_pdsh_command_line(tmp_path):
    p = _plan(tmp_path, "--launcher", "pdsh", "--master_addr", "m", "--ssh_port", "2200", "--num_gpus", "1",
              environ={"PDSH_SSH_ARGS_APPEND": "-F cfg", "HOME": str(tmp_path)})
    argv = p["argv"]
    assert argv[:6] == ["pdsh", "-S", "-f", "1024", "-w", "n0,n1"]
    assert p["env"]["PDSH_RCMD_TYPE"] == "ssh" and p["env"]["PDSH_SSH_ARGS_APPEND"] == "-F cfg -p 2200"
    assert "--node-rank %n " in argv[6] and "--nproc-per-node 1 " in argv[6]
    job = p["node"].pid_job
    assert f"--pid-job {job}" in argv[6] and shlex.split(p["kill_argv"][-1])[-4:] == ["microspeed.cli", "run",
                                                                                     "--stop-job", job]


def test_pdsh_and_slurm_refuse_hosts_with_different_slots(tmp_path):
    with pytest.raises(multinode.LaunchError, match=r"different slots \(n0: 2, n1: 3\); use --launcher ssh"):
        _plan(tmp_path, "--launcher", "slurm", text="n0 slots=2\nn1 slots=3\n")


def test_slurm_builds_the_srun_line(tmp_path):
    p = _plan(tmp_path, "--launcher", "slurm", "--launcher_args", "--partition gpu", "--master_port", "5555")
    argv = p["argv"]
    assert argv[:13] == ["srun", "--nodes", "2", "--ntasks", "2", "--ntasks-per-node", "1", "--nodelist", "n0,n1",
                         "--kill-on-bad-exit=1", "--partition", "gpu", "--export=ALL"]
    assert argv[13:15] == ["bash", "-c"]
    _, env, cmd = _remote(argv[15])
    assert env["NCCL_X"] == "1"
    # the node rank comes from slurm; the master defaults to the first host (no ssh to ask it)
    assert cmd[cmd.index("--node-rank") + 1] == "$SLURM_NODEID" and "--node-rank $SLURM_NODEID " in argv[15]
    assert cmd[cmd.index("--master-addr") + 1] == "n0" and cmd[cmd.index("--master-port") + 1] == "5555"
    assert "--exit-with-stdin" not in cmd


def test_node_command_has_the_elastic_form():
    node = multinode.NodeCommand(nnodes="1:2", master_addr="h0", master_port=29400, script=["t.py"],
                                 rendezvous="c10d", rdzv_id="job7", max_restarts=3, python="py")
    assert node.argv(0, 2) == ["py", "-u", "-m", "microspeed.cli", "run", "--nnodes", "1:2", "--nproc-per-node",
                               "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h0:29400", "--rdzv-id", "job7",
                               "--max-restarts", "3", "t.py"]


def test_one_host_runs_locally_without_ssh(tmp_path):
    p = _plan(tmp_path, "--include", "n1:1")
    assert p["launcher"] == "local" and p["env"]["CUDA_VISIBLE_DEVICES"] == "1"
    assert p["argv"] == ["--nproc-per-node", "1", "--master-port", "29500", "train.py", "--lr", "a b"]


@pytest.mark.parametrize("options", [["--nnodes", "2"], ["--node_rank", "1"], ["--rdzv-endpoint=h:1"],
                                     ["--standalone"]])
def test_options_the_hostfile_sets_are_refused(tmp_path, options):
    with pytest.raises(HostfileError, match="the hostfile launcher sets it"):
        _plan(tmp_path, *options)


# ---------------------------------------------------------------------------------------- watching the nodes

# Stand-ins for the ssh processes: node A runs until its stdin closes (as a node under --exit-with-stdin);
# node B prints a node's failure summary and exits 1.
_WAITS = "import sys; print('step 1', flush=True); sys.stdin.read(); print('stopped', flush=True); sys.exit(143)"
_FAILS = ("import sys, time; time.sleep(0.5); print('microspeed run: rank 3 failed (exit code 1):', file=sys.stderr);"
          "print('ValueError: boom', file=sys.stderr); sys.exit(1)")


@pytest.mark.timeout(60)
def test_a_failing_node_stops_the_others_and_the_report_names_it(capsys):
    start = time.monotonic()
    code = multinode.run_ssh_nodes({"hostA": [sys.executable, "-c", _WAITS], "hostB": [sys.executable, "-c", _FAILS]})
    out, err = capsys.readouterr()
    assert code == 1 and time.monotonic() - start < 30
    assert "hostA: step 1" in out and "hostA: stopped" in out  # prefixed output; A saw its stdin close
    assert err.splitlines()[-4:] == ["microspeed run: node 1 (hostB) failed first (exit code 1):",
                                     "  hostB: microspeed run: rank 3 failed (exit code 1):",
                                     "  hostB: ValueError: boom",
                                     "microspeed run: stopped the other node(s): node 0 (hostA)"], err


@pytest.mark.timeout(60)
def test_ssh_failing_mid_run_is_named(capsys):
    ssh_died = "import sys; print('Connection to hostB closed by remote host.', file=sys.stderr); sys.exit(255)"
    code = multinode.run_ssh_nodes({"hostA": [sys.executable, "-c", _WAITS], "hostB": [sys.executable, "-c", ssh_died]})
    err = capsys.readouterr().err
    assert code == 1
    assert ("microspeed run: node 1 (hostB) failed first: ssh to hostB failed (exit code 255): Connection to hostB "
            "closed by remote host.") in err, err


def test_nodes_that_succeed_give_0(capsys):
    assert multinode.run_ssh_nodes({h: [sys.executable, "-c", "print('done')"] for h in ("a", "b")}) == 0
    assert sorted(capsys.readouterr().out.splitlines()) == ["a: done", "b: done"]


# ---------------------------------------------------------------------------------------- real ssh errors


def _microspeed_run(tmp_path, *args, timeout=60):
    return subprocess.run([sys.executable, "-m", "microspeed.cli", "run", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=tmp_path, env={**os.environ, "HOME": str(tmp_path)})


@pytest.mark.skipif(not multinode.shutil.which("ssh"), reason="needs the ssh client")
@pytest.mark.timeout(90)
def test_unreachable_hosts_are_named(tmp_path):
    (tmp_path / "hostfile").write_text("no-such-host.invalid slots=1\n127.0.0.1 slots=1\n")
    proc = _microspeed_run(tmp_path, "--hostfile", "hostfile", "--launcher", "ssh", "--ssh_port", "1",
                           "--launcher_args", "-o ConnectTimeout=2", "train.py")
    out = proc.stderr
    assert proc.returncode == 1, out
    assert "host 'no-such-host.invalid' is not reachable over ssh" in out
    assert "host '127.0.0.1' is not reachable over ssh" in out and "refused" in out  # nothing listens on port 1
    assert "--no_ssh_check" in out and "Traceback" not in out


@pytest.mark.timeout(60)
def test_bad_hostfile_line_from_the_command_line(tmp_path):
    (tmp_path / "hostfile").write_text("a slots=1\nb slots=x\n")
    proc = _microspeed_run(tmp_path, "--hostfile", "hostfile", "train.py")
    assert proc.returncode == 2 and "hostfile:2: bad hostfile line 'b slots=x'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_exit_with_stdin_stops_the_node_when_stdin_closes(tmp_path):
    """What the ssh launcher relies on to stop a node: its ``microspeed run --exit-with-stdin`` ends with stdin."""
    (tmp_path / "sleep.py").write_text("import time\nopen('started', 'w').close()\ntime.sleep(300)\n")
    proc = subprocess.Popen([sys.executable, "-m", "microspeed.cli", "run", "--exit-with-stdin", "--master-port", "0",
                             "sleep.py"], cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "started").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert (tmp_path / "started").exists(), proc.communicate(timeout=10)
        start = time.monotonic()
        proc.stdin.close()
        proc.wait(timeout=60)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + 15 and "stopped by SIGTERM; the ranks were stopped too" in err, err
    assert time.monotonic() - start < 30
