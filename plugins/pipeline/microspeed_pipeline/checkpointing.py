"""DeepSpeed's activation checkpointing (``deepspeed.checkpointing``): recompute instead of store.

:func:`checkpoint` runs ``function`` without recording its graph and saves only its inputs; in the
backward pass it runs ``function`` again under the RNG states of the forward (the CPU generator, the
current CUDA device's and the tensor-parallel tracker's named states, see
:mod:`microspeed_pipeline.rng`), so dropout draws the same masks, and back-propagates through the
recomputed graph. The saved inputs can be made smaller and cheaper, as DeepSpeed's options do
(ds_config section ``activation_checkpointing``, or :func:`configure`):

* ``partition_activations`` — each tensor-parallel rank keeps only its ``1/tp`` slice of every
  floating-point input (flattened, zero-padded to a multiple of ``tp``); the full tensor is
  all-gathered over the tensor-parallel group at recompute. The inputs must be replicated across
  the tensor-parallel ranks (as the inputs of Megatron-style transformer layers are). With
  ``tp == 1`` it changes nothing.
* ``cpu_checkpointing`` — saved inputs (or their slices) are copied to the CPU and back to their
  device at recompute (a no-op on a CPU-only run).
* ``contiguous_memory_optimization`` with ``number_checkpoints`` — the saved slices are copied into
  buffers preallocated once per forward pass: for each input position one buffer of
  ``number_checkpoints`` slots, so the checkpoints of one pass lie next to each other instead of
  fragmenting the allocator. As in DeepSpeed it needs ``partition_activations`` and
  ``number_checkpoints`` (the number of :func:`checkpoint` calls in one forward pass); the buffers
  are let go at the first backward (or :func:`reset`), and live on while saved slices use them.
* ``synchronize_checkpoint_boundary`` — synchronize the device of the inputs (CUDA) at the start
  and end of every checkpoint's forward and backward; nothing to do for CPU tensors.
* ``profile`` — time every checkpoint's forward and recompute-plus-backward, log each, and keep
  them for :func:`checkpoint_timings`.

**Whose configuration.** DeepSpeed's API is module-level — ``configure()`` once, then
``checkpoint()`` from anywhere in the model code, with no engine in reach. Here each engine whose
ds_config has the section keeps its own :class:`CheckpointingState` (``engine.plugin_state(
"activation_checkpointing").state``), in effect only while that engine's model runs
(:func:`using`); the module-level functions act on the state in effect, and outside any such
engine on a *standalone* state — the script's, for calls made before or without an engine (and for
engines without the section, as in DeepSpeed, where the script configures). So two engines in one
process never see each other's settings, buffers or timings. Each :func:`checkpoint` call takes a
snapshot of the settings and remembers its state, so reconfiguring between a forward and its
backward does not break that backward, and the recompute runs under the forward's state and grid.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.utils.checkpoint

from microspeed.plugin_api import Config, ConfigError, Field, Section, comm, get_logger, load_raw, parse, positive
from microspeed_pipeline.rng import get_cuda_rng_tracker, get_rng_tracker, model_parallel_cuda_manual_seed
from microspeed_pipeline.topology import get_default_grid

__all__ = [
    "ACTIVATION_CHECKPOINTING_SECTION",
    "SECTION",
    "CheckpointFunction",
    "CheckpointTimings",
    "CheckpointingSettings",
    "CheckpointingState",
    "checkpoint",
    "checkpoint_timings",
    "configure",
    "current_state",
    "get_cuda_rng_tracker",
    "get_settings",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "partition_activations_in_checkpoint",
    "reset",
    "reset_checkpoint_timings",
    "set_num_layers",
    "using",
]

SECTION = "activation_checkpointing"
"""The ds_config section these settings are read from."""

ACTIVATION_CHECKPOINTING_SECTION = Section({
    "partition_activations": Field(
        (bool,), False, "keep only this tensor-parallel rank's 1/tp slice of each checkpointed input; "
                        "all-gather it at recompute (no effect when tp = 1)"),
    "cpu_checkpointing": Field(
        (bool,), False, "move checkpointed inputs to CPU memory, back to their device at recompute"),
    "contiguous_memory_optimization": Field(
        (bool,), False, "copy the saved slices into buffers preallocated per forward pass "
                        "(needs partition_activations and number_checkpoints)"),
    "number_checkpoints": Field(
        (int, type(None)), None, "checkpoint() calls per forward pass: sizes the contiguous buffers", positive),
    "synchronize_checkpoint_boundary": Field(
        (bool,), False, "synchronize the device at the start and end of each checkpoint's forward and backward"),
    "profile": Field(
        (bool,), False, "time and log each checkpoint's forward and recompute+backward "
                        "(deepspeed.checkpointing.checkpoint_timings())"),
}, doc="activation checkpointing (deepspeed.checkpointing): recompute layers in backward instead of storing them")
"""The schema of the ``activation_checkpointing`` section (DeepSpeed's keys and defaults)."""

_MAX_TIMINGS = 65536


@dataclass(frozen=True)
class CheckpointingSettings:
    """The values of the ``activation_checkpointing`` section (DeepSpeed's keys and defaults)."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> CheckpointingSettings:
        """Settings from a parsed ``activation_checkpointing`` section (missing keys take defaults)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in section.items() if k in names})

    def validate(self) -> None:
        """Refuse combinations DeepSpeed refuses, with a :class:`ConfigError` naming the key."""
        if self.contiguous_memory_optimization and not self.partition_activations:
            raise ConfigError(
                f"{SECTION}.contiguous_memory_optimization: true needs {SECTION}.partition_activations: true "
                "(as in DeepSpeed, contiguous checkpoint buffers hold the partitioned activations); set "
                "partition_activations to true (it is a no-op without tensor parallelism) or "
                "contiguous_memory_optimization to false.")
        if self.contiguous_memory_optimization and self.number_checkpoints is None:
            raise ConfigError(
                f"{SECTION}.number_checkpoints: required when {SECTION}.contiguous_memory_optimization is true; "
                "give the number of checkpoint() calls in one forward pass (usually the number of "
                "checkpointed layers; configure(num_checkpoints=...)), which sizes the contiguous buffers.")

    def memory_options(self) -> list[str]:
        """The keys set that change how inputs are saved (for messages)."""
        return [k for k in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization")
                if getattr(self, k)]


