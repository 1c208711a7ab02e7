"""Megatron-style tensor (model) parallelism: sharded linear and embedding layers and the maps between regions.

A tensor-parallel group of ``tp`` ranks splits each large matrix of a layer: a
:class:`ColumnParallelLinear` splits the *output* features (each rank computes a slice of the
output), a :class:`RowParallelLinear` splits the *input* features (each rank computes a partial
sum, all-reduced), and a :class:`VocabParallelEmbedding` splits the vocabulary. A column layer with
``gather_output=False`` followed by a row layer with ``input_is_parallel=True`` (Megatron's MLP)
costs one all-reduce forward and one backward.

The four autograd-aware maps move activations between the *replicated* region (every rank holds
the full tensor) and the *parallel* region (each rank holds a slice of the last dimension):

=================================================  ========================  ========================
map                                                forward                   backward
=================================================  ========================  ========================
:func:`copy_to_tensor_model_parallel_region`        identity                  all-reduce (sum)
:func:`reduce_from_tensor_model_parallel_region`    all-reduce (sum)          identity
:func:`scatter_to_tensor_model_parallel_region`     keep this rank's slice    all-gather
:func:`gather_from_tensor_model_parallel_region`    all-gather                keep this rank's slice
=================================================  ========================  ========================

**Which group.** Every function and layer takes an optional ``group``. ``None`` means the
tensor-parallel ("model") group of the default grid (:func:`microspeed_pipeline.initialize_model_parallel`
or the pipeline plugin installs it). Without a grid, in a single process or a one-rank world, the
layers are plain dense layers (``tp == 1``); in a larger world without a grid they raise
:class:`~microspeed.errors.ConfigError` rather than guess. A one-rank group makes every map the
identity. Collectives go through :mod:`microspeed.comm`, so their bytes are counted.

**Initialisation.** The constructors build the *full* ("master") weight on every rank, on the
CPU in float32, from the default CPU generator with ``init_method``, and keep this rank's slice.
So with the same default RNG state on every rank of the group (``torch.manual_seed(seed)``, or
:func:`microspeed_pipeline.rng.model_parallel_seed`, which seeds the default generator identically
on all tensor-parallel ranks), the sharded layer is exactly the dense layer drawn from that state:
``ColumnParallelLinear(i, o, init_method=f)`` shards the weight ``f(torch.empty(o, i))`` that
``torch.manual_seed(seed)`` followed by that call produces in one process. Biases start at zero,
as in Megatron. With ``init_method=lambda w: torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))``
the weight equals ``torch.nn.Linear(i, o).weight`` under the same seed (its bias does not: ours is
zero). :class:`VocabParallelEmbedding` defaults to ``normal_`` and zeroes the padding row, so it
equals ``torch.nn.Embedding`` under the same seed. ``from_dense`` classmethods shard an existing
dense module exactly, without drawing random numbers.

**Parameter attributes** (Megatron's): sharded parameters carry ``tensor_model_parallel = True``,
``partition_dim`` and ``partition_stride``; replicated ones (the row-parallel bias)
``tensor_model_parallel = False``. :func:`full_tensor` and :func:`shard_tensor` convert between a
shard and the dense, topology-independent layout (for checkpoints);
:func:`is_tensor_parallel_duplicate` tells gradient-norm code which parameters to count once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from microspeed.plugin_api import ConfigError, comm
from microspeed_pipeline.topology import get_default_grid

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tensor_model_parallel_region",
    "full_tensor",
    "gather_from_tensor_model_parallel_region",
    "gather_full_weight",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "is_tensor_parallel_duplicate",
    "param_is_not_tensor_parallel_duplicate",
    "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "set_tensor_model_parallel_attributes",
    "shard_tensor",
]

InitMethod = Callable[[torch.Tensor], Any]
"""An ``init_method``: fills the full (master) weight tensor in place, like ``torch.nn.init.xavier_normal_``."""


# --------------------------------------------------------------------------------------------
# The tensor-parallel group
# --------------------------------------------------------------------------------------------


def get_tensor_model_parallel_group(group: Any = None) -> Any:
    """The tensor-parallel group to use: ``group`` if given, else the model-parallel group of the grid in effect.

    The grid in effect (:func:`~microspeed_pipeline.topology.get_default_grid`) is the PipelineModule's
    while it builds or runs its layers, else the one the script set with ``initialize_model_parallel``.

    Without a default grid, returns ``None`` (the dense case) when ``torch.distributed`` is not
    initialised or its world has one rank, and raises :class:`~microspeed.errors.ConfigError` when
    the world is larger: the layers cannot tell which ranks split them.
    """
    if group is not None:
        return group
    grid = get_default_grid()
    if grid is not None:
        return grid.get_model_parallel_group()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    raise ConfigError(
        f"tensor parallelism: no tensor-parallel group. The world has {dist.get_world_size()} ranks but no "
        "default grid is set; call microspeed_pipeline.initialize_model_parallel(tensor_model_parallel_size=...) "
        "on every rank first (or build the layers from a PipelineModule's layer specs, which puts its grid in "
        "effect while it builds and runs them), or pass group=<the tensor-parallel "
        "process group> to the layer or function."
    )


def get_tensor_model_parallel_world_size(group: Any = None) -> int:
    """Number of ranks in the tensor-parallel group (see :func:`get_tensor_model_parallel_group`)."""
    return comm.get_world_size(get_tensor_model_parallel_group(group))


def get_tensor_model_parallel_rank(group: Any = None) -> int:
    """This rank's index in the tensor-parallel group (see :func:`get_tensor_model_parallel_group`)."""
    return comm.get_rank(get_tensor_model_parallel_group(group))


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ConfigError(f"tensor parallelism: {what} ({numerator}) is not divisible by {denominator}; "
                          "choose sizes that are multiples of the tensor-parallel size (times the stride).")
    return numerator // denominator


