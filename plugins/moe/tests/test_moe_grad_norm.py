"""The global gradient norm with experts spread over ranks is one process's norm of the whole model.

The plugin describes expert parameters through ``microspeed_grad_norm_rules`` (squares summed over the
expert-parallel group); the kernel's one norm sums them, whoever steps: the built-in optimizer step, or
ZeRO over its partitions. Checked against one process holding every expert (``ep_size`` 1, every
rank's micro-batch, the mean loss), and against the explicit computation the plugin did before the
rules (replicated squares here, expert squares summed over each expert-parallel group).
"""

from __future__ import annotations

import pytest
import torch
from moe_models import Net, batch, config

from microspeed.testing import run_distributed


def _first_norm(ep_size: int, extra: dict) -> dict:
    import torch.distributed as dist

    import microspeed
    from microspeed.plugin_api import NormRule

    engine, *_ = microspeed.initialize(model=Net(ep_size=ep_size, k=2, drop_tokens=False), config=config(extra))
    moe = engine.plugin_state("moe")
    rules = moe.microspeed_grad_norm_rules(engine)
    loss = engine(batch(0, dist.get_rank()))
    engine.backward(loss)
    explicit = None
    if "zero_optimization" not in extra:  # reduced in backward, whole on every rank: the pre-rules formula
        experts = {id(p): g for p, g in moe.expert_params}
        dense = sum(p.grad.float().square().sum() for p in engine.module.parameters() if id(p) not in experts)
        part = sum(p.grad.float().square().sum() for p in engine.module.parameters() if id(p) in experts)
        ep_group = moe.expert_params[0][1].ep_group
        if dist.get_world_size(ep_group) > 1:
            dist.all_reduce(part, group=ep_group)
        explicit = float((dense + part).sqrt())
    engine.step()
    return {"norm": engine.get_global_grad_norm(), "explicit": explicit,
            "rules": sorted(rules), "all_rules_sum_over_ep": all(
                isinstance(r, NormRule) and not r.skip and r.groups == (moe.expert_params[0][1].ep_group,)
                for r in rules.values())}


def _reference_norm(world: int) -> float:
    net = Net(ep_size=1, k=2, drop_tokens=False)
    loss = torch.stack([net(batch(0, r)) for r in range(world)]).mean()
    loss.backward()
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in net.parameters()])))


@pytest.mark.slow
@pytest.mark.parametrize(("world", "ep_size", "extra"), [
    (2, 2, {}),
    (2, 2, {"gradient_clipping": 0.3}),
    (2, 2, {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.3}),
    (4, 2, {"zero_optimization": {"stage": 1}}),
], ids=["ep2", "ep2-clip", "zero2-ep2-clip", "zero1-ep2xedp2"])
def test_norm_with_experts_apart_equals_one_process(world, ep_size, extra):
    expected = _reference_norm(world)
    results = run_distributed(_first_norm, world_size=world, args=(ep_size, extra), timeout=180)
    for rank, r in enumerate(results):
        assert r["rules"] and all("deepspeed_moe.experts" in name for name in r["rules"]), r["rules"]
        assert r["all_rules_sum_over_ep"]
        assert r["norm"] == pytest.approx(expected, rel=1e-5), f"rank {rank}"
        if r["explicit"] is not None:
            assert r["norm"] == pytest.approx(r["explicit"], rel=1e-6), f"rank {rank}"
    # every expert counted once: the norm differs from any rank's local view unless expert squares are summed
    assert len({round(r["norm"], 6) for r in results}) == 1
