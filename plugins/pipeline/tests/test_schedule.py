"""Tests of the pipeline schedules (:mod:`microspeed_pipeline.schedule`): pure Python, no processes.

Every schedule is checked per rank (each micro-batch forwarded and backwarded once per chunk, in that order;
the memory bound; buffer slots that never alias) and as a set of ranks with :func:`simulate`, which runs them
with the runtime's semantics (non-blocking sends, blocking receives, FIFO channels): no deadlock, every
receive matched, and the bubble against :func:`ideal_bubble_fraction`. Broken schedules must make it fail.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from microspeed_pipeline.schedule import (
    BackwardPass,
    BufferOpInstruction,
    CommInstruction,
    DeadlockError,
    ForwardPass,
    GPipeSchedule,
    InferenceSchedule,
    InterleavedTrainSchedule,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    PipeSchedule,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    ScheduleError,
    SendActivation,
    SendGrad,
    SimulationResult,
    TrainSchedule,
    ideal_bubble_fraction,
    simulate,
)

STAGES = range(1, 5)
MICRO_BATCHES = range(1, 9)
GRID = [(p, m) for p in STAGES for m in MICRO_BATCHES]
INTERLEAVED_GRID = [(p, m, v) for p, m in GRID for v in (2, 3)]
FINAL = [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]


def train(p: int, m: int) -> list[TrainSchedule]:
    return [TrainSchedule(m, p, s) for s in range(p)]


def interleaved(p: int, m: int, v: int) -> list[InterleavedTrainSchedule]:
    return [InterleavedTrainSchedule(m, p, s, v) for s in range(p)]


def virtual(stage: int, chunk: int, stages: int) -> int:
    return chunk * stages + stage


def in_flight_trace(instrs: list[PipeInstruction]) -> list[int]:
    """(chunk, micro-batch) pairs forwarded but not yet backwarded, after each instruction."""
    live: set[tuple[int, int]] = set()
    trace = []
    for instr in instrs:
        if isinstance(instr, ForwardPass):
            live.add((instr.chunk, instr.micro_batch))
        elif isinstance(instr, BackwardPass):
            live.discard((instr.chunk, instr.micro_batch))
        trace.append(len(live))
    return trace


def live_ranges(instrs: list[PipeInstruction]) -> dict[tuple[int, int], tuple[int, int, int]]:
    """(chunk, micro-batch) -> (first index, last index, buffer_id) over the instructions naming it."""
    ranges: dict[tuple[int, int], tuple[int, int, int]] = {}
    for i, instr in enumerate(instrs):
        if instr.micro_batch < 0:
            continue
        key = (instr.chunk, instr.micro_batch)
        first, _, buf = ranges.get(key, (i, i, instr.buffer_id))
        assert buf == instr.buffer_id, f"{key} changes buffer slot at #{i}: {instr}"
        ranges[key] = (first, i, buf)
    return ranges


def check_program(sched: PipeSchedule, training: bool) -> None:
    """Per-rank invariants shared by every schedule."""
    p, m, v, s = sched.stages, sched.micro_batches, sched.chunks, sched.stage_id
    instrs = sched.instructions()
    assert instrs == [i for step in sched.compact_steps() for i in step]
    shown = [i for step in sched.steps() for i in step]  # DeepSpeed's time steps: the same instructions
    assert Counter(map(repr, shown)) == Counter(map(repr, instrs))
    fwd = [(i.chunk, i.micro_batch) for i in instrs if isinstance(i, ForwardPass)]
    bwd = [(i.chunk, i.micro_batch) for i in instrs if isinstance(i, BackwardPass)]
    expected = sorted((c, mb) for c in range(v) for mb in range(m))
    assert sorted(fwd) == expected, "every micro-batch is forwarded exactly once per chunk"
    if training:
        assert sorted(bwd) == expected, "every micro-batch is backwarded exactly once per chunk"
        seen: set[tuple[int, int]] = set()
        for instr in instrs:
            if isinstance(instr, ForwardPass):
                seen.add((instr.chunk, instr.micro_batch))
            elif isinstance(instr, BackwardPass):
                assert (instr.chunk, instr.micro_batch) in seen, f"{instr} before its forward on stage {s}"
        assert instrs[-3:] == FINAL
        assert sum(isinstance(i, (ReduceTiedGrads, ReduceGrads, OptimizerStep)) for i in instrs) == 3
    else:
        assert not bwd
        assert not any(isinstance(i, (BackwardPass, SendGrad, RecvGrad, ReduceTiedGrads, ReduceGrads, OptimizerStep))
                       for i in instrs)

    # loads: inputs on the first virtual stage, labels on the last; everyone else receives its input
    loads = Counter((i.chunk, i.micro_batch) for i in instrs if isinstance(i, LoadMicroBatch))
    for c in range(v):
        first, last = virtual(s, c, p) == 0, virtual(s, c, p) == p * v - 1
        for mb in range(m):
            assert loads[(c, mb)] == (1 if first or last else 0), (s, c, mb)
    # a forward's input (loaded or received) comes right before it
    for i, instr in enumerate(instrs):
        if isinstance(instr, ForwardPass):
            feeder = instrs[i - 1]
            assert isinstance(feeder, (LoadMicroBatch, RecvActivation))
            assert (feeder.micro_batch, feeder.chunk) == (instr.micro_batch, instr.chunk)

    # communication goes to the neighbouring virtual stage: activations forward, grads backward
    for instr in instrs:
        if isinstance(instr, CommInstruction):
            assert 0 <= instr.peer < p
            here, there = virtual(s, instr.chunk, p), virtual(instr.peer, instr.peer_chunk, p)
            step = {SendActivation: 1, RecvActivation: -1, SendGrad: -1, RecvGrad: 1}[type(instr)]
            assert there == here + step, instr
            if v == 1:
                assert instr.peer == s + step

    # buffers: enough slots, and two live micro-batches never share one
    ranges = live_ranges(instrs)
    assert all(0 <= buf < sched.num_pipe_buffers() for _, _, buf in ranges.values())
    events = sorted([(a, 1, key) for key, (a, _, _) in ranges.items()] + [(b, 2, key) for key, (_, b, _) in
                                                                           ranges.items()])
    live: dict[int, tuple[int, int]] = {}
    peak = 0
    for _, kind, key in events:
        buf = ranges[key][2]
        if kind == 1:
            assert buf not in live, f"stage {s}: slot {buf} of {live[buf]} reused by {key} while live"
            live[buf] = key
            peak = max(peak, len(live))
        else:
            del live[buf]
    assert sched.num_pipe_buffers() >= peak >= (max(in_flight_trace(instrs)) if training else 1)


# -- instructions --------------------------------------------------------------------------------------------


def test_instruction_fields_and_defaults() -> None:
    fwd = ForwardPass(3, chunk=1, buffer_id=2)
    assert (fwd.micro_batch, fwd.chunk, fwd.buffer_id, fwd.name) == (3, 1, 2, "ForwardPass")
    assert ForwardPass(0) == ForwardPass(0, 0, 0) and ForwardPass(0) != BackwardPass(0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fwd.micro_batch = 4  # type: ignore[misc]
    send = SendActivation(1, peer=2, peer_chunk=1)
    assert (send.peer, send.peer_chunk, send.chunk) == (2, 1, 0)
    assert isinstance(send, CommInstruction) and isinstance(send, PipeInstruction)
    with pytest.raises(TypeError):
        RecvGrad(0)  # type: ignore[call-arg]  # the peer is required
    assert [i.micro_batch for i in FINAL] == [-1, -1, -1]
    for cls in (LoadMicroBatch, ForwardPass, BackwardPass, SendActivation, RecvActivation, SendGrad, RecvGrad,
                ReduceTiedGrads, ReduceGrads, OptimizerStep):
        assert issubclass(cls, PipeInstruction) and cls.__doc__


# -- per-rank programs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "m"), GRID)
def test_train_schedule(p: int, m: int) -> None:
    for sched in train(p, m):
        check_program(sched, training=True)
        s = sched.stage_id
        assert sched.is_first_stage == (s == 0) and sched.is_last_stage == (s == p - 1)
        trace = in_flight_trace(sched.instructions())
        assert max(trace) <= p - s, "1F1B holds at most stages - stage_id micro-batches"
        assert max(trace) == min(p - s, m) == sched.num_pipe_buffers()
        computes = [type(i) for i in sched.instructions() if isinstance(i, (ForwardPass, BackwardPass))]
        warmup = min(p - s - 1, m)
        assert computes[:warmup] == [ForwardPass] * warmup
        steady = computes[warmup:warmup + 2 * (m - warmup)]
        assert steady == [ForwardPass, BackwardPass] * (m - warmup)


@pytest.mark.parametrize(("p", "m"), GRID)
def test_gpipe_and_inference_schedules(p: int, m: int) -> None:
    for s in range(p):
        gpipe = GPipeSchedule(m, p, s)
        check_program(gpipe, training=True)
        assert max(in_flight_trace(gpipe.instructions())) == m == gpipe.num_pipe_buffers()
        inference = InferenceSchedule(m, p, s)
        check_program(inference, training=False)
        assert inference.num_pipe_buffers() == 1
        assert len(list(inference.compact_steps())) == m
        assert len(list(inference.steps())) == m + p - 1  # DeepSpeed's clock


@pytest.mark.parametrize(("p", "m", "v"), INTERLEAVED_GRID)
def test_interleaved_schedule(p: int, m: int, v: int) -> None:
    for sched in interleaved(p, m, v):
        check_program(sched, training=True)
        s = sched.stage_id
        warmup = min(p - s - 1 + (v - 1) * p, m * v)
        assert sched.num_warmup() == warmup
        assert sched.max_live() == min(warmup + 1, m * v)
        trace = in_flight_trace(sched.instructions())
        assert max(trace) <= sched.max_live(), "the documented bound"
        assert max(trace) <= p - s + (v - 1) * p
        assert sched.num_pipe_buffers() <= v * sched.max_live()
        # per chunk, micro-batches run in order (what makes the slot rings work)
        for kind in (ForwardPass, BackwardPass):
            for c in range(v):
                mbs = [i.micro_batch for i in sched.instructions() if isinstance(i, kind) and i.chunk == c]
                assert mbs == sorted(mbs)


@pytest.mark.parametrize(("p", "m"), GRID)
def test_interleaved_with_one_chunk_is_1f1b(p: int, m: int) -> None:
    for s in range(p):
        assert InterleavedTrainSchedule(m, p, s, 1).instructions() == TrainSchedule(m, p, s).instructions()


def test_train_schedule_program_two_stages() -> None:
    """The exact program of a small case, so the order is pinned and readable."""
    first, last = TrainSchedule(3, 2, 0), TrainSchedule(3, 2, 1)
    assert first.instructions() == [
        LoadMicroBatch(0, buffer_id=0), ForwardPass(0, buffer_id=0), SendActivation(0, buffer_id=0, peer=1),
        LoadMicroBatch(1, buffer_id=1), ForwardPass(1, buffer_id=1), SendActivation(1, buffer_id=1, peer=1),
        RecvGrad(0, buffer_id=0, peer=1), BackwardPass(0, buffer_id=0),
        LoadMicroBatch(2, buffer_id=0), ForwardPass(2, buffer_id=0), SendActivation(2, buffer_id=0, peer=1),
        RecvGrad(1, buffer_id=1, peer=1), BackwardPass(1, buffer_id=1),
        RecvGrad(2, buffer_id=0, peer=1), BackwardPass(2, buffer_id=0),
        *FINAL,
    ]
    assert last.instructions()[:5] == [
        RecvActivation(0, peer=0), LoadMicroBatch(0), ForwardPass(0), BackwardPass(0), SendGrad(0, peer=0),
    ]
    assert len(first.compact_steps()) == 2 * 3 + 1
    assert len(list(first.steps())) == 2 * (3 + 2 - 1)  # DeepSpeed's clock: 8 slots, the last one reduces
    assert [[i.name for i in step] for step in last] == [
        [], ["RecvActivation", "LoadMicroBatch", "ForwardPass"], ["BackwardPass"],
        ["SendGrad", "RecvActivation", "LoadMicroBatch", "ForwardPass"], ["BackwardPass"],
        ["SendGrad", "RecvActivation", "LoadMicroBatch", "ForwardPass"], ["BackwardPass"],
        ["SendGrad", "ReduceTiedGrads", "ReduceGrads", "OptimizerStep"]]


@pytest.fixture(scope="module")
def ds_schedule():
    """DeepSpeed 0.19.8's schedule module (skipped when DeepSpeed cannot be imported)."""
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return pytest.importorskip("deepspeed.runtime.pipe.schedule")


