"""1-bit LAMB (Li et al., 2021, arXiv:2104.06069) with DeepSpeed's parameters and meaning.

* **Warm-up** (steps ``1..freeze_step``): LAMB on gradients averaged at full precision — update
  ``u = m / (sqrt(v) + eps) + weight_decay * p``, trust ratio ``c = ||p|| / ||u||`` clamped to
  ``[min_coeff, max_coeff]`` (1 when either norm is 0), ``p -= lr * c * u`` — while an exponential
  average of each layer's ratio (``coeff_beta``) is recorded; at step ``freeze_step`` the variance
  is copied into a *fresh* variance.
* **Compression** (after): the variance and the recorded ratio are frozen. At the first compressed
  step each momentum gets a scaling coefficient (the mean momentum RMS over all layers divided by
  its own), so that all layers share one magnitude in the compressed buffer. Each step, every rank
  folds its local gradient into its momentum, scales it, and all momenta go through one 1-bit
  all-reduce; unscaled, the averaged momentum gives back an estimate of the averaged gradient, which
  updates the fresh variance. The layer's ratio is the frozen one times a factor
  ``max(frozen denominator / fresh denominator)`` (adjusted for weight decay), clamped to
  ``[factor_min, factor_max]`` and to within ``factor_threshold`` of the last step's factor.

No bias correction (DeepSpeed's 1-bit LAMB ignores ``bias_correction`` too). Loading a warm-up
checkpoint keeps the recorded ratios as saved (DeepSpeed's resets them to zero, which changes the
frozen ratios of a resumed run; here a resumed run continues exactly).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from microspeed_comm.compressed import DEFAULT_BLOCK_SIZE
from microspeed_comm.onebit import OneBitOptimizer, check_number


class OneBitLamb(OneBitOptimizer):
    """1-bit LAMB: LAMB for ``freeze_step`` warm-up steps, then 1-bit momentum with frozen trust ratios.

    Args mirror DeepSpeed's ``OnebitLamb``: ``deepspeed`` (accepted, unused), ``lr``,
    ``freeze_step``, ``bias_correction`` (no effect, as in DeepSpeed), ``betas``, ``eps``,
    ``eps_inside_sqrt``, ``weight_decay``, ``max_grad_norm`` (must be 0), ``max_coeff`` and
    ``min_coeff`` (bounds of the trust ratio), ``amsgrad`` (must be false), ``cuda_aware`` and
    ``comm_backend_name`` (accepted), ``coeff_beta`` (average of the warm-up ratios),
    ``factor_max``, ``factor_min`` and ``factor_threshold`` (bounds of the compression-stage
    factor and of its change per step). Keyword-only ``group`` and ``block_size``.
    """

    def __init__(self, params: Any, deepspeed: Any = None, lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_grad_norm: float = 0.0,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, amsgrad: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl", coeff_beta: float = 0.9, factor_max: float = 4.0,
                 factor_min: float = 0.5, factor_threshold: float = 0.1, *, group: Any = None,
                 block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        del deepspeed
        check_number("freeze_step", freeze_step, 1, integer=True)
        check_number("min_coeff", min_coeff, 0.0, low_open=True)
        check_number("max_coeff", max_coeff, min_coeff)
        check_number("coeff_beta", coeff_beta, 0.0, 1.0)
        check_number("factor_min", factor_min, 0.0, low_open=True)
        check_number("factor_max", factor_max, factor_min)
        check_number("factor_threshold", factor_threshold, 0.0)
        defaults = {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                    "weight_decay": weight_decay, "eps_inside_sqrt": bool(eps_inside_sqrt), "max_coeff": max_coeff,
                    "min_coeff": min_coeff}
        super().__init__(params, defaults, amsgrad=amsgrad, max_grad_norm=max_grad_norm, cuda_aware=cuda_aware,
                         comm_backend_name=comm_backend_name, group=group, block_size=block_size)
        self.freeze_step, self.coeff_beta = freeze_step, coeff_beta
        self.factor_max, self.factor_min, self.factor_threshold = factor_max, factor_min, factor_threshold
        self.lamb_coeffs: list[float] = []

    def full_precision_gradients_next(self) -> bool:
        """True during the warm-up: the next step's gradients must be averaged at full precision."""
        return self.global_step() < self.freeze_step

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratios the last step applied, one per parameter (DeepSpeed's accessor)."""
        return self.lamb_coeffs

    def _init_state(self, p: torch.Tensor) -> dict[str, Any]:
        state = super()._init_state(p)
        if "exp_avg_sq_fresh" not in state:
            state["lamb_coeff_freeze"] = 0.0
            state["last_factor"] = 1.0
            state["exp_avg_sq_fresh"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _step(self) -> None:
        """LAMB in the warm-up; frozen variance and ratios with 1-bit momentum after it."""
        self.lamb_coeffs = []
        t = self.global_step() + 1
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(p)
        if t <= self.freeze_step:
            self._warmup_step(t)
        else:
            self._compressed_step()
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["step"] += 1

    def _update(self, group: dict[str, Any], p: torch.Tensor, m: torch.Tensor,
                v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(denominator, m / denominator, that plus weight decay)``."""
        denom = (v + group["eps"]).sqrt_() if group["eps_inside_sqrt"] else v.sqrt().add_(group["eps"])
        prelim = m / denom
        update = prelim + group["weight_decay"] * p if group["weight_decay"] > 0 else prelim
        return denom, prelim, update

    def _warmup_step(self, t: int) -> None:
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state, g = self.state[p], p.grad
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                if t == self.freeze_step:
                    state["exp_avg_sq_fresh"].copy_(v)
                _, _, update = self._update(group, p, m, v)
                weight_norm, update_norm = float(p.norm()), float(update.norm())
                coeff = 1.0
                if weight_norm != 0 and update_norm != 0:
                    coeff = min(max(weight_norm / update_norm, group["min_coeff"]), group["max_coeff"])
                if coeff != 1.0:
                    state["lamb_coeff_freeze"] = self.coeff_beta * state["lamb_coeff_freeze"] + \
                        (1 - self.coeff_beta) * coeff
                self.lamb_coeffs.append(coeff)
                p.add_(update, alpha=-group["lr"] * coeff)

    def _scaling_coefficients(self) -> None:
        """At the first compressed step: bring every momentum to the mean momentum RMS."""
        params = [p for g in self.param_groups for p in g["params"]]
        rms = [float(self.state[p]["exp_avg"].norm()) / math.sqrt(max(p.numel(), 1)) for p in params]
        united = sum(rms) / max(len(rms), 1)
        for p, r in zip(params, rms, strict=True):
            self.state[p]["scaling_coeff"] = united / r if r > 0 else 1.0

    def _compressed_step(self) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        if params and "scaling_coeff" not in self.state[params[0]]:
            self._scaling_coefficients()
        last: dict[torch.Tensor, torch.Tensor] = {}
        momenta = []
        for group in self.param_groups:
            b1 = group["betas"][0]
            for p in group["params"]:
                state = self.state[p]
                m = state["exp_avg"]
                last[p] = m.clone()
                m.lerp_(self._grad_or_zeros(p), 1 - b1).mul_(state["scaling_coeff"])
                momenta.append(m)
        self.compressed_average_("exp_avg", momenta)
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                m, v, fresh = state["exp_avg"], state["exp_avg_sq"], state["exp_avg_sq_fresh"]
                m.div_(state["scaling_coeff"])
                self._apply_masks(group, [m])
                grad_estimate = (m - b1 * last[p]) / (1 - b1)
                fresh.mul_(b2).addcmul_(grad_estimate, grad_estimate, value=1 - b2)
                denom, prelim, update = self._update(group, p, m, v)
                fresh_denom = (fresh + group["eps"]).sqrt_() if group["eps_inside_sqrt"] else \
                    fresh.sqrt().add_(group["eps"])
                factor = float((denom / fresh_denom).max())
                if group["weight_decay"] > 0:
                    update_norm = float(update.norm())
                    ratio = min(1.0, float(prelim.norm()) / update_norm) if update_norm > 0 else 1.0
                    factor = factor * ratio + (1.0 - ratio)
                factor = min(max(factor, self.factor_min), self.factor_max)
                last_factor = state["last_factor"]
                factor = min(max(factor, last_factor * (1.0 - self.factor_threshold)),
                             last_factor * (1.0 + self.factor_threshold))
                state["last_factor"] = factor
                coeff = state["lamb_coeff_freeze"] * factor
                self.lamb_coeffs.append(coeff)
                p.add_(update, alpha=-group["lr"] * coeff)
