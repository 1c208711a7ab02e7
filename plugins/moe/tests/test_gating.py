"""MoE gating: the sparse routes equal the papers' reference and DeepSpeed's gates; RTS, noise, capacity, errors."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import gating_reference as ref
import pytest
import torch

from microspeed.moe import gating
from microspeed.moe.gating import Routing, capacity, route, route_top1, route_top2, route_topk
from microspeed.moe.sharded_moe import TopKGate, dense, top1gating, top2gating, topkgating
from microspeed.testing import run_distributed


def _cases(count: int, seed: int) -> list[tuple[int, int, float, int, bool]]:
    """``(tokens, experts, capacity_factor, min_capacity, drop_tokens)``: the edges, then a seeded spread."""
    cases = [(1, 2, 1.0, 0, True), (1, 8, 0.5, 4, True), (64, 8, 2.0, 4, False), (64, 2, 0.5, 0, True),
             (7, 3, 1.5, 1, True), (10, 3, 1.5, 0, True)]
    rng = random.Random(seed)
    while len(cases) < count:
        cases.append((rng.randint(1, 64), rng.randint(2, 8), rng.choice([0.5, 0.75, 1.0, 1.25, 1.5, 2.0]),
                      rng.choice([0, 1, 4, 8]), rng.random() < 0.7))
    return cases


CASES = _cases(24, seed=0)


def _ids(case: tuple[int, int, float, int, bool]) -> str:
    tokens, experts, factor, min_cap, drop = case
    return f"T{tokens}-E{experts}-cf{factor}-min{min_cap}-{'drop' if drop else 'nodrop'}"


def _logits(tokens: int, experts: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1009 + tokens * 17 + experts)
    return torch.randn(tokens, experts, generator=generator) * scale


def assert_gate_output(ours: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> None:
    """``(l_aux, combine_weights, dispatch_mask, exp_counts)`` agree; ours has DeepSpeed's dtypes."""
    l_aux, combine, dispatch, counts = ours
    assert combine.dtype == torch.float32 and dispatch.dtype == torch.bool and counts.dtype == torch.long
    assert l_aux.dim() == 0
    torch.testing.assert_close(l_aux.double(), expected[0].double(), rtol=1e-5, atol=1e-7)
    assert combine.shape == expected[1].shape
    torch.testing.assert_close(combine.double(), expected[1].double(), rtol=1e-5, atol=1e-6)
    assert torch.equal(dispatch, expected[2])
    assert torch.equal(counts, expected[3].to(counts.dtype))


def assert_invariants(r: Routing, num_experts: int) -> None:
    """Kept choices have distinct slots below capacity per expert; dropped ones weigh nothing."""
    assert r.experts.dtype == r.slots.dtype == torch.long and r.experts.shape == r.slots.shape == r.weights.shape
    assert bool((r.slots < r.capacity).all()) and bool((r.slots >= -1).all())
    assert bool((r.weights[~r.kept] == 0).all())
    for e in range(num_experts):
        slots = r.slots[r.kept & (r.experts == e)]
        assert slots.numel() == slots.unique().numel() <= r.capacity
    # each token names an expert at most once
    assert all(len(set(row)) == len(row) for row in r.experts.tolist())


# --------------------------------------------------------------------------------------------
# Equal to the papers' reference (noise and random token selection off)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_top1_equals_reference(case):
    tokens, experts, factor, min_cap, drop = case
    logits = _logits(tokens, experts)
    expected = ref.top1(logits, factor, min_cap, drop_tokens=drop)
    assert_gate_output(top1gating(logits, factor, min_cap, drop_tokens=drop, use_rts=False), expected)
    r = route(logits, k=1, capacity_factor=factor, min_capacity=min_cap, drop_tokens=drop, use_rts=False)
    assert_invariants(r, experts)
    assert_gate_output((r.l_aux, *dense(r, experts), r.exp_counts), expected)


