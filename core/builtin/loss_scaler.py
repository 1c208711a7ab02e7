"""Loss scaling for fp16 training, with the semantics of DeepSpeed's ``fp16`` ds_config section.

Two scalers are provided:

* :class:`LossScaler` keeps a fixed scale (``fp16.loss_scale`` > 0).
* :class:`DynamicLossScaler` adapts the scale to gradient overflows (``fp16.loss_scale`` == 0).

:func:`make_loss_scaler` builds the right one from an ``fp16`` section.

The dynamic update rule matches ``DynamicLossScaler.update_scale`` of DeepSpeed 0.19.8 (the version the
project pins as its reference). One call to :meth:`DynamicLossScaler.update_scale` is made per optimizer
step, with ``overflow`` being the *global* overflow flag of that step (see :func:`overflow_across_ranks`):

On overflow:
    If hysteresis is disabled (``hysteresis == 1``) or exhausted (``cur_hysteresis == 1``), the scale is
    divided by ``scale_factor`` (2) but never below ``min_loss_scale``; if it already *equals*
    ``min_loss_scale`` and ``raise_error_at_min_scale`` is set (the default), :class:`LossScaleUnderflowError`
    is raised instead. Otherwise the scale is kept and ``cur_hysteresis`` is decremented. In both cases
    ``last_overflow_iter = cur_iter``. Once exhausted, the hysteresis stays at 1 (so every further overflow
    halves) until it is refilled.

Without overflow:
    With ``consecutive_hysteresis`` the hysteresis is refilled (``cur_hysteresis = hysteresis``) on every
    clean step. Then ``stable = cur_iter - last_overflow_iter - 1`` is the number of clean steps *before*
    this one since the last overflow (or since the start, where ``last_overflow_iter == -1``); if
    ``stable > 0`` and ``stable % loss_scale_window == 0``, the scale is multiplied by ``scale_factor`` and,
    without ``consecutive_hysteresis``, the hysteresis is refilled.

``cur_iter`` is incremented after every update.

Consequently, from a fresh start the first growth happens on the ``(window + 1)``-th clean update (the
update with ``cur_iter == window``), and after an overflow at iteration ``k`` on the update with
``cur_iter == k + 1 + window``. Older DeepSpeed releases tested ``(cur_iter - last_overflow_iter) % window``
instead, which grows one step earlier; this module follows the pinned release.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from microspeed.errors import ConfigError
from microspeed.gradients import has_inf_or_nan  # the kernel's; re-exported here as DeepSpeed's fp16 module has it

__all__ = [
    "BaseLossScaler",
    "DynamicLossScaler",
    "LossScaleUnderflowError",
    "LossScaler",
    "has_inf_or_nan",
    "make_loss_scaler",
    "overflow_across_ranks",
]

logger = logging.getLogger(__name__)

#: Defaults of DeepSpeed's ``fp16`` section (``deepspeed/runtime/constants.py``, ``precision_config.py``).
FP16_DEFAULTS: dict[str, Any] = {
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "consecutive_hysteresis": False,
    "min_loss_scale": 1,
}

_DYNAMIC_STATE_KEYS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


class LossScaleUnderflowError(RuntimeError):
    """Gradients overflowed while the dynamic loss scale was already at ``min_loss_scale``.

    Raised by :meth:`DynamicLossScaler.update_scale` when ``raise_error_at_min_scale`` is set (DeepSpeed
    raises a plain ``Exception`` at the same point and ends the run).
    """


class BaseLossScaler:
    """Common interface of the static and the dynamic loss scaler."""

    #: Whether the scale adapts to overflows.
    dynamic: bool = False

    def __init__(self, scale: float) -> None:
        self.cur_scale = float(scale)

    @property
    def loss_scale(self) -> float:
        """The current loss scale."""
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Return ``loss * loss_scale`` (same dtype as ``loss``), ready for ``backward()``."""
        return loss * self.cur_scale

    def update_scale(self, overflow: bool) -> None:
        """Account for one optimizer step whose (global) gradient overflow flag is ``overflow``."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Return the scaler's mutable state, for checkpointing."""
        raise NotImplementedError

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the state produced by :meth:`state_dict`."""
        raise NotImplementedError

    @staticmethod
    def from_config(fp16_section: Mapping[str, Any] | None) -> BaseLossScaler:
        """Build a static or dynamic scaler from a ds_config ``fp16`` section (:func:`make_loss_scaler`)."""
        return make_loss_scaler(fp16_section)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(loss_scale={self.cur_scale:g})"


class LossScaler(BaseLossScaler):
    """A fixed loss scale (DeepSpeed's ``fp16.loss_scale`` > 0); :meth:`update_scale` never changes it."""

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        if not _is_real(scale) or not math.isfinite(float(scale)) or float(scale) <= 0:
            raise ValueError(f"static loss scale must be a finite number > 0, got {scale!r}")
        super().__init__(scale)

    def update_scale(self, overflow: bool) -> None:
        """Do nothing but log: a static scale ignores overflows (the step is still skipped by the caller)."""
        if overflow:
            logger.info("fp16 gradient overflow; skipping step, static loss scale stays %g", self.cur_scale)

    def state_dict(self) -> dict[str, Any]:
        """Return ``{"cur_scale": ...}``."""
        return {"cur_scale": self.cur_scale}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore ``cur_scale`` from :meth:`state_dict`'s output."""
        _require_keys(state_dict, ("cur_scale",), type(self).__name__)
        self.cur_scale = float(state_dict["cur_scale"])


class DynamicLossScaler(BaseLossScaler):
    """DeepSpeed's dynamic loss scaler with hysteresis (``fp16.loss_scale`` == 0).

    Args:
        init_scale: starting scale (DeepSpeed: ``2 ** initial_scale_power``).
        scale_window: clean steps between two growths (``loss_scale_window``), > 0.
        min_scale: floor of the scale (``min_loss_scale``), > 0.
        delayed_shift: overflows tolerated before the first shrink (``hysteresis``), >= 1.
        consecutive_hysteresis: refill the hysteresis on every clean step rather than only on growth.
        raise_error_at_min_scale: raise :class:`LossScaleUnderflowError` on an overflow at ``min_scale``.
        scale_factor: growth and shrink factor (DeepSpeed always uses 2).

    The exact rule is given in this module's docstring.
    """

    dynamic = True

    def __init__(
        self,
        init_scale: float = 2.0**16,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        delayed_shift: int = 2,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = True,
        scale_factor: float = 2.0,
    ) -> None:
        if not _is_real(init_scale) or not math.isfinite(float(init_scale)) or float(init_scale) <= 0:
            raise ValueError(f"init_scale must be a finite number > 0, got {init_scale!r}")
        if not _is_int(scale_window) or scale_window <= 0:
            raise ValueError(f"scale_window must be an integer > 0, got {scale_window!r}")
        if not _is_real(min_scale) or not math.isfinite(float(min_scale)) or float(min_scale) <= 0:
            raise ValueError(f"min_scale must be a finite number > 0, got {min_scale!r}")
        if not _is_int(delayed_shift) or delayed_shift < 1:
            raise ValueError(f"delayed_shift (hysteresis) must be an integer >= 1, got {delayed_shift!r}")
        if not _is_real(scale_factor) or not float(scale_factor) > 1:
            raise ValueError(f"scale_factor must be a number > 1, got {scale_factor!r}")
        super().__init__(init_scale)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.delayed_shift = int(delayed_shift)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        self.scale_factor = float(scale_factor)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = self.delayed_shift

    def update_scale(self, overflow: bool) -> None:
        """Apply DeepSpeed's update rule for one step (see the module docstring) and advance ``cur_iter``."""
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise LossScaleUnderflowError(
                        f"fp16 gradients overflowed at iteration {self.cur_iter} while the loss scale is "
                        f"already at its minimum ({self.min_scale:g}); it cannot be decreased further. Lower "
                        "fp16.min_loss_scale, or look for the source of the inf/nan (learning rate, data, "
                        "an op unstable in fp16; bf16 may suit this model better)."
                    )
                new_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
                logger.info(
                    "fp16 gradient overflow at iteration %d; skipping step, loss scale %g -> %g",
                    self.cur_iter, self.cur_scale, new_scale,
                )
                self.cur_scale = new_scale
            else:
                logger.info(
                    "fp16 gradient overflow at iteration %d; skipping step, loss scale stays %g "
                    "(hysteresis %d -> %d)",
                    self.cur_iter, self.cur_scale, self.cur_hysteresis, self.cur_hysteresis - 1,
                )
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_steps = self.cur_iter - self.last_overflow_iter - 1
            if stable_steps > 0 and stable_steps % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        """Return the counters: ``cur_scale``, ``cur_iter``, ``last_overflow_iter``, ``cur_hysteresis``.

        The configuration (window, floor, hysteresis, ...) is not included: it comes from ds_config.
        """
        return {
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the counters saved by :meth:`state_dict`; later updates continue identically."""
        _require_keys(state_dict, _DYNAMIC_STATE_KEYS, type(self).__name__)
        self.cur_scale = float(state_dict["cur_scale"])
        self.cur_iter = int(state_dict["cur_iter"])
        self.last_overflow_iter = int(state_dict["last_overflow_iter"])
        self.cur_hysteresis = int(state_dict["cur_hysteresis"])

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaler(loss_scale={self.cur_scale:g}, cur_iter={self.cur_iter}, "
            f"last_overflow_iter={self.last_overflow_iter}, cur_hysteresis={self.cur_hysteresis}, "
            f"scale_window={self.scale_window}, min_scale={self.min_scale:g}, "
            f"hysteresis={self.delayed_shift}, consecutive_hysteresis={self.consecutive_hysteresis})"
        )


def make_loss_scaler(
    fp16_section: Mapping[str, Any] | None, *, raise_error_at_min_scale: bool = True
) -> BaseLossScaler:
    """Build the loss scaler described by a ds_config ``fp16`` section.

    ``loss_scale`` 0 (the default) gives a :class:`DynamicLossScaler` starting at
    ``2 ** initial_scale_power`` with ``loss_scale_window``, ``hysteresis``, ``consecutive_hysteresis`` and
    ``min_loss_scale`` (defaults 16, 1000, 2, False, 1 as in DeepSpeed); any other value gives a static
    :class:`LossScaler`. Other keys of the section (``enabled``, ``auto_cast``, ...) are ignored: whether
    fp16 is on at all is the caller's decision.

    Raises:
        ConfigError: a value has the wrong type or range; the message names the ``fp16.<key>`` path.
    """
    section = dict(FP16_DEFAULTS)
    if fp16_section:
        section.update({k: v for k, v in fp16_section.items() if k in FP16_DEFAULTS})

    loss_scale = section["loss_scale"]
    if not _is_real(loss_scale) or not math.isfinite(float(loss_scale)) or float(loss_scale) < 0:
        raise ConfigError(
            "fp16.loss_scale must be a finite number >= 0 (0 enables dynamic loss scaling), "
            f"got {loss_scale!r}"
        )
    if float(loss_scale) != 0:
        return LossScaler(float(loss_scale))

    power = section["initial_scale_power"]
    if not _is_int(power) or not -126 <= power <= 127:
        raise ConfigError(
            f"fp16.initial_scale_power must be an integer in [-126, 127] (fp32 range), got {power!r}"
        )
    window = section["loss_scale_window"]
    if not _is_int(window) or window <= 0:
        raise ConfigError(
            "fp16.loss_scale_window must be an integer > 0 when dynamic loss scaling is enabled, "
            f"got {window!r}"
        )
    hysteresis = section["hysteresis"]
    if not _is_int(hysteresis) or hysteresis < 1:
        raise ConfigError(
            f"fp16.hysteresis must be an integer >= 1 (1 disables hysteresis), got {hysteresis!r}"
        )
    consecutive = section["consecutive_hysteresis"]
    if not isinstance(consecutive, bool):
        raise ConfigError(f"fp16.consecutive_hysteresis must be true or false, got {consecutive!r}")
    min_scale = section["min_loss_scale"]
    if not _is_real(min_scale) or not math.isfinite(float(min_scale)) or float(min_scale) <= 0:
        raise ConfigError(
            f"fp16.min_loss_scale must be a finite number > 0 when dynamic loss scaling is enabled, "
            f"got {min_scale!r}"
        )
    return DynamicLossScaler(
        init_scale=2.0**power,
        scale_window=window,
        min_scale=float(min_scale),
        delayed_shift=hysteresis,
        consecutive_hysteresis=consecutive,
        raise_error_at_min_scale=raise_error_at_min_scale,
    )


def overflow_across_ranks(local_overflow: bool | torch.Tensor, group: Any = None) -> bool:
    """All-reduce (MAX) an overflow flag over ``group`` so that every rank takes the same decision.

    ``local_overflow`` may be a bool or a (0-d bool or numeric) tensor; a tensor is reduced on its own
    device, which avoids a host synchronisation before the collective. With a bool, the flag is placed on
    the current CUDA device when the group's backend is NCCL, else on the CPU. When
    ``torch.distributed`` is unavailable or not initialised, the local flag is returned as a bool.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return bool(local_overflow)
    if isinstance(local_overflow, torch.Tensor):
        flag = local_overflow.detach().reshape(()).to(torch.float32)
    else:
        backend = torch.distributed.get_backend(group)
        device = torch.device("cpu")
        if "nccl" in str(backend).lower() and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        flag = torch.tensor(1.0 if local_overflow else 0.0, device=device)
    flag = flag.clone()
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(flag.item() > 0)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _require_keys(state_dict: Mapping[str, Any], keys: Iterable[str], owner: str) -> None:
    missing = [k for k in keys if k not in state_dict]
    if missing:
        raise KeyError(f"{owner}.load_state_dict: state dict lacks {missing}; got keys {sorted(state_dict)}")
