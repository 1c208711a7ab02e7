"""The 1-bit optimizers with parameters held by only some data-parallel ranks (MoE experts, ``ReplicaGroup``).

An expert's gradient is the sum over its replica group divided by the data-parallel size (as the MoE plugin
reduces it at full precision). After the warm-up the gradients stay local, so the optimizer exchanges the
experts' momenta (0/1 Adam: gradients) over their own replica group, folding ``g * group size / world`` in.
Constant gradients make 1-bit compression exact, so the momenta can be asserted to the last bits; the
matrix (``tests/matrix``, onebit-adam / zero-one-adam / onebit-lamb x moe) checks training against one process.
"""

from __future__ import annotations

import pytest
import torch

from microspeed.testing import run_distributed


def _momenta(opt_name):
    import microspeed_comm
    import torch.distributed as dist

    from microspeed.plugin_api import ReplicaGroup

    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {ranks: dist.new_group(list(ranks)) for ranks in ((0, 2), (1, 3))}
    mine = (0, 2) if rank % 2 == 0 else (1, 3)
    dense = torch.nn.Parameter(torch.zeros(256))
    expert = torch.nn.Parameter(torch.zeros(256))
    expert.allreduce = False
    expert.replica_group = ReplicaGroup(groups[mine], mine)
    params = {"lr": 1e-3, "betas": (0.5, 0.9)}
    params.update({"freeze_step": 1} if opt_name != "ZeroOneAdam" else
                  {"var_freeze_step": 1, "var_update_scaler": 1, "local_step_clipper": 1})
    opt = getattr(microspeed_comm, opt_name)([dense, expert], **params, block_size=64)
    for p in (dense, expert):  # step 1: gradients averaged at full precision (one everywhere)
        p.grad = torch.ones(256)
    opt.step()
    assert not opt.full_precision_gradients_next()
    for p in (dense, expert):  # step 2: local gradients, rank r holds r + 1
        p.grad = torch.full((256,), float(rank + 1))
    opt.step()
    key = "exp_avg"
    return {"dense": opt.state[dense][key].clone(), "expert": opt.state[expert][key].clone(), "world": world}


@pytest.mark.slow
@pytest.mark.parametrize("opt_name", ["OneBitAdam", "OneBitLamb"])
def test_expert_momenta_are_averaged_over_their_replica_group_divided_by_the_world(opt_name):
    results = run_distributed(_momenta, world_size=4, args=(opt_name,), timeout=180)
    b1 = 0.5
    for rank, r in enumerate(results):
        group = (0, 2) if rank % 2 == 0 else (1, 3)
        expected_expert = b1 * (1 - b1) + (1 - b1) * sum(q + 1 for q in group) / 4  # m1 = (1 - b1) * 1
        expected_dense = b1 * (1 - b1) + (1 - b1) * sum(q + 1 for q in range(4)) / 4
        torch.testing.assert_close(r["dense"], torch.full((256,), expected_dense), rtol=1e-6, atol=0)
        torch.testing.assert_close(r["expert"], torch.full((256,), expected_expert), rtol=1e-6, atol=0)
