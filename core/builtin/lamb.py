"""LAMB with the parameter names and update rule of DeepSpeed's ``FusedLamb``.

LAMB (You et al., 2019, https://arxiv.org/abs/1904.00962) scales an Adam-style update of every
parameter tensor by a per-tensor trust ratio. The variant here follows DeepSpeed's fused CUDA kernel,
which differs from the paper in a few places that matter for parity:

* Bias correction is folded into the step size, ``lr * sqrt(1 - beta2**t) / (1 - beta1**t)``; the
  update whose norm feeds the trust ratio is built from the *uncorrected* moments.
* ``update = exp_avg / (sqrt(exp_avg_sq) + eps) + weight_decay * p`` (``eps_inside_sqrt=True`` puts
  ``eps`` under the square root instead).
* The trust ratio ``||p|| / ||update||`` is clamped to ``[min_coeff, max_coeff]``; it is exactly 1
  when either norm is zero (a freshly zeroed bias, for example).
* Gradients are divided by ``scale`` (the loss scale) and, with ``max_grad_norm > 0``, additionally
  by the clip factor ``(grad_norm / scale + 1e-6) / max_grad_norm`` when that factor exceeds 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

__all__ = ["Lamb"]


class Lamb(torch.optim.Optimizer):
    """The LAMB optimizer, numerically matching DeepSpeed's ``FusedLamb``, for any device.

    Args:
        params: tensors or parameter-group dicts to optimize.
        lr: learning rate.
        bias_correction: fold Adam's bias corrections into the step size.
        betas: decay rates of the first and second moment estimates.
        eps: added to the root of the second moment (or under the root, see ``eps_inside_sqrt``).
        weight_decay: decoupled weight decay, added to the update before the trust ratio.
        max_grad_norm: clip threshold for a parameter group's gradient norm; 0 disables clipping.
        max_coeff: upper bound of the trust ratio.
        min_coeff: lower bound of the trust ratio.
        amsgrad: not supported; ``True`` raises ``ValueError`` (DeepSpeed refuses it too).
        eps_inside_sqrt: DeepSpeed's ``eps_inside_sqrt``: use ``sqrt(v + eps)`` as denominator.

    After each :meth:`step`, :meth:`get_lamb_coeffs` returns the trust ratio used for each
    parameter that had a gradient, in parameter-group order.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        *,
        eps_inside_sqrt: bool = False,
    ) -> None:
        if amsgrad:
            raise ValueError(
                "Invalid amsgrad value: True; Lamb (like DeepSpeed's FusedLamb) has no AMSGrad variant"
            )
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}; must be >= 0")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}; must be >= 0")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Invalid betas value: {betas}; must be two numbers in [0, 1)")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}; must be >= 0")
        if not 0.0 <= max_grad_norm:
            raise ValueError(f"Invalid max_grad_norm value: {max_grad_norm}; must be >= 0 (0 disables)")
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(
                f"Invalid min_coeff/max_coeff values: {min_coeff}/{max_coeff}; "
                "need 0 <= min_coeff <= max_coeff"
            )
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
            eps_inside_sqrt=eps_inside_sqrt,
        )
        super().__init__(params, defaults)
        self.lamb_coeffs: list[torch.Tensor] = []

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickled optimizer, filling in options added after it was saved."""
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("eps_inside_sqrt", False)
        self.__dict__.setdefault("lamb_coeffs", [])

    def get_lamb_coeffs(self) -> list[float]:
        """Trust ratios of the last step, one per parameter that had a gradient, in group order."""
        if not self.lamb_coeffs:
            return []
        return torch.stack([c.detach().float().cpu() for c in self.lamb_coeffs]).tolist()

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], float] | None = None,
        *,
        scale: float = 1.0,
        grad_norms: Sequence[float | torch.Tensor | None] | None = None,
    ) -> float | None:
        """Perform one optimization step.

        Args:
            closure: re-evaluates the model and returns the loss.
            scale: the gradients are divided by this (a loss scale), as in DeepSpeed.
            grad_norms: one norm per parameter group, of the gradients *as stored* (that is, still
                multiplied by ``scale``); used only by groups with ``max_grad_norm > 0``. Where it
                is not given, the group's L2 norm over all its gradients is computed here.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_norms is not None and len(grad_norms) != len(self.param_groups):
            raise ValueError(
                f"grad_norms has {len(grad_norms)} entries, expected one per parameter group "
                f"({len(self.param_groups)})"
            )

        coeffs: list[torch.Tensor] = []
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("Lamb does not support sparse gradients")
            grads = [p.grad for p in params]

            combined_scale: float | torch.Tensor = scale
            if group["max_grad_norm"] > 0:
                norm = grad_norms[index] if grad_norms is not None else None
                if norm is None:
                    norm = _total_norm(grads)
                clip = (norm / scale + 1e-6) / group["max_grad_norm"]
                # Divide by clip * scale only where clip > 1 (no host sync for a tensor norm).
                clip = torch.clamp(clip, min=1.0) if torch.is_tensor(clip) else max(clip, 1.0)
                combined_scale = scale * clip

            coeffs.extend(self._update_group(group, params, grads, combined_scale))
        self.lamb_coeffs = coeffs
        return loss

    def _update_group(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        combined_scale: float | torch.Tensor,
    ) -> list[torch.Tensor]:
        """Update the parameters of one group that have gradients; return their trust ratios."""
        beta1, beta2 = group["betas"]
        # Bucket by (device, dtype) so that each bucket can run as one set of foreach kernels.
        buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, p in enumerate(params):
            buckets.setdefault((p.device, p.dtype), []).append(i)

        coeffs: list[torch.Tensor | None] = [None] * len(params)
        for (device, dtype), indices in buckets.items():
            ps = [params[i] for i in indices]
            gs = [grads[i] for i in indices]
            step_sizes = []
            for p in ps:
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step_sizes.append(
                    _step_size(group["lr"], beta1, beta2, state["step"], group["bias_correction"])
                )
            exp_avgs = [self.state[p]["exp_avg"] for p in ps]
            exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in ps]

            if torch.is_tensor(combined_scale):
                gs = torch._foreach_div(gs, combined_scale.to(device=device, dtype=dtype))
            elif combined_scale != 1.0:
                gs = torch._foreach_div(gs, combined_scale)

            # m = beta1 * m + (1 - beta1) * g ;  v = beta2 * v + (1 - beta2) * g * g
            torch._foreach_mul_(exp_avgs, beta1)
            torch._foreach_add_(exp_avgs, gs, alpha=1.0 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, gs, gs, value=1.0 - beta2)
            del gs

            if group["eps_inside_sqrt"]:
                denom = torch._foreach_add(exp_avg_sqs, group["eps"])
                torch._foreach_sqrt_(denom)
            else:
                denom = torch._foreach_sqrt(exp_avg_sqs)
                torch._foreach_add_(denom, group["eps"])
            updates = torch._foreach_div(exp_avgs, denom)
            del denom
            if group["weight_decay"] != 0:
                torch._foreach_add_(updates, ps, alpha=group["weight_decay"])

            # Norms, trust ratios and step factors in fp32 at least, even for half-precision params.
            acc = torch.float64 if dtype == torch.float64 else torch.float32
            w_norm = torch.stack(torch._foreach_norm(ps)).to(acc)
            u_norm = torch.stack(torch._foreach_norm(updates)).to(acc)
            ratio = (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"])
            coeff = torch.where((w_norm != 0) & (u_norm != 0), ratio, torch.ones_like(ratio))
            factors = torch.tensor(step_sizes, device=device, dtype=acc).mul_(coeff).neg_()
            torch._foreach_mul_(updates, list(factors.unbind()))
            torch._foreach_add_(ps, updates)
            for i, c in zip(indices, coeff.unbind(), strict=True):
                coeffs[i] = c
        return coeffs  # type: ignore[return-value]


def _step_size(lr: float, beta1: float, beta2: float, step: int, bias_correction: bool) -> float:
    """DeepSpeed's step size: Adam's bias corrections folded into the learning rate."""
    if not bias_correction:
        return lr
    return lr * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)


def _total_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm over all elements of ``tensors`` (which may differ in device and dtype)."""
    acc = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    per_tensor = [n.to(device=tensors[0].device, dtype=acc) for n in torch._foreach_norm(tensors)]
    return torch.linalg.vector_norm(torch.stack(per_tensor))
