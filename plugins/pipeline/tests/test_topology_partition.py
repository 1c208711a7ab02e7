"""Process topologies, parallel grids and PipelineModule partitioning.

* :class:`ProcessTopology` and its pipe×data / pipe×model×data forms answer exactly as DeepSpeed 0.19.8's.
* ``partition_balanced`` returns DeepSpeed 0.19.8's boundaries (its rule: least spread between the
  heaviest and lightest part); ``partition_uniform`` is as even as can be.
* ``PipelineModule`` in one process: global parameter names, the three partition methods, counting on the
  meta device, ``seed_layers``, callables, activation checkpointing, and clear errors for bad arguments.
* On 4 ranks (one spawn): every :class:`ParallelGrid` accessor and group against the topology's arithmetic,
  and a 4-stage ``PipelineModule`` that builds only its own layers and the tied ones where they belong.
"""

from __future__ import annotations

import itertools
import os
import random

import pytest
import torch
import torch.distributed as dist
from microspeed_pipeline.module import (
    LayerSpec,
    PipelineModule,
    TiedLayerSpec,
    partition_balanced,
    partition_uniform,
)
from microspeed_pipeline.topology import (
    ParallelGrid,
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
    get_default_grid,
    initialize_model_parallel,
    make_topology,
    set_default_grid,
)
from torch import nn

from microspeed.errors import ConfigError
from microspeed.testing import run_distributed

# -- helpers -------------------------------------------------------------------------------------

BUILDS: list[tuple[int, str]] = []  # (layer index, device type) of every RecordingLinear constructed


class RecordingLinear(nn.Linear):
    """A Linear that records, when constructed, its index and the device its tensors are created on."""

    def __init__(self, idx: int, n_in: int, n_out: int) -> None:
        super().__init__(n_in, n_out)
        BUILDS.append((idx, torch.empty(1).device.type))


class CountingLinear(nn.Linear):
    """A Linear that counts its forward calls (recomputation runs it again)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


class MetaHostile(nn.Module):
    """A layer whose constructor cannot run on the meta device (as one calling a collective could not)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        if torch.empty(1).device.type == "meta":
            raise RuntimeError("cannot build on meta")
        self.lin = nn.Linear(n, n)

    def forward(self, x):
        return self.lin(x)


@pytest.fixture(autouse=True)
def _restore_default_grid():
    """PipelineModule installs its grid as the process default; put the previous one back afterwards."""
    before = get_default_grid()
    yield
    set_default_grid(before)