@dataclass(frozen=True)
class CheckpointTimings:
    """Seconds of each timed checkpoint since the last :func:`reset_checkpoint_timings`.

    ``forward`` and ``backward`` (recompute plus the segment's backward) hold the most recent
    65536 values each, in call order; the counts and totals cover all of them.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    forward_count: int
    backward_count: int
    forward_total_s: float
    backward_total_s: float


class CheckpointingState:
    """One checkpointing configuration with its contiguous buffers and timings.

    One per engine with the ``activation_checkpointing`` section, plus the standalone one for calls
    outside any such engine (see the module docstring).
    """

    def __init__(self) -> None:
        self.configured = False
        self.settings = CheckpointingSettings()
        self.mpu: Any = None
        self.buffers: dict[tuple, _ContiguousBuffer] = {}
        self.forward_times: collections.deque[float] = collections.deque(maxlen=_MAX_TIMINGS)
        self.backward_times: collections.deque[float] = collections.deque(maxlen=_MAX_TIMINGS)
        self.totals = {"forward": [0, 0.0], "backward": [0, 0.0]}
        self.warned_non_reentrant = False
        self.logger: Any = None


_State = CheckpointingState  # the name tests reset the standalone state with

_STATE = CheckpointingState()
"""The standalone state: the script's configuration, for calls outside any engine that has its own."""

_IN_EFFECT: contextvars.ContextVar[CheckpointingState | None] = contextvars.ContextVar(
    "microspeed_pipeline_checkpointing", default=None)


