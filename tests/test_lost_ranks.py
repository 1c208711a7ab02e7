"""A lost rank: the survivors' failed collective names it, every store exchange is bounded, heartbeats go stale."""

from __future__ import annotations

import json
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import microspeed
from microspeed import comm
from microspeed.observe import trace, watchdog
from microspeed.observe.watchdog import RankState, Watchdog
from microspeed.testing import DistributedTestError, run_distributed

GLOO_ERROR = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
              "[127.0.0.1]:31656. This is typically caused by a remote worker crashing.")
CALL = SimpleNamespace(op="all_reduce", label="world", seq=7)


class _CutStore:
    """A store behind a cut link: every call blocks (until the test lets it go)."""

    def __init__(self):
        self.release = threading.Event()

    def _block(self, *args, **kwargs):
        self.release.wait(30)
        raise RuntimeError("store connection lost")

    add = set = get = check = _block


# ------------------------------------------------------------------------------ one process, one store


def test_failed_collective_names_the_ranks_that_are_gone():
    """Ranks 0-3 as watchdogs on one store: 1 answers, 2 is silent (its heartbeat stopped), 3 had exited."""
    store = dist.HashStore()
    wd0 = Watchdog(30.0, rank=0, world_size=4, store=store, gather_s=1.0)
    wd1 = Watchdog(30.0, rank=1, world_size=4, store=store, poll_s=0.05).start()
    wd2 = Watchdog(30.0, rank=2, world_size=4, store=store)
    wd3 = Watchdog(30.0, rank=3, world_size=4, store=store)
    try:
        wd2.beat()  # seen once, then its process is killed: it answers nothing, publishes nothing
        wd3.publish_exit()
        start = time.monotonic()
        error = wd0.explain_failure(CALL, RuntimeError(GLOO_ERROR))
        took = time.monotonic() - start
    finally:
        wd1.stop()
    assert isinstance(error, comm.LostRanksError) and isinstance(error, RuntimeError)
    assert error.lost == [2, 3] and error.answered == [0, 1]
    text = str(error)
    assert text.startswith("microspeed: collective all_reduce (group world, seq 7) failed on rank 0: "
                           "ranks 2-3 are lost (rank 2: no answer within 1 s; last seen ")
    assert "rank 3: exited; no heartbeat seen" in text and "ranks 0-1 answered" in text
    assert text.endswith("Original error: " + GLOO_ERROR)
    assert 0.9 < took < 2.0  # the silent rank is waited for gather_s, no longer


def test_errors_that_are_not_about_a_peer_and_ranks_that_all_answer_stay_as_they_are():
    store = dist.HashStore()
    wd0 = Watchdog(30.0, rank=0, world_size=2, store=store, gather_s=1.0)
    wd1 = Watchdog(30.0, rank=1, world_size=2, store=store, poll_s=0.05).start()
    try:
        assert wd0.explain_failure(CALL, RuntimeError("Tensors must be contiguous")) is None
        assert wd0.explain_failure(CALL, ValueError("Connection closed by peer")) is None
        start = time.monotonic()
        assert wd0.explain_failure(CALL, RuntimeError(GLOO_ERROR)) is None  # everyone answered: nobody is lost
        assert time.monotonic() - start < 0.9
    finally:
        wd1.stop()


def test_a_store_that_does_not_answer_bounds_the_question_and_the_hang_report():
    store = _CutStore()
    try:
        wd0 = Watchdog(30.0, rank=0, world_size=3, store=store, gather_s=0.5, on_timeout=lambda report: None)
        start = time.monotonic()
        error = wd0.explain_failure(CALL, RuntimeError(GLOO_ERROR))
        assert time.monotonic() - start < 2.5
        assert isinstance(error, comm.LostRanksError) and error.lost == []
        assert "which ranks are lost is unknown: the c10d store did not answer within 1.5 s" in str(error)

        me = RankState(0, "collective", "all_reduce", 31.0, group="world", group_ranks=[0, 1, 2], seq=9)
        start = time.monotonic()
        report = wd0.fire(me)  # a cut link must not keep the report (and the exit after it) from coming
        assert time.monotonic() - start < 2.5
    finally:
        store.release.set()
    assert "lost or silent: ranks 1-2 did not answer within 0.5 s (process or host gone, network link cut" in report
    assert "the c10d store: did not answer within 1.5 s" in report
    assert "rank 1: lost or silent (did not answer); not known to be in all_reduce #9 on world" in report