# --------------------------------------------------------------------------------------------
# Collectives along the last dimension (no autograd)
# --------------------------------------------------------------------------------------------


def _reduce(input_: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum over the group, into a new tensor (the input may be saved by autograd or aliased)."""
    if comm.get_world_size(group) == 1:
        return input_
    out = input_.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, group=group)
    return out


def _split_last_dim(input_: torch.Tensor, group: Any) -> torch.Tensor:
    world = comm.get_world_size(group)
    if world == 1:
        return input_
    size = _divide(input_.size(-1), world, "the last dimension of the tensor to split")
    rank = comm.get_rank(group)
    return input_.narrow(-1, rank * size, size).contiguous()


def _gather_last_dim(input_: torch.Tensor, group: Any) -> torch.Tensor:
    world = comm.get_world_size(group)
    if world == 1:
        return input_
    input_ = input_.contiguous()
    parts = [torch.empty_like(input_) for _ in range(world)]
    comm.all_gather(parts, input_, group=group)
    return torch.cat(parts, dim=-1)


# --------------------------------------------------------------------------------------------
# Autograd-aware region maps
# --------------------------------------------------------------------------------------------


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return input_.view_as(input_)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce(grad_output, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: Any) -> torch.Tensor:
        return _reduce(input_, group)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad_output, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _split_last_dim(input_, group)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_last_dim(grad_output, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _gather_last_dim(input_, group)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_last_dim(grad_output, ctx.group), None


def _mapped(fn: type[torch.autograd.Function], input_: torch.Tensor, group: Any) -> torch.Tensor:
    group = get_tensor_model_parallel_group(group)
    return input_ if comm.get_world_size(group) == 1 else fn.apply(input_, group)


def copy_to_tensor_model_parallel_region(input_: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Enter the parallel region: identity forward, all-reduce (sum) of the gradient backward."""
    return _mapped(_CopyToRegion, input_, group)


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Leave the parallel region by summing partial results: all-reduce forward, identity backward."""
    return _mapped(_ReduceFromRegion, input_, group)


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Keep this rank's contiguous slice of the last dimension forward; all-gather the gradient backward."""
    return _mapped(_ScatterToRegion, input_, group)


def gather_from_tensor_model_parallel_region(input_: torch.Tensor, group: Any = None) -> torch.Tensor:
    """All-gather slices along the last dimension (rank order) forward; keep this rank's slice backward."""
    return _mapped(_GatherFromRegion, input_, group)


# --------------------------------------------------------------------------------------------
# Parameter attributes, sharding and gathering
# --------------------------------------------------------------------------------------------


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int = 0,
                                         stride: int = 1) -> None:
    """Mark ``tensor`` Megatron-style: ``tensor_model_parallel``, ``partition_dim``, ``partition_stride``."""
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def is_tensor_parallel_duplicate(param: torch.Tensor, group: Any = None) -> bool:
    """Whether ``param`` is a replica of the tensor-parallel rank 0's copy (count its gradient once).

    True for a parameter that is not sharded (no ``tensor_model_parallel`` attribute, or ``False``)
    on a tensor-parallel rank > 0: layer norms, row-parallel biases and every other replicated
    parameter. ``group`` defaults to the default grid's tensor-parallel group; without a grid nothing
    is a duplicate (there is no tensor parallelism to duplicate across).
    """
    if getattr(param, "tensor_model_parallel", False):
        return False
    if group is None and get_default_grid() is None:
        return False
    return get_tensor_model_parallel_rank(group) > 0


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, group: Any = None) -> bool:
    """Megatron's name for ``not is_tensor_parallel_duplicate(param, group)``."""
    return not is_tensor_parallel_duplicate(param, group)


