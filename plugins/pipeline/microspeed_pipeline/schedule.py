"""Pipeline schedules as data: each rank's program is a list of instructions, checkable without processes.

Instruction model
-----------------
A schedule describes what ONE pipeline stage (rank) does in one training (or inference) batch of
``micro_batches`` micro-batches, as a list of :class:`PipeInstruction` objects (frozen dataclasses, named as in
DeepSpeed). Every instruction names the ``micro_batch`` it works on, the model ``chunk`` (the virtual stage
held by this rank: 0 unless the schedule is interleaved) and the ``buffer_id``: the activation-buffer slot, in
a ring of :meth:`PipeSchedule.num_pipe_buffers` slots, that holds the micro-batch's tensors on this rank.

* :class:`LoadMicroBatch`: the first virtual stage loads the inputs, the last virtual stage loads the labels
  (a single-virtual-stage pipeline loads both with one instruction).
* :class:`ForwardPass`, :class:`BackwardPass`: the compute.
* :class:`SendActivation`, :class:`RecvActivation`, :class:`SendGrad`, :class:`RecvGrad`: point-to-point
  communication; ``peer`` is the stage id at the other end, ``peer_chunk`` its chunk there.
* :class:`ReduceTiedGrads`, :class:`ReduceGrads`, :class:`OptimizerStep`: once, in that order, at the end of
  a training schedule (``micro_batch`` is -1).

Virtual stages: with ``chunks`` model chunks per rank the model is cut into ``stages * chunks`` virtual stages;
virtual stage ``chunk * stages + stage_id`` runs on ``stage_id`` as its chunk ``chunk``. Activations flow from
stage ``s`` chunk ``c`` to stage ``s + 1`` chunk ``c``, and from the last stage's chunk ``c`` to stage 0 chunk
``c + 1``; gradients flow the opposite way.

Execution semantics
-------------------
Each rank runs its own instruction list in order. ``Send*`` is non-blocking (an ``isend``: the rank goes on at
once; the message is delivered whenever the peer gets to the matching receive). ``Recv*`` blocks until the
message is there. Channels are FIFO per (source stage, destination stage, kind), kind being *activation* or
*grad*, so the n-th ``RecvActivation`` from a peer gets the n-th ``SendActivation`` to this rank from that
peer, and it must be for the same micro-batch and chunk pair. :func:`simulate` runs one schedule per stage with
these semantics in virtual time: it proves a set of schedules deadlock free and FIFO-consistent, and measures
its pipeline bubble.

Buffer slots are live from the first instruction that names a micro-batch (its load or receive) to the last
one (its final send). A slot is reused only after that, but an ``isend`` issued from it may still be pending:
the runtime must *replace* a slot's tensors when it reuses it (as DeepSpeed does), not write into them.

Schedules: :class:`TrainSchedule` (1F1B, PipeDream-flush), :class:`InterleavedTrainSchedule` (Megatron-LM's
interleaved 1F1B), :class:`GPipeSchedule` (all forwards, then all backwards) and :class:`InferenceSchedule`.
"""

from __future__ import annotations

import abc
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

__all__ = [
    "BackwardPass",
    "BufferOpInstruction",
    "CommInstruction",
    "DeadlockError",
    "ForwardPass",
    "GPipeSchedule",
    "InferenceSchedule",
    "InterleavedTrainSchedule",
    "LoadMicroBatch",
    "OptimizerStep",
    "PipeInstruction",
    "PipeSchedule",
    "RecvActivation",
    "RecvGrad",
    "ReduceGrads",
    "ReduceTiedGrads",
    "ScheduleError",
    "SendActivation",
    "SendGrad",
    "SimulationResult",
    "TrainSchedule",
    "ideal_bubble_fraction",
    "simulate",
]


# -- instructions --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PipeInstruction:
    """Base of every pipeline instruction: what one rank does to one micro-batch of one model chunk.

    ``micro_batch`` is the micro-batch index (-1 for the once-per-batch instructions), ``chunk`` the model
    chunk (virtual stage) on this rank, ``buffer_id`` the activation-buffer slot holding the micro-batch.
    """

    micro_batch: int
    chunk: int = 0
    buffer_id: int = 0

    @property
    def name(self) -> str:
        """The instruction's kind, its class name (DeepSpeed's ``PipeInstruction.name``)."""
        return type(self).__name__


