"""Two machines: ``microspeed run --hostfile`` over real ssh into two network namespaces (slow, needs root).

Each "machine" is a network namespace with its own address on a bridge the test creates (and always tears
down), running an sshd the test starts on a high port with keys it generates. The launcher runs in the root
namespace, checks both hosts over ssh, finds node 0's address with ``hostname -I``, and starts torchrun on each
(2 processes each) with the ``.microspeed_env`` of its working directory (``GLOO_SOCKET_IFNAME``). A tiny model
trains with ZeRO-2 over gloo; its per-step losses equal 4 local processes' (fp32, rel 1e-5). Then a rank of the
second machine fails: the launcher stops the first machine's ranks (which would sleep for minutes) and its
report names the host.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from microspeed.testing.netns import SlowNetwork, cleanup_leftovers
from microspeed.testing.sshd import SshCluster, sshd_unavailable

PREFIX = "msmn"
SUBNET = "10.79.0"
IFNAME = "msn0"

SCRIPT = r"""
import json, os, sys, time
import torch
import torch.distributed as dist
import microspeed

out, steps, fail_rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 2}}
engine, *_ = microspeed.initialize(model=model, config=config)
rank, world = dist.get_rank(), dist.get_world_size()
if fail_rank >= 0:
    if rank == fail_rank:
        raise ValueError(f"boom on rank {rank}")
    time.sleep(300)  # the launcher must stop these ranks; they never finish on their own
gen = torch.Generator().manual_seed(1)
x, y = torch.randn(steps * 8, 8, generator=gen), torch.randn(steps * 8, 1, generator=gen)
per = 8 // world
losses = []
for step in range(steps):
    rows = slice(step * 8 + rank * per, step * 8 + (rank + 1) * per)
    for micro in range(per // 2):  # 4 ranks: 1 micro-batch of 2; the same 8 samples per step at any world size
        part = slice(rows.start + 2 * micro, rows.start + 2 * micro + 2)
        loss = torch.nn.functional.mse_loss(engine(x[part]), y[part])
        engine.backward(loss)
        engine.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    losses.append(mean.item() / world)
where = [None] * world
dist.all_gather_object(where, (rank, int(os.environ["GROUP_RANK"]), os.stat("/proc/self/ns/net").st_ino))
if rank == 0:
    with open(out, "w") as f:
        json.dump({"world": world, "losses": losses, "where": where}, f)
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], cwd, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HOME": str(cwd / "home")}
    start = time.monotonic()
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
        print(f"--- {' '.join(cmd[3:])}: {time.monotonic() - start:.1f} s, exit {res.returncode}\n{res.stderr}")
        return res
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(cmd[:8])} ... did not finish within {timeout} s: {exc.stderr}")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_machines_over_ssh_train_as_four_local_processes(tmp_path):
    reason = sshd_unavailable()
    if reason:
        pytest.skip(f"two-machine test: {reason}")
    cleanup_leftovers(PREFIX)  # what a killed earlier run of this test left behind
    (tmp_path / "home").mkdir()
    (tmp_path / "train.py").write_text(SCRIPT)
    run = [sys.executable, "-m", "microspeed.cli", "run"]

    ref = _run([*run, "--nproc-per-node", "4", "--master-port", str(_free_port()), "train.py", "ref.json", "4", "-1"],
               tmp_path, 150)
    assert ref.returncode == 0, ref.stderr
    reference = json.loads((tmp_path / "ref.json").read_text())

    with SlowNetwork(2, rate=None, subnet=SUBNET, prefix=PREFIX, host_addr=True, inner_ifname=IFNAME) as net, \
            SshCluster(net, str(tmp_path / "ssh")) as ssh:
        hosts = [net.addr(0), net.addr(1)]
        (tmp_path / "hostfile").write_text(f"# two namespaces\n{hosts[0]} slots=2\n{hosts[1]} slots=2\n")
        (tmp_path / ".microspeed_env").write_text(f"GLOO_SOCKET_IFNAME={IFNAME}\nOMP_NUM_THREADS=1\n")
        launcher = [*run, "--hostfile", "hostfile", "--launcher", "ssh", "--launcher_args", f"-F {ssh.client_config}",
                    "--master_port", str(_free_port())]

        multi = _run([*launcher, "train.py", "multi.json", "4", "-1"], tmp_path, 200)
        assert multi.returncode == 0, multi.stderr
        assert f"ssh launch on 2 nodes: {hosts[0]} (2), {hosts[1]} (2); master {hosts[0]}:" in multi.stderr
        result = json.loads((tmp_path / "multi.json").read_text())
        assert result["world"] == reference["world"] == 4
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        assert len(set(reference["losses"])) == 4  # it trains: every step's loss differs
        where = {rank: (node, ns) for rank, node, ns in result["where"]}
        root_ns = os.stat("/proc/self/ns/net").st_ino
        assert [where[r][0] for r in range(4)] == [0, 0, 1, 1]
        assert where[0][1] == where[1][1] != where[2][1] == where[3][1] and root_ns not in (where[0][1], where[2][1])

        start = time.monotonic()
        failed = _run([*launcher, "--log-dir", "logs", "train.py", "fail.json", "1", "2"], tmp_path, 150)
        took = time.monotonic() - start
    out = failed.stderr
    assert failed.returncode == 1, out
    assert f"microspeed run: node 1 ({hosts[1]}) failed first (exit code 1):" in out, out
    assert f"{hosts[1]}: microspeed run: rank 2 failed" in out and "ValueError: boom on rank 2" in out, out
    assert f"microspeed run: stopped the other node(s): node 0 ({hosts[0]})" in out, out
    assert took < 120, f"the first node's ranks were not stopped: the job took {took:.0f} s"
    traceback_file = re.search(rf"{re.escape(hosts[1])}: microspeed run: rank 2 full traceback: (\S+)", out)
    assert traceback_file and traceback_file[1].startswith("logs/"), out  # torchrun options pass on (--log-dir)
    assert "boom on rank 2" in (tmp_path / traceback_file[1]).read_text()  # the node ran in the same folder
    assert not [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
                if n.startswith(PREFIX)]