def _shard_of(full: torch.Tensor, dim: int, rank: int, world: int, stride: int) -> torch.Tensor:
    dim = dim % full.dim()
    chunk = _divide(full.size(dim), world * stride, f"dimension {dim} of size {full.size(dim)} to shard")
    chunks = torch.split(full, chunk, dim=dim)
    return torch.cat(chunks[rank::world], dim=dim)


def shard_tensor(full: torch.Tensor, partition_dim: int, group: Any = None, stride: int = 1) -> torch.Tensor:
    """This rank's shard of the dense tensor ``full`` along ``partition_dim`` (a new, detached tensor).

    ``full`` is cut into ``tp * stride`` equal chunks along ``partition_dim``; rank ``r`` keeps chunks
    ``r, r + tp, r + 2 tp, ...`` concatenated (Megatron's strided layout; ``stride=1`` is one
    contiguous block per rank). The inverse of :func:`full_tensor`.
    """
    group = get_tensor_model_parallel_group(group)
    world, rank = comm.get_world_size(group), comm.get_rank(group)
    with torch.no_grad():
        return _shard_of(full.detach(), partition_dim, rank, world, stride).clone(memory_format=torch.contiguous_format)


def full_tensor(param: torch.Tensor, group: Any = None, *, partition_dim: int | None = None,
                stride: int | None = None) -> torch.Tensor:
    """The dense tensor of which ``param`` is this rank's shard, all-gathered over the group (detached).

    ``partition_dim`` and ``stride`` default to the parameter's ``partition_dim`` and
    ``partition_stride`` attributes; give them for tensors without attributes (a ``.grad``). A
    tensor that is not sharded (``tensor_model_parallel`` false or missing, and no ``partition_dim``
    given) is returned as a detached copy. Collective over the group when the tensor is sharded.
    The inverse of :func:`shard_tensor`.
    """
    if partition_dim is None:
        if not getattr(param, "tensor_model_parallel", False):
            return param.detach().clone()
        partition_dim = param.partition_dim
    if stride is None:
        stride = getattr(param, "partition_stride", 1)
    group = get_tensor_model_parallel_group(group)
    world = comm.get_world_size(group)
    local = param.detach().contiguous()
    if world == 1:
        return local.clone()
    dim = partition_dim % local.dim()
    parts = [torch.empty_like(local) for _ in range(world)]
    comm.all_gather(parts, local, group=group)
    chunk = _divide(local.size(dim), stride, f"dimension {dim} of size {local.size(dim)} (the shard) to unstride")
    split = [torch.split(p, chunk, dim=dim) for p in parts]
    return torch.cat([split[r][s] for s in range(stride) for r in range(world)], dim=dim)


gather_full_weight = full_tensor
"""Another name for :func:`full_tensor`."""


