"""``deepspeed.git_version_info``: DeepSpeed's build record, describing the microspeed stand-in.

DeepSpeed's installer writes this module (``version``, ``git_hash``, ``git_branch``, ``installed_ops``,
``accelerator_name``, ``torch_info``); tools and DeepSpeed's own test harness read it. Here it reports the
stand-in: its version, no prebuilt DeepSpeed op (microspeed builds none: its CPU optimizers are plain torch),
the accelerator microspeed picks, and the torch it runs on. ``"0.0"`` is DeepSpeed's marker for "not built
against it": readers fall back to asking torch at run time.
"""

from __future__ import annotations

import torch

import deepspeed as _deepspeed
from deepspeed.ops import op_builder as _op_builder
from microspeed.compat.accelerator import get_accelerator as _get_accelerator

version: str = _deepspeed.__version__
"""The stand-in's version, ``0.19.8+microspeed``."""

git_hash: str = "[none]"
"""No DeepSpeed commit was built: the stand-in is microspeed's."""

git_branch: str = "[none]"
"""No DeepSpeed branch was built: the stand-in is microspeed's."""

#: DeepSpeed's op names -> whether a prebuilt kernel is installed: none is (microspeed builds no extension).
installed_ops: dict[str, bool] = dict.fromkeys(
    ("async_io", "cpu_adagrad", "cpu_adam", "cpu_lion", "fused_adam", "fused_lamb", "fused_lion", "pin_memory"),
    False)

#: Which ops work here: those microspeed implements in torch (see :mod:`deepspeed.ops.op_builder`).
compatible_ops: dict[str, bool] = dict(_op_builder.COMPATIBLE_OPS)

accelerator_name: str = _get_accelerator().device_name()
"""The accelerator microspeed uses in this process (``cpu`` or ``cuda``)."""


def _major_minor(text: str | None) -> str:
    """``"2.13.0+cpu"`` -> ``"2.13"``; ``None`` (not built with it) -> ``"0.0"``."""
    if not text:
        return "0.0"
    parts = text.split("+")[0].split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 else "0.0"


def _nccl_version() -> str:
    """NCCL's ``major.minor`` when torch was built with CUDA and NCCL, else ``"0.0"``."""
    if torch.version.cuda is None:
        return "0.0"
    try:
        found = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return "0.0"
    return f"{found[0]}.{found[1]}"


#: The torch this runs on, in DeepSpeed's keys: ``version``, ``bf16_support``, ``cuda_version``,
#: ``nccl_version``, ``hip_version`` (``"0.0"`` where torch has none).
torch_info: dict[str, object] = {
    "version": _major_minor(torch.__version__),
    "bf16_support": bool(_get_accelerator().is_bf16_supported()),
    "cuda_version": _major_minor(torch.version.cuda),
    "nccl_version": _nccl_version(),
    "hip_version": _major_minor(getattr(torch.version, "hip", None)),
}

__all__ = ["accelerator_name", "compatible_ops", "git_branch", "git_hash", "installed_ops", "torch_info", "version"]