@pytest.fixture(scope="module")
def ds():
    """DeepSpeed's topology and partition modules (the test is skipped when DeepSpeed cannot be imported)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    topo = pytest.importorskip("deepspeed.runtime.pipe.topology")
    utils = pytest.importorskip("deepspeed.runtime.utils")
    return topo, utils


def _param_indices(module: nn.Module) -> set[int]:
    """Global layer indices that own parameters in ``module`` (names ``"<idx>.<param>"``)."""
    return {int(name.split(".")[0]) for name, _ in module.named_parameters() if name.split(".")[0].isdigit()}


def _max_part(weights, bounds) -> float:
    return max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))


def _brute_force_best(weights, parts) -> float:
    n = len(weights)
    return min(_max_part(weights, (0, *cuts, n)) for cuts in itertools.combinations(range(1, n), parts - 1))


# -- 1. ProcessTopology equals DeepSpeed's ---------------------------------------------------------

TOPOLOGIES = [("pipe_data", s) for s in [(2, 2), (4, 1), (1, 4), (3, 2)]] + \
             [("pipe_model_data", s) for s in [(2, 2, 2), (1, 2, 3), (4, 2, 1)]] + \
             [("generic", (("x", "y", "z"), (2, 3, 2))), ("generic", (("a",), (5,)))]


def _pair(ds_topo, kind, shape):
    if kind == "pipe_data":
        return PipeDataParallelTopology(*shape), ds_topo.PipeDataParallelTopology(*shape)
    if kind == "pipe_model_data":  # both (num_pp, num_mp, num_dp), axes ["pipe", "data", "model"]
        return PipeModelDataParallelTopology(*shape), ds_topo.PipeModelDataParallelTopology(*shape)
    axes, dims = shape
    return ProcessTopology(list(axes), list(dims)), ds_topo.ProcessTopology(list(axes), list(dims))


@pytest.mark.parametrize(("kind", "shape"), TOPOLOGIES, ids=[f"{k}-{s}" for k, s in TOPOLOGIES])
def test_process_topology_matches_deepspeed(ds, kind, shape):
    """Every query of our topology returns what DeepSpeed's returns for the same shape."""
    ours, theirs = _pair(ds[0], kind, shape)
    assert ours.get_axis_names() == theirs.get_axis_names()
    assert ours.world_size() == theirs.world_size()
    assert {tuple(k): v for k, v in ours.mapping.items()} == {tuple(k): v for k, v in theirs.mapping.items()}
    axes = theirs.get_axis_names()
    for axis in [*axes, "nonexistent"]:
        assert ours.get_dim(axis) == theirs.get_dim(axis), axis
        assert ours.get_axis_comm_lists(axis) == theirs.get_axis_comm_lists(axis), axis
    for axis in axes:
        for idx in range(theirs.get_dim(axis) + 1):  # one past the end too: no ranks
            assert ours.get_axis_list(axis, idx) == theirs.get_axis_list(axis, idx), (axis, idx)
    for rank in range(theirs.world_size()):
        mine, ref = ours.get_coord(rank), theirs.get_coord(rank)
        assert mine._fields == ref._fields and tuple(mine) == tuple(ref), rank
        assert ours.get_rank(**ref._asdict()) == theirs.get_rank(**ref._asdict()) == rank
        for kwargs in [{}, {"omit_axes": []}, {"omit_axes": ["pipe"]}, {"omit_axes": ["model"]},
                       {"omit_axes": [], "inner_sep": "=", "outer_sep": "/"}]:
            assert ours.get_rank_repr(rank, **kwargs) == theirs.get_rank_repr(rank, **kwargs), (rank, kwargs)
    for r in range(len(axes) + 1):
        for subset in itertools.combinations(axes, r):
            for values in itertools.product(*[range(theirs.get_dim(a) + 1) for a in subset]):
                filters = dict(zip(subset, values, strict=True))
                assert ours.filter_match(**filters) == theirs.filter_match(**filters), filters


def test_process_topology_rejects_bad_shapes_and_coordinates():
    """Mismatched axes/dims, repeated axes, empty dims, partial or outside coordinates are errors."""
    with pytest.raises(ValueError, match="2 axes"):
        ProcessTopology(["a", "b"], [2])
    with pytest.raises(ValueError, match="unique"):
        ProcessTopology(["a", "a"], [2, 2])
    with pytest.raises(ValueError, match="positive"):
        ProcessTopology(["a"], [0])
    topo = PipeDataParallelTopology(2, 2)
    with pytest.raises(ValueError, match="every axis"):
        topo.get_rank(pipe=0)
    with pytest.raises(ValueError, match="outside"):
        topo.get_rank(pipe=2, data=0)
    with pytest.raises(ValueError, match="rank 4"):
        topo.get_coord(4)
    assert topo.get_axis_list("model", 0) == []


def test_make_topology_fills_the_world_with_data_parallelism():
    """make_topology: data = world / (pipe × model); no model axis when model == 1; indivisible worlds fail."""
    t = make_topology(pipe=2, model=2, world_size=8)
    assert isinstance(t, PipeModelDataParallelTopology) and t.get_axis_names() == ["pipe", "data", "model"]
    assert (t.get_dim("pipe"), t.get_dim("data"), t.get_dim("model")) == (2, 2, 2)
    t = make_topology(pipe=3, world_size=6)
    assert isinstance(t, PipeDataParallelTopology) and (t.get_dim("pipe"), t.get_dim("data")) == (3, 2)
    assert make_topology().world_size() == 1
    with pytest.raises(ConfigError, match="not divisible"):
        make_topology(pipe=3, world_size=4)


# -- 2. partition_balanced / partition_uniform -----------------------------------------------------


