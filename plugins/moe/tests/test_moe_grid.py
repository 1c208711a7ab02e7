"""MoE layers in a pipeline (experts split over each stage's data axis) and beside tensor-parallel layers,
with and without ZeRO (experts partitioned over their expert-data-parallel group inside a stage).

fp32 per-step losses equal a single-process run of the same layers with every expert local
(``ep_size`` 1), relative 1e-5; the auxiliary loss travels with the activations (:mod:`microspeed_moe.pipe`).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from microspeed.testing import run_distributed

IN, HIDDEN, OUT, EXPERTS = 6, 8, 1, 4
MICRO, TOKENS, GAS, STEPS, BASE_SEED = 2, 4, 2, 3, 77


class Block(nn.Module):
    """Linear → GELU → Linear; with ``tp`` column- then row-parallel (the same initial weights)."""

    def __init__(self, tp: bool = False) -> None:
        super().__init__()
        fc1, fc2 = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)
        if tp:
            from microspeed_pipeline.tensor_parallel import ColumnParallelLinear, RowParallelLinear

            fc1 = ColumnParallelLinear.from_dense(fc1, gather_output=False)
            fc2 = RowParallelLinear.from_dense(fc2, input_is_parallel=True)
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(x)))


def specs(eps: tuple[int, int], tp: bool = False, **moe_kwargs) -> list:
    """Linear, MoE, (tensor-parallel) block, MoE, GELU, Linear — the MoE layers with ``eps`` expert parallelism."""
    from microspeed_moe.pipe import CarryAux, MoEPipeLayer
    from microspeed_pipeline.module import LayerSpec

    torch.manual_seed(5)
    expert = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))
    kwargs = {"num_experts": EXPERTS, "min_capacity": 2, "use_rts": False, "top2_2nd_expert_sampling": False,
              "aux_loss_coef": 0.05, **moe_kwargs}
    return [LayerSpec(nn.Linear, IN, HIDDEN), LayerSpec(MoEPipeLayer, HIDDEN, expert, ep_size=eps[0], **kwargs),
            LayerSpec(CarryAux, Block, tp=tp), LayerSpec(MoEPipeLayer, HIDDEN, expert, ep_size=eps[1], **kwargs),
            LayerSpec(CarryAux, nn.GELU), LayerSpec(CarryAux, nn.Linear, HIDDEN, OUT)]


def micro_batches(step: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` micro-batches of the step's global batch: ``[MICRO, TOKENS, IN]`` inputs, ``[..., OUT]`` targets."""
    g = torch.Generator().manual_seed(4242 + step)
    return [(torch.randn(MICRO, TOKENS, IN, generator=g), torch.randn(MICRO, TOKENS, OUT, generator=g))
            for _ in range(count)]


def config(extra: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 10**6,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, **extra}


def reference_losses(dp: int, clip: float = 0.0, steps: int = STEPS, **moe_kwargs) -> list[float]:
    """One process: the same layers seeded as ``seed_layers`` does, every expert local, all micro-batches."""
    from microspeed_moe.pipe import aux_loss

    modules = []
    for idx, spec in enumerate(specs((1, 1), **moe_kwargs)):
        torch.manual_seed(BASE_SEED + idx)
        modules.append(spec.build())
    model = nn.Sequential(*modules)
    loss_fn = aux_loss(nn.functional.mse_loss)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    out = []
    for step in range(steps):
        loss = torch.stack([loss_fn(model(x), y) for x, y in micro_batches(step, dp * GAS)]).mean()
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        out.append(loss.item())
    return out


CASES = [  # pp, tp, expert parallelism of the two MoE layers, MoE kwargs, extra config[, virtual stages per rank]
    (2, 1, (2, 2), {"k": 1}, {}),
    (2, 1, (1, 2), {"k": 2, "drop_tokens": False}, {"gradient_clipping": 0.2}),
    (2, 1, (2, 2), {"k": 1}, {"zero_optimization": {"stage": 1}, "gradient_clipping": 0.2}),
    (1, 2, (2, 2), {"k": 1}, {"gradient_clipping": 0.2}),
    (1, 2, (2, 1), {"k": 2, "capacity_factor": 0.5}, {}),
    (2, 1, (2, 2), {"k": 1}, {"gradient_clipping": 0.2}, 2),
    (2, 1, (2, 2), {"k": 1}, {"zero_optimization": {"stage": 3}, "gradient_clipping": 0.2}),
    (2, 1, (1, 2), {"k": 2, "drop_tokens": False}, {"zero_optimization": {"stage": 2}}),
    (1, 2, (2, 2), {"k": 1}, {"zero_optimization": {"stage": 3}, "gradient_clipping": 0.2}),
]
IDS = ["pp2xdp2-ep2", "pp2xdp2-ep1+ep2-top2-clip", "pp2xdp2-ep2-zero1-clip", "tp2xdp2-ep2-clip",
       "tp2xdp2-ep2+ep1-top2-drop", "pp2x2chunks-xdp2-ep2-interleaved-clip",
       "pp2xdp2-ep2-zero3-clip", "pp2xdp2-ep1+ep2-top2-zero2", "tp2xdp2-ep2-zero3-clip"]


