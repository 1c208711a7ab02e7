"""``deepspeed.runtime.zero.partition_parameters``: ``Init``, ``GatheredParameters`` and friends from microspeed.zero.

DeepSpeed's ``Init`` wraps ``torch.arange``/``eye``/``randn`` with :func:`zero_wrapper_for_fp_tensor_constructor`
to give new tensors the training dtype and device; microspeed's ``Init`` casts parameters instead and
leaves tensor constructors alone, so code that swaps this wrapper (transformers'
``prevent_arange_dtype_change``) finds it and its swap changes nothing, as intended.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from microspeed.compat.accelerator import get_accelerator  # noqa: F401 - clients reach it through this module

partitioned_param_data_shape = [0]
"""The shape a released ZeRO-3 parameter shows (``p.data`` is an empty placeholder; ``p.ds_shape`` is its real one)."""

_orig_torch_arange = torch.arange
_orig_torch_eye = torch.eye
_orig_torch_randn = torch.randn


def zero_wrapper_for_fp_tensor_constructor(fn: Callable[..., torch.Tensor], target_fp_dtype: torch.dtype | None,
                                           target_device: torch.device | None) -> Callable[..., torch.Tensor]:
    """``fn`` creating tensors on ``target_device`` (unless given), floating ones in ``target_fp_dtype``."""

    def wrapped_fn(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if target_fp_dtype is not None and tensor.is_floating_point():
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor

    return wrapped_fn


class MultipleAllGatherHandles:
    """Several pending gathers waited for as one: :meth:`wait` waits on each in turn."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def wait(self, handle_dependency: bool = True) -> None:
        """Wait on every handle, passing ``handle_dependency`` on by keyword."""
        for handle in self.handles:
            handle.wait(handle_dependency=handle_dependency)


_INTERNAL = "DeepSpeed's internal; microspeed's zero.Init partitions parameters its own way"

ABSENT: dict[str, str] = {
    "InsertPostInitMethodToModuleSubClasses": "the base class of DeepSpeed's zero.Init; use deepspeed.zero.Init "
                                              "(microspeed.zero.Init)",
    "zero3_linear_wrap": "DeepSpeed's memory-efficient linear for zero.Init(mem_efficient_linear=True); microspeed "
                         "runs torch's own linear",
    "CUDAQuantizer": "ZeRO++ quantized weights (zero_quantized_weights) are not offered",
    "get_allgather_dtype": _INTERNAL,
    "print_rank_0": "DeepSpeed's internal logging helper",
    "_orig_torch_empty": "microspeed's zero.Init does not wrap torch.empty",
    "_contradicting_single_rank_pg_error": _INTERNAL,
}
"""DeepSpeed names of this module microspeed does not provide, with the reason (others: ``Init``,
``GatheredParameters``, ``ZeroParamStatus``, ``register_external_parameter`` ... come from :mod:`microspeed.zero`)."""


def __getattr__(name: str) -> Any:
    from deepspeed.runtime.zero import absent_name

    return absent_name(__name__, name, ABSENT)
