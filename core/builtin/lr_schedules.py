"""DeepSpeed's learning-rate schedules and the ``scheduler`` section factory.

The five schedules keep DeepSpeed's class names, constructor parameters, defaults and formulas, so a
ds_config ``scheduler`` section written for DeepSpeed gives the same learning rates here:

* :class:`WarmupLR` -- log or linear warmup from ``warmup_min_lr`` to ``warmup_max_lr``, then flat.
* :class:`WarmupDecayLR` -- the same warmup, then linear decay to 0 at ``total_num_steps``.
* :class:`WarmupCosineLR` -- warmup of a ratio of the optimizer's lr, then cosine decay to ``cos_min_ratio``.
* :class:`OneCycle` -- one triangular cycle of lr (and, inversely, momentum), then optional decay.
* :class:`LRRangeTest` -- lr grows linearly (or in stairs) from ``lr_range_test_min_lr``.

Conventions shared with DeepSpeed (they matter when comparing curves step by step):

* ``last_batch_iteration`` is the index of the last batch trained; ``-1`` means "not started". Constructing
  with ``-1`` writes the schedule's starting lr into the optimizer (for :class:`WarmupCosineLR` that
  starting lr is 0); constructing with any other value leaves the optimizer untouched.
* ``step()`` first advances ``last_batch_iteration`` by one (or sets it to the given value), then writes
  ``get_lr()`` into the optimizer. The first ``step()`` after construction therefore computes batch 0.
* ``state_dict()`` holds only ``last_batch_iteration``; ``load_state_dict()`` restores it and does not touch
  the optimizer (the optimizer's own state dict carries its current lr).

:func:`build_scheduler` turns a ``scheduler`` section into a scheduler, accepting the five names above and
any class of :mod:`torch.optim.lr_scheduler`, and raises :class:`~microspeed.errors.ConfigError` naming the
key path, the value and the fix.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim import lr_scheduler as _torch_lr_scheduler

from microspeed.errors import ConfigError

__all__ = [
    "SCHEDULER_NAMES",
    "VALID_LR_SCHEDULES",
    "WARMUP_TYPES",
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_scheduler",
]

_log = logging.getLogger(__name__)

SCHEDULER_NAMES: tuple[str, ...] = ("LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
"""The DeepSpeed schedule names accepted as ``scheduler.type`` (torch's class names are accepted too)."""

WARMUP_TYPES: tuple[str, ...] = ("log", "linear")
"""Accepted values of ``warmup_type``."""

# DeepSpeed's names for the schedules and their ``scheduler.params`` keys (``deepspeed.runtime.lr_schedules``)
LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
"""The schedule names DeepSpeed implements itself, in DeepSpeed's order (clients check a config's type here)."""
LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"
EDGE_VALUE = "edge_value"
MID_VALUE = "mid_value"
CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"
CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"
WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"
TOTAL_NUM_STEPS = "total_num_steps"

Number = int | float
LrSpec = Number | Sequence[Number]


# ----------------------------------------------------------------------------------------------------------
# Parameter validation, shared by the constructors (key = parameter name) and the factory
# (key = ``scheduler.params.<name>``).


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number_at_least(lo: float, hi: float | None = None) -> Callable[[Any], bool]:
    return lambda v: _is_number(v) and v >= lo and (hi is None or v <= hi)


def _int_at_least(lo: int) -> Callable[[Any], bool]:
    return lambda v: _is_int(v) and v >= lo


def _per_group(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """Accept a scalar passing ``check`` or a non-empty list/tuple of them (one per param group)."""

    def accept(value: Any) -> bool:
        if isinstance(value, list | tuple):
            return len(value) > 0 and all(check(v) for v in value)
        return check(value)

    return accept


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


_NON_NEG = _number_at_least(0.0)
_MOMENTUM = _number_at_least(0.0, 1.0)

# parameter name -> (predicate, what is accepted)
_VALUE_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "warmup_min_lr": (_per_group(_NON_NEG), "a number >= 0, or a list of them with one per param group"),
    "warmup_max_lr": (_per_group(_NON_NEG), "a number >= 0, or a list of them with one per param group"),
    "warmup_num_steps": (_int_at_least(1), "an integer >= 1"),
    "total_num_steps": (_int_at_least(1), "an integer >= 1 (the total number of training steps)"),
    "warmup_min_ratio": (_number_at_least(0.0, 1.0), "a number in [0, 1]"),
    "cos_min_ratio": (_number_at_least(0.0, 1.0), "a number in [0, 1]"),
    "cycle_min_lr": (_per_group(_NON_NEG), "a number >= 0, or a list of them with one per param group"),
    "cycle_max_lr": (_per_group(_NON_NEG), "a number >= 0, or a list of them with one per param group"),
    "decay_lr_rate": (_NON_NEG, "a number >= 0 (0 disables lr decay)"),
    "cycle_first_step_size": (lambda v: _is_number(v) and v > 0, "a number > 0"),
    "cycle_second_step_size": (_optional(_NON_NEG), "null (same as cycle_first_step_size) or a number >= 0"),
    "cycle_first_stair_count": (_int_at_least(0), "an integer >= 0 (0 disables stairs)"),
    "cycle_second_stair_count": (
        _optional(_int_at_least(0)),
        "null (same as cycle_first_stair_count) or an integer >= 0",
    ),
    "decay_step_size": (_NON_NEG, "a number >= 0 (0 disables post-cycle decay)"),
    "cycle_momentum": (lambda v: isinstance(v, bool), "true or false"),
    "cycle_min_mom": (
        _per_group(_MOMENTUM),
        "a number in [0, 1], or a list of them with one per param group",
    ),
    "cycle_max_mom": (
        _per_group(_MOMENTUM),
        "a number in [0, 1], or a list of them with one per param group",
    ),
    "decay_mom_rate": (_NON_NEG, "a number >= 0 (0 disables momentum decay)"),
    "lr_range_test_min_lr": (
        _per_group(_NON_NEG),
        "a number >= 0, or a list of them with one per param group",
    ),
    "lr_range_test_step_size": (_int_at_least(1), "an integer >= 1"),
    "lr_range_test_step_rate": (_NON_NEG, "a number >= 0"),
    "lr_range_test_staircase": (lambda v: isinstance(v, bool), "true or false"),
    "last_batch_iteration": (
        _int_at_least(-1),
        "an integer >= -1 (-1 starts the schedule from the beginning)",
    ),
}


def _check_values(params: dict[str, Any], num_groups: int | None, prefix: str) -> None:
    """Raise ConfigError for the first parameter whose value is not accepted.

    ``prefix`` is prepended to the parameter name to form the key path in the message.
    """
    for key, value in params.items():
        rule = _VALUE_RULES.get(key)
        if rule is None:
            continue
        accepts, accepted = rule
        if not accepts(value):
            raise ConfigError(
                f"{prefix}{key}: got {value!r}; expected {accepted}. Set {prefix}{key} to {accepted}."
            )
        if num_groups is not None and isinstance(value, list | tuple) and len(value) != num_groups:
            raise ConfigError(
                f"{prefix}{key}: got a list of {len(value)} values but the optimizer has {num_groups} param "
                f"group(s); give one value per param group, or a single number for all of them."
            )


def _unwrap_optimizer(optimizer: Any) -> Optimizer:
    """Return the torch optimizer itself, or the one a wrapper keeps in ``.optimizer`` (as DeepSpeed does)."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, Optimizer):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer and wraps none in .optimizer")


def _per_group_list(value: LrSpec, num_groups: int) -> list[float]:
    if isinstance(value, list | tuple):
        return list(value)
    return [value] * num_groups


def _write_lrs(optimizer: Optimizer, lrs: Sequence[float]) -> list[float]:
    """Store ``lrs`` into the param groups (in place for tensor lrs); return the groups' lrs."""
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in optimizer.param_groups]


