"""How plugins cooperate without knowing each other: roles and typed capabilities.

* A :class:`Role` is work with a built-in default that must stand down entirely when a plugin takes
  it over (``engine.claim(Role.GRADIENT_REDUCTION, "zero")``). Roles are a closed set: claiming a
  name that is not a role is a :class:`~microspeed.errors.PluginError`.
* A :class:`Capability` is a typed fact one plugin states about what it does, for others to ask —
  "gradients and optimizer state are partitioned over the data-parallel group, at stage 2", "the
  loss is scaled by this scaler". A plugin states its capabilities by answering the collected hook
  ``microspeed_capabilities(config)`` (right after ``configure``, so that ``microspeed_conflicts``
  and every later hook can ask), or later with ``engine.capabilities.provide(...)``. Others ask
  ``engine.capabilities.get(GradientPartitioning)`` — never another plugin's config section or name.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from microspeed.errors import PluginError


class Role(enum.StrEnum):
    """Work a plugin can take over from the built-in default (see :meth:`microspeed.Engine.claim`)."""

    GRADIENT_REDUCTION = "gradient_reduction"
    """Averaging gradients across the data-parallel group (default: the built-in ``data_parallel``)."""

    OPTIMIZER_STEP = "optimizer_step"
    """Master weights, overflow checks and stepping the optimizer (default: ``mixed_precision`` for
    fp16/bf16, else ``optimizers``)."""

    @classmethod
    def parse(cls, role: Role | str) -> Role:
        """``role`` as a :class:`Role`; a name that is not a role raises :class:`PluginError` listing them."""
        try:
            return cls(role)
        except ValueError:
            raise PluginError(f"{role!r} is not a role; the roles are "
                              f"{', '.join(r.value for r in cls)} (microspeed.plugin_api.Role).") from None


class Capability:
    """Base class of the typed facts plugins state about themselves (frozen dataclasses)."""


@dataclass(frozen=True)
class GradientPartitioning(Capability):
    """Gradients and optimizer state (and from stage 3 the parameters) are partitioned over data-parallel ranks.

    ``stage``: 1 optimizer state, 2 also gradients (reduce-scattered during backward), 3 also parameters.
    ``keeps_replica_groups``: parameters carrying a :class:`~microspeed.plugin_api.ReplicaGroup` are
    partitioned and reduced over their own group (so MoE experts stay apart). ``config_key``: the key
    that turns it on, and ``disable_hint``: how a user turns it off — for refusals that name them.
    ``sums_marked_gradients``: parameters carrying a :class:`~microspeed.plugin_api.GradientSum` (tied
    weights on several pipeline stages) have their reduced gradients summed over the marked group by
    this owner, so the plugin that marked them does not sum ``p.grad`` itself. ``honours_norm_rules``:
    its partitions are counted in the global norm with each parameter's
    :class:`~microspeed.plugin_api.NormRule` (copies another rank counts are skipped).
    """

    stage: int
    keeps_replica_groups: bool
    config_key: str
    disable_hint: str
    sums_marked_gradients: bool = False
    honours_norm_rules: bool = False


@dataclass(frozen=True)
class LossScaling(Capability):
    """Mixed precision: the model's ``dtype``, the fp16 loss ``scaler`` (``None`` for bf16/fp32) and whether
    gradients accumulate in fp32 buffers (``accumulate_fp32``). A plugin that steps the optimizer itself
    unscales with ``scaler.loss_scale`` and reports overflow with ``scaler.update_scale(overflow)``.

    ``accumulated_grad(param)``: where a model parameter's accumulated gradient lives at the accumulation
    boundary — the fp32 buffer it was summed into (reduce that tensor in place; it is what the optimizer
    steps), or ``None`` when it is the parameter's own ``.grad``. A plugin that reduces some parameters
    itself (MoE experts over their own groups) reduces that tensor. ``None`` when not provided: always ``.grad``.
    """

    dtype: Any
    scaler: Any
    accumulate_fp32: bool
    accumulated_grad: Callable[[Any], Any] | None = None


@dataclass(frozen=True)
class GradientCompression(Capability):
    """Error-feedback 1-bit compression of the gradient exchange, offered for the optimizers a plugin recognises.

    A plugin that reduces gradients over partitions and steps the optimizer itself (ZeRO) asks
    ``accepts(optimizer)`` about the client's optimizer; if true it builds the optimizer that steps its
    partitions and hands it over once with ``attach(partition_optimizer)`` (which raises
    :class:`~microspeed.plugin_api.ConfigError` when that optimizer cannot run on partitions). From then
    on the partition optimizer takes gradients already averaged over the group and communicates nothing
    itself; the callable ``attach`` returns says, before each reduction of the next step's gradients,
    whether they may be averaged compressed (else exactly). The codec: ``compress(x, error, block)``
    returns ``(bits, scales)`` (signs packed 8 to a byte, one fp32 scale per ``block`` values) and
    replaces ``error`` in place by what the code dropped; ``decompress(bits, scales, block, out=...,
    accumulate=...)`` decodes; ``block_size`` is the preferred block (a power of two, 64 to 8192).
    ``error(key, numel, device)`` is the sender-error buffer (fp32, zeros at first) of the exchange
    ``key``: the provider keeps it (and checkpoints it per rank), the partitioner asks for it at every
    compressed exchange.
    """

    accepts: Callable[[Any], bool]
    attach: Callable[[Any], Callable[[], bool]]
    compress: Callable[..., tuple[Any, Any]]
    decompress: Callable[..., Any]
    block_size: int
    error: Callable[[Any, int, Any], Any]


@runtime_checkable
class ElementwiseState(Protocol):
    """An optimizer whose state is element-wise over its parameters, so a partitioner may stream it (NVMe offload).

    The contract, for a partitioner that keeps the state out of memory and steps it a piece at a time:

    * :meth:`elementwise_state` names every state tensor shaped like its parameter (``state[p][name]``) and the
      value it starts at; every other entry of ``state[p]`` is a scalar, the same for all pieces of a parameter.
    * ``step()`` updates exactly the parameters holding a ``grad`` (skipping the others), element by element,
      reading and writing only their ``state[p]``: the caller may pass any pieces of a parameter slice as the
      parameters (views of its buffers, the named state tensors views of its buffers too), and step a
      partition in several calls per training step, each seeing the scalars as they were before the step.
    * :meth:`forget` drops whatever the optimizer keeps for ``params`` outside ``state`` (caches), so that
      pieces the caller hands over once hold no memory after their call.
    """

    def elementwise_state(self) -> dict[str, float]:
        """``{name: initial value}`` of the per-element state tensors of every parameter."""
        ...

    def forget(self, params: list[Any]) -> None:
        """Drop anything kept for ``params`` outside the optimizer's ``state`` (they will not be stepped again)."""
        ...


