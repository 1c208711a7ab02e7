"""DeepSpeed 0.19.8's layout of an MoE layer's local experts, which DeepSpeed's own unit tests rely on.

Found by ``benchmarks/deepspeed_unit_tests.py`` (``tests/unit/v1/moe/test_moe.py``
``TestExpertWeightGradWithZero``, which then hung): DeepSpeed keeps a rank's experts in
``layer.deepspeed_moe.experts.deepspeed_experts``, a ``torch.nn.ModuleList`` indexed by the *local* expert number
(so state-dict keys are ``...deepspeed_experts.<local i>.<...>`` on every rank). microspeed uses a ``ModuleDict``
keyed by the *global* expert id: iterating it yields strings, and with ``ep_size=2`` rank 1's keys say ``.1.``
where DeepSpeed's say ``.0.``. DeepSpeed's test builds that state dict, ``load_state_dict`` fails on rank 1 only,
and rank 0 waits forever in ``initialize()``'s cross-rank agreement.
"""

from __future__ import annotations

import pytest
import torch

from microspeed.moe import MoE


def _layer() -> MoE:
    torch.manual_seed(0)
    expert = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    return MoE(hidden_size=4, expert=expert, num_experts=2, ep_size=1, k=1, use_rts=False)


def test_one_local_expert_per_expert_with_ep1():
    experts = _layer().deepspeed_moe.experts.deepspeed_experts
    assert len(experts) == 2


@pytest.mark.xfail(strict=True, reason="deepspeed_experts is a ModuleDict keyed by global expert id "
                   "(plugins/moe/microspeed_moe); DeepSpeed's is a ModuleList of the local experts, indexed 0..n-1 "
                   "on every rank (its tests do [e for e in experts][i][0].weight and map state-dict keys by index)")
def test_local_experts_are_a_module_list():
    layer = _layer()
    experts = layer.deepspeed_moe.experts.deepspeed_experts
    assert isinstance(experts, torch.nn.ModuleList)
    assert all(isinstance(e, torch.nn.Sequential) for e in experts)
    keys = [k for k in layer.state_dict() if "deepspeed_experts" in k]
    assert sorted({k.split("deepspeed_experts.")[1].split(".")[0] for k in keys}) == ["0", "1"]
