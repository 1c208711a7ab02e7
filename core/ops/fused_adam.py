"""Multi-tensor Adam/AdamW: :class:`FusedAdam`, with ``deepspeed.ops.adam.FusedAdam``'s constructor.

One optimizer step updates every parameter, its ``exp_avg`` and its ``exp_avg_sq`` in place with **one Triton
launch per dtype bucket** (parameters of all groups with the same param/grad dtype and device share a bucket;
a model in one dtype takes one launch per step):

* a *chunk table* (int64 ``[chunks, 6]``) cuts every tensor into chunks of :data:`CHUNK` elements; a row holds
  the chunk's element offsets into the param, grad, exp_avg and exp_avg_sq memory, its length, and its tensor's
  index. The offsets are relative to the lowest address of each kind in the bucket (so they are never negative),
  which the kernel receives as its four base pointers: the tensors stay where they are, nothing is flattened or
  copied. The table is rebuilt only when an address changes (e.g. new gradient tensors).
* a *hyper table* (fp32 ``[tensors, 8]``), built per step, holds each tensor's coefficients: the decoupled
  decay ``1 - lr * weight_decay`` (AdamW) or the L2 coefficient (Adam), ``1 - beta1``, ``beta2``, ``1 - beta2``,
  ``eps``, ``lr / (1 - beta1^step)`` and ``sqrt(1 - beta2^step)``; so groups with different ``lr`` or
  ``weight_decay``, and parameters with different step counts, share the launch.

The arithmetic follows ``torch.optim.AdamW`` (``adam_w_mode=True``) or ``torch.optim.Adam`` with L2 weight
decay (``adam_w_mode=False``) operation by operation, in fp32, so fp32 results match them to rounding. fp16/bf16
parameters keep fp16/bf16 state (as DeepSpeed's does) and are updated in fp32 registers.

Without Triton kernels to run (CPU tensors outside the interpreter, or ``MICROSPEED_OPS_BACKEND=torch``; see
:mod:`microspeed.ops._triton`) the same step runs as ``torch._foreach_*`` ops, one bucket at a time; the same
happens for non-contiguous parameters on the Triton path. ``amsgrad=True`` is refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from microspeed.ops import _triton
from microspeed.ops._triton import jit, tl

__all__ = ["CHUNK", "INTERPRETED", "FusedAdam", "backend_for"]

CHUNK = 8192
"""Elements per row of the chunk table (one program each); a program walks its chunk 1024 elements at a time."""

_BLOCK = 1024
_OP = "FusedAdam"


@jit
def _adam_kernel(p_base, g_base, m_base, v_base, table_ptr, hyper_ptr, ADAM_W: tl.constexpr, CHUNK: tl.constexpr,
                 BLOCK: tl.constexpr):
    """One Adam/AdamW update of the chunk in row ``program_id`` of the chunk table."""
    row = table_ptr + tl.program_id(0).to(tl.int64) * 6
    p_off = tl.load(row)
    g_off = tl.load(row + 1)
    m_off = tl.load(row + 2)
    v_off = tl.load(row + 3)
    n = tl.load(row + 4)
    hyper = hyper_ptr + tl.load(row + 5) * 8
    decay = tl.load(hyper)  # AdamW: 1 - lr * wd; Adam: the L2 coefficient wd
    one_minus_beta1 = tl.load(hyper + 1)
    beta2 = tl.load(hyper + 2)
    one_minus_beta2 = tl.load(hyper + 3)
    eps = tl.load(hyper + 4)
    step_size = tl.load(hyper + 5)
    bc2_sqrt = tl.load(hyper + 6)
    for start in tl.static_range(0, CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < n
        p = tl.load(p_base + p_off + offs, mask=inside, other=0.0).to(tl.float32)
        g = tl.load(g_base + g_off + offs, mask=inside, other=0.0).to(tl.float32)
        m = tl.load(m_base + m_off + offs, mask=inside, other=0.0).to(tl.float32)
        v = tl.load(v_base + v_off + offs, mask=inside, other=0.0).to(tl.float32)
        if ADAM_W:
            p = p * decay
        else:
            g = g + decay * p
        m = m + one_minus_beta1 * (g - m)
        v = v * beta2 + one_minus_beta2 * g * g
        denom = tl.sqrt(v) / bc2_sqrt + eps
        p = p - step_size * (m / denom)
        tl.store(p_base + p_off + offs, p.to(p_base.dtype.element_ty), mask=inside)
        tl.store(m_base + m_off + offs, m.to(m_base.dtype.element_ty), mask=inside)
        tl.store(v_base + v_off + offs, v.to(v_base.dtype.element_ty), mask=inside)


INTERPRETED: bool = _triton.is_interpreted(_adam_kernel)
"""Whether this module's kernel was decorated under the Triton interpreter (it then runs on CPU tensors)."""