def test_train_and_inference_steps_are_deepspeeds(ds_schedule) -> None:
    """Per time step, the same instruction kinds as DeepSpeed's TrainSchedule / InferenceSchedule, same count."""
    for m in range(1, 10):
        for p in range(1, 6):
            for s in range(p):
                for ours, theirs in ((TrainSchedule(m, p, s), ds_schedule.TrainSchedule(m, p, s)),
                                     (InferenceSchedule(m, p, s), ds_schedule.InferenceSchedule(m, p, s))):
                    mine = [[i.name for i in step] for step in ours]
                    assert mine == [[type(i).__name__ for i in step] for step in theirs], (ours, m, p, s)
                    assert (ours.num_micro_batches, ours.num_stages, ours.stage) == (m, p, s)
                    for step in ours:
                        for i in step:
                            if isinstance(i, BufferOpInstruction):
                                assert 0 <= i.buffer_id < ours.num_pipe_buffers()
    assert len(list(TrainSchedule(4, 3, 0))) == 12  # was 9 (one step per pass) before DeepSpeed's clock


# -- simulation: deadlock freedom, matching, bubble ----------------------------------------------------------


@pytest.mark.parametrize(("p", "m"), GRID)
def test_simulated_1f1b_and_gpipe_bubble_is_ideal(p: int, m: int) -> None:
    result = simulate(train(p, m))
    assert result.busy == pytest.approx([3.0 * m] * p)
    assert result.makespan == pytest.approx(3.0 * (m + p - 1))
    assert result.bubble_fraction == pytest.approx(ideal_bubble_fraction(p, m), abs=1e-12)
    gpipe = simulate([GPipeSchedule(m, p, s) for s in range(p)])
    assert gpipe.bubble_fraction == pytest.approx(result.bubble_fraction, abs=1e-12)
    inference = simulate([InferenceSchedule(m, p, s) for s in range(p)])
    assert inference.makespan == pytest.approx(m + p - 1)


