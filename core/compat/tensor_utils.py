"""Tensor helpers DeepSpeed code imports from ``deepspeed.runtime.utils`` and ``deepspeed.checkpoint.utils``."""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["PartitionedTensor", "clone_tensors_for_torch_save", "move_to_device", "set_random_seed"]


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


def _even_bounds(numel: int, parts: int) -> list[int]:
    """Cut points splitting ``numel`` elements into ``parts`` runs whose lengths differ by at most one."""
    base, extra = divmod(numel, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


class PartitionedTensor:
    """A tensor split over the ranks of a process group: each rank keeps one flat slice.

    ``PartitionedTensor(tensor, group)`` (every rank passes the same full tensor) keeps this rank's
    slice of the flattened tensor in :attr:`local_data`; :meth:`full` gathers the slices back into
    the original shape. :meth:`to_meta` describes the split as a 1-D ``long`` tensor (shape and cut
    points) small enough to send between pipeline stages; :meth:`from_meta` rebuilds the object on
    a receiver from that description and its slice. Slices differ in length by at most one element.
    (DeepSpeed's ``deepspeed.runtime.utils.PartitionedTensor``.)
    """

    def __init__(self, tensor: torch.Tensor, group: Any, partition_meta: torch.Tensor | None = None) -> None:
        from microspeed import comm

        self.group = group
        self.num_parts = comm.get_world_size(group=group)
        self.rank = comm.get_rank(group=group)
        self.orig_size = list(tensor.size())
        self.orig_device = tensor.device
        if partition_meta is None:
            self.partition = _even_bounds(tensor.numel(), self.num_parts)
            flat = tensor.detach().contiguous().view(-1)
            self.local_data = flat[self.partition[self.rank]:self.partition[self.rank + 1]].clone()
        else:
            self.orig_size, self.partition = self._read_meta(partition_meta, self.num_parts)
            self.local_data = tensor

    @staticmethod
    def _read_meta(meta: torch.Tensor, num_parts: int) -> tuple[list[int], list[int]]:
        """``(shape, cut points)`` from a :meth:`to_meta` tensor; ``ValueError`` when it does not fit the group."""
        values = [int(v) for v in meta.tolist()]
        ndims = values[0]
        shape = values[1:1 + ndims]
        parts = values[1 + ndims]
        bounds = values[2 + ndims:]
        if parts != num_parts or len(bounds) != parts + 1:
            raise ValueError(f"PartitionedTensor meta describes {parts} parts, the group has {num_parts} ranks")
        return shape, bounds

    @classmethod
    def from_meta(cls, meta: torch.Tensor, local_part: torch.Tensor, group: Any,
                  device: torch.device | str | None = None) -> PartitionedTensor:
        """The partitioned tensor described by ``meta`` (from :meth:`to_meta`) whose slice here is ``local_part``."""
        del device  # the slice stays where it is; full() gathers on its device
        return cls(tensor=local_part, group=group, partition_meta=meta)

    def to_meta(self) -> torch.Tensor:
        """``[ndims, *shape, num_parts, *cut_points]`` as a 1-D ``long`` tensor (on the CPU)."""
        return torch.tensor([len(self.orig_size), *self.orig_size, self.num_parts, *self.partition], dtype=torch.long)

    def data(self) -> torch.Tensor:
        """This rank's flat slice."""
        return self.local_data

    def local_size(self) -> torch.Size:
        """The size of this rank's flat slice (1-D)."""
        return self.local_data.size()

    def full(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The whole tensor, gathered from every rank's slice, in its original shape."""
        from microspeed import comm

        longest = max(self.partition[i + 1] - self.partition[i] for i in range(self.num_parts))
        padded = torch.zeros(longest * self.num_parts, dtype=self.local_data.dtype, device=self.local_data.device)
        mine = padded.narrow(0, self.rank * longest, self.local_data.numel())
        mine.copy_(self.local_data.view(-1))
        slots = list(padded.split(longest))
        comm.all_gather(slots, slots[self.rank].clone(), group=self.group)
        pieces = [slots[i][: self.partition[i + 1] - self.partition[i]] for i in range(self.num_parts)]
        flat = torch.cat(pieces) if pieces else padded[:0]
        out = flat.view(self.orig_size)
        return out if device is None else out.to(device)