def _random_cases(count: int, max_items: int, seed: int):
    rng = random.Random(seed)
    for case in range(count):
        n = rng.randint(1, max_items)
        parts = rng.randint(1, n)
        if case % 3 == 0:
            weights = [rng.randint(0, 20) for _ in range(n)]
        elif case % 3 == 1:
            weights = [rng.choice([0, 0, 1, 5, 100]) for _ in range(n)]  # zeros and outliers
        else:
            weights = [rng.uniform(0.0, 10.0) for _ in range(n)]
        yield weights, parts


def _check_bounds(bounds, n, parts):
    assert len(bounds) == parts + 1 and bounds[0] == 0 and bounds[-1] == n, bounds
    assert all(a < b for a, b in itertools.pairwise(bounds)), f"empty part in {bounds}"


def _alexnet_layers() -> list:
    """DeepSpeedExamples' pipeline_parallelism AlexNet, joined into layers as its train.py does (meta device)."""
    with torch.device("meta"):
        features = [nn.Conv2d(3, 64, 11, 4, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
                    nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
                    nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(inplace=True),
                    nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(256, 256, 3, padding=1),
                    nn.ReLU(inplace=True), nn.MaxPool2d(3, 2)]
        classifier = [nn.Dropout(), nn.Linear(256 * 6 * 6, 4096), nn.ReLU(inplace=True), nn.Dropout(),
                      nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Linear(4096, 10)]
        return [*features, nn.AdaptiveAvgPool2d((6, 6)), lambda x: torch.flatten(x, 1), *classifier]


def test_partition_balanced_equals_deepspeed(ds):
    """Same boundaries as DeepSpeed 0.19.8's partition_balanced: random weights, zeros, ties, AlexNet."""
    ds_partition_balanced = ds[1].partition_balanced
    for weights, parts in itertools.chain(_random_cases(300, 14, seed=1), _random_cases(40, 40, seed=2)):
        ours, theirs = partition_balanced(weights, parts), [int(b) for b in ds_partition_balanced(weights, parts)]
        assert ours == theirs, (weights, parts)
    for weights, parts in [([0] * 6, 3), ([0, 0, 0, 0], 2), ([1, 1, 1, 1, 1, 1, 10, 1], 3), ([3, 1, 2], 5),
                           ([5.0], 1), ([2, 2, 2, 2], 4)]:
        assert partition_balanced(weights, parts) == [int(b) for b in ds_partition_balanced(weights, parts)]
    alexnet = [sum(p.numel() for p in m.parameters()) if isinstance(m, nn.Module) else 0 for m in _alexnet_layers()]
    for parts in (2, 3, 4):
        assert partition_balanced(alexnet, parts) == [int(b) for b in ds_partition_balanced(alexnet, parts)]


def test_partition_balanced_follows_deepspeeds_rule():
    """DeepSpeed's rule minimises the spread (max - min), later boundary on ties; AlexNet splits [0, 19, 22]."""
    assert partition_balanced([1, 1, 1, 1, 1, 1, 10, 1], 3) == [0, 3, 6, 8]  # parts 3, 3, 11: not the least max (10)
    assert partition_balanced([0, 0, 0, 0], 2) == [0, 3, 4]  # ties go to the later boundary
    assert partition_balanced([3, 1, 2], 3) == [0, 1, 2, 3]
    assert partition_balanced([1, 1], 3) == [0, 1, 2, 2]  # fewer items than parts: uniform, as DeepSpeed
    module = PipelineModule(_alexnet_layers(), num_stages=1, num_chunks=2, partition_method="parameters")
    assert module.parts == [0, 19, 22]  # DeepSpeedExamples' pipeline_parallelism AlexNet on 2 stages


def test_partition_uniform_sizes_differ_by_at_most_one(ds):
    """Part sizes sum to the items and differ by at most one, the larger ones first, like DeepSpeed's."""
    for n, parts in itertools.product(range(0, 30), range(1, 9)):
        bounds = partition_uniform(n, parts)
        sizes = [b - a for a, b in itertools.pairwise(bounds)]
        assert len(sizes) == parts and sum(sizes) == n and bounds[0] == 0, (n, parts, bounds)
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True), (n, parts, bounds)
        assert bounds == ds[1].partition_uniform(n, parts), (n, parts)


