"""MoE with ZeRO stage 3: experts partitioned over their expert-data-parallel group (fp32, relative 1e-5)."""

from __future__ import annotations

import pytest
import torch
from moe_models import reference_losses
from test_moe_parity import _train

from microspeed.testing import run_distributed

STEPS = 3
CASES = [  # ep_size, net kwargs, extra config
    (2, {"k": 1}, {"zero_optimization": {"stage": 3}}),
    (2, {"k": 2, "drop_tokens": False}, {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                                         "gradient_clipping": 0.3}),
    (4, {"k": 1, "use_residual": True}, {"zero_optimization": {"stage": 3, "reduce_bucket_size": 40}}),
]


def _cases(steps: int) -> list[list[float]]:
    return [_train(ep, steps, kwargs, extra) for ep, kwargs, extra in CASES]


@pytest.mark.slow
def test_zero3_with_experts_equals_one_process():
    """dp4: ep2 (two copies of each expert, each partitioned over its pair), ep2 with clipping and no
    persistent segments, ep4 (every expert alone: a replica group of one) with residual MoE."""
    results = run_distributed(_cases, world_size=4, args=(STEPS,), timeout=240)
    for i, (_, kwargs, extra) in enumerate(CASES):
        expected = reference_losses(4, STEPS, clip=extra.get("gradient_clipping", 0.0), **kwargs)
        for rank, per_case in enumerate(results):
            torch.testing.assert_close(torch.tensor(per_case[i]), torch.tensor(expected), rtol=1e-5, atol=0,
                                       msg=lambda m, r=rank, c=i: f"case {c}, rank {r}: {m}")


def _save_then_resume(path: str) -> list[list[float]]:
    kwargs = {"k": 2, "drop_tokens": False}
    first = _train(2, 2, kwargs, {"zero_optimization": {"stage": 3}}, path, save_after=2)
    resumes = ((1, {}), (4, {"zero_optimization": {"stage": 2}}), (2, {"zero_optimization": {"stage": 3}}))
    return [first] + [_train(ep, 4, kwargs, extra, path, resume=True) for ep, extra in resumes]


@pytest.mark.slow
def test_zero3_checkpoint_with_ep2_loads_with_ep1_ep4_and_zero3(tmp_path):
    """Saved under ZeRO-3 with ep_size 2 (experts as shards over their pairs), resumed under ep_size 1 without
    ZeRO, ep_size 4 with ZeRO-2 and ep_size 2 with ZeRO-3: the losses go on as one process's."""
    expected = reference_losses(4, 4, k=2, drop_tokens=False)
    for per_rank in run_distributed(_save_then_resume, world_size=4, args=(str(tmp_path),), timeout=240):
        torch.testing.assert_close(torch.tensor(per_rank[0]), torch.tensor(expected[:2]), rtol=1e-5, atol=0)
        for losses in per_rank[1:]:
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected[2:]), rtol=1e-5, atol=0)