def _master_weight(shape: tuple[int, ...], init_method: InitMethod) -> torch.Tensor:
    """The full weight, drawn on the CPU in float32 from the default CPU generator (the same on every rank)."""
    master = torch.empty(shape, dtype=torch.float32)
    with torch.no_grad():
        init_method(master)
    return master


class _GroupRef:
    """Holds a layer's process group so that ``copy.deepcopy`` (and pickling) of the model works.

    Process groups cannot be copied: a deep copy of a layer shares its group; a pickled layer
    forgets it and uses the default grid's group (or the dense case) where it is loaded.
    """

    __slots__ = ("group",)

    def __init__(self, group: Any) -> None:
        self.group = group

    def __deepcopy__(self, memo: dict) -> _GroupRef:
        return self

    def __reduce__(self) -> tuple[type, tuple[None]]:
        return _GroupRef, (None,)


class _TensorParallelModule(nn.Module):
    """Base of the layers: the resolved tensor-parallel group, its size and this rank's index."""

    def _set_group(self, group: Any) -> None:
        resolved = get_tensor_model_parallel_group(group)
        self._group_ref = _GroupRef(resolved)
        self.world_size = comm.get_world_size(resolved)
        self.rank = comm.get_rank(resolved)

    @property
    def group(self) -> Any:
        """The tensor-parallel process group this layer is split over (``None``: the dense case)."""
        return self._group_ref.group

    def _make_weight(self, shape: tuple[int, int], dim: int, init_method: InitMethod, stride: int, keep_master: bool,
                     dtype: torch.dtype, device: Any) -> None:
        """Draw the full weight (CPU, float32), keep this rank's slice along ``dim`` as ``self.weight``."""
        master = _master_weight(shape, init_method)
        local = _shard_of(master, dim, self.rank, self.world_size, stride)
        self.weight = nn.Parameter(local.to(device=device, dtype=dtype, copy=True))
        set_tensor_model_parallel_attributes(self.weight, True, dim, stride)
        self.master_weight = master if keep_master else None


def _no_init(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _check_linear(linear: nn.Module, cls: str) -> None:
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"{cls}.from_dense() needs a torch.nn.Linear, got {type(linear).__name__}.")


# --------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------


