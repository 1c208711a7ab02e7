"""The watchdog: a hang becomes a report naming the stragglers, and the job fails instead of hanging."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

import microspeed
from microspeed import comm
from microspeed.cli import trace as trace_cli
from microspeed.observe import trace, watchdog
from microspeed.observe.watchdog import RankState, find_stragglers, format_report
from microspeed.testing import DistributedTestError, run_distributed

TIMEOUT_S = 3.0


# ------------------------------------------------------------------------------ report formatting


def _waiting(rank, seconds=12.0, seq=7):
    return RankState(rank, "collective", "all_reduce", seconds, hook="before_step", plugin="fault", nbytes=4096,
                     group="world", group_ranks=[0, 1, 2, 3], seq=seq, counts={"world": seq}, step=4, micro_step=9,
                     stack='  File "train.py", line 10, in main\n    engine.step()\n')


def test_report_names_the_rank_that_did_not_join():
    states = [_waiting(0), _waiting(2, 11.5), _waiting(3, 11.9),
              RankState(1, "hook", "before_step", 0.1, plugin="slow_plugin", step=4, micro_step=9,
                        stack='  File "train.py", line 10, in main\n    engine.step()\n'
                              '  File "slow.py", line 3, in microspeed_before_step\n    time.sleep(60)\n')]
    stragglers, summary = find_stragglers(states)
    assert stragglers == [(1, "in hook before_step (plugin slow_plugin), has not reached all_reduce #7 on world")]
    assert summary == "ranks 0,2-3 wait in all_reduce #7 on world"
    report = format_report(states, detector=0, timeout_s=10, report_path="/tmp/t/watchdog_rank0.txt")
    lines = report.splitlines()
    assert "rank 0 has been in all_reduce #7 on world (4.0 KB) for 12.0 s [hook before_step, plugin fault]" in lines[1]
    assert any(line.strip().startswith("ranks 0,2-3") and "for 11.5-12.0 s" in line for line in lines)
    assert any(line.strip().startswith("rank 1") and "in hook before_step (plugin slow_plugin) for 0.1 s" in line
               for line in lines)
    assert "straggler: rank 1" in lines
    assert "      time.sleep(60)" in lines and "full report with every rank's stack: /tmp/t/watchdog_rank0.txt" in lines
    assert len(lines) < 30  # one screen
    full = format_report(states, detector=0, timeout_s=10, full=True)
    assert full.count("--- rank") == 4 and full.count("engine.step()") >= 4


@pytest.mark.parametrize("other, expected", [
    (RankState(1, "idle", seconds=3.0, last="after_global_step", counts={"world": 6}),
     "outside hooks and collectives, did not join all_reduce #7 on world; it issued 6 collectives on world"),
    (RankState(1, "exited"), "exited without joining all_reduce #7 on world"),
    (RankState(1, "no answer"), "lost or silent (did not answer); not known to be in all_reduce #7 on world"),
    (RankState(1, "collective", "barrier", 3.0, hook="after_step", plugin="x", group="world", group_ranks=[0, 1],
               seq=7), "in barrier #7 from after_step / x: mismatched with all_reduce #7 on world"),
])
def test_stragglers_by_state(other, expected):
    me = RankState(0, "collective", "all_reduce", 5.0, group="world", group_ranks=[0, 1], seq=7)
    stragglers, _ = find_stragglers([me, other])
    assert stragglers == [(1, expected)]


def test_no_straggler_when_every_rank_waits_in_the_same_collective():
    states = [RankState(r, "collective", "all_reduce", 5.0, group="world", group_ranks=[0, 1], seq=3)
              for r in (0, 1)]
    stragglers, summary = find_stragglers(states)
    assert stragglers == [] and "none missing" in summary
    assert "stragglers: none identified" in format_report(states, 0, 5)


def test_rank_state_round_trips_through_json():
    s = _waiting(3)
    assert RankState.from_json(s.to_json()) == s


# ------------------------------------------------------------------------------ one process: a stuck hook


class Sleeper:
    """Sleeps in ``before_step`` when armed."""

    def __init__(self):
        self.seconds = 0.0

    @microspeed.hookimpl
    def microspeed_before_step(self):
        time.sleep(self.seconds)


def test_watchdog_sees_a_hook_past_the_timeout(tiny_model, base_config):
    reports, fired = [], threading.Event()
    sleeper = Sleeper()
    cfg = dict(base_config, watchdog={"timeout_s": 60.0})
    engine, *_ = microspeed.initialize(model=tiny_model, config=cfg, plugins=[("sleeper", sleeper)])
    context = engine.plugin_state("comms_logger")
    wd = watchdog.current(context)
    probe = trace.probe_for(context)
    try:
        assert wd is not None and wd.timeout_s == 60.0 and wd.probe is probe and probe.is_attached(engine.plugins)
        assert watchdog.current(comm.default_context()) is None  # the engine's own, not the process's
        wd.on_timeout = lambda report: (reports.append(report), fired.set())
        wd.poll_s = 0.05
        x, y = torch.randn(4, 8), torch.randn(4, 1)
        engine.backward(engine(x, y))
        engine.step()  # a first step (lazy imports on a loaded machine) under a generous timeout
        wd.timeout_s = 1.0
        engine.backward(engine(x, y))
        engine.step()  # fast: nothing fires
        assert not reports, reports[0]
        sleeper.seconds = 2.5
        engine.backward(engine(x, y))
        engine.step()
        assert fired.wait(3.0)
    finally:
        watchdog.stop(context)
    assert watchdog.current(context) is None and context.observers == () and not probe.is_attached(engine.plugins)
    report = reports[0]
    assert "rank 0 has been in hook before_step (plugin sleeper)" in report
    assert "straggler: rank 0" in report and "stuck in hook before_step (plugin sleeper)" in report
    assert "time.sleep(self.seconds)" in report  # the innermost frames of the stuck rank


# ------------------------------------------------------------------------------ two ranks: a skipped collective


class SkipCollective:
    """Every rank all-reduces a flag in ``before_step``; rank 1 skips it at its second step."""

    @microspeed.hookimpl
    def microspeed_before_step(self, engine):
        if engine.topology.rank == 1 and engine.global_steps == 1:
            return
        comm.all_reduce(torch.ones(4))


def _hanging_rank_body(timeout_s):
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "steps_per_print": 1000, "watchdog": {"timeout_s": timeout_s}}
    torch.manual_seed(0)
    engine, *_ = microspeed.initialize(model=torch.nn.Linear(4, 1), config=cfg,
                                       plugins=[("fault", SkipCollective)])
    # Not through microspeed.comm, so not watched: a loaded machine may finish initialize() (the first
    # optimizer imports torch._dynamo) seconds apart on the two ranks, which is not the hang under test.
    torch.distributed.barrier()
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
        engine.step()
    time.sleep(60)  # rank 1 gets here and moves on to other work; rank 0 is stuck in the second before_step


@pytest.mark.slow
def test_skipped_collective_fails_the_job_with_a_report_naming_the_rank(tmp_path, capfd):
    directory = str(tmp_path / "trace")
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_hanging_rank_body, world_size=2, args=(TIMEOUT_S,), timeout=50, grace_period=1.0,
                        env={trace.ENV_VAR: directory})
    elapsed = time.monotonic() - start
    err = info.value
    died = [f for f in err.failures if f.kind == "died"]
    assert [(f.rank, f.exitcode) for f in died] == [(0, watchdog.EXIT_CODE)]
    assert not err.timed_out and elapsed < 45

    report = open(os.path.join(directory, "watchdog_rank0.txt")).read()
    assert "microspeed watchdog: rank 0 has been in all_reduce #" in report
    assert "[hook before_step, plugin fault]" in report
    assert "straggler: rank 1" in report
    assert "rank 1: outside hooks and collectives, did not join all_reduce #" in report
    assert "time.sleep(60)" in report  # where rank 1 is
    screen = capfd.readouterr().err
    assert "straggler: rank 1" in screen  # the one-screen report on stderr
    assert "microspeed watchdog: rank 0 reported a hang" in screen  # rank 1's answer

    events = {r: [json.loads(line) for line in open(os.path.join(directory, f"rank{r}.jsonl"))] for r in (0, 1)}
    detector = [e for e in events[0] if e["event"] == "watchdog"]
    answer = [e for e in events[1] if e["event"] == "watchdog"]
    assert detector[0]["role"] == "detector" and detector[0]["stragglers"] == [1]
    assert answer[0]["role"] == "answer" and answer[0]["state"]["kind"] == "idle"
    # the trace alone shows it too: rank 0's all_reduce began and never completed
    summary = trace_cli.summarize(trace_cli.load(directory))
    unfinished = summary[0]["unfinished"]
    assert [(e["op"], e["hook"], e["plugin"]) for e in unfinished] == [("all_reduce", "before_step", "fault")]
    assert summary[1]["unfinished"] == []
    assert "UNFINISHED: all_reduce #" in trace_cli.format_summary(summary)


# ------------------------------------------------------------------------------ the store exchange, in one process


def test_store_exchange_answers_and_exited_ranks():
    """Ranks 0-2 as three watchdogs on one store: 1 answers the alarm (idle), 2 had exited."""
    import torch.distributed as dist

    store = dist.HashStore()
    reports = []
    wd0 = watchdog.Watchdog(5.0, rank=0, world_size=3, store=store, on_timeout=reports.append, gather_s=3.0)
    wd1 = watchdog.Watchdog(5.0, rank=1, world_size=3, store=store, poll_s=0.05).start()
    wd2 = watchdog.Watchdog(5.0, rank=2, world_size=3, store=store)
    try:
        wd2.publish_exit()
        me = RankState(0, "collective", "all_reduce", 6.0, hook="before_step", plugin="fault", nbytes=16,
                       group="world", group_ranks=[0, 1, 2], seq=9, counts={"world": 9})
        start = time.monotonic()
        report = wd0.fire(me)
        assert time.monotonic() - start < 2.0  # both answers were there before gather_s ran out
    finally:
        wd1.stop()
    assert reports == [report]
    assert "stragglers: ranks 1-2" in report
    assert "rank 1: outside hooks and collectives, did not join all_reduce #9 on world" in report
    assert "rank 2: exited without joining all_reduce #9 on world" in report
    assert "exited (its process ended)" in report
    # a later watchdog on the same store does not answer the old alarm
    wd3 = watchdog.Watchdog(5.0, rank=1, world_size=3, store=store, poll_s=0.05).start()
    try:
        assert wd3._next_alarm == 2
    finally:
        wd3.stop()


# ------------------------------------------------------------------------------ on by default


def test_exit_joins_the_thread_before_the_interpreter_finalises():
    """publish_exit (run at exit) ends the thread: a daemon thread caught inside a C++ call at
    finalisation aborts the process ("terminate called without an active exception")."""
    import torch.distributed as dist

    busy = []
    wd = watchdog.Watchdog(5.0, rank=1, world_size=2, store=dist.HashStore(), poll_s=0.01)
    looked = wd.overdue

    def slow_look():
        busy.append(1)
        time.sleep(0.3)  # the thread is busy, outside the store lock, when exit comes
        return looked()

    wd.overdue = slow_look
    wd.start()
    while not busy:
        time.sleep(0.01)
    wd.publish_exit()
    assert not wd._thread.is_alive()
    assert wd.store.check([watchdog.STORE_PREFIX + "exited/1"])


def test_default_timeout_and_how_to_change_it(monkeypatch):
    monkeypatch.delenv(watchdog.ENV_VAR, raising=False)
    assert watchdog.resolve_timeout(world_size=2) == watchdog.DEFAULT_TIMEOUT_S == 600.0
    assert watchdog.resolve_timeout(world_size=1) is None  # one rank waits for no other
    assert watchdog.resolve_timeout(timeout_s=30, world_size=1) == 30.0
    assert watchdog.resolve_timeout(enabled=False, timeout_s=30, world_size=2) is None
    monkeypatch.setenv(watchdog.ENV_VAR, "12.5")
    assert watchdog.resolve_timeout(enabled=False, world_size=1) == 12.5  # the environment wins
    monkeypatch.setenv(watchdog.ENV_VAR, "off")
    assert watchdog.resolve_timeout(timeout_s=30, world_size=2) is None
    monkeypatch.setenv(watchdog.ENV_VAR, "soon")
    with pytest.raises(ValueError, match=watchdog.ENV_VAR):
        watchdog.resolve_timeout(world_size=2)


def test_section_turns_the_engine_watchdog_on_and_off(tiny_model, base_config, monkeypatch):
    monkeypatch.delenv(watchdog.ENV_VAR, raising=False)
    engine, *_ = microspeed.initialize(model=tiny_model, config=base_config)
    assert watchdog.current(engine.plugin_state("comms_logger")) is None  # one rank, nothing configured
    engine, *_ = microspeed.initialize(model=tiny_model, config=dict(base_config, watchdog={"timeout_s": 30}))
    context = engine.plugin_state("comms_logger")
    try:
        assert watchdog.current(context).timeout_s == 30.0 and context.ranks_timeout_s == 30.0
    finally:
        watchdog.stop(context)
    engine, *_ = microspeed.initialize(model=tiny_model, config=dict(base_config, watchdog={
        "enabled": False, "timeout_s": 30}))
    assert watchdog.current(engine.plugin_state("comms_logger")) is None
    monkeypatch.setenv(watchdog.ENV_VAR, "soon")
    with pytest.raises(microspeed.ConfigError, match=watchdog.ENV_VAR):
        microspeed.initialize(model=tiny_model, config=base_config)


def _unconfigured_hanging_rank_body():
    """As ``_hanging_rank_body`` with no watchdog section: only the default (timeout from the environment)."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "steps_per_print": 1000}
    torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1).step()  # the slow first-use imports, before
    torch.distributed.barrier()  # initialize(), whose rank agreement waits TIMEOUT_S at most for a rank
    torch.manual_seed(0)
    engine, *_ = microspeed.initialize(model=torch.nn.Linear(4, 1), config=cfg, plugins=[("fault", SkipCollective)])
    torch.distributed.barrier()  # not watched: ranks may leave initialize() seconds apart on a loaded machine
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
        engine.step()
    time.sleep(60)