def backend_for(t: torch.Tensor) -> str:
    """``'triton'`` or ``'torch'``: how :class:`FusedAdam` updates a parameter like ``t``
    (``MICROSPEED_OPS_BACKEND`` forces one; see :mod:`microspeed.ops._triton`)."""
    return _triton.select_backend(t, INTERPRETED, _OP)


class _Item:
    """One parameter of a step: its tensors and its per-step coefficients."""

    __slots__ = ("exp_avg", "exp_avg_sq", "grad", "hyper", "param")

    def __init__(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 hyper: tuple[float, ...]) -> None:
        self.param, self.grad, self.exp_avg, self.exp_avg_sq, self.hyper = param, grad, exp_avg, exp_avg_sq, hyper


class FusedAdam(torch.optim.Optimizer):
    """Adam/AdamW whose step is one multi-tensor Triton launch per dtype bucket (see the module docstring).

    Same constructor as ``deepspeed.ops.adam.FusedAdam``: ``adam_w_mode=True`` decouples the weight decay
    (``torch.optim.AdamW``), ``False`` adds it to the gradient (L2, ``torch.optim.Adam``);
    ``bias_correction=False`` drops Adam's bias corrections; ``amsgrad=True`` is refused (``ValueError``);
    ``set_grad_none=True`` makes :meth:`zero_grad` set gradients to ``None``. Per parameter, the state holds
    ``step`` (an int), ``exp_avg`` and ``exp_avg_sq``. ``backend`` is the set of implementations the last
    :meth:`step` used (``{'triton'}``, ``{'torch'}`` or both).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:
        if amsgrad:
            raise ValueError("amsgrad: FusedAdam does not implement the AMSGrad variant; use "
                             "torch.optim.Adam(..., amsgrad=True) (or AdamW) instead")
        _check_hyper(lr, betas, eps, weight_decay)
        defaults = {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                    "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.adam_w_mode = bool(adam_w_mode)
        self.set_grad_none = bool(set_grad_none)
        self.backend: set[str] = set()
        self._tables: dict[tuple[Any, ...], tuple[tuple[tuple[int, int], ...], torch.Tensor]] = {}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (as ``torch.optim.Optimizer`` does), checking its hyperparameters and parameter dtypes."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        for p in group["params"]:
            if p.dtype not in _triton.FLOAT_DTYPES:
                raise ValueError(f"params: FusedAdam updates float32, float16 and bfloat16 parameters, got one of "
                                 f"dtype {p.dtype} and shape {tuple(p.shape)}; leave it out of the optimizer")

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear the gradients: set them to ``None`` (``set_to_none``, default ``set_grad_none``) or zero them."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Adam/AdamW step for every parameter with a gradient; returns ``closure()``'s loss (if given)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        buckets: dict[tuple[Any, ...], list[_Item]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedAdam does not support sparse gradients; use torch.optim.SparseAdam")
                if p.grad.shape != p.shape:
                    raise ValueError(f"params: a gradient of shape {tuple(p.grad.shape)} for a parameter of shape "
                                     f"{tuple(p.shape)}; gradients must have their parameter's shape")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                item = _Item(p, p.grad, state["exp_avg"], state["exp_avg_sq"], self._hyper(group, state["step"]))
                backend = backend_for(p)
                if backend == "triton" and not (p.is_contiguous() and state["exp_avg"].is_contiguous()
                                                and state["exp_avg_sq"].is_contiguous()):
                    backend = "torch"  # the kernel walks memory linearly
                buckets.setdefault((backend, p.device, p.dtype, p.grad.dtype), []).append(item)
        self.backend = {key[0] for key in buckets}
        for key, items in buckets.items():
            if key[0] == "triton":
                self._step_triton(key, items)
            else:
                self._step_foreach(items)
        return loss

    def _hyper(self, group: dict[str, Any], step: int) -> tuple[float, ...]:
        """The kernel's coefficients for a parameter of ``group`` at ``step`` (see the hyper table)."""
        beta1, beta2 = group["betas"]
        lr, wd = group["lr"], group["weight_decay"]
        if group["bias_correction"]:
            bc1, bc2 = 1.0 - beta1**step, 1.0 - beta2**step
        else:
            bc1 = bc2 = 1.0
        decay = 1.0 - lr * wd if self.adam_w_mode else wd
        return (decay, 1.0 - beta1, beta2, 1.0 - beta2, group["eps"], lr / bc1, math.sqrt(bc2), 0.0)

    def _step_foreach(self, items: list[_Item]) -> None:
        """The step as ``torch._foreach_*`` ops (the same arithmetic as the kernel, in the parameters' dtype)."""
        by_hyper: dict[tuple[float, ...], list[_Item]] = {}
        for item in items:
            by_hyper.setdefault(item.hyper, []).append(item)
        for hyper, group in by_hyper.items():
            decay, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bc2_sqrt, _ = hyper
            params = [i.param for i in group]
            grads = [i.grad.to(i.param.dtype) for i in group]
            exp_avgs = [i.exp_avg for i in group]
            exp_avg_sqs = [i.exp_avg_sq for i in group]
            if self.adam_w_mode:
                if decay != 1.0:
                    torch._foreach_mul_(params, decay)
            elif decay != 0.0:
                grads = torch._foreach_add(grads, params, alpha=decay)
            torch._foreach_lerp_(exp_avgs, grads, one_minus_beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, one_minus_beta2)
            denom = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_div_(denom, bc2_sqrt)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(params, exp_avgs, denom, -step_size)

    def _step_triton(self, key: tuple[Any, ...], items: list[_Item]) -> None:
        """The step of one bucket as one launch of :func:`_adam_kernel`."""
        items = [i for i in items if i.param.numel() > 0]
        if not items:
            return
        device = items[0].param.device
        grads = [i.grad if i.grad.is_contiguous() else i.grad.contiguous() for i in items]
        kinds = ([i.param for i in items], grads, [i.exp_avg for i in items], [i.exp_avg_sq for i in items])
        bases = [min(tensors, key=lambda t: t.data_ptr()) for tensors in kinds]
        ptrs = tuple((t.data_ptr(), t.numel()) for tensors in kinds for t in tensors)
        cached = self._tables.get(key)
        if cached is not None and cached[0] == ptrs:
            table = cached[1]
        else:
            table = _chunk_table(kinds, bases, device)
            self._tables[key] = (ptrs, table)
        hyper = torch.tensor([i.hyper for i in items], dtype=torch.float32).to(device, non_blocking=True)
        _adam_kernel[(table.shape[0],)](*bases, table, hyper, ADAM_W=self.adam_w_mode, CHUNK=CHUNK, BLOCK=_BLOCK,
                                        num_warps=4)