class ColumnParallelLinear(_TensorParallelModule):
    """``Y = X A + b`` with ``A`` split by columns (output features) over the tensor-parallel group.

    Rank ``r`` holds ``weight`` of shape ``(output_size / tp, input_size)`` (rows ``r*o/tp ...`` of the
    dense ``(output_size, input_size)`` weight when ``stride == 1``) and the matching slice of the bias.

    Args:
        input_size, output_size: the dense layer's sizes; ``output_size`` must divide by ``tp * stride``.
        bias: whether to have a (sharded, zero-initialised) bias.
        gather_output: all-gather the output so every rank holds the full ``output_size`` features;
            ``False`` leaves each rank its slice (feed it to a :class:`RowParallelLinear` with
            ``input_is_parallel=True``).
        init_method: fills the full ``(output_size, input_size)`` weight in place; see the module
            docstring for the seeding that makes it equal a dense layer's.
        stride: Megatron's strided partitioning (for fused weights such as QKV).
        keep_master_weight_for_test: keep the full float32 weight as ``self.master_weight``.
        skip_bias_add: return ``(output, bias)`` without adding the bias (for fusing it later).
        group: the tensor-parallel group (default: the default grid's).
        dtype, device: of the parameters (the master weight is always drawn on the CPU in float32).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = True,
                 init_method: InitMethod = nn.init.xavier_normal_, stride: int = 1,
                 keep_master_weight_for_test: bool = False, skip_bias_add: bool = False, group: Any = None, *,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self._set_group(group)
        self.input_size, self.output_size = input_size, output_size
        self.gather_output, self.skip_bias_add, self.stride = gather_output, skip_bias_add, stride
        self.output_size_per_partition = _divide(output_size, self.world_size, "ColumnParallelLinear output_size")
        _divide(output_size, self.world_size * stride, "ColumnParallelLinear output_size (with stride)")
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        self._make_weight((output_size, input_size), 0, init_method, stride, keep_master_weight_for_test, dtype, device)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, device=device, dtype=dtype))
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_dense(cls, linear: nn.Linear, gather_output: bool = True, group: Any = None, *, stride: int = 1,
                   skip_bias_add: bool = False) -> ColumnParallelLinear:
        """This rank's column shard of ``linear`` (same dtype and device); it computes what ``linear`` does."""
        _check_linear(linear, cls.__name__)
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, gather_output=gather_output,
                    init_method=_no_init, stride=stride, skip_bias_add=skip_bias_add, group=group, dtype=w.dtype,
                    device=w.device)
        with torch.no_grad():
            layer.weight.copy_(shard_tensor(w, 0, layer.group, stride))
            if linear.bias is not None:
                layer.bias.copy_(shard_tensor(linear.bias, 0, layer.group, stride))
        return layer

    def forward(self, input_: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """The output (full if ``gather_output``, else this rank's slice); ``(output, bias)`` if ``skip_bias_add``."""
        input_parallel = copy_to_tensor_model_parallel_region(input_, self.group)
        bias = None if self.skip_bias_add else self.bias
        output_parallel = F.linear(input_parallel, self.weight, bias)
        output = gather_from_tensor_model_parallel_region(output_parallel, self.group) if self.gather_output \
            else output_parallel
        if self.skip_bias_add:
            return output, self.bias
        return output

    def extra_repr(self) -> str:
        """Sizes, partition and options, for ``print(model)``."""
        return (f"input_size={self.input_size}, output_size={self.output_size} "
                f"({self.output_size_per_partition} per rank, tp={self.world_size}), bias={self.bias is not None}, "
                f"gather_output={self.gather_output}, stride={self.stride}, skip_bias_add={self.skip_bias_add}")


class RowParallelLinear(_TensorParallelModule):
    """``Y = X A + b`` with ``A`` split by rows (input features) over the tensor-parallel group.

    Rank ``r`` holds ``weight`` of shape ``(output_size, input_size / tp)``; the partial products are
    all-reduced, then the bias (replicated, not split, zero-initialised) is added once.

    Args:
        input_size, output_size: the dense layer's sizes; ``input_size`` must divide by ``tp * stride``.
        bias: whether to have a bias.
        input_is_parallel: the input is already this rank's slice of the last dimension (the output
            of a :class:`ColumnParallelLinear` with ``gather_output=False``); otherwise the full
            input is given and split here.
        init_method, stride, keep_master_weight_for_test, skip_bias_add, group, dtype, device: as for
            :class:`ColumnParallelLinear` (the master weight is the full ``(output_size, input_size)``).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = False,
                 init_method: InitMethod = nn.init.xavier_normal_, stride: int = 1,
                 keep_master_weight_for_test: bool = False, skip_bias_add: bool = False, group: Any = None, *,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self._set_group(group)
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel, self.skip_bias_add, self.stride = input_is_parallel, skip_bias_add, stride
        self.input_size_per_partition = _divide(input_size, self.world_size, "RowParallelLinear input_size")
        _divide(input_size, self.world_size * stride, "RowParallelLinear input_size (with stride)")
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        self._make_weight((output_size, input_size), 1, init_method, stride, keep_master_weight_for_test, dtype, device)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, device=device, dtype=dtype))
            set_tensor_model_parallel_attributes(self.bias, False, 0, 1)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_dense(cls, linear: nn.Linear, input_is_parallel: bool = False, group: Any = None, *, stride: int = 1,
                   skip_bias_add: bool = False) -> RowParallelLinear:
        """This rank's row shard of ``linear`` (same dtype and device); the bias is copied whole."""
        _check_linear(linear, cls.__name__)
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    input_is_parallel=input_is_parallel, init_method=_no_init, stride=stride,
                    skip_bias_add=skip_bias_add, group=group, dtype=w.dtype, device=w.device)
        with torch.no_grad():
            layer.weight.copy_(shard_tensor(w, 1, layer.group, stride))
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, input_: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """The full output on every rank; ``(output, bias)`` without the bias added if ``skip_bias_add``."""
        input_parallel = input_ if self.input_is_parallel else scatter_to_tensor_model_parallel_region(input_,
                                                                                                      self.group)
        output_parallel = F.linear(input_parallel, self.weight)
        output = reduce_from_tensor_model_parallel_region(output_parallel, self.group)
        if self.skip_bias_add:
            return output, self.bias
        return output + self.bias if self.bias is not None else output

    def extra_repr(self) -> str:
        """Sizes, partition and options, for ``print(model)``."""
        return (f"input_size={self.input_size} ({self.input_size_per_partition} per rank, tp={self.world_size}), "
                f"output_size={self.output_size}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}, stride={self.stride}, skip_bias_add={self.skip_bias_add}")