@pytest.mark.parametrize("case", CASES[:8], ids=_ids)
def test_top1_with_used_token_equals_reference(case):
    tokens, experts, factor, min_cap, drop = case
    logits = _logits(tokens, experts, seed=1)
    used = (torch.arange(tokens) % 3 != 1).long()
    expected = ref.top1(logits, factor, min_cap, drop_tokens=drop, used_token=used)
    r = route_top1(logits, factor, min_cap, used_token=used.bool(), drop_tokens=drop, use_rts=False)
    assert_invariants(r, experts)
    assert not bool(r.kept[used == 0].any())
    assert_gate_output(top1gating(logits, factor, min_cap, used_token=used, drop_tokens=drop, use_rts=False),
                       expected)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_top2_equals_reference(case):
    tokens, experts, factor, min_cap, drop = case
    logits = _logits(tokens, experts)
    expected = ref.top2(logits, factor, min_cap, drop_tokens=drop)
    assert_gate_output(top2gating(logits, factor, min_cap, drop_tokens=drop, top2_2nd_expert_sampling=False),
                       expected)
    r = route(logits, k=2, capacity_factor=factor, min_capacity=min_cap, drop_tokens=drop,
              top2_2nd_expert_sampling=False)
    assert_invariants(r, experts)
    assert_gate_output((r.l_aux, *dense(r, experts), r.exp_counts), expected)


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("case", CASES[::2], ids=_ids)
def test_topk_equals_reference(case, policy):
    tokens, experts, factor, min_cap, drop = case
    logits = _logits(tokens, experts)
    for k in range(1, experts + 1):
        expected = ref.topk(logits, k, factor, min_cap, drop_tokens=drop, drop_policy=policy)
        assert_gate_output(topkgating(logits, k, factor, min_cap, drop_tokens=drop, drop_policy=policy), expected)
        r = route_topk(logits, k, factor, min_cap, drop_tokens=drop, drop_policy=policy)
        assert_invariants(r, experts)
        if k >= 3:
            assert_gate_output(_as_gate_output(route(logits, k=k, capacity_factor=factor, min_capacity=min_cap,
                                                     drop_tokens=drop, drop_policy=policy), experts), expected)


def _as_gate_output(r: Routing, num_experts: int) -> tuple[torch.Tensor, ...]:
    return (r.l_aux, *dense(r, num_experts), r.exp_counts)


def test_drop_policies_differ_as_defined():
    # expert 0 is everyone's first choice; its probability rises with the token index
    logits = torch.tensor([[1.0 + 0.5 * t, 0.0, -1.0, -2.0] for t in range(8)])
    by_probs = route_topk(logits, 1, 0.5, 0, drop_policy="probs")
    by_position = route_topk(logits, 1, 0.5, 0, drop_policy="position")
    assert by_probs.capacity == by_position.capacity == 1
    assert by_probs.kept.squeeze(1).nonzero().flatten().tolist() == [7]  # the most probable token
    assert by_position.kept.squeeze(1).nonzero().flatten().tolist() == [0]  # the first token


def test_top2_second_choices_queue_after_first_choices():
    # tokens 0-2 pick expert 0 first and expert 1 second; token 3 picks expert 1 first
    logits = torch.tensor([[3.0, 2.0, 0.0], [3.0, 2.0, 0.0], [3.0, 2.0, 0.0], [0.0, 3.0, 2.0]])
    r = route_top2(logits, 1.0, 0, drop_tokens=False, top2_2nd_expert_sampling=False)
    assert r.slots.tolist() == [[0, 1], [1, 2], [2, 3], [0, 0]]
    assert r.capacity == 4 and r.exp_counts.tolist() == [3, 4, 1]
    dropped = route_top2(logits, 0.5, 2, top2_2nd_expert_sampling=False)  # capacity max(ceil(4/3·1), 2) = 2
    assert dropped.capacity == 2
    assert dropped.slots.tolist() == [[0, 1], [1, -1], [-1, -1], [0, 0]]
    torch.testing.assert_close(dropped.weights[1], torch.tensor([1.0, 0.0]))  # alone, the kept gate weighs 1