def _train(pp: int, tp: int, eps: tuple[int, int], moe_kwargs: dict, extra: dict, path: str | None = None,
           save_after: int | None = None, resume: bool = False, steps: int = STEPS, chunks: int = 1) -> dict:
    import torch.distributed as dist
    from microspeed_moe.pipe import aux_loss
    from microspeed_pipeline import PipelineModule, PipeModelDataParallelTopology

    import microspeed

    dp = dist.get_world_size() // (pp * tp)
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    model = PipelineModule(specs(eps, tp=tp > 1, **moe_kwargs), topology=topo, loss_fn=aux_loss(nn.functional.mse_loss),
                           partition_method="uniform", seed_layers=True, base_seed=BASE_SEED, num_chunks=chunks)
    engine, *_ = microspeed.initialize(model=model, config=config(extra))
    d = engine.topology.data_parallel_rank
    start = 0
    if resume:
        engine.load_checkpoint(path)
        start = engine.global_steps
    losses = []
    for step in range(start, steps):
        losses.append(engine.train_batch(iter(micro_batches(step, dp * GAS)[d * GAS:(d + 1) * GAS])).item())
        if save_after is not None and step + 1 == save_after:
            engine.save_checkpoint(path)
    group = engine.topology.data_parallel_group
    dp_ranks = sorted(dist.get_process_group_ranks(group)) if group is not None else list(range(dp))
    placed = [(m.ep_size, m.deepspeed_moe.experts.first, list(m.deepspeed_moe.experts.local_indices()))
              for m in model.modules() if type(m).__name__ == "MoE"]
    return {"losses": losses, "dp_ranks": dp_ranks, "placed": placed}


def _all(cases: list) -> list[dict]:
    return [_train(*case[:5], chunks=case[5] if len(case) > 5 else 1) for case in cases]


@pytest.mark.slow
@pytest.mark.parametrize("part", [slice(0, 3), slice(3, 6), slice(6, 9)],
                         ids=["pipeline", "tensor-parallel-and-interleaved", "zero"])
def test_moe_in_a_grid_equals_one_process(part):
    cases, ids = CASES[part], IDS[part]
    results = run_distributed(_all, world_size=4, args=(cases,), timeout=300)
    for i, (pp, tp, _eps, moe_kwargs, extra, *_chunks) in enumerate(cases):
        expected = reference_losses(4 // (pp * tp), clip=extra.get("gradient_clipping", 0.0), **moe_kwargs)
        for rank, per_case in enumerate(results):
            got = per_case[i]
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected), rtol=1e-5, atol=0,
                                       msg=lambda m, r=rank, c=ids[i]: f"{c}, rank {r}: {m}")
            # experts are split over this rank's data axis: its position there says which it holds
            position = got["dp_ranks"].index(rank)
            assert all(first == (position % ep) * (EXPERTS // ep) and len(local) == EXPERTS // ep
                                         for ep, first, local in got["placed"]), (ids[i], rank, got)
        assert all(per_case[i]["placed"] for per_case in results) or len(cases[i]) > 5, ids[i]  # MoE on every stage


def _save_then_resume(path: str) -> list[list[float]]:
    kwargs = {"k": 2, "drop_tokens": False}
    first = _train(2, 1, (2, 2), kwargs, {"zero_optimization": {"stage": 3}}, path, save_after=2, steps=2)
    second = _train(1, 2, (1, 2), kwargs, {"zero_optimization": {"stage": 1}}, path, save_after=3, resume=True,
                    steps=3)  # resumes at step 2, saves after step 3 (experts beside tensor-parallel layers)
    third = _train(2, 1, (1, 1), kwargs, {}, path, resume=True, steps=4)
    return [first["losses"], second["losses"], third["losses"]]


@pytest.mark.slow
def test_checkpoints_with_experts_move_between_pipeline_and_tensor_parallel_and_ep_sizes(tmp_path):
    """pp2 x dp2 with ep_size 2 and ZeRO-3 saves; tp2 x dp2 (ep_size 1 and 2, ZeRO-1) resumes and saves; pp2 x
    dp2 with every expert on every rank resumes that: the losses go on as one process's."""
    expected = reference_losses(2, steps=4, k=2, drop_tokens=False)
    for per_rank in run_distributed(_save_then_resume, world_size=4, args=(str(tmp_path),), timeout=300):
        for losses, want in zip(per_rank, (expected[:2], expected[2:3], expected[3:]), strict=True):
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=0)


def _ep_larger_than_the_stage() -> dict:
    import torch.distributed as dist
    from microspeed_moe.groups import get_expert_groups

    import microspeed

    try:
        _train(2, 1, (2, 2), {"k": 1}, {})  # pp2 x dp1: each stage's data axis is one rank
    except microspeed.ConfigError as exc:
        error = str(exc)
    else:
        error = ""
    first = _train(2, 1, (1, 1), {"k": 1}, {}, steps=1)  # the world is still usable; ep_size 1 works
    groups = get_expert_groups(1)  # a script's later query: the last engine's groups (this stage's)
    return {"error": error, "loss": first["losses"], "edp": groups.edp_ranks, "rank": dist.get_rank()}


@pytest.mark.slow
def test_an_ep_size_the_stage_cannot_split_is_refused_with_the_fix():
    for r in run_distributed(_ep_larger_than_the_stage, world_size=2, timeout=180):
        assert "MoE(ep_size=2): the data-parallel group [" in r["error"] and "choose an ep_size that divides" in \
            r["error"], r["error"]
        assert r["edp"] == (r["rank"],)  # stage r's data axis holds only rank r
        torch.testing.assert_close(torch.tensor(r["loss"]), torch.tensor(reference_losses(1, steps=1, k=1)),
                                   rtol=1e-5, atol=0)
