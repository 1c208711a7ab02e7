"""Tensor helpers DeepSpeed code imports from ``deepspeed.runtime.utils`` and ``deepspeed.checkpoint.utils``."""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["clone_tensors_for_torch_save", "move_to_device", "set_random_seed"]


def move_to_device(item: Any, device: torch.device | str, criterion_func: Any = None) -> Any:
    """``item`` with every tensor inside (lists, tuples, dicts, nested) moved to ``device``.

    With ``criterion_func`` only tensors for which it returns true move; others are returned as
    they are (DeepSpeed's ``deepspeed.runtime.utils.move_to_device``).
    """
    if torch.is_tensor(item):
        if criterion_func is None or criterion_func(item):
            return item.to(device)
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        moved = [move_to_device(v, device, criterion_func) for v in item]
        return type(item)(*moved) if hasattr(item, "_fields") else tuple(moved)
    if isinstance(item, dict):
        out = {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
        return out if type(item) is dict else type(item)(out)
    return item


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """A copy of ``item`` whose tensors are detached clones on ``device``.

    ``torch.save`` of a view writes its whole storage; cloning first writes only the tensor
    (DeepSpeed's ``deepspeed.checkpoint.utils.clone_tensors_for_torch_save``). Containers are
    rebuilt with the same type; other values are returned as they are.
    """
    if torch.is_tensor(item):
        if isinstance(item, torch.nn.Parameter):
            return torch.nn.Parameter(item.detach().clone().to(device), requires_grad=item.requires_grad)
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        out = type(item)() if type(item) is not dict else {}
        for k, v in item.items():
            out[k] = clone_tensors_for_torch_save(v, device)
        return out
    return item


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's (when installed) and torch's generators (all devices)."""
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