def current_state() -> CheckpointingState:
    """The state in effect here: the running engine's (:func:`using`), else the standalone one."""
    state = _IN_EFFECT.get()
    return state if state is not None else _STATE


@contextlib.contextmanager
def using(state: CheckpointingState | None) -> Iterator[None]:
    """Put ``state`` in effect for the block (this thread / task only; ``None``: the standalone one)."""
    token = _IN_EFFECT.set(state)
    try:
        yield
    finally:
        _IN_EFFECT.reset(token)


# -- configuration -----------------------------------------------------------------------------

def _section_from(deepspeed_config: Any) -> dict[str, Any]:
    """The user's raw ``activation_checkpointing`` dict from a ds_config dict, JSON path or ``Config``."""
    if isinstance(deepspeed_config, Config):
        return dict(deepspeed_config.raw.get(SECTION) or {})
    raw = load_raw(deepspeed_config)
    section = raw.get(SECTION, {})
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise ConfigError(f"{SECTION}: expected an object (section), got {section!r}.")
    return dict(section)


def configure(
    mpu_: Any,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Configure activation checkpointing (DeepSpeed's signature and order): the state in effect.

    Outside an engine that has its own (see the module docstring) that is the standalone state.

    Every call starts from the defaults, then reads the ``activation_checkpointing`` section of
    ``deepspeed_config`` (a ds_config dict, a path to its JSON, or a ``microspeed.config.Config``)
    when given, then applies the explicit arguments that are not ``None`` (``contiguous_checkpointing``
    is ``contiguous_memory_optimization``, ``num_checkpoints`` is ``number_checkpoints``,
    ``checkpoint_in_cpu`` is ``cpu_checkpointing``). Values are checked as the ds_config's are:
    a wrong type, or ``contiguous_memory_optimization`` without ``partition_activations`` or
    ``number_checkpoints``, raises :class:`microspeed.ConfigError` naming the key.

    ``mpu_`` answers ``get_{tensor_,}model_parallel_{rank,world_size,group}`` (a
    :class:`~microspeed_pipeline.topology.ParallelGrid`); as in DeepSpeed, ``None`` keeps the one
    configured before. Without any, the default grid (:func:`~microspeed_pipeline.topology.get_default_grid`)
    is used when a checkpoint runs, and without that the tensor-parallel size is 1.
    """
    section = _section_from(deepspeed_config) if deepspeed_config is not None else {}
    overrides = {
        "partition_activations": partition_activations,
        "contiguous_memory_optimization": contiguous_checkpointing,
        "number_checkpoints": num_checkpoints,
        "cpu_checkpointing": checkpoint_in_cpu,
        "synchronize_checkpoint_boundary": synchronize,
        "profile": profile,
    }
    section.update({k: v for k, v in overrides.items() if v is not None})
    parsed = parse({SECTION: section}, Section({SECTION: ACTIVATION_CHECKPOINTING_SECTION}))[SECTION]
    settings = CheckpointingSettings.from_section(parsed)
    settings.validate()
    state = current_state()
    if mpu_ is not None:
        _check_mpu(mpu_)
        state.mpu = mpu_
    state.settings = settings
    state.configured = True
    state.buffers = {}
    if comm.get_rank() == 0:
        _, tp_size, _ = _tensor_parallel(state)
        _logger(state).info("activation checkpointing configured", tensor_parallel_size=tp_size,
                       **{f.name: getattr(settings, f.name) for f in fields(settings)})


def is_configured() -> bool:
    """Whether the state in effect was configured (:func:`configure`, or its engine's section)."""
    return current_state().configured


def get_settings() -> CheckpointingSettings:
    """The settings :func:`checkpoint` uses now (the defaults before any :func:`configure`)."""
    return current_state().settings


def reset() -> None:
    """Let go of the contiguous checkpoint buffers (DeepSpeed's ``reset``).

    The first backward does this; call it after forward passes that have no backward (evaluation
    with gradients enabled), else the next pass finds the buffers full. Slices still saved in the
    old buffers stay valid.
    """
    current_state().buffers = {}


def set_num_layers(nlayers: int | None) -> None:
    """Set ``number_checkpoints`` (DeepSpeed's ``set_num_layers``)."""
    state = current_state()
    state.settings = replace(state.settings, number_checkpoints=nlayers)


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """Turn ``partition_activations`` on or off (DeepSpeed's ``partition_activations_in_checkpoint``)."""
    state = current_state()
    settings = replace(state.settings, partition_activations=bool(partition_activation))
    settings.validate()
    state.settings = settings


def checkpoint_timings() -> CheckpointTimings:
    """The forward and recompute+backward times measured with ``profile`` on."""
    state = current_state()
    (fc, ft), (bc, bt) = state.totals["forward"], state.totals["backward"]
    return CheckpointTimings(tuple(state.forward_times), tuple(state.backward_times), fc, bc, ft, bt)


def reset_checkpoint_timings() -> None:
    """Forget the times :func:`checkpoint_timings` reports."""
    state = current_state()
    state.forward_times.clear()
    state.backward_times.clear()
    state.totals = {"forward": [0, 0.0], "backward": [0, 0.0]}


def _logger(state: CheckpointingState) -> Any:
    if state.logger is None:
        state.logger = get_logger("activation_checkpointing")
    return state.logger


def _check_mpu(mpu: Any) -> None:
    for prefix in ("get_tensor_model_parallel_", "get_model_parallel_"):
        if all(callable(getattr(mpu, prefix + s, None)) for s in ("rank", "world_size", "group")):
            return
    raise TypeError(f"configure(mpu_={type(mpu).__name__}): an mpu needs get_model_parallel_rank, "
                    "get_model_parallel_world_size and get_model_parallel_group (or their get_tensor_model_parallel_ "
                    "names), as microspeed_pipeline.ParallelGrid has; pass None for one tensor-parallel rank.")


def _tensor_parallel(state: CheckpointingState) -> tuple[int, int, Any]:
    """``(rank, size, group)`` of the tensor-parallel axis: the configured mpu's, the grid in effect's, or 1."""
    mpu = state.mpu if state.mpu is not None else get_default_grid()
    if mpu is None:
        return 0, 1, None
    if callable(getattr(mpu, "get_tensor_model_parallel_rank", None)):
        return (mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size(),
                mpu.get_tensor_model_parallel_group())
    return mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size(), mpu.get_model_parallel_group()


# -- devices, RNG, timing ----------------------------------------------------------------------

def _devices(args: tuple[Any, ...]) -> list[torch.device]:
    seen: list[torch.device] = []
    for a in args:
        if torch.is_tensor(a) and a.device not in seen:
            seen.append(a.device)
    return seen


def _synchronize(devices: list[torch.device]) -> None:
    """Wait for the work queued on each accelerator device (nothing to do for the CPU)."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elif device.type not in ("cpu", "meta"):
            backend = getattr(torch, device.type, None)
            if backend is not None and hasattr(backend, "synchronize"):
                backend.synchronize()


def _clock(devices: list[torch.device]) -> float:
    """Wall time after the devices' queued work (so a CUDA time measures the kernels, not the launch)."""
    _synchronize(devices)
    return time.perf_counter()


def _record(state: CheckpointingState, kind: str, seconds: float) -> None:
    times = state.forward_times if kind == "forward" else state.backward_times
    times.append(seconds)
    total = state.totals[kind]
    total[0] += 1
    total[1] += seconds
    _logger(state).info(f"activation checkpoint {kind}", seconds=round(seconds, 6), count=total[0])


class _RNGStates:
    """The CPU, current-CUDA-device and tensor-parallel tracker RNG states at one moment."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        self.tracker = get_rng_tracker().get_states()

    def restore(self) -> None:
        """Make these the current states."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)
        get_rng_tracker().set_states(self.tracker)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Run the block under these states; the states from before the block are restored after."""
        outer = _RNGStates()
        self.restore()
        try:
            yield
        finally:
            outer.restore()


# -- saving inputs -----------------------------------------------------------------------------

class _ContiguousBuffer:
    """``slots`` rows of ``numel`` elements, handed out one row per checkpoint of a forward pass."""

    def __init__(self, slots: int, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.data = torch.empty(slots, numel, dtype=dtype, device=device)
        self.used = 0

    def take(self, piece: torch.Tensor) -> torch.Tensor:
        if self.used == self.data.shape[0]:
            raise RuntimeError(
                f"activation checkpointing: more than {SECTION}.number_checkpoints = {self.data.shape[0]} "
                "checkpoint() calls in one forward pass with contiguous_memory_optimization; raise "
                "number_checkpoints to the number of checkpointed layers, or call "
                "deepspeed.checkpointing.reset() after forward passes that have no backward.")
        row, numel = self.used, self.data.shape[1]
        self.used += 1
        self.data[row].copy_(piece)
        # An alias of the row with its own version counter: the rows filled later are writes to the
        # same buffer, which must not look like in-place changes of this row's saved tensor.
        with torch.no_grad():
            return torch.empty(0, dtype=self.data.dtype, device=self.data.device).set_(
                self.data.untyped_storage(), row * numel, (numel,))


@dataclass(frozen=True)
class _Plan:
    """What one :func:`checkpoint` call does: a snapshot of the settings and the tensor-parallel axis.

    ``state`` is the :class:`CheckpointingState` the call was made under (its buffers and timings).
    """

    settings: CheckpointingSettings
    tp_rank: int
    tp_size: int
    tp_group: Any
    state: CheckpointingState | None = None

    @property
    def transforms(self) -> bool:
        s = self.settings
        return (s.partition_activations and (self.tp_size > 1 or s.contiguous_memory_optimization)) \
            or s.cpu_checkpointing


def _plan_state(plan: _Plan) -> CheckpointingState:
    return plan.state if plan.state is not None else current_state()


@dataclass(frozen=True)
class _SavedInput:
    """How the tensor in ``slot`` of ``ctx.saved_tensors`` becomes the input again."""

    slot: int
    kind: str  # "plain", "offloaded" (to CPU) or "partitioned"
    shape: torch.Size
    device: torch.device
    requires_grad: bool
    numel: int = 0


def _is_activation(t: Any) -> bool:
    """A tensor the memory options apply to (DeepSpeed's test, ``no_checkpointing`` included)."""
    return (torch.is_tensor(t) and t.is_floating_point() and t.numel() > 0
            and not getattr(t, "no_checkpointing", False))


def _partition(t: torch.Tensor, plan: _Plan, index: int) -> torch.Tensor:
    """This rank's slice of ``t`` (flattened, zero-padded), where the settings say to keep it."""
    s = plan.settings
    flat = t.detach().reshape(-1)
    size = -(-flat.numel() // plan.tp_size)
    start = plan.tp_rank * size
    end = min(start + size, flat.numel())
    target = torch.device("cpu") if s.cpu_checkpointing else t.device
    if s.contiguous_memory_optimization:
        key = (index, t.dtype, target, size)
        state = plan.state if plan.state is not None else current_state()
        buf = state.buffers.get(key)
        if buf is None:
            buf = state.buffers[key] = _ContiguousBuffer(s.number_checkpoints, size, t.dtype, target)
        if end - start == size:
            return buf.take(flat[start:end])
        piece = flat.new_zeros(size)
        piece[:max(end - start, 0)] = flat[start:end]
        return buf.take(piece)
    out = torch.zeros(size, dtype=t.dtype, device=target)
    if end > start:
        out[:end - start].copy_(flat[start:end])
    return out


def _save_inputs(ctx: Any, plan: _Plan, args: tuple[Any, ...]) -> None:
    """Save what the recompute needs, with the plan's memory options; ``ctx.layout`` says how to undo."""
    s = plan.settings
    tensors: list[torch.Tensor] = []
    layout: list[Any] = []
    activation = 0
    for arg in args:
        if not torch.is_tensor(arg):
            layout.append(arg)
            continue
        kind, saved = "plain", arg
        if _is_activation(arg) and plan.transforms:
            if s.partition_activations and (plan.tp_size > 1 or s.contiguous_memory_optimization):
                kind, saved = "partitioned", _partition(arg, plan, activation)
            else:
                kind, saved = "offloaded", arg.detach().to("cpu")
            activation += 1
        elif _is_activation(arg):
            activation += 1
        layout.append(_SavedInput(len(tensors), kind, arg.shape, arg.device, arg.requires_grad, arg.numel()))
        tensors.append(saved)
    ctx.save_for_backward(*tensors)
    ctx.layout = layout


def _restore_input(saved: torch.Tensor, entry: _SavedInput, plan: _Plan) -> torch.Tensor:
    if entry.kind == "plain":
        return saved
    if entry.kind == "offloaded":
        return saved.to(entry.device)
    piece = saved.to(entry.device)
    if plan.tp_size > 1:
        flat = torch.empty(piece.numel() * plan.tp_size, dtype=piece.dtype, device=entry.device)
        comm.all_gather_into_tensor(flat, piece.contiguous(), group=plan.tp_group)
    else:
        flat = piece
    return flat[:entry.numel].view(entry.shape)


# -- the checkpoint ----------------------------------------------------------------------------

class CheckpointFunction(torch.autograd.Function):
    """The reentrant autograd function behind :func:`checkpoint` (DeepSpeed's ``CheckpointFunction``).

    ``CheckpointFunction.apply(run_function, plan, *args)``; call :func:`checkpoint` instead.
    """

    @staticmethod
    def forward(ctx: Any, run_function: Callable[..., Any], plan: _Plan, *args: Any) -> Any:
        """Run ``run_function`` without a graph; save its inputs and the RNG states."""
        s = plan.settings
        devices = _devices(args)
        if s.synchronize_checkpoint_boundary:
            _synchronize(devices)
        start = _clock(devices) if s.profile else 0.0
        ctx.run_function, ctx.plan, ctx.devices = run_function, plan, devices
        ctx.context = contextvars.copy_context()  # the recompute runs under the forward's state and grid
        _save_inputs(ctx, plan, args)  # before the run: a function that changes its inputs in place
        ctx.rng = _RNGStates()
        with torch.no_grad():
            outputs = run_function(*args)
        if s.profile:
            _record(_plan_state(plan), "forward", _clock(devices) - start)
        if s.synchronize_checkpoint_boundary:
            _synchronize(devices)
        if torch.is_tensor(outputs):
            ctx.mark_non_differentiable(*([] if outputs.is_floating_point() or outputs.is_complex() else [outputs]))
            return outputs
        if not isinstance(outputs, (tuple, list)):
            raise TypeError(f"checkpoint(): the function returned {type(outputs).__name__}; "
                            "return a tensor or a tuple (of tensors and other values).")
        outputs = tuple(outputs)
        ctx.mark_non_differentiable(*[o for o in outputs if torch.is_tensor(o)
                                      and not (o.is_floating_point() or o.is_complex())])
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        """Rebuild the inputs, recompute under the forward's RNG states, back-propagate."""
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("checkpoint() is not compatible with torch.autograd.grad(); use .backward(), "
                               "or non_reentrant_checkpoint().")
        plan: _Plan = ctx.plan
        s = plan.settings
        if s.contiguous_memory_optimization:
            _plan_state(plan).buffers = {}  # the next forward pass takes fresh buffers (DeepSpeed)
        saved = ctx.saved_tensors
        devices = ctx.devices
        if s.synchronize_checkpoint_boundary:
            _synchronize(devices)
        start = _clock(devices) if s.profile else 0.0
        inputs: list[Any] = []
        for entry in ctx.layout:
            if isinstance(entry, _SavedInput):
                t = _restore_input(saved[entry.slot], entry, plan).detach()
                inputs.append(t.requires_grad_(entry.requires_grad))
            else:
                inputs.append(entry)
        with ctx.rng.swapped_in(), torch.enable_grad():
            outputs = ctx.context.run(ctx.run_function, *inputs)
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=False) if torch.is_tensor(o) and o.requires_grad]
        if not pairs:
            raise RuntimeError("checkpoint(): no output of the recomputed function requires grad; the "
                               "checkpoint is not needed there (or the function ignores its inputs).")
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if s.profile:
            _record(_plan_state(plan), "backward", _clock(devices) - start)
        if s.synchronize_checkpoint_boundary:
            _synchronize(devices)
        return (None, None, *[x.grad if torch.is_tensor(x) and x.requires_grad else None for x in inputs])


def _bind_kwargs(function: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """Keyword arguments as trailing positionals, so their tensors take part in autograd (DeepSpeed)."""
    if not kwargs:
        return function, args
    n, keys = len(args), tuple(kwargs)

    def with_kwargs(*all_args: Any) -> Any:
        return function(*all_args[:n], **dict(zip(keys, all_args[n:], strict=True)))

    return with_kwargs, args + tuple(kwargs.values())


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, with its activations recomputed in backward instead of stored.

    Non-tensor arguments are passed through; tensors that do not require grad get no gradient.
    ``function`` returns a tensor or a tuple (non-tensor items and integer tensors get no
    gradient). The forward's CPU, CUDA and tensor-parallel tracker RNG states are restored for
    the recompute, so dropout draws the same masks. Reentrant, like DeepSpeed's and
    ``torch.utils.checkpoint(use_reentrant=True)``: parameters used inside ``function`` get
    gradients only when some tensor input requires grad, and ``torch.autograd.grad`` is refused.
    With gradients disabled it simply calls ``function``. As DeepSpeed's, a one-item tuple comes
    back as its item.
    """
    function, args = _bind_kwargs(function, args, kwargs)
    if not torch.is_grad_enabled():
        return function(*args)
    if not any(torch.is_tensor(a) and a.requires_grad for a in args):
        warnings.warn("checkpoint(): no tensor input requires grad, so the parameters inside the function "
                      "will get no gradient; make an input require grad or use non_reentrant_checkpoint().",
                      stacklevel=2)
    state = current_state()
    plan = _Plan(state.settings, *_tensor_parallel(state), state=state)
    outputs = CheckpointFunction.apply(function, plan, *args)
    return outputs[0] if isinstance(outputs, tuple) and len(outputs) == 1 else outputs


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` that also restores the tracker's states.

    Works with ``torch.autograd.grad`` and with inputs that do not require grad. It restores the
    RNG states (CPU, CUDA and the tensor-parallel tracker's) for the recompute, but saves inputs as
    torch does: ``partition_activations``, ``cpu_checkpointing``, ``contiguous_memory_optimization``,
    ``synchronize_checkpoint_boundary`` and ``profile`` apply to :func:`checkpoint` only (a warning
    says so once when one of them is on).
    """
    state = current_state()
    s = state.settings
    active = s.memory_options() + [k for k in ("synchronize_checkpoint_boundary", "profile") if getattr(s, k)]
    if active and not state.warned_non_reentrant:
        state.warned_non_reentrant = True
        warnings.warn(f"non_reentrant_checkpoint() does not apply {SECTION}.{', '.join(active)}; "
                      "use checkpoint() for them.", stacklevel=2)
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    tracker = get_rng_tracker()
    forward_states = tracker.get_states()
    context = contextvars.copy_context()  # the recompute runs under the forward's state and grid
    runs = 0

    def run(*a: Any, **k: Any) -> Any:
        nonlocal runs
        runs += 1
        if runs == 1:
            return function(*a, **k)
        outer = tracker.get_states()
        tracker.set_states(forward_states)
        try:
            return context.run(function, *a, **k)
        finally:
            tracker.set_states(outer)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
