"""1-bit Adam (Tang et al., 2021, arXiv:2102.02888) with DeepSpeed's parameters and meaning.

Two stages, switched by ``freeze_step``:

* **Warm-up** (steps ``1..freeze_step``): Adam on gradients averaged at full precision (by the
  engine's data-parallel reduction) — ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``.
* **Compression** (after): the variance ``v`` is frozen; each rank folds its *local* gradient into
  its momentum, and the momenta are averaged by the error-feedback 1-bit all-reduce
  (:mod:`microspeed_comm.compressed`) — about 1/32 of the bytes of an fp32 all-reduce.

The update is DeepSpeed's, in both stages: ``p -= lr * (m / (sqrt(v) + eps) + weight_decay * p)``
(decoupled weight decay, no bias correction — DeepSpeed's 1-bit Adam ignores ``bias_correction``;
we accept the key and warn when it asks for a correction that will not happen). ``eps_inside_sqrt``
gives ``m / sqrt(v + eps)`` (DeepSpeed accepts it and ignores it; here it works). A param group with
``non_freeze: True`` keeps full-precision communication of its gradients and a live variance in the
compression stage; ``exp_avg_mask`` multiplies the group's momentum after each exchange.
"""

from __future__ import annotations

from typing import Any

import torch

from microspeed_comm.compressed import DEFAULT_BLOCK_SIZE
from microspeed_comm.onebit import OneBitOptimizer, check_number


class OneBitAdam(OneBitOptimizer):
    """1-bit Adam: Adam during ``freeze_step`` warm-up steps, then frozen variance and 1-bit momentum.

    Args mirror DeepSpeed's ``OnebitAdam``: ``deepspeed`` (an engine; accepted and unused),
    ``lr``, ``freeze_step`` (warm-up steps at full precision, >= 1), ``bias_correction`` (no effect,
    as in DeepSpeed), ``betas``, ``eps``, ``eps_inside_sqrt``, ``weight_decay``, ``max_grad_norm``
    (must be 0: use ``gradient_clipping``), ``amsgrad`` (must be false), ``cuda_aware`` and
    ``comm_backend_name`` (accepted for compatibility). Keyword-only: ``group`` (the process group
    to average over, default the world) and ``block_size`` (values per scale when compressing).
    """

    def __init__(self, params: Any, deepspeed: Any = None, lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_grad_norm: float = 0.0,
                 amsgrad: bool = False, cuda_aware: bool = False, comm_backend_name: str = "nccl", *,
                 group: Any = None, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        del deepspeed
        check_number("freeze_step", freeze_step, 1, integer=True)
        defaults = {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                    "weight_decay": weight_decay, "eps_inside_sqrt": bool(eps_inside_sqrt), "freeze_step": freeze_step}
        super().__init__(params, defaults, amsgrad=amsgrad, max_grad_norm=max_grad_norm, cuda_aware=cuda_aware,
                         comm_backend_name=comm_backend_name, group=group, block_size=block_size)
        self.freeze_step = freeze_step

    def full_precision_gradients_next(self) -> bool:
        """True during the warm-up: the next step's gradients must be averaged at full precision."""
        return self.global_step() < self.freeze_step

    @property
    def adam_freeze_key(self) -> bool:
        """DeepSpeed's name for "the compression stage has begun" (the variance is frozen)."""
        return self.global_step() >= self.freeze_step

    def _step(self) -> None:
        """Adam in the warm-up; frozen variance and compressed momentum after it."""
        frozen = self.global_step() + 1 > self.freeze_step
        updates: list[tuple[dict[str, Any], list, list, list, bool]] = []  # (group, params, m, v, v frozen)
        compressed: list[tuple[dict[str, Any], list]] = []
        for group in self.param_groups:
            b1, b2 = group["betas"]
            params = self.stepped(group)
            for p in params:
                self._init_state(p)
            live = not frozen or group.get("non_freeze", False)
            if live:
                ps = [p for p in params if p.grad is not None]
                grads = [p.grad for p in ps]
                if frozen:  # non_freeze: this group keeps full-precision gradients and a live variance
                    self.average_(grads, ps)
                ms = [self.state[p]["exp_avg"] for p in ps]
                vs = [self.state[p]["exp_avg_sq"] for p in ps]
                if ps:
                    torch._foreach_lerp_(ms, grads, 1 - b1)
                    torch._foreach_mul_(vs, b2)
                    torch._foreach_addcmul_(vs, grads, grads, value=1 - b2)
            else:
                ps = list(params)
                grads = [self._grad_or_zeros(p) for p in ps]
                ms = [self.state[p]["exp_avg"] for p in ps]
                vs = [self.state[p]["exp_avg_sq"] for p in ps]
                if ps:
                    torch._foreach_lerp_(ms, grads, 1 - b1)
                compressed.append((group, ms, ps))
            updates.append((group, ps, ms, vs, not live))
        if compressed:
            self.compressed_average_("exp_avg", [m for _, ms, _ in compressed for m in ms],
                                     [p for *_, ps in compressed for p in ps])
            for group, ms, _ in compressed:
                self._apply_masks(group, ms)
        for group, ps, ms, vs, v_frozen in updates:
            if ps:
                self._adam_update(group, ps, ms, vs, frozen=v_frozen)
            for p in self.stepped(group):
                self.state[p]["step"] += 1