# -- 3. PipelineModule in one process ---------------------------------------------------------------


def _head(emb: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return x @ emb.weight


def test_pipeline_module_builds_every_layer_with_global_names():
    """One stage builds all layers: '<index>.<param>' names, one tied module, callables in the chain."""
    specs = [TiedLayerSpec("emb", nn.Linear, 4, 6, bias=False), LayerSpec(nn.Linear, 6, 6), nn.Tanh(),
             lambda x: x * 2, nn.Linear(6, 6), TiedLayerSpec("emb", nn.Linear, 4, 6, bias=False, forward_fn=_head)]
    module = PipelineModule(specs, num_stages=1, partition_method="uniform")
    names = [n for n, _ in module.named_parameters()]
    assert sorted(names) == sorted(["1.weight", "1.bias", "4.weight", "4.bias", "tied_modules.emb.weight"])
    assert module.parts == [0, 6] and list(module.layer_range()) == list(range(6))
    assert module.tied_owner_stages("emb") == [0] and module.is_first_stage() and module.is_last_stage()
    assert getattr(module, "4") is specs[4]  # a ready module is used as is
    x = torch.randn(3, 4)
    emb, lin1, lin4 = module.tied_modules["emb"], getattr(module, "1"), getattr(module, "4")
    expected = _head(emb, lin4(torch.tanh(lin1(emb(x))) * 2))
    torch.testing.assert_close(module(x), expected)
    module.to(torch.float64)  # nn.Module machinery (``_apply``) reaches every layer, tied ones included
    assert {p.dtype for p in module.parameters()} == {torch.float64}
    torch.testing.assert_close(module(x.double()), expected.double())


def test_pipeline_module_rejects_a_layer_that_is_not_callable():
    """A layer that is neither a module, a spec nor a callable names its index and type."""
    with pytest.raises(TypeError, match="layer 1 is int"):
        PipelineModule([nn.Linear(2, 2), 5], num_stages=1)


def test_uniform_partition_over_chunks():
    """num_stages=1 × num_chunks=3 splits 10 layers 4/3/3; chaining the chunks equals the whole model."""
    torch.manual_seed(0)
    specs = [nn.Linear(3, 3) if i % 2 == 0 else nn.Tanh() for i in range(10)]
    module = PipelineModule(specs, num_stages=1, num_chunks=3, partition_method="uniform")
    assert module.parts == [0, 4, 7, 10]
    assert [list(module.layer_range(c)) for c in range(3)] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert [module.virtual_stage(c) for c in range(3)] == [0, 1, 2]
    x = torch.randn(2, 3)
    y = x
    for c in range(3):
        y = module(y, chunk=c)
    torch.testing.assert_close(y, nn.Sequential(*specs)(x))


def test_parameters_partition_balances_parameter_counts():
    """'parameters' puts the 90-parameter layer alone here (DeepSpeed's least-spread split)."""
    sizes = [(2, 2), (2, 2), (2, 2), (2, 30), (30, 2), (2, 2)]  # 6, 6, 6, 90, 62, 6 parameters
    specs = [LayerSpec(nn.Linear, *s) for s in sizes]
    module = PipelineModule(specs, num_stages=1, num_chunks=3, partition_method="parameters")
    assert module.parts == [0, 3, 4, 6]
    assert PipelineModule(specs, num_stages=1, num_chunks=3, partition_method="uniform").parts == [0, 2, 4, 6]
    # ready modules count too, frozen parameters do not, layers without parameters weigh nothing
    frozen = nn.Linear(2, 30).requires_grad_(False)
    specs = [nn.Linear(2, 30), frozen, nn.ReLU(), nn.Linear(30, 2), nn.Linear(2, 2)]  # 90, 0, 0, 62, 6
    assert PipelineModule(specs, num_stages=1, num_chunks=2).parts == [0, 3, 5]  # 90|68 or 90|68: later cut wins
    # all weights zero: every split ties, so the later boundaries (DeepSpeed's result)
    assert PipelineModule([nn.ReLU() for _ in range(5)], num_stages=1, num_chunks=2).parts == [0, 4, 5]


def test_parameters_partition_counts_on_meta_then_builds_real_layers():
    """Counting builds every LayerSpec on the meta device first; the real build (CPU) comes after, once."""
    BUILDS.clear()
    specs = [LayerSpec(RecordingLinear, i, 4, 4) if i != 2 else nn.ReLU() for i in range(5)]
    module = PipelineModule(specs, num_stages=1, num_chunks=2, partition_method="parameters")
    assert BUILDS == [(0, "meta"), (1, "meta"), (3, "meta"), (4, "meta"),
                      (0, "cpu"), (1, "cpu"), (3, "cpu"), (4, "cpu")]
    assert all(p.device.type == "cpu" for p in module.parameters())
    BUILDS.clear()
    PipelineModule(specs, num_stages=1, num_chunks=2, partition_method="uniform")
    assert all(dev == "cpu" for _, dev in BUILDS)  # no counting, no meta builds
    # counting on meta draws nothing from the RNG: the same weights as without counting
    specs = [LayerSpec(nn.Linear, 3, 3) for _ in range(4)]
    torch.manual_seed(0)
    counted = PipelineModule(specs, num_stages=1, partition_method="parameters").state_dict()
    torch.manual_seed(0)
    plain = PipelineModule(specs, num_stages=1, partition_method="uniform").state_dict()
    for name, value in plain.items():
        torch.testing.assert_close(counted[name], value, rtol=0, atol=0)
    # a constructor that fails on meta is counted by a real build instead
    specs = [LayerSpec(MetaHostile, 8), LayerSpec(nn.Linear, 2, 2), LayerSpec(nn.Linear, 2, 2)]  # 72, 6, 6
    assert PipelineModule(specs, num_stages=1, num_chunks=2).parts == [0, 1, 3]


def test_type_partition_balances_matching_layers():
    """'type:Linear' (case-insensitive regex on class names) gives each part the same number of Linears."""
    kinds = ["Linear", "ReLU", "ReLU", "ReLU", "Linear", "Linear", "ReLU", "Linear"]
    specs = [LayerSpec(nn.Linear, 2, 2) if k == "Linear" else LayerSpec(nn.ReLU) for k in kinds]
    for method in ("type:Linear", "type:linear", "type:^Lin"):
        module = PipelineModule(specs, num_stages=1, num_chunks=2, partition_method=method)
        assert module.parts == [0, 5, 8], method
        counts = [sum(kinds[i] == "Linear" for i in module.layer_range(c)) for c in range(2)]
        assert counts == [2, 2], method
    assert partition_uniform(len(specs), 2) == [0, 4, 8]  # which would give 1 and 3
    # modules and callables are matched by their class / function names
    specs = [nn.Linear(2, 2), lambda x: x, nn.Linear(2, 2), nn.Tanh(), nn.Tanh(), nn.Tanh()]
    assert PipelineModule(specs, num_stages=1, num_chunks=2, partition_method="type:tanh").parts == [0, 5, 6]
    assert PipelineModule(specs, num_stages=1, num_chunks=2, partition_method="type:lambda").parts == [0, 5, 6]


def test_seed_layers_makes_weights_independent_of_partition_and_global_rng():
    """With seed_layers, layer i is what seeding base_seed + i and building it gives, whatever else happens."""
    specs = [LayerSpec(nn.Linear, 3, 3) for _ in range(4)]
    torch.manual_seed(0)
    a = PipelineModule(specs, num_stages=1, seed_layers=True, base_seed=100)
    torch.manual_seed(999)
    torch.randn(17)
    b = PipelineModule(specs, num_stages=1, num_chunks=4, seed_layers=True, base_seed=100, partition_method="uniform")
    for idx in range(4):
        torch.manual_seed(100 + idx)
        expected = nn.Linear(3, 3)
        for m in (a, b):
            torch.testing.assert_close(getattr(m, str(idx)).weight, expected.weight)
            torch.testing.assert_close(getattr(m, str(idx)).bias, expected.bias)
    torch.manual_seed(1)
    c = PipelineModule(specs, num_stages=1)
    assert not torch.equal(getattr(c, "3").weight, getattr(a, "3").weight)  # without seeding: the global RNG's
    seeds = []
    PipelineModule(specs, num_stages=1, seed_layers=True, seed_fn=seeds.append, base_seed=7)
    assert seeds == [7, 8, 9, 10]


def _checkpoint_specs():
    return [LayerSpec(CountingLinear, 4, 8), LayerSpec(nn.Tanh), LayerSpec(nn.Dropout, 0.25),
            LayerSpec(CountingLinear, 8, 8), lambda x: x * 2, LayerSpec(CountingLinear, 8, 4)]


@pytest.mark.parametrize("input_requires_grad", [False, True], ids=["ids-like-input", "activation-input"])
def test_activation_checkpoint_interval_gives_same_output_and_gradients(input_requires_grad):
    """Recomputing every 2 layers changes neither outputs nor gradients (dropout included); layers run twice."""
    ref = PipelineModule(_checkpoint_specs(), num_stages=1, seed_layers=True)
    ckpt = PipelineModule(_checkpoint_specs(), num_stages=1, seed_layers=True, activation_checkpoint_interval=2)
    x0 = torch.randn(5, 4)
    results = []
    for module in (ref, ckpt):
        x = x0.clone().requires_grad_(input_requires_grad)
        torch.manual_seed(7)
        out = module(x)
        out.pow(2).sum().backward()
        grads = {n: p.grad.clone() for n, p in module.named_parameters()}
        results.append((out.detach(), grads, x.grad))
    torch.testing.assert_close(results[1][0], results[0][0])
    assert results[1][1].keys() == results[0][1].keys() == {f"{i}.{p}" for i in (0, 3, 5) for p in ("weight", "bias")}
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, msg=name)
    if input_requires_grad:
        torch.testing.assert_close(results[1][2], results[0][2])
    assert [getattr(ref, str(i)).calls for i in (0, 3, 5)] == [1, 1, 1]
    assert [getattr(ckpt, str(i)).calls for i in (0, 3, 5)] == [2, 2, 2]  # forward + recompute
    with torch.no_grad():  # no graph: nothing to recompute
        torch.manual_seed(7)
        torch.testing.assert_close(ckpt(x0), results[0][0])


