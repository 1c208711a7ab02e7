"""``deepspeed.runtime.utils``: tensor helpers from :mod:`microspeed.tensor_utils`."""

from microspeed.tensor_utils import clone_tensors_for_torch_save, move_to_device, set_random_seed

__all__ = ["clone_tensors_for_torch_save", "move_to_device", "set_random_seed"]
