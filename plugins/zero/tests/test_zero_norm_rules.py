"""ZeRO honours every plugin's ``NormRule`` on its partitions (``engine.grad_norm(rules=...)``).

A test plugin declares rules for some parameters: ``skip`` (a copy another rank counts) and extra
``groups`` (summed over a group besides the model-parallel one). On 2 data-parallel ranks with ZeRO
stages 1, 2 and 3 (stage 3 segments are per module, so a Linear's weight and skipped bias share one
and are counted in runs of one rule) the norm ZeRO reports equals the single-process norm of the
gradients the rules count; without rules it is the norm of them all (the fast path).
"""

from __future__ import annotations

import pytest
import torch

import microspeed
from microspeed.plugin_api import NormRule, hookimpl
from microspeed.testing import run_distributed

SKIPPED = ("0.bias", "2.weight")
GROUPED = ("4.weight",)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3))


def _batches(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4 * world, 6, generator=g), torch.randn(4 * world, 3, generator=g)


class Rules:
    """Skip ``SKIPPED``; sum ``GROUPED`` over the world group too (inside the data-parallel group: no extra sum)."""

    @hookimpl
    def microspeed_grad_norm_rules(self, engine):
        import torch.distributed as dist

        rules = {name: NormRule(skip=True) for name in SKIPPED}
        rules.update({name: NormRule(groups=(dist.group.WORLD,)) for name in GROUPED})
        return rules


def _train(stage: int, with_rules: bool) -> list[float]:
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                 "reduce_bucket_size": 200}}
    plugins = [("test_norm_rules", Rules())] if with_rules else []
    engine, *_ = microspeed.initialize(model=_model(), config=cfg, plugins=plugins)
    norms = []
    for step in range(2):
        x, y = _batches(step, world)
        loss = torch.nn.functional.mse_loss(engine(x[4 * rank:4 * rank + 4]), y[4 * rank:4 * rank + 4])
        engine.backward(loss)
        engine.step()
        norms.append(float(engine.get_global_grad_norm()))
    return norms


def _runs() -> dict:
    return {f"z{stage}-{rules}": _train(stage, rules) for stage in (1, 2, 3) for rules in (True, False)}


def _reference(world: int, with_rules: bool) -> list[float]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = []
    for step in range(2):
        x, y = _batches(step, world)
        loss = torch.stack([torch.nn.functional.mse_loss(model(x[4 * r:4 * r + 4]), y[4 * r:4 * r + 4])
                            for r in range(world)]).mean()
        opt.zero_grad()
        loss.backward()
        counted = [p.grad for n, p in model.named_parameters() if not (with_rules and n in SKIPPED)]
        norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in counted])).item())
        opt.step()
    return norms


@pytest.mark.slow
def test_partitioned_norm_applies_the_rules():
    results = run_distributed(_runs, world_size=2, timeout=180)
    for rank, result in enumerate(results):
        for name, norms in result.items():
            want = _reference(2, name.endswith("True"))
            torch.testing.assert_close(torch.tensor(norms), torch.tensor(want), rtol=1e-5, atol=0,
                                       msg=lambda m, n=name, r=rank: f"{n} rank {r}: {m}")
