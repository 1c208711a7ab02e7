"""Progressive layer drop (PLD): the keep-ratio schedule θ(t) and the model contract.

PLD (https://arxiv.org/abs/2010.13369; DeepSpeed's ``progressive_layer_drop`` section) skips transformer layers
at random during training, more of them as training goes on. The runtime's part is only the global keep ratio

    θ(t) = (1 − θ̄) · exp(−γ · t) + θ̄

(``θ̄`` = ``theta``, ``γ`` = ``gamma``), which starts at 1 and decays towards ``θ̄``. It is recomputed at every
optimizer step from the step counter and handed to the model's forward as the keyword arguments
``progressive_layer_drop=True, pld_theta=θ`` (:meth:`ProgressiveLayerDrop.get_state`). The model decides
what to drop; the shared GPT (:meth:`microspeed.models.GPT.pld_keep_probs`) runs block ``i`` of ``L`` with
probability ``keep_i = 1 − (i + 1) / L · (1 − θ)`` and divides a running block's residual branches by
``keep_i``, and runs every block in eval mode.

Timing follows DeepSpeed's engine: θ is 1 until the first optimizer step, and the optimizer step taken at
``engine.global_steps == t`` (before the counter advances to ``t + 1``) sets θ(t) for the forwards after it.
So the forwards of step ``t`` (0-based) see θ(t − 1), and those of step 0 see θ = 1 (= θ(0)).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["PLD_KWARGS", "ProgressiveLayerDrop", "accepts_pld_kwargs", "pld_theta"]

PLD_KWARGS = ("progressive_layer_drop", "pld_theta")
"""The keyword arguments PLD adds to the model's forward."""


def pld_theta(step: float, theta: float = 0.5, gamma: float = 0.001) -> float:
    """θ at ``step``: ``(1 − theta) · exp(−gamma · step) + theta``."""
    return (1.0 - theta) * math.exp(-gamma * step) + theta


class ProgressiveLayerDrop:
    """The running PLD schedule (DeepSpeed's ``ProgressiveLayerDrop``, same methods).

    Args:
        theta: θ̄, the keep ratio θ decays to, in ``[0, 1]`` (lower: faster training, more dropping).
        gamma: γ ≥ 0, how fast θ decays per optimizer step.
    """

    def __init__(self, theta: float = 0.5, gamma: float = 0.001) -> None:
        for name, value in (("theta", theta), ("gamma", gamma)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"ProgressiveLayerDrop: {name} must be a finite number, got {value!r}")
        if not 0.0 <= theta <= 1.0:
            raise ValueError(f"ProgressiveLayerDrop: theta must be in [0, 1], got {theta!r}")
        if gamma < 0:
            raise ValueError(f"ProgressiveLayerDrop: gamma must be >= 0, got {gamma!r}")
        self.theta, self.gamma = float(theta), float(gamma)
        self.current_theta = 1.0

    def get_theta(self) -> float:
        """The current θ."""
        return self.current_theta

    def get_state(self) -> dict[str, Any]:
        """The keyword arguments for the model's forward: ``{"progressive_layer_drop": True, "pld_theta": θ}``."""
        return {"progressive_layer_drop": True, "pld_theta": self.current_theta}

    def update_state(self, global_step: int) -> float:
        """Set θ to θ(``global_step``) and return it."""
        self.current_theta = pld_theta(global_step, self.theta, self.gamma)
        return self.current_theta

    def state_dict(self) -> dict[str, float]:
        """The state to checkpoint: ``{"current_theta": θ}`` (θ̄ and γ come from the config)."""
        return {"current_theta": self.current_theta}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s θ."""
        self.current_theta = float(state["current_theta"])


def accepts_pld_kwargs(forward: Callable[..., Any]) -> bool:
    """Whether ``forward`` can be called with ``progressive_layer_drop=`` and ``pld_theta=``.

    True when it names both as keyword-capable parameters or takes ``**kwargs``; a callable whose signature
    cannot be read is given the benefit of the doubt.
    """
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return True
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return True
    named = {p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                   inspect.Parameter.KEYWORD_ONLY)}
    return all(name in named for name in PLD_KWARGS)
