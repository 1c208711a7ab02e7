"""Tests for microspeed.testing: run_distributed, the @distributed decorator and their failure modes.

Rank bodies live at module level (spawned ranks find them by name). Every run starts fresh
processes that import torch (a few seconds on a 2-core machine), so each test checks several
things with a single run.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from microspeed.testing import (
    DistributedTestError,
    RankFailure,
    distributed,
    free_port,
    in_distributed_worker,
    run_distributed,
)

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _leaked_ranks() -> list[str]:
    return [p.name for p in multiprocessing.active_children() if p.name.startswith("microspeed-rank")]


def _wait_for(path: Path, seconds: float = 30.0) -> None:
    end = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.05)


def _stuck_forever() -> None:
    time.sleep(1000)


# ----------------------------------------------------------------------------- rank bodies


def _all_reduce_rank(scale: float) -> dict:
    t = torch.tensor([float(dist.get_rank() + 1) * scale])
    dist.all_reduce(t)
    return {
        "sum": t.item(),
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "env": {k: os.environ[k] for k in ENV_KEYS},
        "omp": os.environ["OMP_NUM_THREADS"],
        "threads": torch.get_num_threads(),
        "in_worker": in_distributed_worker(),
    }


@distributed(world_size=5)  # run_distributed on a decorated function runs the plain body
def _init_it_yourself(key: str) -> tuple[float, str, int]:
    assert not dist.is_initialized()
    dist.init_process_group("gloo")  # env:// from the variables the harness set
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item(), os.environ[key], torch.get_num_threads()  # the harness destroys the group


def _raise_on_rank1_while_rank0_all_reduces() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken")
    t = torch.ones(1)
    dist.all_reduce(t)  # cannot complete: rank 1 never joins
    _stuck_forever()


def _raise_on_rank1_while_rank0_sleeps(directory: Path) -> None:
    ready = directory / "rank0-waiting"
    if os.environ["RANK"] == "1":
        _wait_for(ready)
        value = 41
        assert value == 42  # pytest's assert rewriting applies in the ranks too
    ready.touch()
    _stuck_forever()


def _hang_on_rank1() -> str:
    if os.environ["RANK"] == "1":
        _stuck_forever()
    return "done"


def _exit_on_rank1() -> int:
    if os.environ["RANK"] == "1":
        os._exit(3)
    return 0


def _return_env(key: str) -> str | None:
    return os.environ.get(key)


@distributed(world_size=2, init_process_group=False, grace_period=1.0)
def _skip_on_rank1() -> None:
    if os.environ["RANK"] == "1":
        pytest.skip("needs a GPU")
    _stuck_forever()  # rank 0 is left waiting, as it would be in a collective


# ----------------------------------------------------------------------------- run_distributed


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_all_reduce_returns_per_rank_values(world_size: int) -> None:
    out = run_distributed(_all_reduce_rank, world_size=world_size, args=(10.0,))
    expected = 10.0 * world_size * (world_size + 1) / 2
    assert [o["sum"] for o in out] == [expected] * world_size
    assert [o["rank"] for o in out] == list(range(world_size))
    assert {o["world"] for o in out} == {world_size}
    for rank, o in enumerate(out):
        env = o["env"]
        assert (env["RANK"], env["LOCAL_RANK"]) == (str(rank), str(rank))
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == str(world_size)
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert (o["omp"], o["threads"], o["in_worker"]) == ("1", 1, True)
    assert len({o["env"]["MASTER_PORT"] for o in out}) == 1
    assert not _leaked_ranks()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_without_init_process_group_the_body_starts_it_and_env_overrides_apply() -> None:
    out = run_distributed(
        _init_it_yourself,
        world_size=2,
        kwargs={"key": "OMP_NUM_THREADS"},
        env={"OMP_NUM_THREADS": "2"},
        init_process_group=False,
    )
    assert out == [(2.0, "2", 2), (2.0, "2", 2)]
    assert not in_distributed_worker()


# ----------------------------------------------------------------------------- failures


@pytest.mark.timeout(60)
def test_raising_rank_is_reported_and_the_rank_blocked_in_a_collective_does_not_hang_the_run() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on_rank1_while_rank0_all_reduces, world_size=2)
    assert time.monotonic() - start < 30
    err = info.value
    assert isinstance(err, AssertionError)
    message = str(err)
    assert "rank 1 raised ValueError: rank one is broken" in message
    assert "_raise_on_rank1_while_rank0_all_reduces" in message  # the rank's traceback
    assert err.failures[0].rank == 1 and err.failures[0].kind == "raised"
    # Rank 0 either saw its peer vanish (gloo raises) or was killed after the grace period.
    rank0 = next(f for f in err.failures if f.rank == 0)
    assert rank0.kind in ("raised", "terminated")
    if rank0.kind == "terminated":
        assert "rank 0: terminated after rank 1 failed" in message
    assert not err.timed_out
    assert not _leaked_ranks()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_blocked_rank_is_terminated_after_the_grace_period_with_its_stack(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on_rank1_while_rank0_sleeps, args=(tmp_path,), grace_period=1.0)
    assert time.monotonic() - start < 30
    err = info.value
    message = str(err)
    assert "rank 1 raised AssertionError: assert 41 == 42" in message
    assert "rank 0: terminated after rank 1 failed" in message
    assert message.index("rank 1 raised") < message.index("rank 0: terminated")
    assert err.failed_ranks == [1]
    assert [(f.rank, f.kind, f.cause_rank) for f in err.failures] == [(1, "raised", None), (0, "terminated", 1)]
    if hasattr(signal, "SIGUSR1"):
        assert "_stuck_forever" in err.failures[1].stack  # where rank 0 was waiting
    assert not _leaked_ranks()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_hanging_rank_times_out() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_hang_on_rank1, world_size=2, timeout=5, init_process_group=False)
    assert 5 <= time.monotonic() - start < 20
    err = info.value
    message = str(err)
    assert "timed out after 5s" in message
    assert err.timed_out
    assert 1 in err.unfinished
    if err.unfinished == [1]:  # rank 0 normally returns in time; on a very busy machine it may not
        assert "rank 1 had not finished" in message and "rank 0 returned" in message
        assert [(f.rank, f.kind) for f in err.failures] == [(1, "timed_out")]
    assert not _leaked_ranks()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_rank_that_exits_without_reporting_is_reported_with_its_exit_code() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_exit_on_rank1, world_size=2, init_process_group=False)
    message = str(info.value)
    assert "rank 1 died without reporting a result (exit code 3)" in message
    assert info.value.failures == [RankFailure(1, "died", exitcode=3)]  # rank 0 returned normally
    assert not _leaked_ranks()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_skip_in_a_rank_skips_the_test() -> None:
    with pytest.raises(pytest.skip.Exception, match="rank 1: needs a GPU"):
        _skip_on_rank1()  # the decorated form, called directly; rank 0 is killed after the grace
    assert not _leaked_ranks()


@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(signal, "SIGUSR2"), reason="needs POSIX signals")
def test_interrupting_the_parent_reaps_every_rank() -> None:
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR2, interrupt)
    timer = threading.Timer(1.0, os.kill, args=(os.getpid(), signal.SIGUSR2))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_distributed(_hang_on_rank1, world_size=2, timeout=50, init_process_group=False)
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR2, previous)
    assert not _leaked_ranks()


def test_bad_arguments_are_refused_before_spawning() -> None:
    with pytest.raises(TypeError, match="module level"):
        run_distributed(lambda: 1)

    def local() -> int:
        return 1

    with pytest.raises(TypeError, match="module level"):
        run_distributed(local)
    with pytest.raises(TypeError, match="module level"):
        distributed(world_size=2)(local)
    with pytest.raises(TypeError, match="pickl"):
        run_distributed(_return_env, args=(lambda: 1,))
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(_return_env, world_size=0)
    with pytest.raises(ValueError, match="timeout"):
        run_distributed(_return_env, timeout=0)


def test_free_port_is_bindable() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


# ----------------------------------------------------------------------------- the decorator


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", [3.0])
@distributed(world_size=2)
def test_decorator_runs_the_test_body_on_every_rank(value: float, tmp_path: Path) -> None:
    assert in_distributed_worker()
    assert dist.get_world_size() == 2
    t = torch.tensor([value * (dist.get_rank() + 1)])
    dist.all_reduce(t)
    assert t.item() == 9.0
    (tmp_path / f"rank{dist.get_rank()}").touch()  # fixtures come from the pytest process
    dist.barrier()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]


@pytest.mark.slow
class TestDecoratedMethod:
    @pytest.mark.timeout(60)
    @distributed(world_size=2, init_process_group=False)
    def test_method_runs_on_every_rank(self) -> None:
        assert isinstance(self, TestDecoratedMethod)
        assert in_distributed_worker() and os.environ["RANK"] in ("0", "1")


def _warn_as_microspeed() -> str:
    import warnings

    warnings.warn_explicit("an old API", DeprecationWarning, "fake.py", 1, module="microspeed.fake_module")
    return "no error"


@pytest.mark.slow
@pytest.mark.filterwarnings("error::DeprecationWarning:microspeed")
def test_ranks_inherit_the_error_filters_for_our_own_modules():
    with pytest.raises(DistributedTestError, match="DeprecationWarning: an old API"):
        run_distributed(_warn_as_microspeed, world_size=1, timeout=60, init_process_group=False)


def _env_and_process(keys):
    import sys as _sys

    return ({k: os.environ.get(k) for k in keys}, os.getppid(), "torch" in _sys.modules)


def test_ranks_get_the_callers_environment_at_the_call_and_start_from_the_fork_server(monkeypatch):
    """Ranks fork from a server that imported torch once; each gets the environment as it is when run_distributed
    is called (set, changed and removed variables alike), not the server's, and ``env`` on top."""
    monkeypatch.setenv("MS_HARNESS_A", "first")
    monkeypatch.setenv("MS_HARNESS_GONE", "here")
    run_distributed(_env_and_process, 1, args=(("MS_HARNESS_A",),))  # the server starts with these
    monkeypatch.setenv("MS_HARNESS_A", "changed")
    monkeypatch.delenv("MS_HARNESS_GONE")
    monkeypatch.setenv("MS_HARNESS_NEW", "new")
    keys = ("MS_HARNESS_A", "MS_HARNESS_GONE", "MS_HARNESS_NEW", "MS_HARNESS_ENV")
    results = run_distributed(_env_and_process, 2, args=(keys,), env={"MS_HARNESS_ENV": "x", "MS_HARNESS_A": "env"})
    for env, parent, had_torch in results:
        assert env == {"MS_HARNESS_A": "env", "MS_HARNESS_GONE": None, "MS_HARNESS_NEW": "new", "MS_HARNESS_ENV": "x"}
        assert parent != os.getpid() and had_torch  # forked by the server, torch already there
    monkeypatch.setenv("MICROSPEED_TEST_START_METHOD", "spawn")
    [(env, parent, _)] = run_distributed(_env_and_process, 1, args=(keys,))
    assert parent == os.getpid() and env["MS_HARNESS_A"] == "changed" and env["MS_HARNESS_NEW"] == "new"
    monkeypatch.setenv("MICROSPEED_TEST_START_METHOD", "fork")
    with pytest.raises(ValueError, match="MICROSPEED_TEST_START_METHOD='fork': expected 'forkserver' or 'spawn'"):
        run_distributed(_env_and_process, 1, args=(keys,))


def _print_both(text):
    import sys as _sys

    print(f"out {text}", flush=True)
    print(f"err {text}", file=_sys.stderr, flush=True)


def test_ranks_write_to_the_callers_current_stdout_and_stderr(tmp_path):
    """A rank forked from a server started earlier (under other descriptors, e.g. another test's capture) still
    writes where the caller's descriptors 1 and 2 point now."""
    run_distributed(_print_both, 1, args=("warm",))  # the fork server exists from here on
    saved = os.dup(1), os.dup(2)
    files = tmp_path / "out.txt", tmp_path / "err.txt"
    try:
        for target, path in zip((1, 2), files, strict=True):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, target)
            os.close(fd)
        run_distributed(_print_both, 2, args=("now",))
    finally:
        for target, fd in zip((1, 2), saved, strict=True):
            os.dup2(fd, target)
            os.close(fd)
    assert files[0].read_text().count("out now") == 2 and "err now" not in files[0].read_text()
    assert files[1].read_text().count("err now") == 2
