"""Tensor parallelism on gloo ranks: every sharded layer, an MLP, the vocab-parallel loss and the RNG tracker
equal their dense, single-process counterparts.

Each spawn costs seconds, so one 2-rank run (module fixture ``tp2``) and one 4-rank run (``tp4``:
tp2 × dp2 through the default grid, and tp4 through an explicit ``group=``) compute every check and
return ``{check name: None or a mismatch message}``; the tests below read them.
"""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from microspeed.testing import run_distributed

RTOL, ATOL = 1e-5, 1e-6
IN, OUT, V, DIM = 8, 12, 12, 4  # divisible by tp = 1, 2 and 4


# --------------------------------------------------------------------------------------------
# Helpers run in the ranks (and in the single-process tests)
# --------------------------------------------------------------------------------------------


def _cmp(a: torch.Tensor, b: torch.Tensor, rtol: float = RTOL, atol: float = ATOL) -> str | None:
    """None when ``a`` is close to the reference ``b``, else what differs."""
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    if torch.allclose(a, b, rtol=rtol, atol=atol):
        return None
    return f"max abs diff {(a - b).abs().max().item():.3g} (max |ref| {b.abs().max().item():.3g})"


def _torch_linear_init(w: torch.Tensor) -> torch.Tensor:
    """What ``nn.Linear.reset_parameters`` draws for the weight (before its bias)."""
    return nn.init.kaiming_uniform_(w, a=math.sqrt(5))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pair_checks(out: dict, name: str, layer: nn.Module, dense: nn.Module, x: torch.Tensor, group, *,
                 input_parallel: bool = False, output_parallel: bool = False, seed: int = 0) -> None:
    """Forward and backward of ``layer`` (sharded) against ``dense`` on the same input and output gradient."""
    from microspeed_pipeline.tensor_parallel import full_tensor, shard_tensor

    xd = x.clone().requires_grad_(x.is_floating_point())
    yd = dense(xd)
    g = torch.randn(yd.shape, generator=_gen(seed + 7))
    (yd * g).sum().backward()

    xl = shard_tensor(x, -1, group) if input_parallel else x.clone()
    xl.requires_grad_(x.is_floating_point())
    y = layer(xl)
    if isinstance(y, tuple):  # skip_bias_add
        y, bias = y
        y = y + bias
    (y * (shard_tensor(g, -1, group) if output_parallel else g)).sum().backward()

    out[f"{name}.output"] = _cmp(y, shard_tensor(yd, -1, group) if output_parallel else yd)
    if x.is_floating_point():
        out[f"{name}.input_grad"] = _cmp(xl.grad, shard_tensor(xd.grad, -1, group) if input_parallel else xd.grad)
    for pname, p in layer.named_parameters():
        ref = dict(dense.named_parameters())[pname].grad
        if getattr(p, "tensor_model_parallel", False):
            out[f"{name}.{pname}.grad_shard"] = _cmp(p.grad, shard_tensor(ref, p.partition_dim, group,
                                                                         p.partition_stride))
            out[f"{name}.{pname}.grad_full"] = _cmp(full_tensor(p.grad, group, partition_dim=p.partition_dim,
                                                                stride=p.partition_stride), ref)
        else:
            out[f"{name}.{pname}.grad"] = _cmp(p.grad, ref)