@dataclass(frozen=True)
class BufferOpInstruction(PipeInstruction):
    """Base of the instructions that work on a micro-batch's buffer slot (DeepSpeed's ``BufferOpInstruction``)."""


@dataclass(frozen=True)
class LoadMicroBatch(BufferOpInstruction):
    """Load the micro-batch from the data iterator: inputs on the first virtual stage, labels on the last."""


@dataclass(frozen=True)
class ForwardPass(BufferOpInstruction):
    """Run this chunk's forward on the micro-batch (the last virtual stage computes the loss too)."""


@dataclass(frozen=True)
class BackwardPass(BufferOpInstruction):
    """Run this chunk's backward on the micro-batch, from the loss or from the received output gradient."""


@dataclass(frozen=True, kw_only=True)
class CommInstruction(BufferOpInstruction):
    """Base of the point-to-point instructions: ``peer`` is the other stage, ``peer_chunk`` its chunk."""

    peer: int
    peer_chunk: int = 0


@dataclass(frozen=True, kw_only=True)
class SendActivation(CommInstruction):
    """Send (non-blocking) the chunk's output activation to the next virtual stage."""


@dataclass(frozen=True, kw_only=True)
class RecvActivation(CommInstruction):
    """Receive (blocking) the input activation from the previous virtual stage."""


@dataclass(frozen=True, kw_only=True)
class SendGrad(CommInstruction):
    """Send (non-blocking) the gradient of the chunk's input to the previous virtual stage."""


@dataclass(frozen=True, kw_only=True)
class RecvGrad(CommInstruction):
    """Receive (blocking) the gradient of the chunk's output from the next virtual stage."""


@dataclass(frozen=True)
class ReduceTiedGrads(PipeInstruction):
    """All-reduce the gradients of tied weights (e.g. shared embeddings) among the stages that hold them."""

    micro_batch: int = -1


@dataclass(frozen=True)
class ReduceGrads(PipeInstruction):
    """All-reduce the gradients over the data-parallel group."""

    micro_batch: int = -1


@dataclass(frozen=True)
class OptimizerStep(PipeInstruction):
    """Step the optimizer (once per batch, after the gradient reductions)."""

    micro_batch: int = -1


# -- schedules -----------------------------------------------------------------------------------------------


class _Op(NamedTuple):
    kind: Literal["F", "B"]
    micro_batch: int
    chunk: int


