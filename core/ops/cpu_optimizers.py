"""DeepSpeed's CPU optimizers by name: DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion, FusedLion.

DeepSpeed builds C++ kernels for these; microspeed runs the same arithmetic with PyTorch's
multi-tensor (``torch._foreach_*``) ops, so they work anywhere torch does, with DeepSpeed's
constructor arguments: Adam is :class:`~microspeed.ops.fused_adam.FusedAdam` (``adamw_mode``,
``bias_correction``), Adagrad is ``torch.optim.Adagrad`` (the same update as DeepSpeed's), Lion is
:class:`Lion` below. ``fp32_optimizer_states=True`` (the default) means the optimizer state must be
fp32, which holds when the parameters are fp32 — the master weights microspeed's fp16/bf16
sections give the optimizer; a half-precision parameter is refused with that fix. With
``fp32_optimizer_states=False`` state takes the parameters' dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from microspeed.ops.fused_adam import FusedAdam

__all__ = ["ZERO_ELEMENTWISE", "ZERO_OFFLOAD_CLIENT", "DeepSpeedCPUAdagrad", "DeepSpeedCPUAdam", "DeepSpeedCPULion",
           "FusedLion", "Lion"]


def _check_fp32_states(optimizer: torch.optim.Optimizer, name: str) -> None:
    """Refuse half-precision parameters when ``fp32_optimizer_states`` asks for fp32 state."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.is_floating_point() and p.dtype != torch.float32:
                raise ValueError(f"{name}(fp32_optimizer_states=True): a parameter of dtype {p.dtype} and shape "
                                 f"{tuple(p.shape)} would get {p.dtype} optimizer state; give the optimizer fp32 "
                                 f"(master) parameters, as microspeed's fp16/bf16 sections do, or pass "
                                 f"fp32_optimizer_states=False")


class DeepSpeedCPUAdam(FusedAdam):
    """Adam/AdamW with ``deepspeed.ops.adam.DeepSpeedCPUAdam``'s arguments (``adamw_mode=True``: decoupled decay)."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        super().__init__(model_params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         adam_w_mode=adamw_mode, weight_decay=weight_decay, amsgrad=amsgrad, set_grad_none=True)
        self.fp32_optimizer_states = fp32_optimizer_states
        if fp32_optimizer_states:
            _check_fp32_states(self, "DeepSpeedCPUAdam")


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """Adagrad with ``deepspeed.ops.adagrad.DeepSpeedCPUAdagrad``'s arguments (L2 decay added to the gradient)."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True) -> None:
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdagrad(amsgrad=True): AMSGrad is an Adam variant and has no meaning for "
                             "Adagrad; leave amsgrad=False")
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay, foreach=True)
        self.fp32_optimizer_states = fp32_optimizer_states
        if fp32_optimizer_states:
            _check_fp32_states(self, "DeepSpeedCPUAdagrad")


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, arXiv:2302.06675) as DeepSpeed computes it.

    Per step: ``p *= 1 - lr * weight_decay``; ``p -= lr * sign(beta1 * m + (1 - beta1) * g)``;
    ``m = beta2 * m + (1 - beta2) * g``. State per parameter: ``exp_avg``.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, set_grad_none: bool = True) -> None:
        if lr < 0:
            raise ValueError(f"lr={lr}: expected >= 0")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas={betas}: each must be in [0, 1)")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear the gradients (``None`` when ``set_grad_none``, the default)."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Lion step for every parameter with a gradient; returns ``closure()``'s loss (if given)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients")
                if not self.state[p]:
                    self.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            grads = [p.grad.to(p.dtype) for p in params]
            exp_avgs = [self.state[p]["exp_avg"] for p in params]
            beta1, beta2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            if wd:
                torch._foreach_mul_(params, 1.0 - lr * wd)
            update = torch._foreach_lerp(exp_avgs, grads, 1.0 - beta1)
            torch._foreach_sign_(update)
            torch._foreach_add_(params, update, alpha=-lr)
            torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta2)
        return loss


class DeepSpeedCPULion(Lion):
    """Lion with ``deepspeed.ops.lion.DeepSpeedCPULion``'s arguments."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, fp32_optimizer_states: bool = True) -> None:
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.fp32_optimizer_states = fp32_optimizer_states
        if fp32_optimizer_states:
            _check_fp32_states(self, "DeepSpeedCPULion")


class FusedLion(Lion):
    """Lion with ``deepspeed.ops.lion.FusedLion``'s arguments (multi-tensor PyTorch ops)."""


ZERO_ELEMENTWISE: tuple[type, ...] = (FusedAdam, DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion, FusedLion)
"""The optimizers here (DeepSpeed's names) whose update of an element depends only on that element: ZeRO steps them
on slices of flat partitions without ``zero_allow_untested_optimizer``, as DeepSpeed's ZeRO accepts them."""

ZERO_OFFLOAD_CLIENT: tuple[type, ...] = (DeepSpeedCPUAdam, DeepSpeedCPULion)
"""The CPU optimizers DeepSpeed's ZeRO-Offload takes from a client while ``zero_force_ds_cpu_optimizer`` is true."""