# -- 4. bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"num_stages": 1, "num_chunks": 4}, ConfigError, r"3 layers cannot fill 1 stages × 4 chunks"),
    ({"num_stages": 1, "partition_method": "blocks"}, ConfigError, r"partition_method='blocks'.*expected"),
    ({"num_stages": 1, "partition_method": "type:Conv"}, ConfigError,
     r"partition_method='type:Conv'.*no layer's class name matches"),
    ({"topology": ProcessTopology(["data"], [1])}, ConfigError, r"topology=.*needs a 'pipe' axis"),
    ({"num_stages": 2, "topology": PipeDataParallelTopology(1, 1)}, ConfigError,
     r"num_stages=2 but the topology has 1 pipe stages"),
    ({"num_stages": 1, "num_chunks": 0}, ConfigError, r"num_chunks=0"),
    ({"num_stages": 1, "num_chunks": 1.5}, ConfigError, r"num_chunks=1.5"),
    ({"num_stages": 0}, ConfigError, r"num_stages=0"),
    ({}, ConfigError, r"num_stages=.*topology="),
    ({"num_stages": 1, "activation_checkpoint_interval": -1}, ConfigError, r"activation_checkpoint_interval=-1"),
    ({"topology": PipeDataParallelTopology(2, 1)}, ConfigError, r"has 2 ranks but the world has 1"),
], ids=["too-few-layers", "unknown-method", "type-matches-nothing", "no-pipe-axis", "stages-vs-topology",
        "zero-chunks", "fractional-chunks", "zero-stages", "no-stages-no-topology", "negative-ckpt-interval",
        "topology-world-mismatch"])