@pytest.mark.parametrize(("p", "m", "v"), INTERLEAVED_GRID)
def test_simulated_interleaved(p: int, m: int, v: int) -> None:
    result = simulate(interleaved(p, m, v))  # raises on deadlock or a mismatched receive
    assert result.busy == pytest.approx([3.0 * m] * p)
    if m % p == 0:
        assert result.bubble_fraction == pytest.approx(ideal_bubble_fraction(p, m, v), abs=1e-9)
    if p >= 2 and m >= p:
        assert result.bubble_fraction < simulate(train(p, m)).bubble_fraction - 1e-9
    if p == 1:
        assert result.bubble_fraction == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(("p", "m", "v"), [(5, 4, 2), (5, 7, 4), (6, 6, 3), (6, 9, 2), (8, 8, 4), (8, 11, 3),
                                           (8, 16, 2), (8, 21, 3)])
def test_simulated_interleaved_larger(p: int, m: int, v: int) -> None:
    result = simulate(interleaved(p, m, v))
    if m % p == 0:
        assert result.bubble_fraction == pytest.approx(ideal_bubble_fraction(p, m, v), abs=1e-9)
    if m >= p:
        assert result.bubble_fraction < simulate(train(p, m)).bubble_fraction


def test_simulation_times_by_hand() -> None:
    """Two stages, two micro-batches: F0 F1 | B0 B1 on stage 0, F0 B0 F1 B1 on stage 1."""
    result = simulate(train(2, 2))
    assert isinstance(result, SimulationResult) and result.stages == 2
    assert result.makespan == pytest.approx(9.0) and result.finish == pytest.approx([9.0, 7.0])
    assert result.bubble_fraction == pytest.approx(1 / 3)
    computes = [(a, b, i.name, i.micro_batch) for a, b, i in result.timeline[1] if isinstance(i, (ForwardPass,
                                                                                                   BackwardPass))]
    assert computes == [(1, 2, "ForwardPass", 0), (2, 4, "BackwardPass", 0), (4, 5, "ForwardPass", 1),
                        (5, 7, "BackwardPass", 1)]
    assert [len(t) for t in result.timeline] == [len(s.instructions()) for s in train(2, 2)]
    # a send reaches its peer send_time later: one activation and one grad hop per micro-batch on the path
    assert simulate(train(2, 2), send_time=0.5).makespan == pytest.approx(10.0)
    # a chunk's forward takes forward_time / chunks
    assert simulate(interleaved(1, 2, 2), forward_time=2.0, backward_time=2.0).makespan == pytest.approx(8.0)


