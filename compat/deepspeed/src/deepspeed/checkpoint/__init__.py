"""``deepspeed.checkpoint``: checkpoint helpers (``utils.clone_tensors_for_torch_save``) and microspeed's readers."""

from deepspeed.checkpoint import utils
from microspeed.checkpoint import get_fp32_state_dict
from microspeed.checkpoint_deepspeed import read_deepspeed

__all__ = ["get_fp32_state_dict", "read_deepspeed", "utils"]