def test_capacity_formula_and_floor():
    assert capacity(64, 8, 1.0, 4) == 8
    assert capacity(10, 4, 1.0, 0) == 3
    assert capacity(10, 4, 1.0, 5) == 5
    assert capacity(10, 3, 1.5, 0) == 5  # 10/3 × 1.5 = 5 (double precision would round up to 6)
    assert capacity(2, 7, 10.5, 0) == 4  # DeepSpeed's float32 product 3.0000002 rounds up (exactly it is 3)


# --------------------------------------------------------------------------------------------
# Equal to DeepSpeed 0.19.8
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ds():
    """DeepSpeed's ``sharded_moe`` (CPU accelerator), or skip."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.moe import sharded_moe
    except Exception as exc:  # any import failure means there is no reference here
        pytest.skip(f"deepspeed is not importable: {exc!r}")
    return sharded_moe


def _assert_same(ours: tuple[torch.Tensor, ...], theirs: tuple, exact: bool = True) -> None:
    assert len(ours) == len(theirs) == 4
    for a, b in zip(ours, theirs, strict=True):
        b = torch.as_tensor(b)
        assert a.shape == b.shape and a.dtype == b.dtype
        if exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _ds_grid() -> Iterator[tuple[int, int, float, int, bool, torch.Tensor]]:
    for tokens, experts, factor, min_cap, drop in CASES:
        yield tokens, experts, factor, min_cap, drop, _logits(tokens, experts, seed=2)


def test_deepspeed_top1_without_rts(ds):
    """Exact wherever no token is dropped; when some are, the kept counts, weights, loss and counts agree.

    Without RTS DeepSpeed keeps whichever ``capacity`` tokens ``torch.topk`` returns among tied 0/1 scores
    (an unspecified tie order); we keep the first ones in token order, as Switch does.
    """
    for tokens, _, factor, min_cap, drop, logits in _ds_grid():
        if tokens < min_cap:  # DeepSpeed's top1gating asserts tokens >= min_capacity
            continue
        ours = top1gating(logits, factor, min_cap, drop_tokens=drop, use_rts=False)
        theirs = ds.top1gating(logits.clone(), factor, min_cap, drop_tokens=drop, use_rts=False)
        if int(theirs[3].max()) <= theirs[1].shape[2]:
            _assert_same(ours, theirs)
            continue
        assert ours[1].shape == theirs[1].shape
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[3], theirs[3])
        assert torch.equal(ours[2].sum((0, 2)), theirs[2].sum((0, 2)))  # min(count, capacity) per expert
        both = ours[2].any(2) & theirs[2].any(2)
        assert torch.equal(ours[1].sum(2)[both], theirs[1].sum(2)[both])


def test_deepspeed_top1_seeded_rts_and_rsample(ds):
    """With the same seed our RTS priorities and Gumbel noise are DeepSpeed's, so the outputs are identical."""
    for tokens, _, factor, min_cap, drop, logits in _ds_grid():
        if tokens < min_cap:
            continue
        for policy in (None, "RSample"):
            torch.manual_seed(tokens)
            theirs = ds.top1gating(logits.clone(), factor, min_cap, noisy_gate_policy=policy, drop_tokens=drop)
            torch.manual_seed(tokens)
            ours = top1gating(logits, factor, min_cap, noisy_gate_policy=policy, drop_tokens=drop)
            _assert_same(ours, theirs)


def test_deepspeed_top2(ds):
    for tokens, _, factor, min_cap, drop, logits in _ds_grid():
        _assert_same(top2gating(logits, factor, min_cap, drop_tokens=drop, top2_2nd_expert_sampling=False),
                     ds.top2gating(logits.clone(), factor, min_cap, drop_tokens=drop, top2_2nd_expert_sampling=False))
        torch.manual_seed(tokens)
        theirs = ds.top2gating(logits.clone(), factor, min_cap, drop_tokens=drop)
        torch.manual_seed(tokens)
        _assert_same(top2gating(logits, factor, min_cap, drop_tokens=drop), theirs)