# -- the checker can fail --------------------------------------------------------------------------------------


def test_both_ranks_receiving_first_deadlocks() -> None:
    rank0 = [RecvGrad(0, peer=1), LoadMicroBatch(0), ForwardPass(0), SendActivation(0, peer=1), BackwardPass(0)]
    rank1 = [RecvActivation(0, peer=0), ForwardPass(0), BackwardPass(0), SendGrad(0, peer=0)]
    with pytest.raises(DeadlockError, match=r"deadlock.*stage 0.*RecvGrad.*stage 1.*RecvActivation"):
        simulate([rank0, rank1])
    assert issubclass(DeadlockError, RuntimeError)


def test_dropping_a_send_deadlocks() -> None:
    programs = [s.instructions() for s in train(3, 4)]
    programs[1] = [i for i in programs[1] if not (isinstance(i, SendActivation) and i.micro_batch == 3)]
    with pytest.raises(DeadlockError, match="stage 2"):
        simulate(programs)


def test_fifo_mismatch_is_reported() -> None:
    programs = [s.instructions() for s in train(2, 3)]
    # stage 1 receives micro-batch 1 before 0: the FIFO channel delivers 0 first
    recvs = [i for i, instr in enumerate(programs[1]) if isinstance(instr, RecvActivation)]
    programs[1][recvs[0]], programs[1][recvs[1]] = programs[1][recvs[1]], programs[1][recvs[0]]
    with pytest.raises(ScheduleError, match="FIFO"):
        simulate(programs)
    programs = [s.instructions() for s in interleaved(2, 2, 2)]
    programs[0] = [dataclasses.replace(i, peer_chunk=1) if isinstance(i, RecvGrad) and i.chunk == 0 else i
                   for i in programs[0]]  # names the wrong chunk on the peer (stage 1 chunk 0 sends it)
    with pytest.raises(ScheduleError, match="FIFO"):
        simulate(programs)


