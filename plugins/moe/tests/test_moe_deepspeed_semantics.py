"""DeepSpeed behaviours of the MoE layer: gating's ``sparse_routes=``, and ``MoE(ep_size>1)`` built before
``init_distributed`` (DeepSpeed makes the expert groups at ``initialize``)."""

from __future__ import annotations

import os

import pytest
import torch

from microspeed.moe.sharded_moe import TopKGate, top1gating, top2gating, topkgating
from microspeed.testing import run_distributed


@pytest.fixture(scope="module")
def ds():
    """DeepSpeed 0.19.8's ``sharded_moe`` (CPU accelerator), or skip."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.moe import sharded_moe
    except Exception as exc:
        pytest.skip(f"deepspeed is not importable: {exc!r}")
    return sharded_moe


CASES = [(16, 4, 1.0, 1, True), (16, 4, 0.5, 0, True), (9, 3, 1.5, 2, True), (12, 4, 1.0, 4, False),
         (1, 2, 1.0, 0, True)]


def _same(ours: tuple, theirs: tuple) -> None:
    assert len(ours) == len(theirs) == 7
    assert torch.equal(ours[0], theirs[0])  # l_aux
    assert ours[1] == int(theirs[1]) and ours[2] == theirs[2]  # capacity, num_experts
    for a, b in zip(ours[3:], theirs[3:], strict=True):  # indices, locations, gates, exp_counts
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), (a, b)


def test_sparse_routes_equal_deepspeeds(ds):
    """top1 (seeded RTS), top2 (seeded sampling) and top-k with sparse_routes=True give DeepSpeed's tuples."""
    for tokens, experts, factor, min_cap, drop in CASES:
        logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens * 7 + experts)) * 2
        if tokens >= min_cap:  # DeepSpeed's top1gating asserts tokens >= min_capacity
            torch.manual_seed(3)
            theirs = ds.top1gating(logits.clone(), factor, min_cap, drop_tokens=drop, sparse_routes=True)
            torch.manual_seed(3)
            _same(top1gating(logits, factor, min_cap, drop_tokens=drop, sparse_routes=True), theirs)
        torch.manual_seed(4)
        theirs = ds.top2gating(logits.clone(), factor, min_cap, drop_tokens=drop, sparse_routes=True)
        torch.manual_seed(4)
        _same(top2gating(logits, factor, min_cap, drop_tokens=drop, sparse_routes=True), theirs)
        for k in range(1, experts + 1):
            theirs = ds.topkgating(logits.clone(), k, factor, min_cap, drop_tokens=drop, sparse_routes=True)
            _same(topkgating(logits, k, factor, min_cap, drop_tokens=drop, sparse_routes=True), theirs)


def test_topkgate_forward_sparse_routes_is_the_dense_outputs_sparse_form():
    """TopKGate(...)(x, sparse_routes=True): every kept route is a nonzero of the dense combine weights."""
    torch.manual_seed(0)
    gate = TopKGate(8, 4, k=2, capacity_factor=0.75, min_capacity=0)
    x = torch.randn(10, 8)
    torch.manual_seed(1)
    l_aux, combine, _, counts = gate(x)
    torch.manual_seed(1)
    s_aux, cap, experts, indices, locations, gates, s_counts = gate(x, sparse_routes=True)
    assert torch.equal(l_aux, s_aux) and torch.equal(counts, s_counts)
    assert (cap, experts) == (combine.shape[2], 4) and indices.shape == (2, 10)
    rebuilt = torch.zeros_like(combine)
    for j in range(2):
        for t in range(10):
            if indices[j, t] >= 0:
                rebuilt[t, indices[j, t], locations[j, t]] += gates[j, t]
    assert torch.equal(rebuilt, combine) and (indices < 0).any()  # some routes were dropped, flagged -1
    with pytest.raises(ValueError, match="use_tutel"):
        gate(x, use_tutel=True)


