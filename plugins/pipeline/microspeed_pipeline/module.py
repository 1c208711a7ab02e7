"""``PipelineModule``: a model given as a list of layers, split into pipeline stages.

A user describes the model as a flat sequence — modules, :class:`LayerSpec` (build later, only on
the stage that runs it), :class:`TiedLayerSpec` (one module shared by several positions, usually
the embedding and the output head), or plain callables. ``PipelineModule`` picks a partition
(``uniform``, ``parameters`` or ``type:<regex>``, balanced so the heaviest stage is as light as
possible), and each rank builds only its own layers. Parameter names are *global*: layer ``i`` is
``"<i>.<param>"`` whatever stage holds it, a tied module is ``"tied_modules.<key>.<param>"`` —
so a checkpoint written with two stages names the same tensors as one written with four.

With ``num_chunks = v > 1`` each rank holds ``v`` non-adjacent parts (virtual stages
``c * stages + stage``), the layout of the interleaved 1F1B schedule.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from microspeed.plugin_api import ConfigError, GradientSum
from microspeed_pipeline.topology import (
    ParallelGrid,
    PipeDataParallelTopology,
    ProcessTopology,
    using_grid,
)


class LayerSpec:
    """A layer to build later: ``LayerSpec(nn.Linear, 8, 8)`` builds ``nn.Linear(8, 8)`` on its stage only."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec: typename must be a torch.nn.Module subclass, got {typename!r}.")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> nn.Module:
        """Construct the module."""
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose module (``tied_weight_attr`` weights) is shared by every position with the same ``key``.

    ``forward_fn(module, x)`` replaces ``module(x)`` at this position (an output head reusing the
    embedding's weight: ``forward_fn=lambda emb, x: x @ emb.weight.t()``). Positions on different
    stages each hold a copy; the copies start equal and their gradients are summed after backward.
    """

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Callable | None = None,
                 tied_weight_attr: str | Sequence[str] = "weight", **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)

    def __repr__(self) -> str:
        return f"TiedLayerSpec({self.key!r}, {self.typename.__name__})"


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries (``num_parts + 1``) splitting ``num_items`` into parts whose sizes differ by at most one."""
    base, extra = divmod(num_items, num_parts)
    bounds = [0]
    for p in range(num_parts):
        bounds.append(bounds[-1] + base + (1 if p < extra else 0))
    return bounds


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries (``num_parts + 1``) of contiguous parts, chosen by DeepSpeed 0.19.8's rule.

    DeepSpeed's rule (``deepspeed.runtime.utils.partition_balanced``): among splits into non-empty
    parts, take the one whose heaviest and lightest parts differ least (the spread, not the heaviest
    part, is minimised), building it part by part; on a tie the later boundary wins. With no more
    items than parts it is :func:`partition_uniform`. Same input, same boundaries as DeepSpeed, so
    a pipeline splits its layers over the stages exactly as DeepSpeed's would.
    """
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = float("inf")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    hi = [[inf] * (m + 1) for _ in range(n + 1)]  # heaviest part of the chosen split of i items into j parts
    lo = [[inf] * (m + 1) for _ in range(n + 1)]  # its lightest part
    spread = [[inf] * (m + 1) for _ in range(n + 1)]
    where = [[0] * (m + 1) for _ in range(n + 1)]
    hi[0][0] = spread[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                top, bottom = max(hi[k][j - 1], part), min(lo[k][j - 1], part)
                cost = top - bottom
                if spread[i][j] >= cost:  # inf - inf is nan: never taken, as in numpy
                    spread[i][j], hi[i][j], lo[i][j], where[i][j] = cost, top, bottom, k
    bounds = [n]
    for j in range(m, 0, -1):
        bounds.append(where[bounds[-1]][j])
    return bounds[::-1]


def _count_params(spec: Any) -> int:
    """Trainable parameters of a layer, built on the meta device when it is a spec (no memory)."""
    if isinstance(spec, nn.Module):
        return sum(p.numel() for p in spec.parameters() if p.requires_grad)
    if isinstance(spec, LayerSpec):
        try:
            with torch.device("meta"):
                module = spec.build()
        except Exception:  # a constructor that cannot run on meta (it calls collectives, say)
            module = spec.build()
        return sum(p.numel() for p in module.parameters() if p.requires_grad)
    return 0


_KEYWORDS: dict[Any, frozenset[str]] = {}


def _keyword_names(layer: Any) -> frozenset[str]:
    """The keyword-capable parameter names of a layer's forward (a module, a LayerSpec's class or a callable)."""
    method = isinstance(layer, (LayerSpec, nn.Module))  # the class's forward: self, then the activations
    target = layer.typename.forward if isinstance(layer, LayerSpec) else (
        type(layer).forward if isinstance(layer, nn.Module) else layer)
    try:
        return _KEYWORDS[target]
    except (KeyError, TypeError):  # not seen yet, or not hashable
        pass
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = frozenset(p.name for p in params[2 if method else 1:]  # not those taking self and the activations
                      if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))
    try:
        _KEYWORDS[target] = names
    except TypeError:
        pass
    return names


def _layer_name(spec: Any) -> str:
    if isinstance(spec, LayerSpec):
        return spec.typename.__name__
    if isinstance(spec, nn.Module):
        return type(spec).__name__
    return getattr(spec, "__name__", type(spec).__name__)


class PipelineModule(nn.Module):
    """A sequence of layers split over pipeline stages (DeepSpeed's ``PipelineModule``).

    Args:
        layers: modules, :class:`LayerSpec`/:class:`TiedLayerSpec` or callables, applied in order;
            each receives the previous one's output (a tensor or a tuple).
        num_stages: pipeline stages; the data-parallel size fills the world. Or give ``topology``.
        topology: a :class:`~microspeed_pipeline.topology.ProcessTopology` with a ``pipe`` axis
            (and ``data``, optionally ``model`` for tensor parallelism).
        loss_fn: ``loss_fn(outputs, labels)`` on the last stage; without it the last layer's output
            is the loss.
        partition_method: ``"parameters"`` (balance trainable parameter counts), ``"uniform"``
            (balance layer counts) or ``"type:<regex>"`` (balance layers whose class name matches).
        activation_checkpoint_interval: recompute each run of this many layers in backward (0: off).
        activation_checkpoint_func: the checkpoint function (default:
            :func:`microspeed_pipeline.checkpointing.checkpoint`).
        checkpointable_layers: class names that may be checkpointed (default: layers with parameters).
        seed_layers / seed_fn / base_seed: seed the RNG with ``base_seed + layer index`` before
            building each layer, so a layer's initial weights do not depend on the partition.
        num_chunks: model chunks per rank (virtual stages) for the interleaved schedule.
        dynamic_shape: as DeepSpeed's: activations and gradients may change shape (or dtype) from one
            micro-batch to the next, so every transfer sends its shape header first (a small extra
            message per micro-batch). Without it shapes are agreed once per batch and may change only
            between batches (a change inside a batch raises and names this argument).
    """

    def __init__(self, layers: Sequence[Any], num_stages: int | None = None, topology: ProcessTopology | None = None,
                 loss_fn: Callable | None = None, seed_layers: bool = False, seed_fn: Callable | None = None,
                 base_seed: int = 1234, partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable | None = None, checkpointable_layers: list[str] | None = None,
                 num_chunks: int = 1, dynamic_shape: bool = False) -> None:
        super().__init__()
        if num_stages is None and topology is None:
            raise ConfigError("PipelineModule: give num_stages=... or topology=....")
        world = dist.get_world_size() if dist.is_initialized() else 1
        if topology is None:
            if num_stages < 1 or world % num_stages:
                raise ConfigError(f"PipelineModule(num_stages={num_stages}): the world size {world} must be a "
                                  f"multiple of num_stages.")
            topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages)
        elif "pipe" not in topology.get_axis_names():
            raise ConfigError(f"PipelineModule(topology={topology}): the topology needs a 'pipe' axis.")
        if num_stages is not None and num_stages != topology.get_dim("pipe"):
            raise ConfigError(f"PipelineModule: num_stages={num_stages} but the topology has "
                              f"{topology.get_dim('pipe')} pipe stages.")
        if not isinstance(num_chunks, int) or num_chunks < 1:
            raise ConfigError(f"PipelineModule(num_chunks={num_chunks!r}): expected a positive int.")
        if activation_checkpoint_interval < 0:
            raise ConfigError(f"PipelineModule(activation_checkpoint_interval={activation_checkpoint_interval}): "
                              f"expected >= 0.")
        self._topo = topology
        self._grid = ParallelGrid(topology)
        self.num_stages = topology.get_dim("pipe")
        self.stage_id = self._grid.get_stage_id()
        self.num_chunks = num_chunks
        self.dynamic_shape = bool(dynamic_shape)
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self._layer_specs = list(layers)
        self.partition_method = partition_method
        with using_grid(self._grid):  # tensor-parallel layers built below find their group here
            self.parts = self._partition(partition_method)
            self.tied_modules = nn.ModuleDict()
            self.tied_weight_attrs: dict[str, list[str]] = {}
            self._tie_groups: dict[str, Any] = {}
            self._funcs: dict[int, list[tuple[int, Any]]] = {}
            for chunk in range(num_chunks):
                self._funcs[chunk] = self._build_chunk(chunk)
            self._make_tie_groups()
            self._synchronize_tied_weights()

    # -- partition ---------------------------------------------------------------------

    def _partition(self, method: str) -> list[int]:
        parts = self.num_stages * self.num_chunks
        n = len(self._layer_specs)
        if n < parts:
            raise ConfigError(f"PipelineModule: {n} layers cannot fill {self.num_stages} stages × {self.num_chunks} "
                              f"chunks; use fewer stages or chunks.")
        low = method.lower()
        if low == "uniform":
            return partition_uniform(n, parts)
        if low == "parameters":
            return partition_balanced([_count_params(spec) for spec in self._layer_specs], parts)
        if low.startswith("type:"):
            regex = re.compile(method[5:], re.IGNORECASE)
            weights = [1 if regex.search(_layer_name(spec)) else 0 for spec in self._layer_specs]
            if not any(weights):
                raise ConfigError(f"PipelineModule(partition_method={method!r}): no layer's class name matches; "
                                  f"layers are {[_layer_name(s) for s in self._layer_specs]}.")
            return partition_balanced(weights, parts)
        raise ConfigError(f"PipelineModule(partition_method={method!r}): expected 'parameters', 'uniform' or "
                          f"'type:<regex>'.")

    def virtual_stage(self, chunk: int = 0, stage_id: int | None = None) -> int:
        """The virtual stage index of ``chunk`` on ``stage_id`` (default: this rank's stage)."""
        return chunk * self.num_stages + (self.stage_id if stage_id is None else stage_id)

    def layer_range(self, chunk: int = 0, stage_id: int | None = None) -> range:
        """Global indices of the layers ``chunk`` of ``stage_id`` runs."""
        v = self.virtual_stage(chunk, stage_id)
        return range(self.parts[v], self.parts[v + 1])

    def _build_chunk(self, chunk: int) -> list[tuple[int, Any]]:
        funcs = []
        for idx in self.layer_range(chunk):
            spec = self._layer_specs[idx]
            if self.seed_layers:
                (self.seed_fn or torch.manual_seed)(self.base_seed + idx)
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied_modules:
                    self.tied_modules[spec.key] = spec.build()
                    self.tied_weight_attrs[spec.key] = spec.tied_weight_attr
                funcs.append((idx, spec))
            elif isinstance(spec, LayerSpec):
                module = spec.build()
                self.add_module(str(idx), module)
                funcs.append((idx, module))
            elif isinstance(spec, nn.Module):
                self.add_module(str(idx), spec)
                funcs.append((idx, spec))
            elif callable(spec):
                funcs.append((idx, spec))
            else:
                raise TypeError(f"PipelineModule: layer {idx} is {type(spec).__name__}; expected an nn.Module, a "
                                f"LayerSpec or a callable.")
        return funcs

    # -- tied weights ------------------------------------------------------------------

    def tied_owner_stages(self, key: str) -> list[int]:
        """Stages (sorted) holding a copy of the tied module ``key``."""
        stages = set()
        for v in range(self.num_stages * self.num_chunks):
            for idx in range(self.parts[v], self.parts[v + 1]):
                spec = self._layer_specs[idx]
                if isinstance(spec, TiedLayerSpec) and spec.key == key:
                    stages.add(v % self.num_stages)
        return sorted(stages)

    def _tie_keys(self) -> list[str]:
        keys = []
        for spec in self._layer_specs:
            if isinstance(spec, TiedLayerSpec) and spec.key not in keys:
                keys.append(spec.key)
        return keys

    def _make_tie_groups(self) -> None:
        """One group per tied key and (data, model) coordinate, over the owning stages (collective).

        Each copy of a tied weight is marked ``summed_over`` (a :class:`~microspeed.plugin_api.GradientSum`
        over that group, keyed by the tied module's name, equal on every stage): a gradient-reduction owner
        that states ``sums_marked_gradients`` sums the copies' reduced gradients itself; otherwise the
        pipeline's ``ReduceTiedGrads`` sums ``p.grad`` (:meth:`allreduce_tied_weight_gradients`).
        """
        if not dist.is_initialized():
            return
        topo, axes = self._topo, self._topo.get_axis_names()
        others = [a for a in axes if a != "pipe"]
        for key in self._tie_keys():
            stages = self.tied_owner_stages(key)
            if len(stages) < 2:
                continue
            spec = next(s for s in self._layer_specs if isinstance(s, TiedLayerSpec) and s.key == key)
            with torch.device("meta"):  # the same answer on every rank, before any collective
                names = [n for n, _ in spec.build().named_parameters()]
            extra = [n for n in names if n not in spec.tied_weight_attr]
            if extra:  # each stage would train its own copy of these, and the copies would drift apart
                raise ConfigError(f"TiedLayerSpec({key!r}): the module has parameters {extra} besides "
                                  f"tied_weight_attr {spec.tied_weight_attr}, and it is used on stages {stages}; "
                                  f"only the tied weights are kept equal across stages. Move the other "
                                  f"parameters into a layer of their own, or name them in tied_weight_attr.")
            seen = set()
            for rank in range(topo.world_size()):
                coord = topo.get_coord(rank)._asdict()
                fixed = tuple(coord[a] for a in others)
                if fixed in seen:
                    continue
                seen.add(fixed)
                ranks = [topo.get_rank(**{**coord, "pipe": s}) for s in stages]
                group = dist.new_group(ranks)
                if self._grid.global_rank in ranks:
                    self._tie_groups[key] = (group, ranks)
                    for p in self.tied_parameters(key):  # for an owner of reduction that sums marked gradients
                        p.summed_over = GradientSum(group, tuple(ranks), f"tied_modules.{key}")

    def tied_parameters(self, key: str) -> list[nn.Parameter]:
        """The shared weights of tied module ``key`` on this rank."""
        module = self.tied_modules[key]
        return [module.get_parameter(attr) for attr in self.tied_weight_attrs[key]]

    def _synchronize_tied_weights(self) -> None:
        """Copies of a tied module start as the first owning stage's."""
        for key, (group, ranks) in self._tie_groups.items():
            for p in self.tied_parameters(key):
                dist.broadcast(p.data, src=ranks[0], group=group)

    def allreduce_tied_weight_gradients(self) -> None:
        """Sum the gradients of each tied weight across the stages that hold it."""
        for key, (group, _ranks) in self._tie_groups.items():
            for p in self.tied_parameters(key):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=group)

    def tied_duplicate_names(self) -> set[str]:
        """Names of tied parameters whose gradient another stage's copy also holds (count them once)."""
        names = set()
        for key, (_group, ranks) in self._tie_groups.items():
            if ranks.index(self._grid.global_rank) > 0:
                names.update(f"tied_modules.{key}.{attr}" for attr in self.tied_weight_attrs[key])
        return names

    # -- forward -----------------------------------------------------------------------

    def _is_checkpointable(self, funcs: list[Any]) -> bool:
        if self.checkpointable_layers is not None:
            return all(_layer_name(f) in self.checkpointable_layers for f in funcs)
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for f in funcs)

    def _run_layers(self, funcs: list[tuple[int, Any]], x: Any, kwargs: dict[str, Any] | None = None) -> Any:
        for _idx, f in funcs:
            if isinstance(f, TiedLayerSpec):
                module = self.tied_modules[f.key]
                x = f.forward_fn(module, x) if f.forward_fn is not None else module(x)
            else:
                named = {k: v for k, v in kwargs.items() if k in _keyword_names(f)} if kwargs else {}
                x = f(x, **named)
        return x

    def layer_names(self) -> list[str]:
        """The class name of every layer (all stages), in order: what ``partition_method="type:..."`` matches."""
        return [_layer_name(spec) for spec in self._layer_specs]

    def layers_accepting(self, names: Sequence[str]) -> list[int]:
        """Global indices of the layers (all stages) whose forward names every keyword argument in ``names``.

        Those layers receive them when a plugin passes them to :meth:`forward` (progressive layer drop's
        ``progressive_layer_drop`` / ``pld_theta``); tied layers and ``**kwargs`` do not count.
        """
        return [i for i, spec in enumerate(self._layer_specs)
                if not isinstance(spec, TiedLayerSpec) and set(names) <= _keyword_names(spec)]

    def forward(self, forward_input: Any, chunk: int = 0, **kwargs: Any) -> Any:
        """Run this rank's layers of ``chunk`` on ``forward_input`` (with this module's grid in effect).

        Keyword arguments (a plugin's, e.g. progressive layer drop's ``pld_theta``) go to each layer whose
        forward names them (:meth:`layers_accepting`); the others receive only the activations.
        """
        with using_grid(self._grid):
            return self._forward(forward_input, chunk, kwargs)

    def _forward(self, forward_input: Any, chunk: int, kwargs: dict[str, Any] | None = None) -> Any:
        funcs = self._funcs[chunk]
        interval = self.activation_checkpoint_interval
        if interval == 0 or not torch.is_grad_enabled():
            return self._run_layers(funcs, forward_input, kwargs)
        ckpt = self.activation_checkpoint_func
        if ckpt is None:
            from microspeed_pipeline.checkpointing import checkpoint, non_reentrant_checkpoint

            # the reentrant form gives no parameter gradients when no input needs one (token ids
            # into the first stage): recompute that piece with the non-reentrant form instead
            def ckpt(fn: Callable, *args: Any) -> Any:
                needs = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
                return (checkpoint if needs else non_reentrant_checkpoint)(fn, *args)
        x = forward_input
        for start in range(0, len(funcs), interval):
            piece = funcs[start:start + interval]
            real = [self.tied_modules[f.key] if isinstance(f, TiedLayerSpec) else f for _, f in piece]
            if self._is_checkpointable(real):
                args = x if isinstance(x, tuple) else (x,)
                x = ckpt(lambda *a, piece=piece: self._run_layers(piece, a if len(a) > 1 else a[0], kwargs), *args)
            else:
                x = self._run_layers(piece, x, kwargs)
        return x

    # -- introspection -----------------------------------------------------------------

    def topology(self) -> ProcessTopology:
        """The process topology this module was partitioned for."""
        return self._topo

    def mpu(self) -> ParallelGrid:
        """The process grid (Megatron-style ``mpu`` accessors)."""
        return self._grid

    def num_pipeline_stages(self) -> int:
        """Number of pipeline stages."""
        return self.num_stages

    def is_first_stage(self) -> bool:
        """Whether this rank runs the first stage."""
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        """Whether this rank runs the last stage."""
        return self.stage_id == self.num_stages - 1

    def extra_repr(self) -> str:
        return (f"stages={self.num_stages}, stage_id={self.stage_id}, chunks={self.num_chunks}, "
                f"parts={self.parts}")