def _chunk_table(kinds: tuple[list[torch.Tensor], ...], bases: list[torch.Tensor], device: torch.device
                 ) -> torch.Tensor:
    """The int64 ``[chunks, 6]`` table of :func:`_adam_kernel` (see the module docstring), on ``device``."""
    offsets = []
    for tensors, base in zip(kinds, bases, strict=True):
        size, origin = base.element_size(), base.data_ptr()
        column = []
        for t in tensors:
            delta = t.data_ptr() - origin
            if delta % size:
                raise RuntimeError(f"FusedAdam: a tensor at address {t.data_ptr():#x} is not aligned to its "
                                   f"{size}-byte elements relative to {origin:#x}; cannot address it from one base")
            column.append(delta // size)
        offsets.append(torch.tensor(column, dtype=torch.int64))
    numels = torch.tensor([t.numel() for t in kinds[0]], dtype=torch.int64)
    counts = (numels + CHUNK - 1) // CHUNK
    tensor_index = torch.repeat_interleave(torch.arange(len(numels)), counts)
    first_chunk = torch.cumsum(counts, 0) - counts
    start = (torch.arange(int(counts.sum())) - first_chunk[tensor_index]) * CHUNK
    table = torch.stack([offsets[0][tensor_index] + start, offsets[1][tensor_index] + start,
                         offsets[2][tensor_index] + start, offsets[3][tensor_index] + start,
                         torch.clamp(numels[tensor_index] - start, max=CHUNK), tensor_index], dim=1)
    return table.to(device)


def _check_hyper(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:
    """Raise ``ValueError`` naming the first bad hyperparameter."""
    if not isinstance(lr, (int, float)) or not 0.0 <= lr < math.inf:
        raise ValueError(f"lr: expected a finite number >= 0, got {lr!r}")
    if (not isinstance(betas, (tuple, list)) or len(betas) != 2
            or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"betas: expected two numbers in [0, 1), got {betas!r}")
    if not isinstance(eps, (int, float)) or not 0.0 <= eps < math.inf:
        raise ValueError(f"eps: expected a finite number >= 0, got {eps!r}")
    if not isinstance(weight_decay, (int, float)) or not 0.0 <= weight_decay < math.inf:
        raise ValueError(f"weight_decay: expected a finite number >= 0, got {weight_decay!r}")
