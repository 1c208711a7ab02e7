"""Process topology: which ranks form which groups. The default is pure data parallelism.

Plugins that split the model (pipeline, tensor parallel, experts) answer
``microspeed_make_topology`` with a richer :class:`Topology`; the core only needs the
data-parallel group (for the batch triad and gradient reduction) and the model-parallel group
(for the global gradient norm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass
class Topology:
    """The groups the core uses. ``None`` as a group means the default (world) group.

    ``model_parallel_group`` holds the ranks that own *different* parameters of one replica
    (tensor and pipeline parallel); gradient norms are summed over it. It is ``None`` with a
    ``model_parallel_size`` of 1 in pure data parallelism.
    """

    world_size: int
    rank: int
    data_parallel_size: int
    data_parallel_rank: int
    data_parallel_group: Any = None
    model_parallel_size: int = 1
    model_parallel_rank: int = 0
    model_parallel_group: Any = None

    @classmethod
    def data_parallel(cls) -> Topology:
        """Every rank is one replica: the data-parallel group is the world."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        return cls(world_size=world, rank=rank, data_parallel_size=world, data_parallel_rank=rank)

    def describe(self) -> str:
        """One line for logs: ``world=4 dp=4 mp=1``."""
        return f"world={self.world_size} dp={self.data_parallel_size} mp={self.model_parallel_size}"
