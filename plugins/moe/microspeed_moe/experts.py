"""The experts of one MoE layer that live on this rank, named by their global index.

``Experts(expert, num_experts, ep_size)`` holds ``num_experts / ep_size`` copies of ``expert`` —
those of this rank's position in its expert-parallel group — in a ``ModuleDict`` keyed by the
*global* expert index (``"0"`` … ``"E−1"``), so a checkpoint written with ``ep_size`` 2 names the same
tensors as one written with 1 or 4, and loads into either. Every expert parameter is marked
``allreduce = False`` (DeepSpeed's mark): the data-parallel reducer leaves it to the MoE plugin, which
sums it over the expert-data-parallel group.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from microspeed_moe.groups import check_ep_size, expert_rank


class Experts(nn.Module):
    """This rank's experts of a layer (``num_local = num_experts / ep_size`` deep copies of ``expert``)."""

    def __init__(self, expert: nn.Module, num_experts: int, ep_size: int = 1, group_name: str | None = None) -> None:
        super().__init__()
        check_ep_size(ep_size, num_experts)
        self.num_experts, self.ep_size = num_experts, ep_size
        self.num_local = num_experts // ep_size
        self.first = expert_rank(ep_size) * self.num_local
        self.group_name = group_name or f"ep_size_{ep_size}"
        self.deepspeed_experts = nn.ModuleDict(
            {str(self.first + i): copy.deepcopy(expert) for i in range(self.num_local)})
        for p in self.parameters():
            p.allreduce = False
            p.group_name = self.group_name

    def place(self, ep_rank: int | None = None) -> None:
        """Re-key the local experts by this rank's position ``ep_rank`` in its expert-parallel group.

        A layer is built before its groups exist and places itself by the global rank (or the
        launcher's ``RANK``); once the groups say otherwise (the position in a pipeline stage's or a
        tensor rank's data axis), the same modules (and parameters) take the right global indices.
        ``None``: the position in the world (pure data parallelism).
        """
        first = (expert_rank(self.ep_size) if ep_rank is None else ep_rank) * self.num_local
        if first != self.first:
            modules = list(self.deepspeed_experts.values())
            self.deepspeed_experts = nn.ModuleDict({str(first + i): m for i, m in enumerate(modules)})
            self.first = first

    def local_indices(self) -> range:
        """Global indices of the experts on this rank."""
        return range(self.first, self.first + self.num_local)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """``inputs``: ``[num_local, tokens, hidden]``; each local expert runs on its slice."""
        outs = []
        for chunk, index in zip(inputs.unbind(0), self.local_indices(), strict=True):
            out = self.deepspeed_experts[str(index)](chunk)
            outs.append(out[0] if isinstance(out, tuple) else out)  # an expert may return (out, bias)
        return torch.stack(outs)