def _layer_checks(group, seed: int) -> dict:
    """Column, row and vocab layers against dense ones, built by from_dense and by the constructor."""
    from microspeed_pipeline.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        full_tensor,
        is_tensor_parallel_duplicate,
        shard_tensor,
    )

    out: dict = {}
    x = torch.randn(3, 5, IN, generator=_gen(seed))
    tp = ColumnParallelLinear(IN, OUT, group=group).world_size

    # ColumnParallelLinear
    for gather in (True, False):
        for skip in ((False, True) if not gather else (False,)):
            torch.manual_seed(11)
            dense = nn.Linear(IN, OUT)
            layer = ColumnParallelLinear.from_dense(dense, gather_output=gather, group=group, skip_bias_add=skip)
            _pair_checks(out, f"column.from_dense.gather={gather}.skip={skip}", layer, dense, x, group,
                         output_parallel=not gather, seed=seed)
        torch.manual_seed(12)
        layer = ColumnParallelLinear(IN, OUT, gather_output=gather, init_method=_torch_linear_init, group=group)
        torch.manual_seed(12)
        dense = nn.Linear(IN, OUT)
        out[f"column.ctor.gather={gather}.init_equals_nn_linear"] = (
            None if torch.equal(full_tensor(layer.weight, group), dense.weight.detach()) else "weights differ")
        out[f"column.ctor.gather={gather}.bias_zero"] = None if not layer.bias.any() else "bias not zero"
        with torch.no_grad():
            dense.bias.zero_()
        _pair_checks(out, f"column.ctor.gather={gather}", layer, dense, x, group, output_parallel=not gather, seed=seed)
    # default init (xavier_normal_) and the master weight
    torch.manual_seed(13)
    layer = ColumnParallelLinear(IN, OUT, keep_master_weight_for_test=True, group=group)
    torch.manual_seed(13)
    ref = nn.init.xavier_normal_(torch.empty(OUT, IN))
    out["column.ctor.xavier_master"] = None if torch.equal(layer.master_weight, ref) else "master differs"
    out["column.ctor.xavier_shard"] = None if torch.equal(layer.weight, shard_tensor(ref, 0, group)) else "shard"
    out["column.shapes"] = None if (layer.weight.shape == (OUT // tp, IN) and layer.bias.shape == (OUT // tp,)) \
        else f"{tuple(layer.weight.shape)}"
    out["column.attributes"] = None if (layer.weight.tensor_model_parallel and layer.weight.partition_dim == 0
                                        and layer.bias.tensor_model_parallel) else "attributes"
    # stride 2: strided shards of the master, gathered back in the dense layout
    torch.manual_seed(14)
    layer = ColumnParallelLinear(IN, OUT // 3 * 2, stride=2, keep_master_weight_for_test=True, group=group)
    out["column.stride2.full_is_master"] = _cmp(full_tensor(layer.weight, group), layer.master_weight, 0, 0)
    out["column.stride2.shard"] = _cmp(layer.weight, shard_tensor(layer.master_weight, 0, group, stride=2), 0, 0)

    # RowParallelLinear
    for parallel_in in (False, True):
        for skip in (False, True):
            torch.manual_seed(21)
            dense = nn.Linear(IN, OUT)
            layer = RowParallelLinear.from_dense(dense, input_is_parallel=parallel_in, group=group, skip_bias_add=skip)
            _pair_checks(out, f"row.from_dense.parallel_in={parallel_in}.skip={skip}", layer, dense, x, group,
                         input_parallel=parallel_in, seed=seed)
        torch.manual_seed(22)
        layer = RowParallelLinear(IN, OUT, input_is_parallel=parallel_in, init_method=_torch_linear_init, group=group)
        torch.manual_seed(22)
        dense = nn.Linear(IN, OUT)
        out[f"row.ctor.parallel_in={parallel_in}.init_equals_nn_linear"] = (
            None if torch.equal(full_tensor(layer.weight, group), dense.weight.detach()) else "weights differ")
        with torch.no_grad():
            dense.bias.zero_()
        _pair_checks(out, f"row.ctor.parallel_in={parallel_in}", layer, dense, x, group, input_parallel=parallel_in,
                     seed=seed)
    rank = layer.rank
    out["row.shapes"] = None if (layer.weight.shape == (OUT, IN // tp) and layer.bias.shape == (OUT,)) else "shape"
    out["row.attributes"] = None if (layer.weight.tensor_model_parallel and layer.weight.partition_dim == 1
                                     and layer.bias.tensor_model_parallel is False) else "attributes"
    norm = nn.LayerNorm(4)
    dup = [is_tensor_parallel_duplicate(p, group) for p in (layer.weight, layer.bias, norm.weight)]
    out["duplicates"] = None if dup == [False, rank > 0, rank > 0] else f"{dup} on tp rank {rank}"

    # VocabParallelEmbedding (padding_idx in the last rank's range: its row stays zero, gets no gradient)
    tokens = torch.randint(0, V, (3, V + 2), generator=_gen(seed + 1))
    tokens[0, :V] = torch.arange(V)  # every range is hit
    for padding_idx in (None, V - 2):
        torch.manual_seed(31)
        dense = nn.Embedding(V, DIM, padding_idx=padding_idx)
        layer = VocabParallelEmbedding.from_dense(dense, group=group)
        _pair_checks(out, f"vocab.from_dense.pad={padding_idx}", layer, dense, tokens, group, seed=seed)
        torch.manual_seed(32)
        layer = VocabParallelEmbedding(V, DIM, padding_idx=padding_idx, group=group)
        torch.manual_seed(32)
        dense = nn.Embedding(V, DIM, padding_idx=padding_idx)
        out[f"vocab.ctor.pad={padding_idx}.init_equals_nn_embedding"] = (
            None if torch.equal(full_tensor(layer.weight, group), dense.weight.detach()) else "weights differ")
        _pair_checks(out, f"vocab.ctor.pad={padding_idx}", layer, dense, tokens, group, seed=seed)
        if padding_idx is not None:
            full_grad = full_tensor(layer.weight.grad, group, partition_dim=0)
            out["vocab.padding_row_grad_zero"] = None if not full_grad[padding_idx].any() else "padding row has grad"
    per = V // tp
    out["vocab.range"] = None if (layer.vocab_start_index, layer.vocab_end_index) == (rank * per, (rank + 1) * per) \
        else "range"
    return out


def _mlp_checks(group, seed: int) -> dict:
    """Column(gather_output=False) → GELU → Row(input_is_parallel=True) equals the dense MLP over 3 SGD steps."""
    from microspeed_pipeline.tensor_parallel import ColumnParallelLinear, RowParallelLinear, full_tensor

    from microspeed import comm

    out: dict = {}
    torch.manual_seed(41)
    dense = nn.Sequential(nn.Linear(IN, 2 * OUT), nn.GELU(), nn.Linear(2 * OUT, IN))
    model = nn.Sequential(ColumnParallelLinear.from_dense(dense[0], gather_output=False, group=group), nn.GELU(),
                          RowParallelLinear.from_dense(dense[2], input_is_parallel=True, group=group))
    twin, dense0 = copy.deepcopy(model), copy.deepcopy(dense)  # layers hold process groups: a deep copy shares them
    opt_d = torch.optim.SGD(dense.parameters(), lr=0.1)
    opt_t = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = _gen(seed + 2)
    before = comm.stats.total_bytes()
    for step in range(3):
        x = torch.randn(4, 3, IN, generator=gen)
        target = torch.randn(4, 3, IN, generator=gen)
        xd, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
        yd, yt = dense(xd), model(xt)
        loss_d, loss_t = F.mse_loss(yd, target), F.mse_loss(yt, target)
        opt_d.zero_grad()
        opt_t.zero_grad()
        loss_d.backward()
        loss_t.backward()
        out[f"mlp.step{step}.output"] = _cmp(yt, yd)
        out[f"mlp.step{step}.loss"] = _cmp(loss_t, loss_d)
        out[f"mlp.step{step}.input_grad"] = _cmp(xt.grad, xd.grad)
        opt_d.step()
        opt_t.step()
    for (name, p), ref in zip(model.named_parameters(), dense.parameters(), strict=True):
        out[f"mlp.after_3_steps.{name}"] = _cmp(full_tensor(p, group), ref)
    tp = model[0].world_size
    out["mlp.comm_bytes_counted"] = None if (tp == 1 or comm.stats.total_bytes() > before) else "no bytes counted"
    x = torch.randn(2, IN, generator=gen)
    out["mlp.deepcopy_forward"] = _cmp(twin(x), dense0(x))
    return out


def _ce_checks(group, seed: int) -> dict:
    """vocab_parallel_cross_entropy equals F.cross_entropy(reduction='none'), loss and logits gradient."""
    from microspeed_pipeline.cross_entropy import vocab_parallel_cross_entropy
    from microspeed_pipeline.tensor_parallel import shard_tensor

    out: dict = {}
    gen = _gen(seed + 3)
    for scale in (3.0, 1e4):  # 1e4: exp would overflow without the max shift
        for ls in (0.0, 0.1):
            full = torch.randn(4, 3, V, generator=gen) * scale
            target = torch.randint(0, V, (4, 3), generator=gen)
            weights = torch.rand(4, 3, generator=gen)
            ref_logits = full.clone().requires_grad_()
            ref = F.cross_entropy(ref_logits.reshape(-1, V), target.reshape(-1), reduction="none",
                                  label_smoothing=ls).view_as(target)
            (ref * weights).sum().backward()
            local = shard_tensor(full, -1, group).requires_grad_()
            loss = vocab_parallel_cross_entropy(local, target, label_smoothing=ls, group=group)
            (loss * weights).sum().backward()
            tag = f"ce.scale={scale:g}.ls={ls}"
            out[f"{tag}.loss"] = _cmp(loss, ref, rtol=RTOL, atol=1e-5 * scale)
            out[f"{tag}.finite"] = None if torch.isfinite(loss).all() else "non-finite loss"
            out[f"{tag}.grad"] = _cmp(local.grad, shard_tensor(ref_logits.grad, -1, group))
    # half-precision logits: the loss comes back in float32, the gradient in the logits' dtype
    full = torch.randn(2, V, generator=gen)
    target = torch.randint(0, V, (2,), generator=gen)
    local = shard_tensor(full, -1, group).to(torch.bfloat16).requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target.int(), group=group)
    loss.sum().backward()
    out["ce.bf16.dtypes"] = None if (loss.dtype, local.grad.dtype) == (torch.float32, torch.bfloat16) else \
        f"{loss.dtype}, {local.grad.dtype}"
    out["ce.bf16.loss"] = _cmp(loss, F.cross_entropy(full.bfloat16().float(), target, reduction="none"), 1e-5, 1e-5)
    return out


def _roundtrip_checks(group) -> dict:
    """shard_tensor then full_tensor gives the tensor back, for several dims and strides."""
    from microspeed_pipeline.tensor_parallel import full_tensor, shard_tensor

    out: dict = {}
    full = torch.randn(8, 12, 4, generator=_gen(5))
    for dim in (0, 1, -1):
        for stride in (1, 2):
            try:
                shard = shard_tensor(full, dim, group, stride)
                back = full_tensor(shard, group, partition_dim=dim, stride=stride)
                out[f"roundtrip.dim={dim}.stride={stride}"] = _cmp(back, full, 0, 0)
            except ValueError as e:  # sizes not divisible at this tp: fine, reported clearly
                out[f"roundtrip.dim={dim}.stride={stride}"] = None if "not divisible" in str(e) else str(e)
    p = nn.Parameter(torch.ones(3))
    out["roundtrip.replicated_param"] = _cmp(full_tensor(p, group), p)
    return out


def _rng_checks(group) -> dict:
    """Dropout under the tracker's fork differs across tensor-parallel ranks; outside it agrees."""
    from microspeed_pipeline.rng import get_cuda_rng_tracker, get_rng_tracker, model_parallel_seed
    from microspeed_pipeline.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        get_tensor_model_parallel_group,
    )

    from microspeed import comm

    out: dict = {}
    tp_group = get_tensor_model_parallel_group(group)  # None → the default grid's
    tracker = get_rng_tracker()
    ones = torch.ones(256)
    tp_rank = None if group is None else comm.get_rank(group)  # None: the default grid's tensor-parallel rank
    model_parallel_seed(1234, tp_rank)
    outer = torch.get_rng_state()
    with tracker.fork():
        inside = F.dropout(ones, 0.5)
    out["rng.fork_restores_outer_state"] = None if torch.equal(torch.get_rng_state(), outer) else "outer changed"
    outside = F.dropout(ones, 0.5)
    states = tracker.get_states()
    with get_cuda_rng_tracker().fork():
        inside2 = F.dropout(ones, 0.5)
    tracker.set_states(states)
    with tracker.fork():
        inside2_replay = F.dropout(ones, 0.5)
    masks = comm.all_gather_object((inside, outside), group=tp_group)
    out["rng.fork_differs_across_tp"] = None if all(not torch.equal(m[0], masks[0][0]) for m in masks[1:]) \
        else "identical masks inside the fork"
    out["rng.outside_agrees_across_tp"] = None if all(torch.equal(m[1], masks[0][1]) for m in masks) \
        else "masks outside the fork differ"
    out["rng.fork_advances"] = None if not torch.equal(inside, inside2) else "fork state did not advance"
    out["rng.set_states_replays"] = None if torch.equal(inside2, inside2_replay) else "set_states did not restore"
    model_parallel_seed(1234, tp_rank)
    out["rng.fork_does_not_consume_outer"] = None if torch.equal(F.dropout(ones, 0.5), outside) else "outer consumed"
    with tracker.fork():
        out["rng.fork_reproducible"] = None if torch.equal(F.dropout(ones, 0.5), inside) else "not reproducible"
    try:
        tracker.add("model-parallel-rng", 99)
        out["rng.duplicate_name_rejected"] = "no error"
    except ValueError:
        out["rng.duplicate_name_rejected"] = None

    # Megatron's use: dropout on the column-parallel (sharded) activations inside the fork
    model_parallel_seed(7, tp_rank)
    col = ColumnParallelLinear(IN, OUT, gather_output=False, group=group)
    row = RowParallelLinear(OUT, IN, input_is_parallel=True, group=group)
    x = torch.randn(5, IN, generator=_gen(9)).requires_grad_()
    h = col(x)
    with tracker.fork():
        h = F.dropout(h, 0.5)
    kept = (h != 0).flatten()
    y = F.dropout(row(h), 0.1)  # replicated region: same mask everywhere, so y agrees across ranks
    y.sum().backward()
    both = comm.all_gather_object((kept, y.detach(), x.grad), group=tp_group)
    if len(both) > 1:
        out["rng.column_dropout_shard_masks_differ"] = None if not torch.equal(both[0][0], both[1][0]) else "same"
    out["rng.row_output_agrees"] = None if all(torch.equal(b[1], both[0][1]) for b in both) else "outputs differ"
    out["rng.input_grad_agrees"] = None if all(torch.equal(b[2], both[0][2]) for b in both) else "grads differ"
    return out


def _error_checks() -> dict:
    """A world of 2 without a grid and without group=: every entry point raises a ConfigError that says what to do."""
    import torch.distributed as dist
    from microspeed_pipeline.cross_entropy import vocab_parallel_cross_entropy
    from microspeed_pipeline.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        copy_to_tensor_model_parallel_region,
        gather_from_tensor_model_parallel_region,
        shard_tensor,
    )
    from microspeed_pipeline.topology import get_default_grid

    from microspeed.errors import ConfigError

    assert get_default_grid() is None
    calls = {
        "column": lambda: ColumnParallelLinear(4, 4),
        "row": lambda: RowParallelLinear(4, 4),
        "vocab": lambda: VocabParallelEmbedding(4, 4),
        "copy": lambda: copy_to_tensor_model_parallel_region(torch.ones(2)),
        "gather": lambda: gather_from_tensor_model_parallel_region(torch.ones(2)),
        "shard": lambda: shard_tensor(torch.ones(4), 0),
        "cross_entropy": lambda: vocab_parallel_cross_entropy(torch.ones(2, 4), torch.zeros(2, dtype=torch.long)),
    }
    out: dict = {}
    for name, call in calls.items():
        try:
            call()
            out[f"error.{name}"] = "no error raised"
        except ConfigError as e:
            msg = str(e)
            out[f"error.{name}"] = None if ("initialize_model_parallel" in msg and "group=" in msg) else msg
    # an explicit group works without a grid
    layer = ColumnParallelLinear(4, 4, group=dist.group.WORLD)
    out["error.explicit_group_ok"] = None if layer.world_size == 2 else f"world {layer.world_size}"
    return out


def _tp2_body() -> dict:
    from microspeed_pipeline import initialize_model_parallel

    out = {"errors": _error_checks()}
    initialize_model_parallel(tensor_model_parallel_size=2)
    out["layers"] = _layer_checks(None, seed=100)
    out["mlp"] = _mlp_checks(None, seed=100)
    out["ce"] = _ce_checks(None, seed=100)
    out["roundtrip"] = _roundtrip_checks(None)
    out["rng"] = _rng_checks(None)
    return out


def _tp4_body() -> dict:
    import torch.distributed as dist
    from microspeed_pipeline import get_default_grid, initialize_model_parallel

    grid = initialize_model_parallel(tensor_model_parallel_size=2)  # tp2 × dp2: groups {0, 1} and {2, 3}
    seed = 100 + grid.get_data_parallel_rank()  # different data in the two replicas
    out = {"tp2dp2": {**_layer_checks(None, seed), **_mlp_checks(None, seed), **_ce_checks(None, seed),
                      **_rng_checks(None)},
           "tp_group_ranks": get_default_grid().group_ranks["model"]}
    world = dist.group.WORLD  # tp4 through an explicit group
    out["tp4"] = {**_layer_checks(world, 200), **_mlp_checks(world, 200), **_ce_checks(world, 200),
                  **_roundtrip_checks(world), **_rng_checks(world)}
    return out


# --------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------


def _failures(results: list[dict], key: str) -> dict:
    return {f"rank{r}:{name}": msg for r, res in enumerate(results) for name, msg in res[key].items() if msg}


@pytest.fixture(scope="module")
def tp2() -> list[dict]:
    return run_distributed(_tp2_body, world_size=2, timeout=120)


@pytest.fixture(scope="module")
def tp4() -> list[dict]:
    return run_distributed(_tp4_body, world_size=4, timeout=120)


@pytest.mark.slow
def test_world_without_grid_or_group_raises_clear_error(tp2):
    assert _failures(tp2, "errors") == {}
    assert len(tp2[0]["errors"]) == 8


def test_layers_equal_dense_forward_and_backward(tp2):
    assert _failures(tp2, "layers") == {}
    assert len(tp2[0]["layers"]) > 80


def test_mlp_equals_dense_over_three_sgd_steps(tp2):
    assert _failures(tp2, "mlp") == {}


def test_vocab_parallel_cross_entropy_equals_torch(tp2):
    assert _failures(tp2, "ce") == {}


def test_full_tensor_shard_tensor_roundtrip(tp2):
    assert _failures(tp2, "roundtrip") == {}


def test_rng_tracker_fork_across_tensor_parallel_ranks(tp2):
    assert _failures(tp2, "rng") == {}


@pytest.mark.slow
def test_tp2_by_dp2_and_tp4_on_four_ranks(tp4):
    assert [r["tp_group_ranks"] for r in tp4] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert _failures(tp4, "tp2dp2") == {}
    assert _failures(tp4, "tp4") == {}


# -- one process, no torch.distributed: dense layers --------------------------------------------


@pytest.fixture
def no_grid():
    import torch.distributed as dist
    from microspeed_pipeline.topology import get_default_grid, set_default_grid

    if dist.is_initialized():  # an earlier in-process initialize() started a 1-rank group
        assert dist.get_world_size() == 1
        dist.destroy_process_group()
    saved = get_default_grid()
    set_default_grid(None)
    yield
    set_default_grid(saved)


def test_single_process_layers_are_dense(no_grid):
    from microspeed_pipeline.tensor_parallel import (
        ColumnParallelLinear,
        copy_to_tensor_model_parallel_region,
        gather_from_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
        scatter_to_tensor_model_parallel_region,
    )

    checks = {**_layer_checks(None, 1), **_mlp_checks(None, 1), **_ce_checks(None, 1), **_roundtrip_checks(None),
              **_rng_checks(None)}
    assert {k: v for k, v in checks.items() if v} == {}
    x = torch.randn(3, 4)
    for fn in (copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
               scatter_to_tensor_model_parallel_region, gather_from_tensor_model_parallel_region):
        assert fn(x) is x
    layer = ColumnParallelLinear(4, 6)
    assert layer.world_size == 1 and layer.weight.shape == (6, 4)
    clone = pickle.loads(pickle.dumps(layer))  # a pickled layer forgets its group, keeps its weights
    assert torch.equal(clone(x), layer(x))


def test_single_process_with_tp1_grid(no_grid):
    from microspeed_pipeline import initialize_model_parallel
    from microspeed_pipeline.tensor_parallel import RowParallelLinear, is_tensor_parallel_duplicate

    initialize_model_parallel(tensor_model_parallel_size=1)
    torch.manual_seed(0)
    dense = nn.Linear(IN, OUT)
    layer = RowParallelLinear.from_dense(dense)
    x = torch.randn(2, IN)
    assert torch.equal(layer(x), dense(x))
    assert not is_tensor_parallel_duplicate(layer.bias)


def test_cross_entropy_gradcheck_and_validation(no_grid):
    from microspeed_pipeline.cross_entropy import vocab_parallel_cross_entropy

    logits = torch.randn(3, 5, dtype=torch.double, requires_grad=True)
    target = torch.tensor([0, 4, 2])
    for ls in (0.0, 0.2):
        assert torch.autograd.gradcheck(lambda z, ls=ls: vocab_parallel_cross_entropy(z, target, ls), (logits,))
    with pytest.raises(ValueError, match="label_smoothing"):
        vocab_parallel_cross_entropy(logits, target, label_smoothing=1.0)
    with pytest.raises(ValueError, match="do not match"):
        vocab_parallel_cross_entropy(logits, target[:2])


def test_sizes_not_divisible_and_bad_modules(no_grid):
    from microspeed_pipeline.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding, shard_tensor

    from microspeed.errors import ConfigError

    with pytest.raises(ConfigError, match="not divisible"):
        shard_tensor(torch.ones(5), 0, stride=2)
    with pytest.raises(TypeError, match="nn.Linear"):
        ColumnParallelLinear.from_dense(nn.Conv1d(2, 2, 1))
    with pytest.raises(ValueError, match="max_norm"):
        VocabParallelEmbedding.from_dense(nn.Embedding(4, 2, max_norm=1.0))