def _check_int(name: str, value: object, minimum: int, owner: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: {name} must be an int >= {minimum}, got {value!r}.")


class PipeSchedule(abc.ABC):
    """The instructions one stage runs for one batch of ``micro_batches`` micro-batches on ``stages`` stages.

    Subclasses give the order of their compute (``_compute_order``: forward and backward passes as
    ``(kind, micro_batch, chunk)``); this base wraps each pass with its loads, receives and sends, numbers
    the buffer slots, and appends the gradient reductions and optimizer step to training schedules.
    """

    #: whether the schedule trains (ends with the gradient reductions and the optimizer step)
    is_training: bool = True

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        owner = type(self).__name__
        _check_int("micro_batches", micro_batches, 1, owner)
        _check_int("stages", stages, 1, owner)
        _check_int("stage_id", stage_id, 0, owner)
        if stage_id >= stages:
            raise ValueError(f"{owner}: stage_id must be in [0, stages={stages}), got {stage_id}.")
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.chunks = 1
        self._steps: list[list[PipeInstruction]] | None = None
        self._ring: int | None = None

    @abc.abstractmethod
    def _compute_order(self) -> list[_Op]:
        """This rank's forward (``"F"``) and backward (``"B"``) passes, in the order it runs them."""

    # -- topology -------------------------------------------------------------------------------------------

    @property
    def num_micro_batches(self) -> int:
        """The micro-batches of one batch (DeepSpeed's name)."""
        return self.micro_batches

    @property
    def num_stages(self) -> int:
        """The pipeline stages (DeepSpeed's name)."""
        return self.stages

    @property
    def stage(self) -> int:
        """This rank's stage id (DeepSpeed's name)."""
        return self.stage_id

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank is pipeline stage 0."""
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank is the last pipeline stage."""
        return self.stage_id == self.stages - 1

    @property
    def prev_stage(self) -> int:
        """The stage before this one (wrapping around: only interleaved schedules talk to it from stage 0)."""
        return (self.stage_id - 1) % self.stages

    @property
    def next_stage(self) -> int:
        """The stage after this one (wrapping around: only interleaved schedules talk to it from the last)."""
        return (self.stage_id + 1) % self.stages

    def _prev_virtual(self, chunk: int) -> tuple[int, int] | None:
        """(stage, chunk) of the virtual stage feeding ``chunk`` on this rank; ``None`` for the first one."""
        if self.stage_id > 0:
            return self.stage_id - 1, chunk
        return (self.stages - 1, chunk - 1) if chunk > 0 else None

    def _next_virtual(self, chunk: int) -> tuple[int, int] | None:
        """(stage, chunk) of the virtual stage fed by ``chunk`` on this rank; ``None`` for the last one."""
        if self.stage_id < self.stages - 1:
            return self.stage_id + 1, chunk
        return (0, chunk + 1) if chunk < self.chunks - 1 else None

    # -- the program ----------------------------------------------------------------------------------------

    def num_pipe_buffers(self) -> int:
        """Number of activation-buffer slots: the most micro-batches live at once on this rank.

        Slots are a ring per chunk (``chunk * ring + micro_batch % ring``); each chunk runs its micro-batches
        in order, so the live ones on a chunk are consecutive and never share a slot.
        """
        if self._ring is None:
            self._ring = self._peak_per_chunk()
        return self._ring * self.chunks

    def _peak_per_chunk(self) -> int:
        live = [0] * self.chunks
        peak = 1
        for op in self._compute_order():
            if op.kind == "F":
                live[op.chunk] += 1
                peak = max(peak, live[op.chunk])
                if not self.is_training:
                    live[op.chunk] -= 1
            else:
                live[op.chunk] -= 1
        return peak

    def _buffer(self, micro_batch: int, chunk: int) -> int:
        ring = self.num_pipe_buffers() // self.chunks
        return chunk * ring + micro_batch % ring

    def _wrap(self, op: _Op) -> list[PipeInstruction]:
        mb, chunk = op.micro_batch, op.chunk
        kw = {"micro_batch": mb, "chunk": chunk, "buffer_id": self._buffer(mb, chunk)}
        prev, nxt = self._prev_virtual(chunk), self._next_virtual(chunk)
        step: list[PipeInstruction] = []
        if op.kind == "F":
            if prev is None:
                step.append(LoadMicroBatch(**kw))
            else:
                step.append(RecvActivation(**kw, peer=prev[0], peer_chunk=prev[1]))
                if nxt is None:
                    step.append(LoadMicroBatch(**kw))  # the labels, for the loss
            step.append(ForwardPass(**kw))
            if nxt is not None:
                step.append(SendActivation(**kw, peer=nxt[0], peer_chunk=nxt[1]))
        else:
            if nxt is not None:
                step.append(RecvGrad(**kw, peer=nxt[0], peer_chunk=nxt[1]))
            step.append(BackwardPass(**kw))
            if prev is not None:
                step.append(SendGrad(**kw, peer=prev[0], peer_chunk=prev[1]))
        return step

    def compact_steps(self) -> list[list[PipeInstruction]]:
        """The program the runtime executes: one step per pass, its loads and receives before it, sends after.

        A training schedule ends with a step of :class:`ReduceTiedGrads`, :class:`ReduceGrads` and
        :class:`OptimizerStep`.
        """
        if self._steps is None:
            built = [self._wrap(op) for op in self._compute_order()]
            if self.is_training:
                built.append([ReduceTiedGrads(), ReduceGrads(), OptimizerStep()])
            self._steps = built
        return [list(step) for step in self._steps]

    def steps(self) -> Iterator[list[PipeInstruction]]:
        """Yield, per time step, the instructions of the step (DeepSpeed's API).

        Schedules DeepSpeed also has (:class:`TrainSchedule`, :class:`InferenceSchedule` with one chunk)
        yield DeepSpeed's time steps (see their ``steps``); the others yield :meth:`compact_steps`.
        """
        yield from self.compact_steps()

    def __iter__(self) -> Iterator[list[PipeInstruction]]:
        return self.steps()

    def instructions(self) -> list[PipeInstruction]:
        """The runtime's program (:meth:`compact_steps`) as one list, in execution order."""
        return [instr for step in self.compact_steps() for instr in step]

    def _kw(self, micro_batch: int) -> dict[str, int]:
        return {"micro_batch": micro_batch, "chunk": 0, "buffer_id": self._buffer(micro_batch, 0)}

    def _valid(self, micro_batch: int) -> bool:
        return 0 <= micro_batch < self.micro_batches

    def __repr__(self) -> str:
        extra = f", chunks={self.chunks}" if self.chunks > 1 else ""
        return (f"{type(self).__name__}(micro_batches={self.micro_batches}, stages={self.stages}, "
                f"stage_id={self.stage_id}{extra})")


class TrainSchedule(PipeSchedule):
    """1F1B training (PipeDream-flush): warm-up forwards, then one forward and one backward, then cool-down.

    Stage ``s`` runs ``min(stages - s - 1, micro_batches)`` warm-up forwards, so it holds the activations of
    at most ``stages - s`` micro-batches at once (GPipe holds all ``micro_batches``); its bubble is
    ``(stages - 1) / (micro_batches + stages - 1)`` of the time when a backward costs twice a forward.
    """

    def num_warmup(self) -> int:
        """Forwards this stage runs before its first backward."""
        return min(self.stages - self.stage_id - 1, self.micro_batches)

    def _compute_order(self) -> list[_Op]:
        m, w = self.micro_batches, self.num_warmup()
        order = [_Op("F", i, 0) for i in range(w)]
        for i in range(m - w):
            order += [_Op("F", w + i, 0), _Op("B", i, 0)]
        order += [_Op("B", i, 0) for i in range(m - w, m)]
        return order

    def _step_to_micro_batch(self, step_id: int) -> tuple[int, bool]:
        """DeepSpeed's clock: (micro-batch, is_forward) of time step ``step_id`` on this stage."""
        s, half = self.stage_id, step_id // 2
        if step_id % 2 == s % 2:  # forward slots
            return (half if step_id % 2 == 0 else (step_id - 1) // 2) - s // 2, True
        if step_id % 2 == 0:  # even step, odd stage: backward
            return half - self.stages + (s + 1) // 2, False
        return (step_id - 1) // 2 - self.stages + 1 + s // 2, False

    def steps(self) -> Iterator[list[PipeInstruction]]:
        """DeepSpeed's time steps: ``2 * (micro_batches + stages - 1)`` of them, forward and backward slots
        alternating (some empty), each as DeepSpeed's ``TrainSchedule`` fills it: a forward slot sends the
        previous backward's input gradient and receives, a backward slot receives the output gradient and
        sends the previous forward's activation; the last step reduces and steps. The passes come in the
        same order as :meth:`instructions` (the runtime's compact program), which runs sends right after
        their pass instead of one slot later.
        """
        total = 2 * (self.micro_batches + self.stages - 1)
        first, last = self.stage_id == 0, self.stage_id == self.stages - 1
        prev_mb = -1
        for step_id in range(total):
            mb, forward = self._step_to_micro_batch(step_id)
            cmds: list[PipeInstruction] = []
            if forward:
                if self._valid(prev_mb) and not first:
                    cmds.append(SendGrad(**self._kw(prev_mb), peer=self.stage_id - 1))
                if self._valid(mb) and not first:
                    cmds.append(RecvActivation(**self._kw(mb), peer=self.stage_id - 1))
            else:
                if self._valid(mb) and not last:
                    cmds.append(RecvGrad(**self._kw(mb), peer=self.stage_id + 1))
                if self._valid(prev_mb) and not last:
                    cmds.append(SendActivation(**self._kw(prev_mb), peer=self.stage_id + 1))
            if (first or last) and forward and self._valid(mb):
                cmds.append(LoadMicroBatch(**self._kw(mb)))
            if self._valid(mb):
                cmds.append((ForwardPass if forward else BackwardPass)(**self._kw(mb)))
            if step_id == total - 1:
                cmds += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
            prev_mb = mb
            yield cmds


class GPipeSchedule(PipeSchedule):
    """GPipe training: every forward, then every backward (in the same order); holds all micro-batches."""

    def _compute_order(self) -> list[_Op]:
        m = self.micro_batches
        return [_Op("F", i, 0) for i in range(m)] + [_Op("B", i, 0) for i in range(m)]


class InferenceSchedule(PipeSchedule):
    """Forward passes only (evaluation): no backward, no gradient traffic, no optimizer step.

    With ``chunks > 1`` (an interleaved model) each rank runs ``(micro_batch, chunk)`` in lexicographic
    order: a pass depends only on passes earlier in that order (the previous stage's same chunk, or the last
    stage's previous chunk), so the schedules cannot deadlock.
    """

    is_training = False

    def __init__(self, micro_batches: int, stages: int, stage_id: int, chunks: int = 1) -> None:
        super().__init__(micro_batches, stages, stage_id)
        _check_int("chunks", chunks, 1, type(self).__name__)
        self.chunks = chunks

    def _compute_order(self) -> list[_Op]:
        return [_Op("F", i, c) for i in range(self.micro_batches) for c in range(self.chunks)]

    def steps(self) -> Iterator[list[PipeInstruction]]:
        """With one chunk, DeepSpeed's time steps: ``micro_batches + stages - 1``, stage ``s`` forwarding
        micro-batch ``step - s`` and sending the previous one's activation (even stages send before they
        receive, odd stages after), first and last stages loading. Interleaved: :meth:`compact_steps`.
        """
        if self.chunks > 1:
            yield from self.compact_steps()
            return
        first, last, even = self.stage_id == 0, self.stage_id == self.stages - 1, self.stage_id % 2 == 0
        for step_id in range(self.micro_batches + self.stages - 1):
            mb = step_id - self.stage_id
            cmds: list[PipeInstruction] = []
            if (first or last) and self._valid(mb):
                cmds.append(LoadMicroBatch(**self._kw(mb)))
            send = [SendActivation(**self._kw(mb - 1), peer=self.stage_id + 1)] \
                if not last and self._valid(mb - 1) else []
            recv = [RecvActivation(**self._kw(mb), peer=self.stage_id - 1)] if not first and self._valid(mb) else []
            cmds += send + recv if even else recv + send
            if self._valid(mb):
                cmds.append(ForwardPass(**self._kw(mb)))
            yield cmds


class InterleavedTrainSchedule(PipeSchedule):
    """Megatron-LM's interleaved 1F1B: ``chunks`` model chunks (virtual stages) per rank.

    The forwards run the micro-batches in groups of ``stages``: for each group, chunk 0 on each of them, then
    chunk 1, ... (Megatron's order); the backwards run the same order with the chunks reversed. Stage ``s``
    runs ``min((stages - s - 1) + (chunks - 1) * stages, micro_batches * chunks)`` warm-up forwards (one
    ``stages - s - 1`` term less than Megatron, whose blocking exchanges need it twice; the sends here are
    non-blocking), then alternates one forward and one backward, then cools down. So at most
    ``stages - s + (chunks - 1) * stages`` (chunk, micro-batch) pairs are live on stage ``s``, each holding
    ``1 / chunks`` of the stage's activations: stage 0 holds as much as 1F1B's (``stages`` micro-batches' worth).

    Megatron requires ``micro_batches % stages == 0``; here any ``micro_batches`` works: the last group is
    simply shorter (Megatron-core's order for that case). With this warm-up, :func:`simulate` finds the set of
    schedules deadlock free for every ``2 <= stages <= 16``, ``micro_batches <= 32`` (and 40, 48, 63, 64),
    ``2 <= chunks <= 6`` (the tests check a smaller range), with a bubble below :class:`TrainSchedule`'s whenever
    ``micro_batches >= stages >= 2``, equal to :func:`ideal_bubble_fraction` when ``stages`` divides
    ``micro_batches``. Megatron's larger warm-up can deadlock under these semantics when the last group is
    short (e.g. 8 stages, 12 micro-batches). A runtime can check its own configuration by simulating every
    stage's schedule once at start-up (under a second). ``chunks=1`` gives exactly :class:`TrainSchedule`'s program.
    """

    def __init__(self, micro_batches: int, stages: int, stage_id: int, chunks: int) -> None:
        super().__init__(micro_batches, stages, stage_id)
        _check_int("chunks", chunks, 1, type(self).__name__)
        self.chunks = chunks

    def num_warmup(self) -> int:
        """Forwards (of one chunk each) this stage runs before its first backward."""
        p, v = self.stages, self.chunks
        return min(p - self.stage_id - 1 + (v - 1) * p, self.micro_batches * v)

    def max_live(self) -> int:
        """The documented bound on (chunk, micro-batch) pairs forwarded but not yet backwarded on this stage."""
        return min(self.num_warmup() + 1, self.micro_batches * self.chunks)

    def _forward_table(self) -> list[tuple[int, int]]:
        p, v, m = self.stages, self.chunks, self.micro_batches
        return [(mb, c) for group in range(0, m, p) for c in range(v) for mb in range(group, min(group + p, m))]

    def _compute_order(self) -> list[_Op]:
        v = self.chunks
        table = self._forward_table()
        fwd = [_Op("F", mb, c) for mb, c in table]
        bwd = [_Op("B", mb, v - 1 - c) for mb, c in table]
        n, w = len(table), self.num_warmup()
        order = fwd[:w]
        for i in range(n - w):
            order += [fwd[w + i], bwd[i]]
        return order + bwd[n - w:]


# -- simulation ----------------------------------------------------------------------------------------------


class ScheduleError(RuntimeError):
    """A set of schedules is inconsistent: a receive does not match its send, a send is never received, ..."""


class DeadlockError(ScheduleError):
    """A set of schedules cannot complete: every unfinished rank waits on a receive that never comes."""


@dataclass
class SimulationResult:
    """What :func:`simulate` measured, in the units of its ``forward_time``.

    ``busy[s]`` is stage ``s``'s compute time (forwards and backwards), ``finish[s]`` when it ran its last
    instruction; ``timeline[s]`` lists ``(start, end, instruction)`` for every instruction it ran (a receive
    starts when the rank reaches it and ends when the message is there).
    """

    busy: list[float]
    finish: list[float]
    makespan: float
    timeline: list[list[tuple[float, float, PipeInstruction]]] = field(repr=False)

    @property
    def stages(self) -> int:
        """Number of stages simulated."""
        return len(self.busy)

    @property
    def bubble_fraction(self) -> float:
        """The share of the stages' time spent idle: ``1 - sum(busy) / (stages * makespan)``."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (self.stages * self.makespan)


class _Message(NamedTuple):
    micro_batch: int
    src_chunk: int
    dst_chunk: int
    time: float
    instr: PipeInstruction


_SENDS = {SendActivation: "activation", SendGrad: "grad"}
_RECVS = {RecvActivation: "activation", RecvGrad: "grad"}


def simulate(schedules: Sequence[PipeSchedule | Sequence[PipeInstruction]], forward_time: float = 1.0,
             backward_time: float = 2.0, send_time: float = 0.0) -> SimulationResult:
    """Run one schedule per stage (``schedules[s]`` for stage ``s``) with the execution semantics, in virtual time.

    A rank runs its instructions in order. A forward of one chunk takes ``forward_time / chunks`` and a
    backward ``backward_time / chunks`` (so the times are those of a whole stage, whatever the interleaving);
    a send costs the sender nothing and reaches the peer ``send_time`` later; a receive waits for its message;
    the other instructions take no time. ``chunks`` is the schedules' ``chunks``, or for bare instruction
    lists one more than the largest chunk in them.

    Raises :class:`DeadlockError` when the ranks cannot all finish (naming what each one waits for), and
    :class:`ScheduleError` when a receive gets a message of another micro-batch or chunk than it names
    (channels are FIFO per source, destination and kind), a peer is not a stage, or a send is never received.
    """
    stages = len(schedules)
    if stages == 0:
        raise ValueError("simulate: schedules is empty; give one schedule per stage.")
    for name, value in (("forward_time", forward_time), ("backward_time", backward_time), ("send_time", send_time)):
        if value < 0:
            raise ValueError(f"simulate: {name} must be >= 0, got {value}.")
    programs: list[list[PipeInstruction]] = []
    chunk_counts: set[int] = set()
    for s, sched in enumerate(schedules):
        if isinstance(sched, PipeSchedule):
            if sched.stages != stages or sched.stage_id != s:
                raise ValueError(f"simulate: schedules[{s}] is {sched!r}; schedules[s] must be stage s of {stages}.")
            chunk_counts.add(sched.chunks)
            programs.append(sched.instructions())
        else:
            programs.append(list(sched))
    if len(chunk_counts) > 1:
        raise ValueError(f"simulate: the schedules disagree on chunks ({sorted(chunk_counts)}).")
    chunks = chunk_counts.pop() if chunk_counts else 1 + max((i.chunk for p in programs for i in p), default=0)
    fwd, bwd = forward_time / chunks, backward_time / chunks

    channels: dict[tuple[int, int, str], deque[_Message]] = {}
    pcs, clocks, busy = [0] * stages, [0.0] * stages, [0.0] * stages
    timeline: list[list[tuple[float, float, PipeInstruction]]] = [[] for _ in range(stages)]
    forwarded: list[set[tuple[int, int]]] = [set() for _ in range(stages)]

    def where(s: int) -> str:
        return f"stage {s} instruction #{pcs[s]} {programs[s][pcs[s]]!r}"

    progress = True
    while progress:  # each rank runs until it blocks; the times do not depend on the order ranks are visited
        progress = False
        for s in range(stages):
            program = programs[s]
            while pcs[s] < len(program):
                instr, start = program[pcs[s]], clocks[s]
                if isinstance(instr, CommInstruction) and not 0 <= instr.peer < stages:
                    raise ScheduleError(f"simulate: {where(s)} names peer {instr.peer}, not one of {stages} stages.")
                if type(instr) in _SENDS:
                    key = (s, instr.peer, _SENDS[type(instr)])
                    msg = _Message(instr.micro_batch, instr.chunk, instr.peer_chunk, start + send_time, instr)
                    channels.setdefault(key, deque()).append(msg)
                elif type(instr) in _RECVS:
                    queue = channels.get((instr.peer, s, _RECVS[type(instr)]))
                    if not queue:
                        break  # blocked: wait for the peer
                    msg = queue.popleft()
                    if (msg.micro_batch, msg.src_chunk, msg.dst_chunk) != (instr.micro_batch, instr.peer_chunk,
                                                                         instr.chunk):
                        raise ScheduleError(f"simulate: {where(s)} received {msg.instr!r} from stage {instr.peer}: "
                                            f"the FIFO channel delivers another micro-batch or chunk than it names.")
                    clocks[s] = max(start, msg.time)
                elif isinstance(instr, ForwardPass):
                    forwarded[s].add((instr.micro_batch, instr.chunk))
                    clocks[s] += fwd
                    busy[s] += fwd
                elif isinstance(instr, BackwardPass):
                    if (instr.micro_batch, instr.chunk) not in forwarded[s]:
                        raise ScheduleError(f"simulate: {where(s)} comes before the forward it differentiates.")
                    clocks[s] += bwd
                    busy[s] += bwd
                timeline[s].append((start, clocks[s], instr))
                pcs[s] += 1
                progress = True

    stuck = [s for s in range(stages) if pcs[s] < len(programs[s])]
    if stuck:
        waits = "; ".join(f"{where(s)} waits for stage {programs[s][pcs[s]].peer}" for s in stuck)  # type: ignore[attr-defined]
        raise DeadlockError(f"simulate: pipeline deadlock, {len(stuck)} of {stages} stages cannot go on: {waits}.")
    left = [f"{m.instr!r} from stage {src} to stage {dst}" for (src, dst, _), q in channels.items() for m in q]
    if left:
        raise ScheduleError(f"simulate: {len(left)} sends were never received: {'; '.join(left[:5])}.")
    return SimulationResult(busy=busy, finish=list(clocks), makespan=max(clocks), timeline=timeline)


def ideal_bubble_fraction(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """The bubble of (interleaved) 1F1B as a fraction of the total time: ``(p - 1) / (chunks * m + p - 1)``.

    With ``p`` stages, ``m`` micro-batches and a stage's forward plus backward taking ``t``, 1F1B runs for
    ``(m + p - 1) * t`` of which ``m * t`` is compute; with ``chunks = v`` the ramp-up and ramp-down cost
    ``(p - 1) * t / v`` (Megatron-LM's paper writes the bubble as ``(p - 1) / (v * m)`` of the *ideal compute*
    time ``m * t``). Idle over total is then ``((p - 1) / v) / (m + (p - 1) / v)``: the definition used here
    and by :attr:`SimulationResult.bubble_fraction`.
    """
    _check_int("stages", stages, 1, "ideal_bubble_fraction")
    _check_int("micro_batches", micro_batches, 1, "ideal_bubble_fraction")
    _check_int("chunks", chunks, 1, "ideal_bubble_fraction")
    return (stages - 1) / (chunks * micro_batches + stages - 1)