def test_other_inconsistencies_are_reported() -> None:
    with pytest.raises(ScheduleError, match="never received"):
        simulate([[LoadMicroBatch(0), ForwardPass(0), SendActivation(0, peer=1)], [ForwardPass(0)]])
    with pytest.raises(ScheduleError, match="before the forward"):
        simulate([[BackwardPass(0), ForwardPass(0)]])
    with pytest.raises(ScheduleError, match="peer 2"):
        simulate([[SendActivation(0, peer=2)], []])
    with pytest.raises(ValueError, match=r"schedules\[0\]"):
        simulate([TrainSchedule(2, 2, 1), TrainSchedule(2, 2, 0)])
    with pytest.raises(ValueError, match="chunks"):
        simulate([TrainSchedule(2, 2, 0), InterleavedTrainSchedule(2, 2, 1, 2)])
    with pytest.raises(ValueError, match="send_time"):
        simulate(train(2, 2), send_time=-1.0)
    with pytest.raises(ValueError, match="schedules"):
        simulate([])


# -- arguments -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("make", "name"), [
    (lambda: TrainSchedule(0, 2, 0), "micro_batches"),
    (lambda: TrainSchedule(2, 0, 0), "stages"),
    (lambda: TrainSchedule(2, 2, 2), "stage_id"),
    (lambda: TrainSchedule(2, 2, -1), "stage_id"),
    (lambda: InferenceSchedule(2.0, 2, 0), "micro_batches"),
    (lambda: GPipeSchedule(True, 2, 0), "micro_batches"),
    (lambda: InterleavedTrainSchedule(4, 2, 0, 0), "chunks"),
    (lambda: InterleavedTrainSchedule(4, 2, 3, 2), "stage_id"),
    (lambda: ideal_bubble_fraction(0, 4), "stages"),
    (lambda: ideal_bubble_fraction(2, 0), "micro_batches"),
    (lambda: ideal_bubble_fraction(2, 4, 0), "chunks"),
])
def test_bad_arguments(make, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        make()


def test_ideal_bubble_fraction() -> None:
    assert ideal_bubble_fraction(1, 8) == 0.0
    assert ideal_bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert ideal_bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)
    # Megatron's form: the bubble is (p - 1) / (v * m) of the ideal compute time
    p, m, v = 4, 8, 3
    bubble = ideal_bubble_fraction(p, m, v)
    assert bubble / (1 - bubble) == pytest.approx((p - 1) / (v * m))


@pytest.mark.parametrize("chunks", [2, 3])
def test_interleaved_inference_completes_and_runs_every_chunk_once(chunks):
    """An interleaved model's evaluation: each (micro-batch, chunk) forward once, no deadlock, no backward."""
    for stages in range(1, 5):
        for m in range(1, 9):
            schedules = [InferenceSchedule(m, stages, s, chunks) for s in range(stages)]
            simulate(schedules)
            for sch in schedules:
                fwd = [(i.micro_batch, i.chunk) for i in sch.instructions() if isinstance(i, ForwardPass)]
                assert sorted(fwd) == [(mb, c) for mb in range(m) for c in range(chunks)]
                assert not any(isinstance(i, (BackwardPass, SendGrad, RecvGrad)) for i in sch.instructions())