class _Schedule:
    """Shared machinery of the DeepSpeed-style schedules: stepping, last lr, state dict."""

    optimizer: Optimizer
    last_batch_iteration: int

    def _setup(self, optimizer: Any, params: dict[str, Any]) -> None:
        self.optimizer = _unwrap_optimizer(optimizer)
        _check_values(params, len(self.optimizer.param_groups), prefix="")
        self.last_batch_iteration = params["last_batch_iteration"]
        self._last_lr: list[float] | None = None

    def get_lr(self) -> list[float]:  # pragma: no cover - overridden
        """The lr of every param group for batch ``last_batch_iteration``."""
        raise NotImplementedError

    def _after_step(self) -> None:
        """Hook for schedules that also move something other than the lr (OneCycle's momentum)."""

    def step(self, last_batch_iteration: int | None = None, *, batch_iteration: int | None = None) -> None:
        """Advance to batch ``last_batch_iteration`` (default: the next) and write its lr to the optimizer.

        ``batch_iteration`` is accepted as an alias because DeepSpeed's ``OneCycle``/``LRRangeTest`` name the
        argument that way.
        """
        if batch_iteration is not None:
            if last_batch_iteration is not None:
                raise TypeError("step() got both last_batch_iteration and batch_iteration; pass one")
            last_batch_iteration = batch_iteration
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _write_lrs(self.optimizer, self.get_lr())
        self._after_step()

    def get_last_lr(self) -> list[float]:
        """The lrs last written into the optimizer by this scheduler.

        Raises RuntimeError if none were written yet (constructed with ``last_batch_iteration != -1``, or a
        :class:`OneCycle`, and ``step()`` not called).
        """
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__}.get_last_lr(): no lr computed yet; call step() first")
        return self._last_lr

    def state_dict(self) -> dict[str, int]:
        """The scheduler's state: only ``last_batch_iteration``, as in DeepSpeed."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore ``last_batch_iteration``; the optimizer's lr changes at the next ``step()``."""
        self.last_batch_iteration = sd["last_batch_iteration"]