def test_pipeline_module_bad_arguments_name_the_argument(kwargs, error, match):
    """Each wrong argument raises an error whose message names it and what was given."""
    specs = [LayerSpec(nn.Linear, 2, 2), LayerSpec(nn.ReLU), LayerSpec(nn.Linear, 2, 2)]
    with pytest.raises(error, match=match):
        PipelineModule(specs, **kwargs)


def test_layer_spec_rejects_non_module_typename():
    """LayerSpec(typename) needs an nn.Module subclass; a function or other class is refused by name."""
    for bad in (torch.relu, int, nn.Linear(2, 2)):
        with pytest.raises(TypeError, match="typename must be a torch.nn.Module subclass"):
            LayerSpec(bad)
    with pytest.raises(TypeError, match="typename"):
        TiedLayerSpec("emb", torch.relu)


# -- 5. several ranks -----------------------------------------------------------------------------------


def _stages_not_dividing_world():
    """On 2 ranks: num_stages=3 and a 4-rank topology are refused (before any collective)."""
    messages = []
    for kwargs in ({"num_stages": 3}, {"topology": PipeDataParallelTopology(2, 2)}):
        try:
            PipelineModule([nn.Linear(2, 2) for _ in range(4)], **kwargs)
        except ConfigError as e:
            messages.append(str(e))
    return messages