@pytest.mark.slow
def test_hung_rank_with_no_watchdog_configured_ends_with_the_report(capfd):
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_unconfigured_hanging_rank_body, world_size=2, timeout=50, grace_period=1.0,
                        env={watchdog.ENV_VAR: str(TIMEOUT_S), trace.ENV_VAR: ""})
    elapsed = time.monotonic() - start
    err = info.value
    assert [(f.rank, f.exitcode) for f in err.failures if f.kind == "died"] == [(0, watchdog.EXIT_CODE)]
    assert not err.timed_out and elapsed < 45
    screen = capfd.readouterr().err
    assert "microspeed watchdog: rank 0 has been in all_reduce #" in screen
    assert f"(timeout_s={TIMEOUT_S:g}); stopping the job" in screen
    assert "straggler: rank 1" in screen and "rank 1: outside hooks and collectives, did not join" in screen
    assert "time.sleep(60)" in screen  # where rank 1 is


def _late_rank_body():
    """Rank 1 never comes to initialize() (it waits for rank 0's word); rank 0 reports who it waited for, and when."""
    import datetime

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    if dist.get_rank() == 1:
        store.wait(["test/rank0_done"], datetime.timedelta(seconds=90))  # alive (not in initialize) all along
        return None
    start = time.monotonic()
    try:
        microspeed.initialize(model=torch.nn.Linear(4, 1), config={"train_batch_size": 2})
        got = {"error": None}
    except comm.MissingRanksError as exc:
        got = {"error": str(exc), "missing": exc.missing, "seconds": time.monotonic() - start}
    store.set("test/rank0_done", "1")
    return got


@pytest.mark.slow
def test_rank_that_never_reaches_initialize_is_named_within_the_timeout():
    results = run_distributed(_late_rank_body, world_size=2, timeout=120,
                              env={watchdog.ENV_VAR: "2", trace.ENV_VAR: ""})
    got = results[0]
    assert got["missing"] == [1], got
    assert "initialize() rank agreement: rank 1 of 2 did not arrive within 2 s" in got["error"]
    # the watchdog timeout (plus initialize()'s own work on a loaded machine), not gloo's 30 minutes
    assert 1.9 < got["seconds"] < 30.0
