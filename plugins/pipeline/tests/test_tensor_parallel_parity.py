"""fp32 losses with tensor parallelism (alone, × data, × pipeline) equal the single-process model's."""

from __future__ import annotations

import pytest
import torch
from pipeline_models import block_specs, build_reference, micro_batches, pipeline
from test_pipeline_parity import GAS, MICRO, _config, reference_losses

from microspeed.testing import run_distributed


def _train(pp: int, tp: int, plain: bool, steps: int) -> list[float]:
    import torch.distributed as dist
    from microspeed_pipeline import PipeModelDataParallelTopology, initialize_model_parallel
    from pipeline_models import BASE_SEED

    import microspeed

    dp = dist.get_world_size() // (pp * tp)
    if plain:  # a hand-written tensor-parallel model, no PipelineModule: the grid comes as mpu
        grid = initialize_model_parallel(tensor_model_parallel_size=tp)
        modules = []
        for idx, spec in enumerate(block_specs(tp=True)):
            torch.manual_seed(BASE_SEED + idx)
            modules.append(spec.build())
        engine, *_ = microspeed.initialize(model=torch.nn.Sequential(*modules), config=_config(), mpu=grid)
    else:
        topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
        engine, *_ = microspeed.initialize(model=pipeline(block_specs(tp=True), topology=topo), config=_config())
    d = engine.topology.data_parallel_rank
    losses = []
    for step in range(steps):
        mine = micro_batches(step, dp * GAS, MICRO)[d * GAS:(d + 1) * GAS]
        if plain:
            total = []
            for x, y in mine:
                loss = torch.nn.functional.mse_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                total.append(loss.detach())
            mean = torch.stack(total).mean()
            dist.all_reduce(mean, group=engine.topology.data_parallel_group)
            losses.append(mean.item() / dp)
        else:
            losses.append(engine.train_batch(iter(mine)).item())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize(("world", "pp", "tp", "plain"),
                         [(2, 1, 2, False), (4, 1, 2, False), (4, 2, 2, False), (4, 1, 2, True)],
                         ids=["tp2", "tp2xdp2", "pp2xtp2", "tp2xdp2-plain-module"])
def test_tensor_parallel_losses_equal_single_process(world, pp, tp, plain):
    results = run_distributed(_train, world_size=world, args=(pp, tp, plain, 4), timeout=180)
    expected = reference_losses(world // (pp * tp), specs=block_specs(tp=False))
    for rank, losses in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0,
                                   msg=lambda m, r=rank: f"rank {r}: {m}")


def test_reference_blocks_are_deterministic():
    a, b = build_reference(block_specs(tp=False)), build_reference(block_specs(tp=False))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def _tp_save_or_resume(pp: int, tp: int, path: str, save_after: int | None, resume: bool, steps: int,
                       precision: str = "fp32") -> list[float]:
    import torch.distributed as dist
    from microspeed_pipeline import PipeModelDataParallelTopology

    import microspeed

    dp = dist.get_world_size() // (pp * tp) if dist.is_initialized() else 1
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    extra = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    engine, *_ = microspeed.initialize(model=pipeline(block_specs(tp=tp > 1), topology=topo), config=_config(extra))
    start = 0
    if resume:
        engine.load_checkpoint(path)
        start = engine.global_steps
    d = engine.topology.data_parallel_rank
    losses = []
    for step in range(start, steps):
        mine = micro_batches(step, dp * GAS, MICRO)[d * GAS:(d + 1) * GAS]
        losses.append(engine.train_batch(iter(mine)).item())
        if save_after is not None and step + 1 == save_after:
            engine.save_checkpoint(path)
    return losses


@pytest.mark.slow
def test_checkpoint_saved_with_tensor_parallel_2_loads_into_tp1_and_pp2xtp2(tmp_path):
    expected = reference_losses(1, specs=block_specs(tp=False), steps=4)
    saved = run_distributed(_tp_save_or_resume, world_size=2, args=(1, 2, str(tmp_path), 2, False, 2), timeout=120)
    torch.testing.assert_close(torch.tensor(saved[0]), torch.tensor(expected[:2]), rtol=1e-5, atol=0)
    for world, pp, tp in ((1, 1, 1), (4, 2, 2)):
        resumed = run_distributed(_tp_save_or_resume, world_size=world, args=(pp, tp, str(tmp_path), None, True, 4),
                                  timeout=120)
        for losses in resumed:
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected[2:]), rtol=1e-5, atol=0)


def _partitioned_and_whole(steps: int) -> dict:
    """pp2 x tp2: the same training with activations/gradients split over the tensor ranks and sent whole."""
    from microspeed_pipeline import PipeModelDataParallelTopology

    import microspeed

    out = {}
    for split in (True, False):
        topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
        section = {"pipe_partitioned": split, "grad_partitioned": split}
        engine, *_ = microspeed.initialize(model=pipeline(block_specs(tp=True), topology=topo),
                                           config=_config({"pipeline": section}))
        p2p = engine.plugin_state("pipeline").p2p
        losses = [engine.train_batch(iter(micro_batches(step, GAS, MICRO))).item() for step in range(steps)]
        out[split] = {"losses": losses, "bytes": p2p.bytes_sent - p2p.header_bytes, "kinds": sorted(p2p.split_kinds)}
    return out


def test_pipe_and_grad_partitioned_send_a_tensor_slice_with_the_same_losses():
    """DeepSpeed's pipe_partitioned / grad_partitioned: each tensor rank sends 1/tp of what crosses stages."""
    results = run_distributed(_partitioned_and_whole, world_size=4, args=(2,), timeout=120)
    expected = reference_losses(1, specs=block_specs(tp=False))[:2]
    for rank, r in enumerate(results):
        assert r[True]["kinds"] == ["act", "grad"] and r[False]["kinds"] == []
        assert r[True]["losses"] == r[False]["losses"], rank  # the same numbers, bit for bit
        torch.testing.assert_close(torch.tensor(r[True]["losses"]), torch.tensor(expected), rtol=1e-5, atol=0)
        assert r[True]["bytes"] * 2 == r[False]["bytes"], (rank, r[True]["bytes"], r[False]["bytes"])  # 1/tp