def _warmup_type(owner: str, warmup_type: Any) -> str:
    """``warmup_type`` itself when known; else, as DeepSpeed does, ``'log'`` with a warning naming the value."""
    if warmup_type in WARMUP_TYPES:
        return warmup_type
    _log.warning("%s: unknown warmup_type %r; using 'log' as DeepSpeed does (the accepted values are %s).",
                 owner, warmup_type, ", ".join(repr(t) for t in WARMUP_TYPES))
    return "log"


def _warmup_fraction(warmup_type: str, last_batch_iteration: int, warmup_num_steps: int) -> float:
    """Fraction of the warmup done at batch ``last_batch_iteration`` (< warmup_num_steps)."""
    if warmup_type == "log":
        return math.log(last_batch_iteration + 1) / math.log(warmup_num_steps)
    return last_batch_iteration / warmup_num_steps


class WarmupLR(_Schedule):
    """Warm the lr of each param group up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold it.

    At batch ``t`` (``last_batch_iteration``) with ``W = max(2, warmup_num_steps)``::

        log:    lr = min + (max - min) * log(t + 1) / log(W)     for t < W
        linear: lr = min + (max - min) * t / W                   for t < W
                lr = max                                          for t >= W

    Before the first ``step()`` (``t == -1``) the lr is ``warmup_min_lr``.

    Args:
        optimizer: a torch optimizer, or a wrapper holding one in ``.optimizer``.
        warmup_min_lr: starting lr, a number or one per param group. Default 0.
        warmup_max_lr: lr reached at the end of warmup, a number or one per param group. Default: the
                optimizer's lr of each group (as DeepSpeed 0.19.8).
        warmup_num_steps: warmup length in batches (values below 2 act as 2). Default 1000.
        warmup_type: ``'log'`` or ``'linear'``. Default ``'log'``; another value warns, uses ``'log'`` (as DeepSpeed).
        last_batch_iteration: index of the last trained batch; -1 starts from the beginning.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: LrSpec = 0.0,
        warmup_max_lr: LrSpec | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        if warmup_max_lr is None:  # DeepSpeed 0.19.8: default to the optimizer's own lr
            warmup_max_lr = [float(g["lr"]) for g in _unwrap_optimizer(optimizer).param_groups]
        self._setup(
            optimizer,
            {
                "warmup_min_lr": warmup_min_lr,
                "warmup_max_lr": warmup_max_lr,
                "warmup_num_steps": warmup_num_steps,
                "warmup_type": warmup_type,
                "last_batch_iteration": last_batch_iteration,
            },
        )
        groups = len(self.optimizer.param_groups)
        self.min_lrs = _per_group_list(warmup_min_lr, groups)
        self.max_lrs = _per_group_list(warmup_max_lr, groups)
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs, strict=True)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _warmup_type(type(self).__name__, warmup_type)
        if last_batch_iteration == -1:
            self._last_lr = _write_lrs(self.optimizer, self.get_lr())

    def _gamma(self) -> float:
        """Scale of ``max - min`` at the current batch."""
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(self.warmup_type, self.last_batch_iteration, self.warmup_num_steps)
        return 1.0

    def get_lr(self) -> list[float]:
        """The lr of every param group for batch ``last_batch_iteration`` (``warmup_min_lr`` before 0)."""
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`'s warmup, then linear decay from ``warmup_max_lr`` to 0 at ``total_num_steps``.

    For ``t >= W`` (``W = max(2, warmup_num_steps)``, ``T = total_num_steps``)::

        lr = min + (max - min) * max(0, (T - t) / max(1, T - W))

    so the lr equals ``warmup_max_lr`` at ``t == W`` and ``warmup_min_lr`` (0 by default) from ``t == T`` on.

    Args:
        optimizer: a torch optimizer, or a wrapper holding one in ``.optimizer``.
        total_num_steps: total number of training batches (required).
        warmup_min_lr: starting and final lr, a number or one per param group. Default 0.
        warmup_max_lr: peak lr, a number or one per param group. Default 0.001.
        warmup_num_steps: warmup length in batches. Default 1000.
        warmup_type: ``'log'`` or ``'linear'``. Default ``'log'``; another value warns, uses ``'log'`` (as DeepSpeed).
        last_batch_iteration: index of the last trained batch; -1 starts from the beginning.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: LrSpec = 0.0,
        warmup_max_lr: LrSpec = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        _check_values({"total_num_steps": total_num_steps}, None, prefix="")
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration
        )
        if total_num_steps < self.warmup_num_steps:
            _log.warning(
                "WarmupDecayLR: total_num_steps %d < warmup_num_steps %d", total_num_steps, warmup_num_steps
            )

    def _gamma(self) -> float:
        """Scale of ``max - min``: warmup, then linear decay reaching 0 at ``total_num_steps``."""
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(self.warmup_type, self.last_batch_iteration, self.warmup_num_steps)
        remaining = float(self.total_num_steps - self.last_batch_iteration)
        return max(0.0, remaining / float(max(1, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_Schedule):
    """Scale each param group's lr (read from the optimizer at construction) by a warmup-then-cosine ratio.

    With ``W = max(2, warmup_num_steps)``, ``T = total_num_steps`` and ``r0 = warmup_min_ratio``::

        t < W:   ratio = r0 + (1 - r0) * f(t)        f = log(t + 1) / log(W)  or  t / W
        t >= W:  p = min(1, (t - W + 1) / max(1, T - W))
                 ratio = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2)

    ``lr = base_lr * ratio``. Note that before the first ``step()`` the lr is 0 (DeepSpeed does the same),
    and that the base lrs are whatever the optimizer holds when the scheduler is built.

    Args:
        optimizer: a torch optimizer, or a wrapper holding one in ``.optimizer``.
        total_num_steps: total number of training batches (required).
        warmup_min_ratio: ratio at batch 0. Default 0.
        warmup_num_steps: warmup length in batches. Default 1000.
        cos_min_ratio: ratio reached at ``total_num_steps`` and kept afterwards. Default 0.0001.
        warmup_type: ``'log'`` or ``'linear'``. Default ``'log'``; another value warns, uses ``'log'`` (as DeepSpeed).
        last_batch_iteration: index of the last trained batch; -1 starts from the beginning.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self._setup(
            optimizer,
            {
                "total_num_steps": total_num_steps,
                "warmup_min_ratio": warmup_min_ratio,
                "warmup_num_steps": warmup_num_steps,
                "cos_min_ratio": cos_min_ratio,
                "warmup_type": warmup_type,
                "last_batch_iteration": last_batch_iteration,
            },
        )
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _warmup_type(type(self).__name__, warmup_type)
        if total_num_steps < self.warmup_num_steps:
            _log.warning(
                "WarmupCosineLR: total_num_steps %d < warmup_num_steps %d", total_num_steps, warmup_num_steps
            )
        self.org_lrs = [
            g["lr"].clone() if torch.is_tensor(g["lr"]) else g["lr"] for g in self.optimizer.param_groups
        ]
        if last_batch_iteration == -1:
            self._last_lr = _write_lrs(self.optimizer, self.get_lr())

    def get_lr_ratio(self) -> float:
        """The ratio of the base lr at batch ``last_batch_iteration`` (0 before batch 0)."""
        t = self.last_batch_iteration
        if t < 0:
            return 0.0
        if t < self.warmup_num_steps:
            frac = _warmup_fraction(self.warmup_type, t, self.warmup_num_steps)
            return self.warmup_min_ratio + frac * (1.0 - self.warmup_min_ratio)
        progress = min(
            1.0, (t - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps)
        )
        half_cos = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * half_cos)

    def get_lr(self) -> list[float]:
        """The lr of every param group for batch ``last_batch_iteration``: base lr * :meth:`get_lr_ratio`."""
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [base * ratio for base in self.org_lrs]


