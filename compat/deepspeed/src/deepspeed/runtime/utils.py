"""``deepspeed.runtime.utils``: tensor helpers (:mod:`microspeed.compat.tensor_utils`), pipeline partition rules."""

from __future__ import annotations

from typing import Any

from microspeed.compat.tensor_utils import (
    PartitionedTensor,
    clone_tensors_for_torch_save,
    move_to_device,
    set_random_seed,
)

#: Served by the pipeline plugin (``microspeed.pipe.module``), imported when first used.
PIPE_NAMES = ("partition_uniform", "partition_balanced")

__all__ = ["PartitionedTensor", "clone_tensors_for_torch_save", "move_to_device", "prefix_sum_inc", "see_memory_usage",
           "set_random_seed", *PIPE_NAMES]


def prefix_sum_inc(weights: list[float]) -> list[float]:
    """Inclusive prefix sums: ``[1, 2, 3] -> [1, 3, 6]``."""
    out: list[float] = []
    total: Any = 0
    for w in weights:
        total += w
        out.append(total)
    return out


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log ``message`` with this process's memory use (rank 0; only when ``force``, as DeepSpeed)."""
    if not force:
        return
    from deepspeed.utils.logging import logger
    from microspeed import comm
    from microspeed.compat.accelerator import get_accelerator

    if comm.get_rank() != 0:
        return
    acc = get_accelerator()
    gib = 2**30
    logger.info(f"{message} | MA {acc.memory_allocated() / gib:.2f} GB | Max_MA {acc.max_memory_allocated() / gib:.2f} "
                f"GB | CA {acc.memory_reserved() / gib:.2f} GB | Max_CA {acc.max_memory_reserved() / gib:.2f} GB")


def __getattr__(name: str) -> Any:
    if name in PIPE_NAMES:
        import importlib

        return getattr(importlib.import_module("microspeed.pipe.module"), name)
    raise AttributeError(f"module 'deepspeed.runtime.utils' (microspeed stand-in) has no attribute {name!r}")
