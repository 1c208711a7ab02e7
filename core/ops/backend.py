"""Which implementation a Triton-backed op runs: one rule for every plugin's kernels.

Each kernel family has an environment variable (``MICROSPEED_MOE_KERNELS``, ``MICROSPEED_COMM_KERNELS``, ...)
set to ``triton``, ``torch`` or ``auto`` (the default): ``auto`` runs the Triton kernels for CUDA tensors when
Triton imports, and the PyTorch path for everything else.
"""

from __future__ import annotations

import functools
import os

import torch

CHOICES = ("triton", "torch", "auto")


def env_choice(env_var: str) -> str:
    """``'triton'``, ``'torch'`` or ``'auto'`` from ``env_var`` (unset or empty: ``'auto'``); else ``ValueError``."""
    choice = os.environ.get(env_var, "").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{env_var}={os.environ[env_var]!r}: expected 'triton', 'torch' or 'auto'")
    return choice


@functools.cache
def triton_importable() -> bool:
    """Whether ``import triton`` works here (checked once)."""
    try:
        import triton  # noqa: F401
    except Exception:  # an ImportError, or a broken install failing in its own way
        return False
    return True


def kernel_backend(t: object, env_var: str) -> str:
    """``'triton'`` or ``'torch'`` for tensors like ``t``, following ``env_var`` (see the module docstring)."""
    choice = env_choice(env_var)
    if choice != "auto":
        return choice
    if isinstance(t, torch.Tensor) and t.is_cuda and torch.cuda.is_available() and triton_importable():
        return "triton"
    return "torch"
