"""``deepspeed.utils.groups``: the process groups of data, model, pipeline and expert parallelism.

Data/model/pipeline groups come from the pipeline plugin's grid: the one in effect (inside a
``PipelineModule``'s build or run), else the script's (``initialize()`` with a PipelineModule or
``initialize_model_parallel`` sets it, as DeepSpeed's engine sets ``groups.mpu``), else data parallelism
is the whole world. Expert groups are the MoE plugin's (``ep_size_<n>`` names, as DeepSpeed's). microspeed has no
sequence parallelism: its world size is 1 and asking for its group is refused.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from microspeed import comm


def _grid() -> Any:
    try:
        from microspeed.pipe import get_default_grid
    except ImportError:
        return None
    return get_default_grid()


def _get_data_parallel_group() -> Any:
    """The data-parallel group of this rank (the world without a pipeline/tensor grid)."""
    grid = _grid()
    return grid.get_data_parallel_group() if grid is not None else (dist.group.WORLD if comm.is_initialized()
                                                                     else None)


def _get_data_parallel_world_size() -> int:
    """Ranks in this rank's data-parallel group."""
    grid = _grid()
    return grid.get_data_parallel_world_size() if grid is not None else comm.get_world_size()


def _get_data_parallel_rank() -> int:
    """This rank's position in its data-parallel group."""
    grid = _grid()
    return grid.get_data_parallel_rank() if grid is not None else comm.get_rank()


def _get_model_parallel_group() -> Any:
    """The tensor(model)-parallel group (``None`` without a grid: no model parallelism)."""
    grid = _grid()
    return grid.get_model_parallel_group() if grid is not None else None


def _get_model_parallel_world_size() -> int:
    """Ranks in the tensor(model)-parallel group (1 without a grid)."""
    grid = _grid()
    return grid.get_model_parallel_world_size() if grid is not None else 1


def _get_model_parallel_rank() -> int:
    """This rank's position in its tensor(model)-parallel group (0 without a grid)."""
    grid = _grid()
    return grid.get_model_parallel_rank() if grid is not None else 0


def _get_pipe_parallel_world_size() -> int:
    """Pipeline stages (1 without a grid)."""
    grid = _grid()
    return grid.get_pipe_parallel_world_size() if grid is not None else 1


def _get_sequence_parallel_world_size() -> int:
    """1: microspeed has no sequence parallelism."""
    return 1


def _get_sequence_parallel_rank() -> int:
    """0: microspeed has no sequence parallelism."""
    return 0


def _get_sequence_parallel_group() -> Any:
    """Refused: microspeed has no sequence parallelism (DeepSpeed's Ulysses)."""
    raise NotImplementedError("deepspeed.utils.groups._get_sequence_parallel_group(): microspeed has no sequence "
                              "parallelism (DeepSpeed-Ulysses); run with sequence-parallel size 1")


def _ep_size(group_name: str) -> int:
    prefix = "ep_size_"
    if not group_name.startswith(prefix) or not group_name[len(prefix):].isdigit():
        raise ValueError(f"expert group name {group_name!r}: expected 'ep_size_<n>' (as MoE layers name them)")
    return int(group_name[len(prefix):])


def _create_expert_and_data_parallel(expert_parallel_size_: int,
                                     use_data_before_expert_parallel_: bool = False) -> None:
    """Create (collectively) the expert and expert-data-parallel groups for ``expert_parallel_size_``."""
    if use_data_before_expert_parallel_:
        raise ValueError("_create_expert_and_data_parallel(use_data_before_expert_parallel_=True): microspeed lays "
                         "expert groups out expert-first only (consecutive ranks share experts)")
    from microspeed.moe.groups import get_expert_groups

    get_expert_groups(expert_parallel_size_)


def _get_expert_parallel_group(group_name: str) -> Any:
    """The expert-parallel group of ``ep_size_<n>``."""
    from microspeed.moe.groups import get_expert_groups

    return get_expert_groups(_ep_size(group_name)).ep_group


def _get_expert_data_parallel_group(group_name: str) -> Any:
    """The expert-data-parallel group of ``ep_size_<n>`` (the ranks that hold the same experts)."""
    from microspeed.moe.groups import get_expert_groups

    return get_expert_groups(_ep_size(group_name)).edp_group


def _get_expert_parallel_world_size(group_name: str) -> int:
    """Ranks in the expert-parallel group of ``ep_size_<n>``."""
    return _ep_size(group_name)


def _get_expert_parallel_rank(group_name: str) -> int:
    """This rank's position in its expert-parallel group."""
    from microspeed.moe.groups import get_expert_groups

    return get_expert_groups(_ep_size(group_name)).ep_rank


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    """Ranks that hold the same experts."""
    from microspeed.moe.groups import get_expert_groups

    return get_expert_groups(_ep_size(group_name)).edp_size


def _get_expert_parallel_ranks(world_size: int, tensor_parallel_size_: int, expert_parallel_size_: int,
                               pipeline_parallel_size_: int = 1,
                               use_data_before_expert_parallel_: bool = False) -> tuple[list[list[int]],
                                                                                        list[list[int]]]:
    """The rank lists of the expert-parallel and expert-data-parallel groups, without creating them.

    Data-parallel groups are the ranks with the same tensor-parallel offset in one pipeline stage
    (stride ``tensor_parallel_size_``); each is cut into consecutive runs of ``expert_parallel_size_``
    ranks (an expert-parallel group), and the ranks at the same position of those runs hold the same
    experts (an expert-data-parallel group). With one tensor and pipeline stage this is the layout
    microspeed's MoE plugin creates (``ep_size_<n>`` groups over the world); microspeed lays experts
    out expert-first only.
    """
    if use_data_before_expert_parallel_:
        raise ValueError("_get_expert_parallel_ranks(use_data_before_expert_parallel_=True): microspeed lays expert "
                         "groups out expert-first only (consecutive data-parallel ranks share experts)")
    for name, value in (("tensor_parallel_size_", tensor_parallel_size_), ("expert_parallel_size_",
                                                                           expert_parallel_size_),
                        ("pipeline_parallel_size_", pipeline_parallel_size_)):
        if value < 1:
            raise ValueError(f"_get_expert_parallel_ranks({name}={value}): must be at least 1")
    stage_size = world_size // pipeline_parallel_size_
    if world_size % pipeline_parallel_size_ or stage_size % tensor_parallel_size_:
        raise ValueError(f"_get_expert_parallel_ranks: world_size={world_size} must be a multiple of "
                         f"pipeline_parallel_size_ x tensor_parallel_size_ = "
                         f"{pipeline_parallel_size_ * tensor_parallel_size_}")
    dp_size = stage_size // tensor_parallel_size_
    if dp_size % expert_parallel_size_:
        raise ValueError(f"_get_expert_parallel_ranks: the data-parallel size {dp_size} must be a multiple of "
                         f"expert_parallel_size_={expert_parallel_size_}")
    ep_groups: list[list[int]] = []
    edp_groups: list[list[int]] = []
    for stage in range(pipeline_parallel_size_):
        for offset in range(tensor_parallel_size_):
            dp_ranks = list(range(stage * stage_size + offset, (stage + 1) * stage_size, tensor_parallel_size_))
            ep_groups.extend(dp_ranks[i:i + expert_parallel_size_]
                             for i in range(0, dp_size, expert_parallel_size_))
            edp_groups.extend(dp_ranks[j::expert_parallel_size_] for j in range(expert_parallel_size_))
    return ep_groups, edp_groups