def _build_before_init() -> dict:
    """MoE(ep_size=2) built with no process group (the launcher's RANK/WORLD_SIZE set), then initialize."""
    import torch.distributed as dist

    import microspeed
    from microspeed.moe import MoE

    assert not dist.is_initialized()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), MoEBlock(MoE(8, torch.nn.Linear(8, 8), num_experts=4,
                                                                    ep_size=2, k=1)))
    names_before = sorted(n for n, _ in model.named_parameters())
    engine, *_ = microspeed.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}})
    assert dist.is_initialized() and dist.get_world_size() == 2
    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(step * 2 + dist.get_rank())
        loss = engine(torch.randn(4, 4, generator=g)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    experts = model[1].moe.deepspeed_moe.experts
    return {"names": names_before, "local": list(experts.local_indices()), "keys": sorted(experts.deepspeed_experts),
            "losses": losses}


class MoEBlock(torch.nn.Module):
    """Wraps an MoE layer so a Sequential can hold it (MoE returns a triple)."""

    def __init__(self, moe: torch.nn.Module) -> None:
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)[0]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_moe_with_ep_size_2_can_be_built_before_init_distributed():
    results = run_distributed(_build_before_init, world_size=2, timeout=150, init_process_group=False)
    assert [r["local"] for r in results] == [[0, 1], [2, 3]]  # rank r holds experts 2r, 2r+1
    assert [r["keys"] for r in results] == [["0", "1"], ["2", "3"]]
    assert results[0]["losses"] != results[1]["losses"]  # each rank its own data, both trained
    assert all(len(r["losses"]) == 3 for r in results)


def test_moe_with_ep_size_2_without_a_process_group_refuses_at_first_forward(monkeypatch):
    """Built fine (as DeepSpeed's); the first forward without torch.distributed names the fix."""
    import torch.distributed as dist

    from microspeed.moe import MoE

    if dist.is_initialized():
        pytest.skip("an earlier test left a process group")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    layer = MoE(8, torch.nn.Linear(8, 8), num_experts=4, ep_size=2)
    assert list(layer.deepspeed_moe.experts.local_indices()) == [0, 1]
    with pytest.raises(ValueError, match="needs torch.distributed"):
        layer(torch.randn(3, 8))
    monkeypatch.setenv("WORLD_SIZE", "3")  # the launcher's world cannot hold ep_size 2: refused at once
    with pytest.raises(ValueError, match="world size 3 must be a multiple of ep_size"):
        MoE(8, torch.nn.Linear(8, 8), num_experts=4, ep_size=2)


def test_sparse_encode_decode_helpers_equal_the_dense_einsums():
    """DeepSpeed's private helpers its tests import: the sparse routes reproduce the dense dispatch and combine."""
    from microspeed.moe.sharded_moe import _route_slots, _sparse_decode, _sparse_encode

    for k in (1, 2, 3):
        torch.manual_seed(k)
        logits, hidden = torch.randn(16, 4), torch.randn(16, 8)
        gate = {1: lambda lg=logits, **kw: top1gating(lg, 1.0, 0, use_rts=False, **kw),
                2: lambda lg=logits, **kw: top2gating(lg, 1.0, 0, top2_2nd_expert_sampling=False, **kw),
                3: lambda lg=logits, **kw: topkgating(lg, 3, 1.0, 0, **kw)}[k]
        _, combine, dispatch, _ = gate()
        _, cap, experts, indices, locations, gates, _ = gate(sparse_routes=True)
        slots = _route_slots(indices, locations, experts, cap)
        assert (slots == experts * cap).any() or bool((indices >= 0).all())  # dropped routes: the scratch slot
        encoded = _sparse_encode(hidden, slots, experts, cap)
        torch.testing.assert_close(encoded, torch.einsum("sec,sm->ecm", dispatch.float(), hidden))
        out = torch.randn_like(encoded)
        torch.testing.assert_close(_sparse_decode(out.view(experts * cap, 8), slots, gates, 16),
                                   torch.einsum("sec,ecm->sm", combine, out))


def test_moelayer_is_reachable_where_deepspeed_exposes_it():
    """DeepSpeed scripts import ``MOELayer`` from ``deepspeed.moe.sharded_moe``."""
    from microspeed_moe import layer, sharded_moe

    assert sharded_moe.MOELayer is layer.MOELayer
    with pytest.raises(AttributeError, match="no_such_name"):
        sharded_moe.no_such_name  # noqa: B018
