"""The comms logger (DeepSpeed's ``comms_logger``): bandwidth formulas, selection, records, the config section.

Its counts and sizes on a real 2-rank run are checked in ``tests/test_trace.py`` (the same run as
the trace, so that both are compared with each other).
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

import microspeed
from microspeed import comm


def test_bandwidth_formulas_match_deepspeed():
    # deepspeed.utils.comms_logging.calc_bw_log: size in bytes, duration in ms, results in Gbps
    size, ms, n = 1_000_000, 2.0, 4
    gbps = 8 / 1e6  # bytes per ms -> Gbit/s
    assert comm.calc_bw_log("all_reduce", size, ms, n) == pytest.approx(
        (2 * size / ms * gbps, size / ms * 2 * (n - 1) / n * gbps))
    assert comm.calc_bw_log("all_gather", size, ms, n) == pytest.approx(
        (size * n / ms * gbps, size * n / ms * (n - 1) / n * gbps))
    assert comm.calc_bw_log("reduce_scatter", size, ms, n) == comm.calc_bw_log("all_gather", size, ms, n)
    assert comm.calc_bw_log("all_to_all_single", size, ms, n) == pytest.approx(
        (size / ms * gbps, size / ms * (n - 1) / n * gbps))
    assert comm.calc_bw_log("broadcast", size, ms, n) == pytest.approx((size / ms * gbps, size / ms * gbps))
    assert comm.calc_bw_log("barrier", 0, ms, n) == (0.0, 0.0)
    assert comm.convert_size(1536) == "1.5 KB" and comm.convert_size(0) == "0B"
    assert comm.trim_mean([1.0] * 9 + [100.0]) == pytest.approx(1.0)
    assert comm.trim_mean([]) == 0.0


def test_wire_bytes_are_the_bandwidth_optimal_costs():
    # what one rank sends: ring all-reduce 2(n-1)/n S; all-gather (n-1) S_in; all-to-all, reduce-scatter (n-1)/n S
    assert comm.wire_bytes("all_reduce", 1000, 4) == 1500
    assert comm.wire_bytes("all_gather_into_tensor", 1000, 4) == 3000
    assert comm.wire_bytes("all_to_all_single", 1000, 4) == 750
    assert comm.wire_bytes("reduce_scatter_tensor", 1000, 4) == 750
    assert comm.wire_bytes("broadcast", 1000, 4) == 1000
    assert comm.wire_bytes("all_reduce", 1000, 1) == 0
    stats = comm.CommStats()
    stats.record("all_reduce", 100, 150)
    stats.record("all_gather_p2p", 40)  # no wire count given: the payload is what was sent
    assert stats.total_bytes() == 140 and stats.total_wire_bytes() == 190
    stats.reset()
    assert stats.total_wire_bytes() == 0 and not stats.calls


def _record(logger, op, nbytes, ms, group_size=2):
    """Feed one finished collective to ``logger`` as :mod:`microspeed.comm` would."""
    call = comm.Collective(op, nbytes, None, False, False)
    call.group_size = group_size
    logger.collective_start(call)
    call.t_done = call.t_end = call.t0 + int(ms * 1e6)
    logger.collective_end(call, None)


def test_selection_debug_names_and_summary():
    logger = comm.CommsLogger()
    logger.configure(prof_all=True)
    for ms in (1.0, 2.0, 3.0):
        _record(logger, "all_reduce", 4096, ms)
    _record(logger, "broadcast", 100, 0.5)
    _record(logger, "reduce_scatter_tensor", 4096, 1.0)  # recorded with the output shard as message
    assert logger.get_total_operations() == 5
    assert {k: sorted(v) for k, v in logger.get_raw_data().items()} == {
        "all_reduce": [4096], "broadcast": [100], "reduce_scatter_tensor": [2048]}
    row = logger.summary()["all_reduce"][4096]
    assert row["count"] == 3 and row["total_latency_ms"] == pytest.approx(6.0)
    assert row["avg_latency_ms"] == pytest.approx(2.0) and row["msg_size_str"] == "4.0 KB"
    assert row["busbw_avg_gbps"] == pytest.approx(comm.trim_mean(
        [comm.calc_bw_log("all_reduce", 4096, ms, 2)[1] for ms in (1.0, 2.0, 3.0)]))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        logger.log_all()
    assert printed.getvalue().splitlines()[0].split() == ["Comm.", "Op", "Message", "Size", "Count", "Total",
                                                         "Latency(ms)", "Avg", "Latency(ms)", "tput_avg", "(Gbps)",
                                                         "busbw_avg", "(Gbps)"]

    logger.reset_data()
    logger.configure(prof_all=False, prof_ops=["all_reduce"], debug=True)
    _record(logger, "broadcast", 100, 0.5)
    _record(logger, "all_reduce", 8, 0.5)
    assert list(logger.get_raw_data()) == ["all_reduce | [Caller Func: _record]"]
    logger.stop_profiling_op(["all_reduce"])
    logger.start_profiling_op(["broadcast"])
    assert logger.prof_ops == ["broadcast"]


def test_section_configures_the_process_logger():
    model = torch.nn.Linear(2, 1)
    try:
        microspeed.initialize(model=model, config={"train_batch_size": 2, "comms_logger": {
            "enabled": True, "prof_all": False, "prof_ops": ["all_reduce"], "verbose": False}})
        assert comm.comms_logger.enabled and comm.comms_logger in comm.observers()
        assert comm.comms_logger.prof_ops == ["all_reduce"] and not comm.comms_logger.prof_all
    finally:
        comm.configure(enabled=False, prof_all=True, prof_ops=[])
    assert comm.observers() == ()
    with pytest.raises(microspeed.ConfigError, match="comms_logger.prof_ops"):
        microspeed.initialize(model=model, config={"train_batch_size": 2, "comms_logger": {"prof_ops": [1]}})
    with pytest.raises(microspeed.ConfigError, match="comms_logger"):
        microspeed.initialize(model=model, config={"train_batch_size": 2, "comms_logger": {"verbos": True}})


def _observed_body() -> tuple[list[str], dict, dict]:
    import torch
    import torch.distributed as dist

    from microspeed import comm

    events: list[str] = []

    class Seen(comm.CollectiveObserver):
        def collective_start(self, call):
            events.append(f"start {call.op} {call.nbytes}")

        def collective_launched(self, call):
            events.append("launched")

        def collective_end(self, call, exc):
            events.append(f"end {exc is None}")

    x = torch.arange(8.0) + 10 * dist.get_rank()
    out = torch.empty_like(x)
    comm.stats.reset()
    comm.add_observer(Seen())
    work = comm.observed("all_to_all_single", x, None, True,  # a transport of the caller's own: here, gloo's itself
                         lambda o, i: dist.all_to_all_single(o, i, async_op=True), out, x)
    work.wait()
    r = dist.get_rank()
    assert all(out[4 * q:4 * q + 4].tolist() == (torch.arange(4.0) + 4 * r + 10 * q).tolist() for q in (0, 1))
    return events, dict(comm.stats.bytes), dict(comm.stats.wire)


def test_a_collective_on_a_transport_of_ones_own_is_counted_and_observed():
    """``comm.observed``: a plugin's own transport (ZeRO's shared-memory exchange) counts its bytes and tells the
    observers as microspeed's wrappers do: 32 payload bytes, 16 on the wire for an all-to-all of 2 ranks."""
    from microspeed.testing import run_distributed

    for events, nbytes, wire in run_distributed(_observed_body, world_size=2, timeout=120):
        assert events == ["start all_to_all_single 32", "launched", "end True"], events
        assert nbytes == {"all_to_all_single": 32} and wire == {"all_to_all_single": 16}
