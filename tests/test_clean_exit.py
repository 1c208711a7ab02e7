"""A job that finished exits 0: no thread of microspeed is inside a torch operation when a rank's interpreter exits.

The cause found (issue 31): ZeRO stages 1-2 gather the stepped parameters asynchronously, through the shared-memory
exchange between the ranks of one host (``microspeed_zero.shm``) whose worker is a daemon thread, and nothing waits
for the last step's gathers before a script returns. A daemon thread still inside a torch operation (which releases
the GIL) when the interpreter finalises is ended by ``pthread_exit`` as it takes the GIL back; the forced unwinding
through torch's C++ GIL guard calls ``std::terminate``: "terminate called without an active exception", SIGABRT,
and the launcher reports a job that had finished as failed. (Found in a core dump of the HelloDeepSpeed client: the
worker in ``copy_`` of a gather's round, the main thread in ``Py_FinalizeEx``.) Now every exchange is stopped at
exit, its operations in flight finished first, and ``engine.destroy()`` waits for them too.

The multi-rank tests launch real processes rather than the project's harness: a harness rank ends with
``os._exit`` (multiprocessing's), which skips the interpreter's finalisation where the abort happens.
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from microspeed_zero import shm

from microspeed.testing import free_port

TESTS = Path(__file__).resolve().parent


def _wired_pair() -> tuple[list[shm.LocalExchange], list[int]]:
    """The exchanges of ranks 0 and 1 in this process, over an anonymous shared mapping and real pipes (what a
    2-rank job's collective set-up builds, wired by hand); their pipes' descriptors."""
    mapping = mmap.mmap(-1, shm.shm_bytes(2))
    pipes = {(kind, src, dst): os.pipe() for kind in ("post", "ack") for src, dst in ((0, 1), (1, 0))}
    pair = []
    for r in (0, 1):
        q = 1 - r
        ex = shm.LocalExchange.__new__(shm.LocalExchange)
        ex.group, ex.rank, ex.world, ex.global_ranks, ex._map = None, r, 2, [0, 1], mapping
        ex._post_in, ex._ack_in = {q: pipes["post", q, r][0]}, {q: pipes["ack", q, r][0]}
        ex._post_out, ex._ack_out = {q: pipes["post", r, q][1]}, {q: pipes["ack", r, q][1]}
        for fd in (*ex._post_in.values(), *ex._ack_in.values()):
            os.set_blocking(fd, False)
        ex._begin()
        pair.append(ex)
    return pair, [fd for ends in pipes.values() for fd in ends]


def _gather(ex: shm.LocalExchange, flat: torch.Tensor) -> shm.ExchangeWork:
    flat[ex.rank * 4:(ex.rank + 1) * 4] = float(ex.rank + 1)
    return ex.gather(flat, 0, 4)


def test_the_end_of_the_process_finishes_the_gather_in_flight_then_ends_the_worker(capsys):
    """Rank 0 returns from its script with its last gather in flight; its peer issues that gather 0.3 s later (it
    finishes its last step later). The exit's stop waits for it, ends the worker, and takes no operation after."""
    (ex0, ex1), fds = _wired_pair()
    flat0, flat1 = torch.zeros(8), torch.zeros(8)
    try:
        work0 = _gather(ex0, flat0)
        late = threading.Timer(0.3, lambda: _gather(ex1, flat1).wait())
        late.start()
        assert ex0.stop(timeout=30) is True  # the exit hook (shm.stop_all) runs this for every exchange
        assert not ex0._worker.is_alive()
        work0.wait()
        assert flat0.tolist() == [1.0] * 4 + [2.0] * 4
        with pytest.raises(RuntimeError, match="rank 0's exchange was stopped"):
            _gather(ex0, flat0)
        late.join()
        assert ex1.stop(timeout=30) is True
        assert "abandoned" not in capsys.readouterr().err
    finally:
        for fd in fds:
            os.close(fd)


def test_a_peer_that_never_issues_the_gather_delays_the_exit_by_the_timeout_only(capsys):
    """A peer that never issues the operation (it hangs): the stop gives up after its timeout, says so naming the
    rank, and the worker starts no torch operation afterwards (it fails the work instead) and ends."""
    (ex0, ex1), fds = _wired_pair()
    flat0, flat1 = torch.zeros(8), torch.zeros(8)
    try:
        work0 = _gather(ex0, flat0)
        start = time.monotonic()
        assert ex0.stop(timeout=0.3) is False
        assert time.monotonic() - start < 5
        err = capsys.readouterr().err
        assert "exchange (rank 0)" in err and "not done within 0.3 s" in err and "abandoned" in err
        _gather(ex1, flat1).wait()  # the peer comes back: rank 0's worker wakes, and gives up instead of copying
        with pytest.raises(RuntimeError, match="abandoned at the end of the process"):
            work0.wait()
        assert flat0.tolist() == [1.0] * 4 + [0.0] * 4
        ex0._worker.join(5)
        assert not ex0._worker.is_alive()
        assert ex1.stop(timeout=30) is True
    finally:
        for fd in fds:
            os.close(fd)


RANK_SCRIPT = r"""
import atexit, datetime, os, sys, threading
import torch
import torch.distributed as dist

target = torch.zeros(8)
# registered before the exchange's module is imported: runs after its exit hook (atexit runs last-in first-out)
atexit.register(lambda: print("reduced at exit:", target.tolist(), flush=True))
from microspeed_zero import shm

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
ex = shm.local_exchange(None, rank, 2)
assert ex is not None, "no shared-memory exchange on this host"
inside = threading.Event()
sum_rows = shm._sum_rows


def slow_sum(target, rows, post, accumulate):
    # the worker inside a C++ call that releases the GIL for 1 s when the interpreter exits (where a real reduction
    # or gather copies for microseconds): the interleaving that aborted the HelloDeepSpeed client, made certain
    inside.set()
    try:
        dist.HashStore().wait(["never-set"], datetime.timedelta(seconds=1))
    except Exception:
        pass
    sum_rows(target, rows, post, accumulate)


shm._sum_rows = slow_sum
ex.reduce_scatter(torch.ones(2, 8), target, 1.0, False)  # its work is not waited: the script ends here
inside.wait()
print(f"rank {rank}: returning with the reduction in flight", flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rank_that_returns_with_a_reduction_in_flight_exits_0(tmp_path):
    """Each rank's script ends while the exchange's worker is inside a torch call: before the fix both ranks aborted
    ("terminate called without an active exception", exit -6); now the exit finishes the reduction first."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=100)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert "terminate called" not in out and p.returncode == 0, f"rank {r} exited {p.returncode}:\n{out}"
        assert f"rank {r}: returning with the reduction in flight" in out, out
        assert "reduced at exit: " + str([2.0] * 8) in out, out


# ------------------------------------------------------------------------------ the jobs that aborted, many times

CLIENT_RUNS = 3
"""HelloDeepSpeed client runs (each launches 2 ranks twice: 4 steps saving, then resumed to 6): 14 s each on 2 cores
(28 s while other jobs shared them)."""

REFERENCE_RUNS = 6
"""Runs of the recovery test's 4-rank reference (2 segments, each a fresh engine loaded from a tag): 8-9 s each (15-20
s shared). With the 4-rank training run that makes its checkpoints, the test took 100 s on 2 cores."""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_hello_deepspeed_client_and_the_recovery_reference_exit_0_every_time(tmp_path):
    """The two jobs that aborted at exit after training (1 of 3 HelloDeepSpeed client runs; the 4-rank reference run
    of tests/test_multinode_recovery.py), run several times: every launch exits 0. The client runs are skipped where
    the DeepSpeedExamples snapshot (or transformers) is absent, as the client tests are."""
    from test_multinode_recovery import SCRIPT

    seconds: dict[str, list[float]] = {"client": [], "reference": []}
    sys.path.insert(0, str(TESTS / "clients"))
    try:
        import examples_run
    finally:
        sys.path.remove(str(TESTS / "clients"))
    import importlib.util

    if examples_run.snapshot_available() and importlib.util.find_spec("transformers") is not None:
        case = examples_run.CASES["hello_bert_bf16_zero1_offload"]
        for i in range(CLIENT_RUNS):
            start = time.monotonic()
            examples_run.run_case(case, "microspeed", tmp_path / f"client{i}")  # raises on a non-zero exit
            seconds["client"].append(time.monotonic() - start)

    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "limit").write_text("4")
    (tmp_path / "segments.json").write_text(json.dumps([["global_step2", 2, 5], ["global_step4", 4, 7]]))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def launch(*args: str) -> None:
        start = time.monotonic()
        res = subprocess.run([sys.executable, "-m", "microspeed.cli", "run", "--nproc-per-node", "4", "--master-port",
                              str(free_port()), "train.py", str(tmp_path / "out"), str(tmp_path / "ckpt"), *args],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
        assert res.returncode == 0 and "terminate called" not in res.stderr, (args, res.returncode,
                                                                              res.stderr[-4000:])
        seconds["reference"].append(time.monotonic() - start)

    launch("train")  # 4 steps on 4 ranks, saving at 2 and 4: the checkpoints the reference resumes from
    for _ in range(REFERENCE_RUNS):
        launch("reference", str(tmp_path / "segments.json"))
    print({k: [round(s, 1) for s in v] for k, v in seconds.items()})
