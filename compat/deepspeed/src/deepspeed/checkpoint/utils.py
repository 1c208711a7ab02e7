"""``deepspeed.checkpoint.utils``: :func:`microspeed.compat.tensor_utils.clone_tensors_for_torch_save`."""

from microspeed.compat.tensor_utils import clone_tensors_for_torch_save

__all__ = ["clone_tensors_for_torch_save"]