def test_deepspeed_topk(ds):
    for _, experts, factor, min_cap, drop, logits in _ds_grid():
        for k in range(1, experts + 1):
            for policy in ("probs", "position"):
                _assert_same(topkgating(logits, k, factor, min_cap, drop_tokens=drop, drop_policy=policy),
                             ds.topkgating(logits.clone(), k, factor, min_cap, drop_tokens=drop, drop_policy=policy))


def test_deepspeed_capacity(ds):
    for tokens in range(1, 65, 3):
        for experts in range(1, 9):
            for factor in (0.3, 0.5, 0.75, 1.0, 1.1, 1.25, 1.5, 2.0, 10.5):
                theirs = ds._capacity(torch.empty(tokens, experts), torch.tensor(factor), torch.tensor(2))
                assert capacity(tokens, experts, factor, 2) == int(theirs)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_deepspeed_gradients(ds, k):
    """The loss and combine weights carry the same gradients to the logits as DeepSpeed's."""
    logits = _logits(24, 6, seed=3)
    probe = torch.randn(24, 6, 64, generator=torch.Generator().manual_seed(5))

    def grad(fn):
        x = logits.clone().requires_grad_(True)
        torch.manual_seed(0)
        l_aux, combine, _, _ = fn(x * 1.0)  # not the leaf: DeepSpeed's top2gating adds noise in place
        (l_aux + (combine[..., :probe.shape[2]] * probe[..., :combine.shape[2]]).sum()).backward()
        return x.grad

    def gate(module, x):
        if k == 1:
            return module.top1gating(x, 1.0, 4)
        return module.top2gating(x, 0.75, 4) if k == 2 else module.topkgating(x, k, 0.75, 4)

    import microspeed.moe.sharded_moe as ours

    torch.testing.assert_close(grad(lambda x: gate(ours, x)), grad(lambda x: gate(ds, x)), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("k", "policy"), [(1, "Jitter"), (1, "RSample"), (2, None), (4, None)])
def test_deepspeed_topkgate(ds, k, policy):
    """``TopKGate`` (same weights, same seed) gives DeepSpeed's output in training and evaluation."""
    kwargs = {"k": k, "capacity_factor": 1.0, "eval_capacity_factor": 2.0, "min_capacity": 4,
              "noisy_gate_policy": policy}
    ours, theirs = TopKGate(16, 8, **kwargs), ds.TopKGate(16, 8, **kwargs)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
    for training in (True, False):
        ours.train(training)
        theirs.train(training)
        torch.manual_seed(7)
        expected = theirs(x)
        torch.manual_seed(7)
        _assert_same(ours(x), expected)


# --------------------------------------------------------------------------------------------
# Random token selection and noisy gates
# --------------------------------------------------------------------------------------------


