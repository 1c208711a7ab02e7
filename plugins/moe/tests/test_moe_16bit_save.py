"""``save_16bit_model`` with expert parallelism writes every expert, named by global index (fp32, relative 1e-5).

dp2/ep2: each rank holds half of the experts. Without ZeRO (the built-in default state dict) and under
ZeRO-3 (whole weights gathered over the data-parallel group), the file rank 0 writes holds all four
experts, and a one-process model with ``ep_size`` 1 that loads it computes the distributed model's next
losses.
"""

from __future__ import annotations

import os

import pytest
import torch
from moe_models import EXPERTS, Net, batch, config

from microspeed.testing import run_distributed

WORLD, STEPS = 2, 2
PREFIX = "moe.deepspeed_moe.experts.deepspeed_experts."
CASES = {  # name -> extra config
    "no_zero": {},
    "zero3": {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
                                    "stage3_param_persistence_threshold": 0}},
}


def _own_experts(engine) -> dict[str, torch.Tensor]:
    """This rank's expert tensors (whole without ZeRO; ``{}`` under ZeRO-3, where they are partitioned)."""
    if engine.zero_optimization_stage() == 3:
        return {}
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items() if k.startswith(PREFIX)}


def _train_save(root: str) -> dict:
    """Per case: train ep2 for STEPS, save the 16-bit model, then the mean loss of the next micro-batches."""
    import torch.distributed as dist

    import microspeed

    rank = dist.get_rank()
    out: dict = {}
    for name, extra in CASES.items():
        engine, *_ = microspeed.initialize(model=Net(ep_size=2, k=2, drop_tokens=False), config=config(extra))
        for step in range(STEPS):
            loss = engine(batch(step, rank))
            engine.backward(loss)
            engine.step()
        assert engine.save_16bit_model(os.path.join(root, name)) is True
        if engine.zero_optimization_stage() == 3:  # HF Accelerate's get_state_dict: the same gathered dict
            whole = engine._zero3_consolidated_16bit_state_dict()
            out[f"{name}_whole"] = None if whole is None else {k: v.detach().clone() for k, v in whole.items()}
        out[f"{name}_experts"] = _own_experts(engine)
        with torch.no_grad():
            loss = engine(batch(STEPS, rank)).detach().clone()
        dist.all_reduce(loss)
        out[name] = loss.item() / WORLD
    return out


@pytest.mark.slow
def test_16bit_model_with_ep2_holds_every_expert_and_loads_with_ep1(tmp_path):
    """Without ZeRO and with ZeRO-3: all experts in the file under their global names; loaded with ep_size 1
    (strict), one process computes the trained distributed model's next loss."""
    results = run_distributed(_train_save, world_size=WORLD, args=(str(tmp_path),), timeout=240)
    assert [results[0][n] for n in CASES] == [results[1][n] for n in CASES]
    expert_keys = {f"{PREFIX}{e}.{i}.{w}"
                   for e in range(EXPERTS) for i in (0, 2) for w in ("weight", "bias")}
    for name in CASES:
        state = torch.load(tmp_path / name / "pytorch_model.bin", weights_only=True)
        assert expert_keys <= set(state), f"{name}: missing {sorted(expert_keys - set(state))}"
        net = Net(ep_size=1, k=2, drop_tokens=False)
        assert set(state) == set(net.state_dict()), name
        # every expert holds what its rank trained (rank 1's experts 2 and 3 included); ZeRO-3 trains the same
        held = {k: v for r in results for k, v in r[f"{name}_experts"].items()}
        if name == "no_zero":
            assert {k[len(PREFIX):].split(".")[0] for k in held} == {"0", "1", "2", "3"}
            assert not torch.equal(state[f"{PREFIX}3.0.weight"], net.state_dict()[f"{PREFIX}3.0.weight"])
            saved = state
        for key in expert_keys:
            reference, rtol = (held[key], 0) if name == "no_zero" else (saved[key], 1e-5)
            torch.testing.assert_close(state[key], reference, rtol=rtol, atol=1e-7 if rtol else 0,
                                       msg=lambda m, k=key, n=name: f"{n} {k}: {m}")
        if f"{name}_whole" in results[0]:  # engine._zero3_consolidated_16bit_state_dict(): rank 0 only, every expert
            assert results[1][f"{name}_whole"] is None
            whole = results[0][f"{name}_whole"]
            assert set(whole) == set(state), f"{name}: {sorted(set(state) ^ set(whole))}"
            for key in state:
                torch.testing.assert_close(whole[key], state[key], rtol=0, atol=0)
        net.load_state_dict(state, strict=True)
        with torch.no_grad():
            expected = torch.stack([net(batch(STEPS, r)) for r in range(WORLD)]).mean()
        torch.testing.assert_close(torch.tensor(results[0][name]), expected, rtol=1e-5, atol=0,
                                   msg=lambda m, n=name: f"{n}: {m}")