class VocabParallelEmbedding(_TensorParallelModule):
    """An embedding table split along the vocabulary into contiguous ranges, one per tensor-parallel rank.

    Rank ``r`` holds rows ``[r * V/tp, (r + 1) * V/tp)`` (``num_embeddings`` must divide by ``tp``;
    pad the vocabulary otherwise). Tokens outside the local range look up zeros; the all-reduce
    then gives every rank the full embeddings.

    Args:
        num_embeddings, embedding_dim: the dense table's sizes.
        padding_idx: a (global) token whose row is zero-initialised and gets no gradient, as in
            ``torch.nn.Embedding``.
        init_method: fills the full ``(num_embeddings, embedding_dim)`` table in place (default
            ``normal_``, like ``torch.nn.Embedding``; see the module docstring on seeding).
        group, dtype, device: as for :class:`ColumnParallelLinear`.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 init_method: InitMethod = nn.init.normal_, group: Any = None, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self._set_group(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"VocabParallelEmbedding: padding_idx {padding_idx} is outside the vocabulary "
                                 f"of {num_embeddings}.")
            padding_idx %= num_embeddings
        self.padding_idx = padding_idx
        self.num_embeddings_per_partition = _divide(num_embeddings, self.world_size,
                                                    "VocabParallelEmbedding num_embeddings (pad the vocabulary)")
        self.vocab_start_index = self.rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self._local_padding_idx = (padding_idx - self.vocab_start_index
                                   if padding_idx is not None and self.vocab_start_index <= padding_idx
                                   < self.vocab_end_index else None)
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        master = _master_weight((num_embeddings, embedding_dim), init_method)
        if padding_idx is not None:
            master[padding_idx].zero_()
        local = _shard_of(master, 0, self.rank, self.world_size, 1)
        self.weight = nn.Parameter(local.to(device=device, dtype=dtype, copy=True))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, group: Any = None) -> VocabParallelEmbedding:
        """This rank's vocabulary shard of ``embedding`` (same dtype, device and ``padding_idx``).

        ``max_norm``, ``scale_grad_by_freq`` and ``sparse`` are not supported (they need the whole table).
        """
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"{cls.__name__}.from_dense() needs a torch.nn.Embedding, got {type(embedding).__name__}.")
        if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
            raise ValueError(f"{cls.__name__}.from_dense(): max_norm, scale_grad_by_freq and sparse are not supported "
                             "by a vocabulary-parallel embedding.")
        w = embedding.weight
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, padding_idx=embedding.padding_idx,
                    init_method=_no_init, group=group, dtype=w.dtype, device=w.device)
        with torch.no_grad():
            layer.weight.copy_(shard_tensor(w, 0, layer.group))
        return layer

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """The embeddings of the token ids ``input_`` (any shape), full on every rank."""
        if self.world_size > 1:
            outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            local_ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
        else:
            outside, local_ids = None, input_
        output_parallel = F.embedding(local_ids, self.weight, self._local_padding_idx)
        if outside is not None:
            output_parallel = output_parallel.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(output_parallel, self.group)

    def extra_repr(self) -> str:
        """Sizes and this rank's vocabulary range, for ``print(model)``."""
        return (f"{self.num_embeddings}, {self.embedding_dim}, vocab range [{self.vocab_start_index}, "
                f"{self.vocab_end_index}) of tp={self.world_size}, padding_idx={self.padding_idx}")