def _skewed(tokens: int = 48, experts: int = 4) -> torch.Tensor:
    logits = _logits(tokens, experts, seed=4)
    logits[: tokens * 3 // 4, 0] += 6.0  # expert 0 is badly over capacity
    return logits


def test_rts_keeps_min_count_capacity_and_is_seeded():
    logits = _skewed()
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        r = route_top1(logits, 1.0, 4, use_rts=True)
        assert_invariants(r, 4)
        kept = torch.zeros(4, dtype=torch.long).index_add_(0, r.experts[r.kept], torch.ones_like(r.slots[r.kept]))
        assert torch.equal(kept, torch.clamp(r.exp_counts, max=r.capacity))
        for e in range(4):  # kept tokens take slots 0, 1, ... in token order
            assert r.slots[r.kept & (r.experts == e)].tolist() == list(range(int(kept[e])))
        runs.append(r)
    assert torch.equal(runs[0].slots, runs[1].slots) and torch.equal(runs[0].weights, runs[1].weights)
    assert not torch.equal(runs[0].kept, runs[2].kept)  # another seed keeps other tokens of expert 0
    first_come = route_top1(logits, 1.0, 4, use_rts=False)
    assert not torch.equal(runs[0].kept, first_come.kept)


def test_rsample_changes_routing_keeps_invariants_and_is_off_in_evaluation():
    logits = _logits(64, 8, seed=5, scale=0.5)
    plain = route(logits, k=1, use_rts=False)
    torch.manual_seed(0)
    noisy = route(logits, k=1, use_rts=False, noisy_gate_policy="RSample")
    assert_invariants(noisy, 8)
    assert not torch.equal(noisy.experts, plain.experts)
    chosen = torch.softmax(logits, 1).gather(1, noisy.experts)  # the weight is the noiseless probability
    torch.testing.assert_close(noisy.weights[noisy.kept], chosen[noisy.kept])
    evaluation = route(logits, k=1, use_rts=False, noisy_gate_policy="RSample", training=False)
    assert torch.equal(evaluation.experts, plain.experts) and torch.equal(evaluation.slots, plain.slots)


def test_jitter_changes_routing_in_training_only():
    torch.manual_seed(1)
    gate = TopKGate(16, 8, k=1, min_capacity=0, noisy_gate_policy="Jitter", use_rts=False)
    x = torch.randn(1024, 16, generator=torch.Generator().manual_seed(6))  # enough tokens for a 1% jitter to flip some
    gate.eval()
    clean, clean_route = gate.logits(x), gate.route(x)
    torch.manual_seed(0)
    assert torch.equal(gate.route(x).experts, clean_route.experts)  # no jitter in evaluation
    gate.train()
    torch.manual_seed(0)
    jittered = gate.logits(x)
    assert not torch.equal(jittered, clean)
    torch.testing.assert_close(jittered, clean, rtol=0.05, atol=0.05)
    torch.manual_seed(0)
    noisy_route = gate.route(x)
    assert_invariants(noisy_route, 8)
    assert not torch.equal(noisy_route.experts, clean_route.experts)
    y = gating.multiplicative_jitter(torch.ones(1000), epsilon=0.1)
    assert float(y.min()) >= 0.9 and float(y.max()) < 1.1
    assert gating.multiplicative_jitter(x, epsilon=0) is x


def test_top2_sampling_varies_the_second_expert_only_and_leaves_logits_alone():
    logits = _logits(64, 8, seed=7, scale=0.5)
    before = logits.clone()
    plain = route_top2(logits, 1.0, 4, top2_2nd_expert_sampling=False)
    torch.manual_seed(0)
    sampled = route_top2(logits, 1.0, 4)
    assert torch.equal(logits, before)  # DeepSpeed's top2gating adds the noise to its argument in place
    assert_invariants(sampled, 8)
    assert torch.equal(sampled.experts[:, 0], plain.experts[:, 0])
    assert not torch.equal(sampled.experts[:, 1], plain.experts[:, 1])


# --------------------------------------------------------------------------------------------
# The gate module and the Routing helpers
# --------------------------------------------------------------------------------------------


def test_topkgate_route_matches_forward_and_uses_eval_capacity_factor():
    gate = TopKGate(16, 4, k=2, capacity_factor=0.5, eval_capacity_factor=2.0, min_capacity=0,
                    top2_2nd_expert_sampling=False)
    assert list(gate.state_dict()) == ["wg.weight"]
    x = torch.randn(2, 12, 16)  # leading dimensions are flattened
    r = gate.route(x)
    assert r.capacity == capacity(24, 4, 1.0, 0)
    l_aux, combine, dispatch, counts = gate(x)
    assert torch.equal(combine, dense(r, 4)[0]) and torch.equal(l_aux, r.l_aux) and torch.equal(counts, r.exp_counts)
    gate.eval()
    assert gate.route(x).capacity == capacity(24, 4, 4.0, 0)
    gate._set_ep_group("group")
    with pytest.raises(RuntimeError, match="ep_group"):
        gate._set_ep_group("another")


def test_routing_helpers_and_dense_gradient():
    logits = _skewed(16, 4).requires_grad_(True)
    r = route_top2(logits, 0.5, 0, top2_2nd_expert_sampling=False)
    assert r.num_tokens == 16 and r.k == 2 and not bool(r.kept.all())
    flat = r.flat_slots()
    assert torch.equal(flat[r.kept], (r.experts * r.capacity + r.slots)[r.kept]) and bool((flat[~r.kept] == -1).all())
    combine, dispatch = dense(r, 4)
    assert int(dispatch.sum()) == int(r.kept.sum())
    (combine.sum() + r.l_aux).backward()
    assert logits.grad is not None and bool(logits.grad.abs().sum() > 0)


# --------------------------------------------------------------------------------------------
# No dropping across an expert-parallel group
# --------------------------------------------------------------------------------------------


def _busiest_over_group() -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    logits = _logits(12, 4, seed=8 + rank)
    if rank == 0:
        logits[:10, 0] += 8.0  # rank 0: expert 0 takes 10 of 12 tokens (and second choices pile up too)
    out = {}
    for k in (1, 2, 3):
        r = route(logits, k=k, drop_tokens=False, ep_group=group, use_rts=False, top2_2nd_expert_sampling=False)
        local = route(logits, k=k, drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)
        assert bool(r.kept.all())
        out[k] = {"capacity": r.capacity, "local_capacity": local.capacity, "busiest": int(r.exp_counts.max())}
    return out


@pytest.mark.slow
def test_no_drop_capacity_is_the_busiest_expert_over_the_ep_group():
    results = run_distributed(_busiest_over_group, world_size=2, timeout=60)
    for k in (1, 2, 3):
        busiest = max(r[k]["busiest"] for r in results)
        for r in results:
            assert r[k]["local_capacity"] == r[k]["busiest"]
            assert r[k]["capacity"] == (min(busiest, 12) if k == 1 else busiest)
        assert results[0][k]["capacity"] == results[1][k]["capacity"] > results[1][k]["local_capacity"]


# --------------------------------------------------------------------------------------------
# Argument errors
# --------------------------------------------------------------------------------------------

_L = torch.zeros(8, 4)


@pytest.mark.parametrize(("call", "match"), [
    (lambda: route(_L, k=0), "k must be an int >= 1"),
    (lambda: route(_L, k=5), "k=5 exceeds the number of experts"),
    (lambda: route(_L, k=True), "k must be"),
    (lambda: route(_L, noisy_gate_policy="Gumbel"), "noisy_gate_policy"),
    (lambda: route(_L, k=3, drop_policy="random"), "drop_policy"),
    (lambda: route(_L, drop_policy="random"), "drop_policy"),
    (lambda: route(_L, capacity_factor=0), "capacity_factor"),
    (lambda: route(_L, capacity_factor=float("nan")), "capacity_factor"),
    (lambda: route(_L, min_capacity=-1), "min_capacity"),
    (lambda: route(_L, min_capacity=2.5), "min_capacity"),
    (lambda: route(torch.zeros(8)), "logits"),
    (lambda: route(torch.zeros(8, 4, dtype=torch.long)), "logits"),
    (lambda: top1gating(_L, 1.0, 4, used_token=torch.ones(7)), "used_token"),
    (lambda: top2gating(torch.zeros(8, 1), 1.0, 4), "k=2 exceeds"),
    (lambda: topkgating(_L, 3, 1.0, 4, drop_policy="first"), "drop_policy"),
    (lambda: topkgating(_L, 3, -1.0, 4), "capacity_factor"),
    (lambda: TopKGate(16, 4, k=5), "k=5"),
    (lambda: TopKGate(16, 0), "num_experts"),
    (lambda: TopKGate(0, 4), "model_dim"),
    (lambda: TopKGate(16, 4, eval_capacity_factor=0.0), "eval_capacity_factor"),
    (lambda: TopKGate(16, 4, noisy_gate_policy="jitter"), "noisy_gate_policy"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_argument_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_none_string_is_no_noise():
    plain = route(_logits(8, 4), use_rts=False)
    named = route(_logits(8, 4), use_rts=False, noisy_gate_policy="None")
    assert torch.equal(plain.slots, named.slots) and torch.equal(plain.experts, named.experts)
