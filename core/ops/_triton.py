"""Shared plumbing of the fused kernels in :mod:`microspeed.ops`: importing Triton, choosing a backend, checks.

Every fused op (:mod:`~microspeed.ops.fused_layernorm`, :mod:`~microspeed.ops.fused_bias_gelu`,
:mod:`~microspeed.ops.fused_softmax`, :mod:`~microspeed.ops.fused_adam`) has two implementations: Triton kernels
and a plain PyTorch path. Which one runs for a tensor is decided by :func:`select_backend`:

* ``MICROSPEED_OPS_BACKEND=torch`` forces the PyTorch path, ``MICROSPEED_OPS_BACKEND=triton`` forces the kernels
  (an error if they cannot run on that tensor: Triton missing, or a CPU tensor without the interpreter);
* unset, empty or ``auto``: the kernels for CUDA tensors (when Triton imports), and for CPU tensors when the
  kernels were decorated under the Triton interpreter (``TRITON_INTERPRET=1`` in the environment *before* the
  op's module was first imported); the PyTorch path everywhere else.

When Triton is not installed, :data:`jit` is a stand-in decorator that leaves the kernel functions undecorated
(they are then never launched), so the modules import and their PyTorch paths work.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "BACKEND_ENV",
    "FLOAT_DTYPES",
    "HAVE_TRITON",
    "check_float_tensor",
    "compute_dtype",
    "is_interpreted",
    "jit",
    "next_power_of_2",
    "num_warps_for",
    "select_backend",
    "tl",
    "triton",
]

BACKEND_ENV = "MICROSPEED_OPS_BACKEND"
"""Environment variable that forces the implementation of every fused op: ``triton``, ``torch``, or ``auto``."""

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""The dtypes the fused kernels accept (their arithmetic is fp32 whatever the storage dtype)."""

HAVE_TRITON: bool
"""Whether Triton imported (the kernels can only run when it did)."""

try:  # pragma: no branch - the environment decides
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton ships with this project's environment
    triton = None
    tl = None
    HAVE_TRITON = False


def _no_triton_jit(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Stand-in for ``triton.jit`` when Triton is missing: the function stays a plain (never launched) function."""
    return fn


jit: Callable[..., Any] = triton.jit if HAVE_TRITON else _no_triton_jit
"""``triton.jit`` (or a stand-in that decorates nothing when Triton is not installed)."""


def is_interpreted(kernel: Any) -> bool:
    """Whether ``kernel`` (a decorated ``@jit`` function) runs in the Triton interpreter (``TRITON_INTERPRET=1``
    was set when it was decorated): such kernels run on CPU tensors, slowly."""
    return type(kernel).__name__ == "InterpretedFunction"


def select_backend(t: Any, interpreted: bool, op: str) -> str:
    """``'triton'`` or ``'torch'``: the implementation ``op`` uses for tensors like ``t`` (see the module docstring).

    ``interpreted`` says whether ``op``'s kernels were decorated under the interpreter. Raises ``ValueError``
    for a bad :data:`BACKEND_ENV` value and ``RuntimeError`` when the kernels are forced but cannot run.
    """
    choice = os.environ.get(BACKEND_ENV, "").strip().lower()
    if choice not in ("", "auto", "triton", "torch"):
        raise ValueError(f"{BACKEND_ENV}={os.environ[BACKEND_ENV]!r}: expected 'triton', 'torch' or 'auto'")
    if choice == "torch":
        return "torch"
    is_tensor = isinstance(t, torch.Tensor)
    runnable = HAVE_TRITON and is_tensor and (interpreted or (t.is_cuda and torch.cuda.is_available()))
    if choice == "triton":
        if not HAVE_TRITON:
            raise RuntimeError(f"{op}: {BACKEND_ENV}=triton but Triton is not installed; "
                               "install it (pip install 'microspeed[kernels]') or unset the variable")
        if not runnable:
            where = t.device if is_tensor else type(t).__name__
            raise RuntimeError(f"{op}: {BACKEND_ENV}=triton but the kernels cannot run on {where}: they need a CUDA "
                               "tensor, or TRITON_INTERPRET=1 set before the op's module is first imported")
        return "triton"
    return "triton" if runnable else "torch"


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def num_warps_for(block: int) -> int:
    """A warp count for a program that holds ``block`` fp32 values of one row: 1 warp per 256 values, 1 to 16."""
    return min(max(block // 256, 1), 16)


def check_float_tensor(name: str, t: Any, *, min_dim: int = 0) -> torch.Tensor:
    """Check that ``t`` is an fp32/fp16/bf16 tensor with at least ``min_dim`` dimensions; returns it.

    Raises ``TypeError`` for a non-tensor and ``ValueError`` (naming ``name`` and the fix) otherwise.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: expected dtype float32, float16 or bfloat16, got {t.dtype}; convert it first "
                         "(e.g. .float())")
    if t.dim() < min_dim:
        raise ValueError(f"{name}: expected at least {min_dim} dimension(s), got shape {tuple(t.shape)}")
    return t


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a PyTorch reference computes ``t`` in: fp32 for fp16/bf16/fp32, ``t``'s own for wider ones."""
    return torch.promote_types(t.dtype, torch.float32)
