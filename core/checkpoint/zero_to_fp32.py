"""DeepSpeed's ``zero_to_fp32`` functions over microspeed checkpoints (``deepspeed.utils.zero_to_fp32``).

microspeed checkpoints already hold full, named tensors (:mod:`microspeed.checkpoint`), so
consolidating is reading them: :func:`get_fp32_state_dict_from_zero_checkpoint` returns the module's
state dict in fp32 (fp32 master weights where the run was fp16/bf16), as DeepSpeed's function of the
same name does for its ZeRO shards. A folder written by real DeepSpeed is read too
(:func:`microspeed.checkpoint.deepspeed_format.read_deepspeed`).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from microspeed.checkpoint import (
    CheckpointError,
    get_fp32_state_dict,
    resolve_tag_dir,
    save_state_dict_file,
)

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
]


def _is_microspeed(checkpoint_dir: str, tag: str | None) -> bool:
    try:
        tag_dir = resolve_tag_dir(checkpoint_dir, tag)
    except (CheckpointError, OSError):
        return False
    return os.path.isfile(os.path.join(tag_dir, "manifest.msgpack"))


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The module's state dict with floating-point tensors in fp32, from a checkpoint folder.

    ``checkpoint_dir`` is the folder given to ``save_checkpoint`` (``tag`` default: the one named
    in ``latest``). Works without a process group. ``lazy_mode=True`` (DeepSpeed returns lazily
    loaded tensors to save memory) returns loaded tensors: the same values, with a warning that the
    memory saving does not apply. ``exclude_frozen_parameters=True`` is refused: a microspeed
    checkpoint does not record which parameters were frozen.
    """
    if exclude_frozen_parameters:
        raise ValueError("get_fp32_state_dict_from_zero_checkpoint(exclude_frozen_parameters=True): a microspeed "
                         "checkpoint does not record which parameters were frozen; drop the frozen names from the "
                         "returned dict yourself (those with requires_grad=False in your model)")
    if lazy_mode:
        warnings.warn("get_fp32_state_dict_from_zero_checkpoint(lazy_mode=True): microspeed returns loaded tensors "
                      "(the same values); the memory saving of lazy loading does not apply", stacklevel=2)
    if _is_microspeed(checkpoint_dir, tag):
        return get_fp32_state_dict(checkpoint_dir, tag)
    from microspeed.checkpoint.deepspeed_format import read_deepspeed

    read = read_deepspeed(checkpoint_dir, tag)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in read["module"].items():
        t = read["masters"].get(name, tensor)
        out[name] = t.float() if t.is_floating_point() else t
    for name, target in read.get("aliases", {}).items():
        if target in out:
            out[name] = out[target]
    return out


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str, max_shard_size: str = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> str:
    """Write the fp32 state dict to ``output_dir`` (``pytorch_model.bin`` or ``model.safetensors``); returns the file.

    Unlike DeepSpeed this writes one file whatever ``max_shard_size`` says; a ``max_shard_size`` the
    state dict exceeds is refused rather than ignored.
    """
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    limit = _parse_size(max_shard_size)
    total = sum(t.numel() * t.element_size() for t in {id(t): t for t in state.values()}.values())
    if total > limit:
        raise ValueError(f"convert_zero_checkpoint_to_fp32_state_dict(max_shard_size={max_shard_size!r}): the state "
                         f"dict is {total} bytes and microspeed writes one file; raise max_shard_size")
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "model.safetensors" if safe_serialization else "pytorch_model.bin")
    if safe_serialization:  # safetensors refuses shared storage: store tied tensors separately
        state = {k: v.contiguous().clone() for k, v in state.items()}
    save_state_dict_file(state, path)
    return path


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str,
                                         tag: str | None = None) -> torch.nn.Module:
    """Load the fp32 weights of a checkpoint into ``model`` (moved to the CPU, as DeepSpeed does); returns it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def _parse_size(size: Any) -> int:
    """``"5GB"`` / ``"500MB"`` / an int -> bytes."""
    if isinstance(size, int):
        return size
    text = str(size).strip().upper()
    for unit, mult in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3),
                       ("B", 1)):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * mult)
    return int(text)

