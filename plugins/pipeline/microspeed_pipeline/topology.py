"""Process topologies: ranks as coordinates of a Cartesian grid, and the groups along each axis.

:class:`ProcessTopology` is pure arithmetic (no processes needed): axes are named, laid out
row-major (the *last* axis varies fastest), so ``PipeModelDataParallelTopology(pipe, model, data)``
with axes ``["pipe", "data", "model"]`` puts the tensor-parallel ranks of one stage next to each
other, as DeepSpeed does (they communicate most).

:class:`ParallelGrid` creates the process groups of every axis once and answers the Megatron-style
``mpu`` questions (``get_{data,model,pipe}_parallel_{rank,group,world_size}``). Its *model* axis is
the tensor-parallel one, as in Megatron's ``mpu`` that tensor-parallel layers are written against;
the *slice* group is every rank of one data-parallel replica (all stages, all tensor shards), the
group over which gradient norms are summed.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import namedtuple
from collections.abc import Iterator
from itertools import product
from typing import Any

import torch.distributed as dist

from microspeed.plugin_api import ConfigError


class ProcessTopology:
    """Maps ranks to coordinates of an n-dimensional grid with named axes (row-major).

    ``ProcessTopology(axes=["x", "y"], dims=[2, 3])`` has 6 ranks; rank ``r`` has coordinate
    ``(r // 3, r % 3)``.
    """

    def __init__(self, axes: list[str], dims: list[int]) -> None:
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology: {len(axes)} axes {axes} but {len(dims)} dims {dims}.")
        if len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology: axis names must be unique, got {axes}.")
        if any(not isinstance(d, int) or d < 1 for d in dims):
            raise ValueError(f"ProcessTopology: every dim must be a positive int, got {dims}.")
        self.axes = list(axes)
        self.dims = list(dims)
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)
        self.mapping: dict[Any, int] = {}
        for rank, coord in enumerate(product(*[range(d) for d in self.dims])):
            self.mapping[self.ProcessCoord(*coord)] = rank

    def world_size(self) -> int:
        """Number of ranks in the grid."""
        return len(self.mapping)

    def get_axis_names(self) -> list[str]:
        """The axis names, outermost first."""
        return list(self.axes)

    def get_dim(self, axis: str) -> int:
        """The size of ``axis`` (0 when the topology has no such axis)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_rank(self, **coord: int) -> int:
        """The rank at a full coordinate, given by axis name: ``get_rank(pipe=1, data=0)``."""
        if set(coord) != set(self.axes):
            raise ValueError(f"get_rank(): give every axis {self.axes}, got {sorted(coord)}.")
        key = self.ProcessCoord(**coord)
        if key not in self.mapping:
            dims = dict(zip(self.axes, self.dims, strict=True))
            raise ValueError(f"get_rank(): coordinate {coord} is outside dims {dims}.")
        return self.mapping[key]

    def get_coord(self, rank: int) -> Any:
        """The coordinate (a namedtuple with one field per axis) of ``rank``."""
        for coord, r in self.mapping.items():
            if r == rank:
                return coord
        raise ValueError(f"get_coord(): rank {rank} is not in a topology of {self.world_size()} ranks.")

    def get_rank_repr(self, rank: int, omit_axes: tuple[str, ...] = ("data", "pipe"), inner_sep: str = "_",
                      outer_sep: str = "-") -> str:
        """A short name for ``rank`` without the ``omit_axes``: ``model_01`` for model-parallel rank 1."""
        coord = self.get_coord(rank)
        parts = [f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in self.axes if axis not in omit_axes]
        return outer_sep.join(parts)

    def filter_match(self, **filters: int) -> list[int]:
        """Ranks whose coordinate matches every ``axis=value`` given, in rank order."""
        return sorted(r for c, r in self.mapping.items()
                      if all(getattr(c, axis) == value for axis, value in filters.items()))

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """Ranks whose coordinate on ``axis`` is ``idx``."""
        return self.filter_match(**{axis: idx}) if axis in self.axes else []

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The groups of ranks that differ only along ``axis`` (each sorted), one per combination of the others."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for values in product(*[range(self.get_dim(a)) for a in others]):
            fixed = dict(zip(others, values, strict=True))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def __str__(self) -> str:
        return f"ProcessTopology({dict(zip(self.axes, self.dims, strict=True))})"


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline × data parallelism; axes ``["pipe", "data"]`` (data-parallel ranks adjacent)."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline × data × tensor ("model") parallelism; axes ``["pipe", "data", "model"]``."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def make_topology(pipe: int = 1, model: int = 1, data: int | None = None,
                  world_size: int | None = None) -> ProcessTopology:
    """The standard topology for ``pipe`` stages and ``model`` tensor shards; ``data`` fills the world."""
    world = world_size if world_size is not None else (dist.get_world_size() if dist.is_initialized() else 1)
    if data is None:
        if world % (pipe * model):
            raise ConfigError(f"pipeline: world size {world} is not divisible by pipeline stages ({pipe}) × "
                              f"tensor-parallel size ({model}); launch a multiple of {pipe * model} ranks.")
        data = world // (pipe * model)
    if model == 1:
        return PipeDataParallelTopology(num_pp=pipe, num_dp=data)
    return PipeModelDataParallelTopology(num_pp=pipe, num_mp=model, num_dp=data)


class ParallelGrid:
    """The process groups of a topology, created once, with Megatron-style ``mpu`` accessors.

    Every rank must construct it (creating groups is collective). Groups of size 1 are still real
    groups, so that code never branches on ``None``. ``global_rank`` defaults to this process's rank.
    """

    def __init__(self, topology: ProcessTopology, global_rank: int | None = None) -> None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        if topology.world_size() != world:
            raise ConfigError(f"pipeline topology {topology} has {topology.world_size()} ranks but the world has "
                              f"{world}; make pipe × data × model equal the number of processes.")
        self._topo = topology
        self.global_rank = global_rank if global_rank is not None else (dist.get_rank() if dist.is_initialized() else 0)
        self.world_size = world
        coord = topology.get_coord(self.global_rank)
        self.stage_id = getattr(coord, "pipe", 0)
        self.data_parallel_id = getattr(coord, "data", 0)
        self.model_parallel_id = getattr(coord, "model", 0)
        self.pipe_parallel_size = max(topology.get_dim("pipe"), 1)
        self.data_parallel_size = max(topology.get_dim("data"), 1)
        self.model_parallel_size = max(topology.get_dim("model"), 1)
        self.groups: dict[str, Any] = {}
        self.group_ranks: dict[str, list[int]] = {}
        for axis in ("pipe", "data", "model"):
            self._make_axis_group(axis)
        # one replica: every rank with this data-parallel coordinate (all stages, all tensor shards)
        slices = [topology.filter_match(data=d) if "data" in topology.axes else list(range(world))
                  for d in range(self.data_parallel_size)]
        self._make_group("slice", slices)
        # DeepSpeed's PipelineParallelGrid attributes: flags and the ranks of this rank's groups
        self.is_first_stage: bool = self.stage_id == 0
        self.is_last_stage: bool = self.stage_id == self.pipe_parallel_size - 1
        self.pp_group: list[int] = list(self.group_ranks.get("pipe", [self.global_rank]))
        self.dp_group: list[int] = list(self.group_ranks.get("data", [self.global_rank]))

    def _is_grid_valid(self) -> bool:
        """Whether the topology's ranks are the world's (DeepSpeed's check; the constructor already enforces it)."""
        return self._topo.world_size() == (dist.get_world_size() if dist.is_initialized() else 1)

    def _make_axis_group(self, axis: str) -> None:
        lists = self._topo.get_axis_comm_lists(axis) or [[r] for r in range(self.world_size)]
        self._make_group(axis, lists)

    def _make_group(self, name: str, lists: list[list[int]]) -> None:
        for ranks in lists:  # every rank takes part in creating every group, in the same order
            group = dist.new_group(ranks) if dist.is_initialized() else None
            if self.global_rank in ranks:
                self.groups[name], self.group_ranks[name] = group, ranks

    # -- the grid ------------------------------------------------------------------------

    def topology(self) -> ProcessTopology:
        """The :class:`ProcessTopology` this grid was made from."""
        return self._topo

    def get_stage_id(self) -> int:
        """This rank's pipeline stage."""
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        """This rank's data-parallel coordinate."""
        return self.data_parallel_id

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        """The global rank of ``stage_id`` with this rank's other coordinates (overridable by ``kwargs``)."""
        coord = self._topo.get_coord(self.global_rank)._asdict()
        if "pipe" not in coord:
            if stage_id != 0:
                raise ValueError(f"stage_to_global({stage_id}): the topology has no pipe axis.")
            return self.global_rank
        coord.update(pipe=stage_id, **kwargs)
        return self._topo.get_rank(**coord)

    def get_global_rank(self) -> int:
        """This process's rank in the world."""
        return self.global_rank

    # -- mpu accessors -------------------------------------------------------------------

    def get_pipe_parallel_rank(self) -> int:
        """The pipeline stage (rank in the pipe group)."""
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        """Number of pipeline stages."""
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> Any:
        """The group of this rank's pipeline (one rank per stage)."""
        return self.groups["pipe"]

    def get_data_parallel_rank(self) -> int:
        """Rank in the data-parallel group."""
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        """Number of data-parallel replicas."""
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        """The ranks holding the same parameters (same stage, same tensor shard)."""
        return self.groups["data"]

    def get_model_parallel_rank(self) -> int:
        """Rank in the tensor-parallel group (Megatron's "model parallel")."""
        return self.model_parallel_id

    def get_model_parallel_world_size(self) -> int:
        """Tensor-parallel size."""
        return self.model_parallel_size

    def get_model_parallel_group(self) -> Any:
        """The tensor-parallel group: the ranks that split each layer of this stage."""
        return self.groups["model"]

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group
    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_pipeline_model_parallel_group = get_pipe_parallel_group

    def get_slice_parallel_rank(self) -> int:
        """Rank within one replica (all stages and tensor shards)."""
        return self.group_ranks["slice"].index(self.global_rank)

    def get_slice_parallel_world_size(self) -> int:
        """Ranks per replica: pipeline stages × tensor-parallel size."""
        return len(self.group_ranks["slice"])

    def get_slice_parallel_group(self) -> Any:
        """Every rank of this replica; gradient norms and overflow flags are reduced over it."""
        return self.groups["slice"]

    def __repr__(self) -> str:
        return (f"ParallelGrid(rank={self.global_rank}, pipe={self.stage_id}/{self.pipe_parallel_size}, "
                f"data={self.data_parallel_id}/{self.data_parallel_size}, "
                f"model={self.model_parallel_id}/{self.model_parallel_size})")


class _StandaloneGrid:
    """The grid a script installs with :func:`set_default_grid` / :func:`initialize_model_parallel`."""

    def __init__(self) -> None:
        self.grid: ParallelGrid | None = None


_STANDALONE = _StandaloneGrid()
"""Only for code that runs outside any PipelineModule (Megatron-style scripts, DeepSpeed's ``groups`` queries)."""

_IN_EFFECT: contextvars.ContextVar[ParallelGrid | None] = contextvars.ContextVar("microspeed_pipeline_grid",
                                                                                 default=None)


def set_default_grid(grid: ParallelGrid | None) -> None:
    """Make ``grid`` the one tensor-parallel layers use when built without an explicit ``group`` (Megatron's mpu).

    This is the script's grid, for code that runs outside any :class:`~microspeed_pipeline.PipelineModule`
    (:func:`initialize_model_parallel` sets it, and so does ``initialize()`` with a PipelineModule, as
    DeepSpeed's engine hands its mpu to ``deepspeed.utils.groups``). Building a PipelineModule never changes
    it, and an engine's own work never reads it: a PipelineModule puts its own grid
    in effect only while it builds and runs its layers (:func:`using_grid`), so two models (and two
    engines) in one process never see each other's grid.
    """
    _STANDALONE.grid = grid


@contextlib.contextmanager
def using_grid(grid: ParallelGrid | None) -> Iterator[None]:
    """Put ``grid`` in effect for the block (this thread / task only); the previous one afterwards."""
    token = _IN_EFFECT.set(grid)
    try:
        yield
    finally:
        _IN_EFFECT.reset(token)


def get_default_grid() -> ParallelGrid | None:
    """The grid in effect here: the PipelineModule's that is being built or run, else the script's.

    The script's is the one :func:`set_default_grid` / :func:`initialize_model_parallel` set (``None``
    before any).
    """
    grid = _IN_EFFECT.get()
    return grid if grid is not None else _STANDALONE.grid


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              pipeline_model_parallel_size: int = 1) -> ParallelGrid:
    """Megatron-style set-up: build (collectively) and install the default grid; returns it."""
    grid = ParallelGrid(make_topology(pipe=pipeline_model_parallel_size, model=tensor_model_parallel_size))
    set_default_grid(grid)
    return grid
