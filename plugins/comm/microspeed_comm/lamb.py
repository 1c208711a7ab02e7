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
                    "min_coeff": min_coeff, "freeze_step": freeze_step, "coeff_beta": coeff_beta,
                    "factor_max": factor_max, "factor_min": factor_min, "factor_threshold": factor_threshold}
        super().__init__(params, defaults, amsgrad=amsgrad, max_grad_norm=max_grad_norm, cuda_aware=cuda_aware,
                         comm_backend_name=comm_backend_name, group=group, block_size=block_size)
        self.freeze_step, self.coeff_beta = freeze_step, coeff_beta
        self.factor_max, self.factor_min, self.factor_threshold = factor_max, factor_min, factor_threshold
        self.lamb_coeffs: list[float] = []
        self._ids: dict[torch.Tensor, tuple[int, torch.Tensor]] = {}
        self._given_sums: torch.Tensor | None = None

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
        if self.partitioned:
            self._partitioned_step()
            return
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
        self.compressed_average_("exp_avg", momenta, params)
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

    # -- partitioned (ZeRO): whole-parameter ratios from per-parameter partial reductions ---------------

    def _piece_ids(self, view: torch.Tensor) -> tuple[int, torch.Tensor]:
        """``(count, ids)``: the number of partitioned parameters and, per element of ``view``, its parameter's index.

        From the ``partition_pieces = (count, ((index, lo, hi), ...))`` the partitioner put on each slice.
        """
        cached = self._ids.get(view)
        if cached is None:
            count, pieces = view.partition_pieces
            ids = torch.full((view.numel(),), -1, dtype=torch.long, device=view.device)
            for index, lo, hi in pieces:
                ids[lo:hi] = index
            if view.numel() and int(ids.min()) < 0:
                raise ValueError("OneBitLamb: a partition slice has elements no parameter piece covers")
            cached = self._ids[view] = (count, ids)
        return cached

    def _per_element(self, state: dict[str, Any], key: str, p: torch.Tensor, default: float) -> torch.Tensor:
        """``state[key]`` as one value per element of ``p`` (its parameter's: it is checkpointed like ``exp_avg``)."""
        value = state.get(key, default)
        if not isinstance(value, torch.Tensor) or value.shape != p.shape:
            value = state[key] = torch.full_like(p, float(value) if not isinstance(value, torch.Tensor) else
                                                 float(value.reshape(-1)[0]) if value.numel() else default)
        return value

    def _local_sums(self, rows: list[tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]],
                    count: int, device: Any) -> torch.Tensor:
        """``[count, 4]``: per parameter, this rank's sums of the squares of ``rows``' three tensors and the maximum
        of the fourth."""
        partial = torch.zeros(count, 4, dtype=torch.float64, device=device)
        for ids, squares, ratio in rows:
            for col, x in enumerate(squares):
                partial[:, col].index_add_(0, ids, x.reshape(-1).double().square())
            if ratio is not None:
                partial[:, 3].scatter_reduce_(0, ids, ratio.reshape(-1).double(), "amax")
        return partial

    def _whole_parameter_sums(self, partial: torch.Tensor) -> torch.Tensor:
        """``[count, 4]``: :meth:`_local_sums` summed (maximised, the fourth) over the group (one collective for the
        step, the same shape in every phase)."""
        return self.reduce_partials(partial, summed=3)  # over each parameter's holders (experts: replica group)

    # -- streamed (ZeRO's NVMe offload: microspeed.plugin_api.ElementwiseState / ParameterSums) ---------

    def elementwise_state(self) -> dict[str, float]:
        """Momentum, variance, fresh variance, and (partitioned: one value per element, its parameter's) the
        recorded trust ratio and the last factor, with their initial values."""
        return {"exp_avg": 0.0, "exp_avg_sq": 0.0, "exp_avg_sq_fresh": 0.0, "lamb_coeff_freeze": 0.0,
                "last_factor": 1.0}

    def forget(self, params: list[torch.Tensor]) -> None:
        """Drop what is cached for ``params`` outside ``state`` (frozen denominators, parameter ids)."""
        super().forget(params)
        for p in params:
            self._ids.pop(p, None)

    def needs_parameter_sums(self) -> bool:
        """Partitioned, every step's ratios need whole-parameter norms."""
        return self.partitioned

    def parameter_sums(self, totals: torch.Tensor | None) -> torch.Tensor:
        """``totals`` plus the partial sums of the parameters holding a gradient (as the next ``step()`` computes
        them, on copies of the state: nothing is modified)."""
        stepped, t, count, device = self._partitioned_setup()
        rows, _ = self._partitioned_rows(stepped, t, modify=False)
        partial = self._local_sums(rows, count, device)
        if totals is None:
            return partial
        return torch.cat([totals[:, :3] + partial[:, :3], torch.maximum(totals[:, 3:], partial[:, 3:])], dim=1)

    def reduce_parameter_sums(self, totals: torch.Tensor) -> torch.Tensor:
        """This rank's partial sums over the whole partition, combined over the group (one collective)."""
        return self._whole_parameter_sums(totals)

    def use_parameter_sums(self, sums: torch.Tensor | None) -> None:
        """The next ``step()`` calls take ``sums`` (whole-parameter sums) instead of exchanging their own."""
        self._given_sums = sums

    # -- partitioned (ZeRO): whole-parameter ratios from per-parameter partial reductions ---------------

    def _partitioned_setup(self) -> tuple[list[tuple[dict[str, Any], torch.Tensor]], int, int, Any]:
        """``(stepped (group, param) pairs, the step's number, count of partitioned parameters, device)``."""
        stepped = [(group, p) for group in self.param_groups for p in self.stepped(group)]
        for _, p in stepped:
            self._init_state(p)
        held = [p for group in self.param_groups for p in group["params"]]
        count = held[0].partition_pieces[0] if held else 0
        device = next((p.device for p in held if p.numel()), held[0].device if held else None)
        return stepped, self.global_step() + 1, count, device

    def _partitioned_rows(self, stepped: list[tuple[dict[str, Any], torch.Tensor]], t: int, modify: bool
                          ) -> tuple[list[Any], list[Any]]:
        """Fold each gradient into the state (on copies unless ``modify``): ``(rows for the sums, work)``."""
        warmup = t <= self.freeze_step
        rows, work = [], []
        for group, p in stepped:
            b1, b2 = group["betas"]
            state = self.state[p]
            _, ids = self._piece_ids(p)
            m, v, fresh = state["exp_avg"], state["exp_avg_sq"], state["exp_avg_sq_fresh"]
            if not modify:
                m, v, fresh = m.clone(), v.clone(), fresh.clone()
            if warmup:
                m.lerp_(p.grad, 1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                if t == self.freeze_step:
                    fresh.copy_(v)
                _, prelim, update = self._update(group, p, m, v)
                rows.append((ids, [p, update, prelim], None))
            else:
                last = m.clone()
                m.lerp_(p.grad, 1 - b1)
                grad_estimate = (m - b1 * last) / (1 - b1)
                fresh.mul_(b2).addcmul_(grad_estimate, grad_estimate, value=1 - b2)
                denom, prelim, update = self._update(group, p, m, v)
                fresh_denom = (fresh + group["eps"]).sqrt_() if group["eps_inside_sqrt"] else \
                    fresh.sqrt().add_(group["eps"])
                rows.append((ids, [p, update, prelim], denom / fresh_denom))
            work.append((group, p, ids, update))
        return rows, work

    def _partitioned_step(self) -> None:
        """One step on slices of parameters: every ratio is computed from whole-parameter sums over the group.

        The gradients arrive averaged over the group (exactly in the warm-up, else by the partitioner's
        1-bit reduce-scatter with error feedback), so nothing is compressed here and the momenta need no
        scaling coefficients; what LAMB takes from whole parameters (``||w||``, ``||update||``, the largest
        frozen/fresh denominator ratio) is summed (or maximised) per parameter over the group in one
        collective of ``4 * parameters`` values — or given (:meth:`use_parameter_sums`) by a streamer that
        steps the partition in pieces after a first pass. The recorded ratio and last factor are kept per
        element (each element holds its parameter's), so they are checkpointed and resharded like the momentum.
        """
        stepped, t, count, device = self._partitioned_setup()
        warmup = t <= self.freeze_step
        rows, work = self._partitioned_rows(stepped, t, modify=True)
        if count == 0:
            return
        sums = self._given_sums
        if sums is None:
            sums = self._whole_parameter_sums(self._local_sums(rows, count, device))
        weight_norm, update_norm, prelim_norm = sums[:, 0].sqrt(), sums[:, 1].sqrt(), sums[:, 2].sqrt()
        for group, p, ids, update in work:
            state = self.state[p]
            if warmup:
                wn, un = weight_norm[ids], update_norm[ids]
                ratio = (wn / un.clamp_min(1e-300)).clamp(group["min_coeff"], group["max_coeff"])
                coeff = torch.where((wn != 0) & (un != 0), ratio, torch.ones_like(ratio)).to(p.dtype)
                freeze = self._per_element(state, "lamb_coeff_freeze", p, 0.0)
                freeze.copy_(torch.where(coeff != 1.0, self.coeff_beta * freeze + (1 - self.coeff_beta) * coeff,
                                         freeze))
            else:
                factor = sums[:, 3][ids]
                if group["weight_decay"] > 0:
                    un = update_norm[ids]
                    shrink = torch.where(un > 0, (prelim_norm[ids] / un.clamp_min(1e-300)).clamp(max=1.0),
                                         torch.ones_like(un))
                    factor = factor * shrink + (1.0 - shrink)
                factor = factor.clamp(self.factor_min, self.factor_max).to(p.dtype)
                last_factor = self._per_element(state, "last_factor", p, 1.0)
                factor = torch.minimum(torch.maximum(factor, last_factor * (1.0 - self.factor_threshold)),
                                       last_factor * (1.0 + self.factor_threshold))
                last_factor.copy_(factor)
                coeff = self._per_element(state, "lamb_coeff_freeze", p, 0.0) * factor
            self.lamb_coeffs += [float(coeff[lo]) for _, lo, _ in p.partition_pieces[1]]
            p.addcmul_(update, coeff.view_as(update), value=-group["lr"])
        for _, p in stepped:
            self.state[p]["step"] += 1
