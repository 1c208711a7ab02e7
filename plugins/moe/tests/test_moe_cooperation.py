"""MoE asks the gradient-reduction owner what it can do through its typed capability, never by its name."""

from __future__ import annotations

import pytest
import torch
from microspeed_moe.layer import MoE

import microspeed
from microspeed.plugin_api import GradientPartitioning, NormRule, Role


class Reducer:
    """A third-party plugin that reduces gradients itself; ``keeps`` None states no partitioning at all."""

    def __init__(self, keeps: bool | None) -> None:
        self.keeps = keeps

    @microspeed.hookimpl
    def microspeed_capabilities(self, config):
        if self.keeps is None:
            return None
        return [GradientPartitioning(stage=7, keeps_replica_groups=self.keeps, config_key="reducer.level",
                                     disable_hint="drop the reducer plugin")]

    @microspeed.hookimpl
    def microspeed_setup(self, engine):
        engine.claim(Role.GRADIENT_REDUCTION, "reducer")


def _init(reducer: Reducer):
    torch.manual_seed(0)
    model = MoE(8, torch.nn.Linear(8, 8), num_experts=2)
    config = {"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    engine, *_ = microspeed.initialize(model=model, config=config, plugins=[("reducer", reducer)])
    return engine


def test_an_owner_that_cannot_keep_replica_groups_is_refused_with_its_key_and_fix():
    with pytest.raises(microspeed.ConfigError, match=r"MoE layers: the plugin 'reducer' reduces gradients but cannot "
                                                     r"keep expert parameters apart .*reducer\.level=7 .*drop the "
                                                     r"reducer plugin"):
        _init(Reducer(keeps=False))


def test_an_owner_stating_no_partitioning_is_refused():
    with pytest.raises(microspeed.ConfigError, match=r"the plugin 'reducer' .*turn that feature off"):
        _init(Reducer(keeps=None))


def test_an_owner_that_keeps_replica_groups_is_accepted_and_the_experts_are_marked():
    engine = _init(Reducer(keeps=True))
    moe = engine.plugin_state("moe")
    assert moe.expert_params and all(p.replica_group is not None for p, _ in moe.expert_params)
    rules = moe.microspeed_grad_norm_rules(engine)
    names = {n for n, p in engine.module.named_parameters() if not getattr(p, "allreduce", True)}
    assert set(rules) == names and all(r == NormRule(groups=(g.ep_group,)) for (_, g), r in
                                       zip(moe.expert_params, rules.values(), strict=True))


def test_two_engines_in_one_process_keep_their_own_expert_state():
    first, second = _init(Reducer(keeps=True)), _init(Reducer(keeps=True))
    a, b = first.plugin_state("moe"), second.plugin_state("moe")
    assert a is not b
    assert {id(p) for p, _ in a.expert_params}.isdisjoint({id(p) for p, _ in b.expert_params})
    assert set(a.microspeed_grad_norm_rules(first)) == set(b.microspeed_grad_norm_rules(second))


def _groups_in_two_worlds(path: str) -> dict:
    import torch.distributed as dist
    from microspeed_moe.groups import get_expert_groups

    rank = dist.get_rank()
    first = get_expert_groups(2)
    assert get_expert_groups(2) is first  # made once per world
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    second = get_expert_groups(2)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=second.ep_group)  # a group of the new world: usable
    return {"fresh": second is not first and second.ep_group is not first.ep_group, "sum": t.item(),
            "ranks": second.ep_ranks}


@pytest.mark.slow
def test_a_new_world_gets_its_own_expert_groups(tmp_path):
    from microspeed.testing import run_distributed

    for r in run_distributed(_groups_in_two_worlds, world_size=2, args=(str(tmp_path / "store"),), timeout=120):
        assert r == {"fresh": True, "sum": 3.0, "ranks": (0, 1)}