def test_peer_watch_sees_exited_ranks_and_stopped_heartbeats():
    store = dist.HashStore()
    wd0 = Watchdog(30.0, rank=0, world_size=4, store=store, gather_s=0.5)
    wd1 = Watchdog(30.0, rank=1, world_size=4, store=store, poll_s=0.02, beat_s=0.05).start()
    wd2 = Watchdog(30.0, rank=2, world_size=4, store=store)
    wd3 = Watchdog(30.0, rank=3, world_size=4, store=store)
    try:
        wd2.beat()
        wd3.publish_exit()
        watch = wd0.peer_watch(stale_s=0.5)
        assert list(watch.lost([1, 2, 3])) == [3]  # known at once
        time.sleep(0.8)
        lost = watch.lost([1, 2, 3])
        assert sorted(lost) == [2, 3]  # rank 1 kept beating
        assert lost[2].startswith("no heartbeat for ") and "its process or host is gone" in lost[2]
        assert lost[3] == "exited (its process ended)"
    finally:
        wd1.stop()
    cut = _CutStore()
    try:
        with pytest.raises(ConnectionError, match="the c10d store did not answer within 1.5 s"):
            Watchdog(30.0, rank=0, world_size=2, store=cut, gather_s=0.5).peer_watch().lost([1])
    finally:
        cut.release.set()


def test_answer_timeout_is_a_config_key(tiny_model, base_config):
    engine, *_ = microspeed.initialize(model=tiny_model, config=dict(base_config, watchdog={
        "timeout_s": 30, "answer_timeout_s": 2}))
    context = engine.plugin_state("comms_logger")
    try:
        assert watchdog.current(context).gather_s == 2.0
    finally:
        watchdog.stop(context)
    with pytest.raises(microspeed.ConfigError, match="answer_timeout_s"):
        microspeed.initialize(model=tiny_model, config=dict(base_config, watchdog={"answer_timeout_s": 0}))


# ------------------------------------------------------------------------------ three ranks, one killed


def _rank_two_dies_before_all_reduce(answer_s, folder):
    watchdog.start(60.0, context=comm.default_context(), gather_s=answer_s)
    comm.barrier()
    if comm.get_rank() == 2:
        os._exit(9)  # a node lost: no exit handlers run, nothing is published
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(4))  # raises on the survivors: the error must name rank 2
    except RuntimeError as exc:
        with open(os.path.join(folder, f"rank{comm.get_rank()}.json"), "w") as f:
            json.dump({"seconds": time.monotonic() - start, "cause": type(exc.__cause__).__name__}, f)
        raise


@pytest.mark.timeout(60)
def test_survivors_error_names_the_killed_rank(tmp_path):
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank_two_dies_before_all_reduce, world_size=3, args=(2.0, str(tmp_path)), timeout=45,
                        grace_period=10, env={trace.ENV_VAR: "", watchdog.ENV_VAR: ""})
    failures = {f.rank: f for f in info.value.failures}
    assert failures[2].kind == "died" and failures[2].exitcode == 9
    for rank in (0, 1):
        f = failures[rank]
        assert f.kind == "raised" and f.exc_type.endswith("LostRanksError"), f.describe()
        assert f.message.startswith(f"microspeed: collective all_reduce (group world, seq 2) failed on rank {rank}: "
                                    "rank 2 is lost (rank 2: no answer within 2 s; last seen "), f.message
        assert "ranks 0-1 answered" in f.message and "Original error: " in f.message
        assert "Connection closed by peer" in f.message or "Connection reset by peer" in f.message
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["cause"] == "RuntimeError"  # gloo's error, kept as __cause__
        assert seen["seconds"] < 2.0 + 3.0  # the silent rank is waited for answer_s, then the error comes


def test_ranks_at_the_failed_peer_are_named_when_the_store_is_gone_too(monkeypatch):
    """The store died with the peer's host (it served the workers' store): the ranks at the address gloo names are
    named from the addresses every rank published with its heartbeat."""
    store = dist.HashStore()
    addresses = ["10.9.0.1", "10.9.0.1", "10.9.0.2", "10.9.0.2"]
    dogs = []
    for rank, addr in enumerate(addresses):
        monkeypatch.setattr(watchdog, "route_address", lambda addr=addr: addr)
        dogs.append(Watchdog(30.0, rank=rank, world_size=4, store=store, beat_s=0.01))
    for wd in dogs:
        wd.beat()
    time.sleep(0.02)
    dogs[2].beat()  # every heartbeat is there now: rank 2 reads them all once
    assert dogs[2].addresses == dict(enumerate(addresses))
    dogs[2].store = _CutStore()
    try:
        error = dogs[2].explain_failure(CALL, RuntimeError(GLOO_ERROR.replace("127.0.0.1", "10.9.0.1")))
    finally:
        dogs[2].store.release.set()
    assert isinstance(error, comm.LostRanksError) and error.lost == [0, 1]
    assert ("ranks 0-1 (at 10.9.0.1, the failed connection's peer) are lost, presumably with their host: the c10d "
            "store did not answer either") in str(error)
    # a peer at this rank's own address (one machine) tells nothing: the message stays "unknown"
    dogs[2].store = _CutStore()
    try:
        error = dogs[2].explain_failure(CALL, RuntimeError(GLOO_ERROR.replace("127.0.0.1", "10.9.0.2")))
    finally:
        dogs[2].store.release.set()
    assert error.lost == [] and "which ranks are lost is unknown" in str(error)


def test_route_address_is_the_source_address_towards_master_addr(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert watchdog.route_address() == "127.0.0.1"
    monkeypatch.delenv("MASTER_ADDR")
    assert watchdog.route_address() is None