@runtime_checkable
class ParameterSums(Protocol):
    """An :class:`ElementwiseState` optimizer whose update also needs sums over whole parameters (LAMB's norms).

    A partitioner that steps pieces in several calls first streams every piece once, calling
    :meth:`parameter_sums` (which changes nothing) with the same parameters, gradients and state the step will
    see; then every rank of the group calls :meth:`reduce_parameter_sums` once (a collective); then it
    hands the result to :meth:`use_parameter_sums`, steps the pieces, and calls ``use_parameter_sums(None)``.
    """

    def needs_parameter_sums(self) -> bool:
        """Whether the next ``step()`` needs whole-parameter sums (else the first pass is skipped)."""
        ...

    def parameter_sums(self, totals: Any) -> Any:
        """``totals`` (``None`` at first) plus this call's parameters' partial sums; nothing is modified."""
        ...

    def reduce_parameter_sums(self, totals: Any) -> Any:
        """This rank's ``totals`` combined over the optimizer's group (every rank calls it once per step)."""
        ...

    def use_parameter_sums(self, sums: Any) -> None:
        """The next ``step()`` calls take ``sums`` (from :meth:`reduce_parameter_sums`); ``None``: their own."""
        ...


C = TypeVar("C", bound=Capability)


class Capabilities:
    """The capabilities stated for one engine: at most one provider per capability type."""

    def __init__(self) -> None:
        self._by_type: dict[type, tuple[Capability, str]] = {}

    def provide(self, capability: Capability, plugin: str) -> None:
        """Record that ``plugin`` provides ``capability``; a second provider of its type is refused."""
        if not isinstance(capability, Capability):
            raise PluginError(f"plugin {plugin!r} states {capability!r}, which is not a "
                              f"microspeed.plugin_api.Capability.")
        held = self._by_type.get(type(capability))
        if held is not None and held[1] != plugin:
            raise PluginError(f"plugins {held[1]!r} and {plugin!r} both provide {type(capability).__name__}; "
                              f"disable one of them (\"plugins\": {{\"disable\": [...]}}) or turn off its config "
                              f"section.")
        self._by_type[type(capability)] = (capability, plugin)

    def get(self, kind: type[C]) -> C | None:
        """The capability of type ``kind`` some plugin stated, or ``None``."""
        held = self._by_type.get(kind)
        return held[0] if held is not None else None  # type: ignore[return-value]

    def provider(self, kind: type[Capability]) -> str | None:
        """The name of the plugin that stated ``kind``, or ``None``."""
        held = self._by_type.get(kind)
        return held[1] if held is not None else None

    def __repr__(self) -> str:
        return f"Capabilities({', '.join(f'{t.__name__}<-{p}' for t, (_, p) in self._by_type.items())})"