@pytest.mark.slow
def test_num_stages_must_divide_world_size():
    """num_stages=3 on 2 ranks names num_stages and the world size; a topology of 4 ranks on 2 names both."""
    for messages in run_distributed(_stages_not_dividing_world, world_size=2, timeout=60):
        assert len(messages) == 2, messages
        assert "num_stages=3" in messages[0] and "world size 2" in messages[0], messages[0]
        assert "has 4 ranks but the world has 2" in messages[1], messages[1]


def _check_grid(grid: ParallelGrid, topo: ProcessTopology) -> None:
    rank = dist.get_rank()
    where = f"rank {rank}, {topo}"
    coord = topo.get_coord(rank)
    assert grid.get_global_rank() == rank and grid.topology() is topo, where
    expected_rank = {"pipe": getattr(coord, "pipe", 0), "data": getattr(coord, "data", 0),
                     "model": getattr(coord, "model", 0)}
    expected_ranks = {}
    for axis in ("pipe", "data", "model"):
        lists = topo.get_axis_comm_lists(axis) or [[r] for r in range(topo.world_size())]
        expected_ranks[axis] = next(lst for lst in lists if rank in lst)
    expected_ranks["slice"] = topo.filter_match(data=coord.data) if "data" in topo.axes else list(range(4))
    expected_rank["slice"] = expected_ranks["slice"].index(rank)
    for axis in ("pipe", "data", "model", "slice"):
        group = getattr(grid, f"get_{axis}_parallel_group")()
        ranks = expected_ranks[axis]
        assert getattr(grid, f"get_{axis}_parallel_rank")() == expected_rank[axis], (where, axis)
        assert getattr(grid, f"get_{axis}_parallel_world_size")() == len(ranks), (where, axis)
        if axis != "slice":
            assert max(topo.get_dim(axis), 1) == len(ranks), (where, axis)
        assert dist.get_process_group_ranks(group) == ranks, (where, axis)
        assert dist.get_rank(group) == ranks.index(rank) == expected_rank[axis], (where, axis)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        assert t.item() == sum(ranks), (where, axis, t.item(), ranks)
    # Megatron names are the same accessors
    assert grid.get_tensor_model_parallel_rank() == grid.get_model_parallel_rank()
    assert grid.get_pipeline_model_parallel_world_size() == grid.get_pipe_parallel_world_size()
    stages = max(topo.get_dim("pipe"), 1)
    assert grid.get_stage_id() == expected_rank["pipe"] and grid.get_data_parallel_id() == expected_rank["data"]
    assert grid.is_first_stage == (expected_rank["pipe"] == 0), where  # attributes, as DeepSpeed's
    assert grid.is_last_stage == (expected_rank["pipe"] == stages - 1), where
    assert grid._is_grid_valid()
    assert grid.dp_group == grid.group_ranks["data"] and grid.pp_group == grid.group_ranks["pipe"]
    assert rank in grid.dp_group and rank in grid.pp_group
    for s in range(stages):
        assert grid.stage_to_global(s) == topo.get_rank(**{**coord._asdict(), "pipe": s}), (where, s)
        if "data" in topo.axes and topo.get_dim("data") > 1:
            other = 1 - coord.data
            assert grid.stage_to_global(s, data=other) == topo.get_rank(**{**coord._asdict(), "pipe": s,
                                                                            "data": other}), (where, s)


