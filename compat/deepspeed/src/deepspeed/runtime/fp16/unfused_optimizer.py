"""``deepspeed.runtime.fp16.unfused_optimizer``: ``FP16_UnfusedOptimizer``, a 16-bit optimizer wrapper.

Wraps a torch optimizer whose parameters are fp16 or bf16: the wrapped optimizer steps fp32 master copies
(one per parameter); :meth:`FP16_UnfusedOptimizer.backward` scales the loss, :meth:`step` unscales the
gradients into the masters, skips the step on an inf/NaN gradient (the scale shrinks), clips when
``clip_grad`` is set, steps and copies the masters back into the 16-bit parameters. The loss scale is one of
microspeed's scalers (:mod:`microspeed.builtin.loss_scaler`: DeepSpeed's dynamic rule with hysteresis, or a
static scale). It is a standalone wrapper: microspeed's engine keeps its own fp32 masters (the
mixed-precision built-in) and does not wrap the optimizer in this class.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from microspeed.builtin.loss_scaler import DynamicLossScaler, LossScaler, has_inf_or_nan, overflow_across_ranks

__all__ = ["FP16_UnfusedOptimizer"]


class FP16_UnfusedOptimizer:  # noqa: N801 - DeepSpeed's name
    """A 16-bit optimizer wrapper with fp32 masters per parameter (see the module docstring)."""

    def __init__(self, init_optimizer: torch.optim.Optimizer, deepspeed: Any = None, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: dict[str, Any] | None = None,
                 verbose: bool = True, mpu: Any = None, clip_grad: float = 0.0, fused_lamb_legacy: bool = False,
                 low_precision_dtype: torch.dtype = torch.float16) -> None:
        del deepspeed, verbose, fused_lamb_legacy
        if low_precision_dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"FP16_UnfusedOptimizer(low_precision_dtype={low_precision_dtype}): expected "
                             "torch.float16 or torch.bfloat16")
        self.optimizer = init_optimizer
        self.low_precision_dtype = low_precision_dtype
        self.mpu = mpu
        self.clip_grad = float(clip_grad)
        self.fp16_groups: list[list[torch.nn.Parameter]] = []
        self.fp32_groups: list[list[torch.nn.Parameter]] = []
        for group in self.optimizer.param_groups:
            low = list(group["params"])
            masters = [torch.nn.Parameter(p.detach().float().clone(), requires_grad=p.requires_grad) for p in low]
            self.fp16_groups.append(low)
            self.fp32_groups.append(masters)
            group["params"] = masters
        self.optimizer.state.clear()
        if dynamic_loss_scale:
            args = dict(dynamic_loss_args or {})
            self.scaler = DynamicLossScaler(init_scale=args.get("init_scale", 2.0**16),
                                            scale_window=args.get("scale_window", 1000),
                                            min_scale=args.get("min_scale", 1.0),
                                            delayed_shift=args.get("delayed_shift", 2),
                                            consecutive_hysteresis=args.get("consecutive_hysteresis", False),
                                            raise_error_at_min_scale=args.get("raise_error_at_min_scale", True))
        else:
            self.scaler = LossScaler(static_loss_scale)
        self.overflow = False

    # ------------------------------------------------------------------ DeepSpeed's attributes
    @property
    def loss_scale_config(self) -> SimpleNamespace:
        """``dynamic_loss_scale`` and ``cur_scale``, as DeepSpeed's ``loss_scale_config``."""
        return SimpleNamespace(dynamic_loss_scale=bool(getattr(self.scaler, "dynamic", False)),
                               cur_scale=self.scaler.cur_scale)

    @property
    def cur_scale(self) -> float:
        """The current loss scale."""
        return self.scaler.cur_scale

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's groups (their ``params`` are the fp32 masters)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's state (keyed by the fp32 masters)."""
        return self.optimizer.state

    # ------------------------------------------------------------------ training
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the 16-bit parameters' gradients (the masters' are filled by :meth:`step`)."""
        for group in self.fp16_groups:
            for p in group:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.detach_()
                    p.grad.zero_()

    def backward(self, loss: torch.Tensor, create_graph: bool = False, retain_graph: bool = False) -> None:
        """Backward of ``loss`` times the loss scale."""
        (loss.float() * self.scaler.cur_scale).backward(create_graph=create_graph, retain_graph=retain_graph)

    def _overflow(self) -> bool:
        grads = [p.grad for group in self.fp16_groups for p in group]
        local = has_inf_or_nan(grads)
        group = self.mpu.get_model_parallel_group() if self.mpu is not None else None
        return overflow_across_ranks(local, group=group) if torch.distributed.is_initialized() else local

    def step(self, closure: Any = None) -> bool:
        """Unscale, check for overflow, clip, step the masters and copy them back; return whether it overflowed."""
        del closure
        self.overflow = self._overflow()
        inv = 1.0 / self.scaler.cur_scale  # the scale the loss was multiplied with, before it is updated
        self.scaler.update_scale(self.overflow)
        if self.overflow:
            self.zero_grad()
            return True
        for low_group, master_group in zip(self.fp16_groups, self.fp32_groups, strict=True):
            for low, master in zip(low_group, master_group, strict=True):
                master.grad = None if low.grad is None else low.grad.detach().float() * inv
        if self.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_([m for g in self.fp32_groups for m in g if m.grad is not None],
                                           self.clip_grad)
        self.optimizer.step()
        with torch.no_grad():
            for low_group, master_group in zip(self.fp16_groups, self.fp32_groups, strict=True):
                for low, master in zip(low_group, master_group, strict=True):
                    low.copy_(master)
        self.zero_grad()
        return False