class OneCycle(_Schedule):
    """DeepSpeed's 1Cycle policy: one triangular lr cycle (momentum moves inversely), then optional decay.

    With ``b = t + 1`` (``t = last_batch_iteration``), ``S1 = cycle_first_step_size``,
    ``S2 = cycle_second_step_size`` (default ``S1``) and ``C = S1 + S2``, the cycle's scale ``s`` at batch
    ``t < C`` rises linearly from 0 (``b = 0``) to 1 (``b = S1``) and falls back to 0 (``b = C``)::

        lr  = cycle_min_lr  + (cycle_max_lr  - cycle_min_lr)  * s
        mom = cycle_max_mom - (cycle_max_mom - cycle_min_mom) * s

    With stair counts ``n > 0`` the scale is quantised to ``floor(s * n) / n`` (computed from the integer
    batch offset so the peak is exact). From ``t >= C`` on, with ``d = t - C + 1``::

        lr  = cycle_min_lr  / (1 + decay_lr_rate  * d / decay_step_size)
        mom = cycle_max_mom * (1 + decay_mom_rate * d / decay_step_size)

    (``decay_step_size == 0`` or a zero rate keeps ``cycle_min_lr`` / ``cycle_max_mom``.)

    Momentum is ``betas[0]`` for optimizers with ``betas`` (Adam, AdamW, ...) -- ``betas[1]`` is kept as the
    optimizer has it -- and ``momentum`` for optimizers with ``momentum`` (SGD, RMSprop); for other
    optimizers momentum cycling is switched off with a warning. As in DeepSpeed, constructing with
    ``last_batch_iteration == -1`` sets the lr to ``cycle_min_lr`` and the momentum to ``cycle_min_mom``.

    Args:
        optimizer: a torch optimizer, or a wrapper holding one in ``.optimizer``.
        cycle_min_lr: lower lr of the cycle, a number or one per param group.
        cycle_max_lr: upper lr of the cycle, a number or one per param group.
        decay_lr_rate: post-cycle lr decay rate. Default 0.
        cycle_first_step_size: batches in the rising half. Default 2000.
        cycle_second_step_size: batches in the falling half; None means ``cycle_first_step_size``.
        cycle_first_stair_count: stairs in the rising half; 0 means continuous. Default 0.
        cycle_second_stair_count: stairs in the falling half; None means ``cycle_first_stair_count``.
        decay_step_size: batches per unit of post-cycle decay; 0 disables decay. Default 0.
        cycle_momentum: cycle momentum inversely to lr. Default True.
        cycle_min_mom: lower momentum, a number or one per param group. Default 0.8.
        cycle_max_mom: upper momentum, a number or one per param group. Default 0.9.
        decay_mom_rate: post-cycle momentum decay rate. Default 0.
        last_batch_iteration: index of the last trained batch; -1 starts from the beginning.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        cycle_min_lr: LrSpec,
        cycle_max_lr: LrSpec,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: LrSpec = 0.8,
        cycle_max_mom: LrSpec = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        self._setup(
            optimizer,
            {
                "cycle_min_lr": cycle_min_lr,
                "cycle_max_lr": cycle_max_lr,
                "decay_lr_rate": decay_lr_rate,
                "cycle_first_step_size": cycle_first_step_size,
                "cycle_second_step_size": cycle_second_step_size,
                "cycle_first_stair_count": cycle_first_stair_count,
                "cycle_second_stair_count": cycle_second_stair_count,
                "decay_step_size": decay_step_size,
                "cycle_momentum": cycle_momentum,
                "cycle_min_mom": cycle_min_mom,
                "cycle_max_mom": cycle_max_mom,
                "decay_mom_rate": decay_mom_rate,
                "last_batch_iteration": last_batch_iteration,
            },
        )
        groups = len(self.optimizer.param_groups)
        # Cycle shape.
        self.first_step_size = float(cycle_first_step_size)
        self.second_step_size = (
            self.first_step_size if cycle_second_step_size is None else float(cycle_second_step_size)
        )
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        # Learning rate.
        self.min_lrs = _per_group_list(cycle_min_lr, groups)
        self.max_lrs = _per_group_list(cycle_max_lr, groups)
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = decay_step_size == 0 or decay_lr_rate == 0
        # Momentum.
        self.decay_mom_rate = decay_mom_rate
        self.skip_mom_decay = decay_step_size == 0 or decay_mom_rate == 0
        self.min_moms = _per_group_list(cycle_min_mom, groups)
        self.max_moms = _per_group_list(cycle_max_mom, groups)
        self._momentum_key = self._find_momentum_key() if cycle_momentum else None
        self.cycle_momentum = self._momentum_key is not None
        # Adam-style betas: get_mom() returns (beta1, beta2) per group, as DeepSpeed's; beta2 is the group's own
        # (DeepSpeed writes a fixed 0.99 there, overriding the optimizer's beta2; the cycles are the same)
        self._beta2 = [tuple(g["betas"])[1] if "betas" in g else 0.99 for g in self.optimizer.param_groups]

        if last_batch_iteration == -1:
            _write_lrs(self.optimizer, self.min_lrs)
            if self.cycle_momentum:
                self._write_momentum(self.min_moms)

    def _find_momentum_key(self) -> str | None:
        defaults = self.optimizer.defaults
        if "betas" in defaults:
            return "betas"
        if "momentum" in defaults:
            return "momentum"
        _log.warning(
            "OneCycle: cycle_momentum disabled, %s has neither betas nor momentum",
            type(self.optimizer).__name__,
        )
        return None

    def _write_momentum(self, moms: Sequence[float]) -> None:
        for group, mom in zip(self.optimizer.param_groups, moms, strict=True):
            if self._momentum_key == "betas":
                group["betas"] = (mom, *tuple(group["betas"])[1:])
            else:
                group["momentum"] = mom

    def _scale(self) -> float:
        """Position within the cycle, 0 at the edges and 1 at the peak (quantised when stairs are on)."""
        b = self.last_batch_iteration + 1
        x = b / self.total_size - math.floor(b / self.total_size)
        if x <= self.step_ratio:
            scale = x / self.step_ratio
            stairs = self.first_stair_count
        else:
            scale = (1.0 - x) / (1.0 - self.step_ratio)
            stairs = self.second_stair_count
        if stairs > 0:
            # Quantise from the integer batch offset: the float scale can land a hair under a stair edge.
            offset = b % self.total_size
            if offset <= self.first_step_size:
                position = offset * stairs / self.first_step_size
            else:
                position = (self.total_size - offset) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def _decay_units(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        """The lr of every param group for batch ``last_batch_iteration``."""
        if self.last_batch_iteration < self.total_size:
            s = self._scale()
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1.0 + self.decay_lr_rate * self._decay_units()
        return [lo / factor for lo in self.min_lrs]

    def _momentum(self) -> list[float] | None:
        """The first-moment coefficient (beta1, or SGD's momentum) of every group at ``last_batch_iteration``."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            s = self._scale()
            return [hi - (hi - lo) * s for lo, hi in zip(self.min_moms, self.max_moms, strict=True)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1.0 + self.decay_mom_rate * self._decay_units()
        return [hi * factor for hi in self.max_moms]

    def get_mom(self) -> list[tuple[float, float]] | list[float] | None:
        """The momentum of every param group for batch ``last_batch_iteration``; ``None`` if not cycling.

        As DeepSpeed's: ``(beta1, beta2)`` per group for optimizers with ``betas`` (Adam and friends), beta1
        cycling and beta2 the group's own. For an optimizer with a scalar ``momentum`` (SGD, which DeepSpeed
        does not cycle) the floats.
        """
        moms = self._momentum()
        if moms is None or self._momentum_key != "betas":
            return moms
        return [(m, b2) for m, b2 in zip(moms, self._beta2, strict=True)]

    def _after_step(self) -> None:
        moms = self._momentum()
        if moms is not None:
            self._write_momentum(moms)


class LRRangeTest(_Schedule):
    """LR range test: grow the lr from ``lr_range_test_min_lr`` to find the largest lr that still trains.

    With ``b = last_batch_iteration + 1`` and ``k = b / lr_range_test_step_size`` (``floor`` of it when
    ``lr_range_test_staircase``)::

        lr = lr_range_test_min_lr * (1 + lr_range_test_step_rate * k)

    Before the first ``step()`` the lr is ``lr_range_test_min_lr``.

    Args:
        optimizer: a torch optimizer, or a wrapper holding one in ``.optimizer``.
        lr_range_test_min_lr: starting lr, a number or one per param group. Default 0.001.
        lr_range_test_step_size: batches per unit of increase. Default 2000.
        lr_range_test_step_rate: increase per unit. Default 1.0.
        lr_range_test_staircase: increase in stairs rather than continuously. Default False.
        last_batch_iteration: index of the last trained batch; -1 starts from the beginning.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        lr_range_test_min_lr: LrSpec = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        self._setup(
            optimizer,
            {
                "lr_range_test_min_lr": lr_range_test_min_lr,
                "lr_range_test_step_size": lr_range_test_step_size,
                "lr_range_test_step_rate": lr_range_test_step_rate,
                "lr_range_test_staircase": lr_range_test_staircase,
                "last_batch_iteration": last_batch_iteration,
            },
        )
        self.min_lr = _per_group_list(lr_range_test_min_lr, len(self.optimizer.param_groups))
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        if last_batch_iteration == -1:
            self._last_lr = _write_lrs(self.optimizer, self.min_lr)

    def get_lr(self) -> list[float]:
        """The lr of every param group for batch ``last_batch_iteration``."""
        units = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            units = math.floor(units)
        increase = 1.0 + self.step_rate * units
        return [lo * increase for lo in self.min_lr]


# ----------------------------------------------------------------------------------------------------------
# Factory for the ds_config ``scheduler`` section.

_DEEPSPEED_CLASSES: dict[str, type[_Schedule]] = {
    "LRRangeTest": LRRangeTest,
    "OneCycle": OneCycle,
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}


def _torch_scheduler_classes() -> dict[str, type]:
    """Public scheduler classes of :mod:`torch.optim.lr_scheduler`, by name (the abstract base excluded)."""
    base = getattr(_torch_lr_scheduler, "LRScheduler", None) or _torch_lr_scheduler._LRScheduler
    found: dict[str, type] = {}
    for name, obj in vars(_torch_lr_scheduler).items():
        if name.startswith("_") or name == "LRScheduler" or not inspect.isclass(obj):
            continue
        if issubclass(obj, base) or name == "ReduceLROnPlateau":
            found[name] = obj
    return found


def _suggest(word: str, choices: Sequence[str]) -> str:
    """`` did you mean 'X'?`` for the closest choice, or an empty string if none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    if not close:
        close = difflib.get_close_matches(word.lower(), [c.lower() for c in choices], n=1, cutoff=0.6)
        close = [next(c for c in choices if c.lower() == close[0])] if close else []
    return f" did you mean {close[0]!r}?" if close else ""


def build_scheduler(optimizer: Any, section: dict[str, Any]) -> Any:
    """Build the lr scheduler a ds_config ``scheduler`` section describes.

    ``section`` is ``{"type": NAME, "params": {...}}``; NAME is one of :data:`SCHEDULER_NAMES` or the name of
    a class in :mod:`torch.optim.lr_scheduler` (for example ``"StepLR"``), and ``params`` are its constructor
    keyword arguments (the optimizer is passed for you). ``params`` may be omitted when every parameter has a
    default.

    Raises:
        ConfigError: naming the key path (``scheduler.type``, ``scheduler.params.<key>``), the value given,
            what is accepted and how to fix it.
    """
    if not isinstance(section, dict):
        raise ConfigError(
            f"scheduler: got {type(section).__name__} {section!r}; expected an object like "
            '{"type": "WarmupLR", "params": {...}}.'
        )
    extra = sorted(set(section) - {"type", "params"})
    if extra:
        key = extra[0]
        raise ConfigError(
            f"scheduler.{key}: unknown key;{_suggest(key, ['type', 'params'])} The scheduler section takes "
            f"only 'type' and 'params'; move scheduler arguments into scheduler.params."
        )
    torch_classes = _torch_scheduler_classes()
    name = section.get("type")
    if name is None:
        raise ConfigError(
            f"scheduler.type: missing; set it to one of {', '.join(SCHEDULER_NAMES)} "
            "or a torch.optim.lr_scheduler class name."
        )
    if not isinstance(name, str) or (name not in _DEEPSPEED_CLASSES and name not in torch_classes):
        hint = _suggest(name, [*SCHEDULER_NAMES, *torch_classes]) if isinstance(name, str) else ""
        raise ConfigError(
            f"scheduler.type: unknown scheduler {name!r};{hint} Valid DeepSpeed schedulers: "
            f"{', '.join(SCHEDULER_NAMES)}; any torch.optim.lr_scheduler class (e.g. 'StepLR', "
            "'CosineAnnealingLR') is accepted too."
        )
    params = section.get("params")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ConfigError(
            f"scheduler.params: got {type(params).__name__} {params!r}; expected an object mapping parameter "
            f"names of {name} to values."
        )

    cls = _DEEPSPEED_CLASSES.get(name) or torch_classes[name]
    signature = inspect.signature(cls)
    accepted = [
        p
        for p in signature.parameters.values()
        if p.name != "optimizer" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    valid_names = [p.name for p in accepted]
    if not takes_any:
        for key in params:
            if key not in valid_names:
                raise ConfigError(
                    f"scheduler.params.{key}: {name} has no parameter {key!r};{_suggest(key, valid_names)} "
                    f"Valid parameters of {name}: {', '.join(valid_names)}."
                )
    for p in accepted:
        if p.default is p.empty and p.name not in params:
            raise ConfigError(
                f"scheduler.params.{p.name}: required by {name} but missing; "
                f'add "{p.name}" to scheduler.params.'
            )

    if name in _DEEPSPEED_CLASSES:
        torch_optimizer = _unwrap_optimizer(optimizer)
        _check_values(params, len(torch_optimizer.param_groups), prefix="scheduler.params.")
        return cls(optimizer, **params)
    try:
        return cls(optimizer, **params)
    except (TypeError, ValueError, KeyError) as exc:
        raise ConfigError(
            f"scheduler.params: torch.optim.lr_scheduler.{name} rejected {params!r}: {exc}. "
            f"Fix the values in scheduler.params to what {name} accepts."
        ) from exc