def _four_stage_specs():
    """8 layers for 4 stages; 'emb' tied between the first and last layer (120 parameters counted)."""
    tied = ("weight", "bias")
    return [TiedLayerSpec("emb", RecordingLinear, 0, 4, 4, tied_weight_attr=tied),
            LayerSpec(RecordingLinear, 1, 4, 4), nn.ReLU(), LayerSpec(RecordingLinear, 3, 4, 4), lambda x: x * 0.5,
            LayerSpec(RecordingLinear, 5, 4, 4), LayerSpec(RecordingLinear, 6, 4, 4),
            TiedLayerSpec("emb", RecordingLinear, 7, 4, 4, forward_fn=lambda emb, x: x @ emb.weight,
                          tied_weight_attr=tied)]


def _four_ranks():
    """On 4 ranks: three grids, Megatron-style initialisation, then a 4-stage PipelineModule."""
    for topo in (PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1),
                 PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=2),
                 PipeDataParallelTopology(num_pp=2, num_dp=2)):
        _check_grid(ParallelGrid(topo), topo)
    grid = initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert get_default_grid() is grid and grid.get_model_parallel_world_size() == 2
    assert grid.get_pipe_parallel_world_size() == 2 and grid.get_data_parallel_world_size() == 1

    BUILDS.clear()
    torch.manual_seed(dist.get_rank())  # different RNG states: the tied copies must be synchronised
    module = PipelineModule(_four_stage_specs(), num_stages=4, partition_method="parameters", seed_layers=True,
                            base_seed=50)
    return {"stage": module.stage_id, "parts": module.parts, "local": list(module.layer_range()),
            "builds": list(BUILDS), "param_indices": sorted(_param_indices(module)),
            "tied": sorted(module.tied_modules.keys()), "owners": module.tied_owner_stages("emb"),
            "duplicates": sorted(module.tied_duplicate_names()),
            "state": {k: v.clone() for k, v in module.state_dict().items()}}


@pytest.mark.slow
def test_grids_and_pipeline_module_on_four_ranks():
    """Grid accessors and groups agree with the topology; a 4-stage module builds local layers only."""
    results = run_distributed(_four_ranks, world_size=4, timeout=120)
    specs = _four_stage_specs()
    weights = [20, 20, 0, 20, 0, 20, 20, 20]
    reference = PipelineModule(specs, num_stages=1, seed_layers=True, base_seed=50).state_dict()
    spec_indices = [i for i, s in enumerate(specs) if isinstance(s, LayerSpec)]
    for rank, res in enumerate(results):
        assert res["stage"] == rank
        assert res["parts"] == partition_balanced(weights, 4) and _max_part(weights, res["parts"]) == 40
        local = res["local"]
        assert local == list(range(res["parts"][rank], res["parts"][rank + 1]))
        # counting built every spec on meta (the tie check builds a tied spec on meta once more), the real
        # build only the local ones
        assert sorted({i for i, dev in res["builds"] if dev == "meta"}) == spec_indices, (rank, res["builds"])
        assert sorted(i for i, dev in res["builds"] if dev == "cpu") == [i for i in local if i in spec_indices], \
            (rank, res["builds"])
        assert res["param_indices"] == [i for i in local if i in (1, 3, 5, 6)], (rank, res["param_indices"])
        owns_tied = rank in (0, 3)
        assert res["tied"] == (["emb"] if owns_tied else []), rank
        assert res["owners"] == [0, 3]
        assert res["duplicates"] == (["tied_modules.emb.bias", "tied_modules.emb.weight"] if rank == 3 else [])
        for name, value in res["state"].items():  # seeded layers and synchronised tied copies: as in one process
            torch.testing.assert_close(value, reference[name], msg=lambda m, r=rank, n=name: f"rank {r} {n}: {m}")
    assert set().union(*(r["state"] for r in results)) == set(reference)
