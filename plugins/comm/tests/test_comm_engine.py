"""The 1-bit optimizers through ``microspeed.initialize`` on gloo ranks: hand-over, bytes, precisions, checkpoints."""

from __future__ import annotations

import os

import pytest
import torch

import microspeed
from microspeed.testing import run_distributed

HIDDEN = 512


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.GELU(), torch.nn.Linear(HIDDEN, 1))


def _gpt():
    from microspeed.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32))


def _config(opt_type, params, micro=4, gas=1, **extra):
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "steps_per_print": 10**6,
            "optimizer": {"type": opt_type, "params": params}, **extra}


def _mlp_batch(step, rank, world, micro):
    g = torch.Generator().manual_seed(1000 + step % 2)  # two batches, alternating: a loss that must fall
    x = torch.randn(micro * world, 64, generator=g)
    y = 2 * x[:, :1] - x[:, 1:2] + 0.1 * torch.randn(micro * world, 1, generator=g)  # a learnable teacher
    return x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro]


def _mlp_step(engine, step, rank, world, micro=4, gas=1):
    import torch.distributed as dist

    total = 0.0
    for k in range(gas):
        x, y = _mlp_batch(step * gas + k, rank, world, micro)
        x = x.to(next(engine.module.parameters()).dtype)  # fp16/bf16 models take low-precision inputs
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        t = loss.detach().float().clone()
        if dist.is_initialized() and world > 1:
            dist.all_reduce(t)
        total += t.item() / world / gas
    return total


def _params_agree(engine) -> bool:
    import torch.distributed as dist

    flat = torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])
    seen = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(seen, flat)
    return all(torch.equal(s, flat) for s in seen)


# ------------------------------------------------------------------ hand-over and bytes (2 ranks)


def _handover_and_bytes():
    import torch.distributed as dist

    from microspeed import comm

    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = _config("OneBitAdam", {"lr": 1e-3, "freeze_step": 2}, comms_logger={"enabled": True})
    engine, *_ = microspeed.initialize(model=_mlp(), config=cfg)
    out = {"owners": [], "ops": [], "all_reduce_bytes": [], "wire": [], "agree": []}
    for step in range(5):
        comm.stats.reset()
        _mlp_step(engine, step, rank, world)
        out["owners"].append(engine.owner("gradient_reduction"))
        out["ops"].append(sorted(op for op, n in comm.stats.calls.items() if n))
        out["all_reduce_bytes"].append(comm.stats.bytes.get("all_reduce", 0))
        out["wire"].append(comm.stats.total_wire_bytes())
        out["agree"].append(_params_agree(engine))
    summary = comm.log_summary(return_dict=True) or {}
    out["logged_ops"] = sorted(summary.get("summary", {}))
    out["param_bytes"] = sum(p.numel() * 4 for p in engine.module.parameters())
    return out


@pytest.mark.slow
def test_handover_and_bytes_on_two_ranks():
    results = run_distributed(_handover_and_bytes, world_size=2, timeout=240)
    for r in results:
        # steps 1-2 are the warm-up: the data-parallel all-reduce runs; from step 3 the optimizer communicates
        assert r["owners"] == [None, "comm", "comm", "comm", "comm"], r["owners"]
        assert "all_reduce" in r["ops"][0] and "all_to_all_single" not in r["ops"][0], r["ops"]
        for ops in r["ops"][2:]:
            assert "all_to_all_single" in ops and "all_gather_into_tensor" in ops, ops
        # no data-parallel all-reduce after the warm-up: the one left is the step's non-finite flag (one float),
        # agreed because the compressed phase leaves each rank's gradients local
        assert r["all_reduce_bytes"][2:] == [4, 4, 4], r["all_reduce_bytes"]
        assert r["wire"][0] >= r["param_bytes"]  # 2 ranks: an fp32 all-reduce sends 2 (n-1)/n S = S
        ratio = r["wire"][0] / max(r["wire"][3], 1)
        assert ratio >= 26, (ratio, r["wire"])  # after warm-up, >= 26x fewer bytes on the wire per step
        assert all(r["agree"])  # every rank holds the same parameters after every step
        assert "all_to_all_single" in r["logged_ops"] and "all_reduce" in r["logged_ops"]


# -------------------------------------------------- warm-up equals data parallel Adam-without-bias-correction


def _losses(opt_type, params, steps, gas=1, precision=None, micro=4):
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    extra = {precision: {"enabled": True}} if precision else {}
    if precision == "bf16":
        extra["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, *_ = microspeed.initialize(model=_mlp(), config=_config(opt_type, params, micro=micro, gas=gas, **extra))
    losses, agree, owners = [], [], []
    for step in range(steps):
        losses.append(_mlp_step(engine, step, rank, world, micro=micro, gas=gas))
        if world > 1:
            agree.append(_params_agree(engine))
        owners.append(engine.owner("gradient_reduction"))
    return {"losses": losses, "agree": agree, "owners": owners}


def _many(cases):
    return [_losses(*case) for case in cases]


PRECISION_CASES = [  # short runs: a fast variance decay (0.9), so the variance frozen after a few steps is sane
    ("OneBitAdam", {"lr": 1e-3, "freeze_step": 100}, 4),  # all warm-up: compared with one process below
    ("OneBitAdam", {"lr": 3e-3, "freeze_step": 4, "betas": [0.9, 0.9]}, 10, 2),  # gradient accumulation 2
    ("OneBitAdam", {"lr": 3e-3, "freeze_step": 4, "betas": [0.9, 0.9]}, 10, 1, "fp16"),
    ("OneBitAdam", {"lr": 3e-3, "freeze_step": 4, "betas": [0.9, 0.9]}, 10, 1, "bf16"),
    ("ZeroOneAdam", {"lr": 1e-3, "betas": [0.9, 0.9], "var_freeze_step": 3, "var_update_scaler": 1,
                     "local_step_scaler": 1, "local_step_clipper": 4}, 12),
    ("ZeroOneAdam", {"lr": 1e-3, "betas": [0.9, 0.9], "var_freeze_step": 3, "var_update_scaler": 1,
                     "local_step_scaler": 1, "local_step_clipper": 2}, 12, 1, "bf16"),
    ("OneBitLamb", {"lr": 3e-2, "freeze_step": 4, "betas": [0.9, 0.9], "max_coeff": 0.3, "min_coeff": 0.01}, 10),
    ("OneBitLamb", {"lr": 3e-2, "freeze_step": 4, "betas": [0.9, 0.9]}, 10, 2, "fp16"),
]


@pytest.fixture(scope="module")
def precision_runs():
    return run_distributed(_many, world_size=2, args=(PRECISION_CASES,), timeout=300)


@pytest.mark.slow
def test_warmup_equals_the_single_process_run(precision_runs):
    # the warm-up reduces gradients at full precision: 2 ranks with half batches == 1 process, full batches
    single = _losses("OneBitAdam", {"lr": 1e-3, "freeze_step": 100}, 4, micro=8)
    torch.testing.assert_close(precision_runs[0][0]["losses"], single["losses"], rtol=1e-5, atol=0)


@pytest.mark.parametrize("i", range(1, len(PRECISION_CASES)))
def test_precisions_accumulation_and_optimizers_train(precision_runs, i):
    case = PRECISION_CASES[i]
    for rank_runs in precision_runs:
        r = rank_runs[i]
        assert all(torch.isfinite(torch.tensor(r["losses"]))), (case, r["losses"])
        assert sum(r["losses"][-2:]) < 0.7 * sum(r["losses"][:2]), (case, r["losses"])  # it learns
        assert "comm" in r["owners"], (case, r["owners"])  # compression took over at some step
        if case[0] != "ZeroOneAdam":
            assert all(r["agree"]), case
    if case[0] == "ZeroOneAdam":  # local steps: replicas agree at every synchronisation (here, by the end)
        assert precision_runs[0][i]["agree"][-1], case
    assert precision_runs[0][i]["losses"] == precision_runs[1][i]["losses"]


# ---------------------------------------------------------------------------------------- checkpoints


def _resume(opt_type, params, directory, precision=None, before=4):
    """Train ``before`` steps, save, train 3 (A); a fresh engine loads and trains the same 3 (B)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    extra = {precision: {"enabled": True}} if precision else {}
    cfg = _config(opt_type, params, **extra)
    engine, *_ = microspeed.initialize(model=_mlp(), config=cfg)
    for step in range(before):
        _mlp_step(engine, step, rank, world)
    engine.save_checkpoint(directory, tag="t")
    a = [_mlp_step(engine, step, rank, world) for step in range(before, before + 3)]
    fresh, *_ = microspeed.initialize(model=_mlp(), config=cfg)
    fresh.load_checkpoint(directory, tag="t")
    owner = fresh.owner("gradient_reduction")
    b = [_mlp_step(fresh, step, rank, world) for step in range(before, before + 3)]
    return {"a": a, "b": b, "owner": owner, "agree": _params_agree(fresh)}


RESUME_CASES = [
    ("OneBitAdam", {"lr": 1e-3, "freeze_step": 2, "betas": [0.9, 0.9]}),
    # local steps from step 3, synchronised at steps 3, 4, 8: saved after step 5, between them
    ("ZeroOneAdam", {"lr": 1e-3, "betas": [0.9, 0.9], "var_freeze_step": 1, "var_update_scaler": 1,
                     "local_step_scaler": 1, "local_step_clipper": 4}, None, 5),
    ("OneBitLamb", {"lr": 1e-2, "freeze_step": 2, "betas": [0.9, 0.9]}, "fp16", 6),  # fp16 skips 3 steps first
]


def _resume_all(directory):
    return [_resume(case[0], case[1], os.path.join(directory, case[0]), *case[2:]) for case in RESUME_CASES]


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path):
    results = run_distributed(_resume_all, world_size=2, args=(str(tmp_path),), timeout=300)
    for rank_results in results:
        for case, r in zip(RESUME_CASES, rank_results, strict=True):
            assert r["a"] == r["b"], (case[0], r)  # error-feedback buffers restored per rank: no divergence
            assert r["owner"] == "comm" and r["agree"], (case[0], r)


def _load_on_other_world(directory):
    import torch.distributed as dist

    micro = 8 // dist.get_world_size()  # the global batch of the 2-rank run that saved
    engine, *_ = microspeed.initialize(model=_mlp(), config=_config(*RESUME_CASES[0], micro=micro))
    engine.load_checkpoint(directory, tag="t")
    restored_errors = engine.optimizer.error_state()
    losses = [_mlp_step(engine, step, dist.get_rank(), dist.get_world_size(), micro=micro) for step in range(4, 7)]
    return {"losses": losses, "owner": engine.owner("gradient_reduction"), "agree": _params_agree(engine),
            "restored_errors": restored_errors}


@pytest.mark.slow
def test_checkpoint_loads_on_another_world_size(tmp_path):
    saved = run_distributed(_resume, world_size=2, timeout=240, args=(*RESUME_CASES[0], str(tmp_path)))
    loaded = run_distributed(_load_on_other_world, world_size=4, args=(str(tmp_path),), timeout=240)
    for r in loaded:  # 4 ranks: errors start from zero, the compression stage continues
        assert r["owner"] == "comm" and r["agree"]
        assert r["restored_errors"] == {}  # another world size: the error feedback starts from zero
        torch.testing.assert_close(r["losses"][0], saved[0]["a"][0], rtol=1e-5, atol=0)  # the same model
        assert all(torch.isfinite(torch.tensor(r["losses"]))), r["losses"]


# --------------------------------------------------------------------------------- bad input, refusals


def test_bad_params_are_refused_at_initialize():
    with pytest.raises(microspeed.ConfigError, match=r"optimizer\.params\.freeze_step: must be >= 1"):
        microspeed.initialize(model=_mlp(), config=_config("OneBitAdam", {"freeze_step": 0}))
    with pytest.raises(microspeed.ConfigError, match=r"optimizer\.params\.freez_step: .*did you mean 'freeze_step'"):
        microspeed.initialize(model=_mlp(), config=_config("OneBitAdam", {"freez_step": 10}))
    with pytest.raises(microspeed.ConfigError, match=r"optimizer\.params\.comm_backend_name"):
        microspeed.initialize(model=_mlp(), config=_config("ZeroOneAdam", {"comm_backend_name": "tcp"}))
    with pytest.warns(UserWarning, match=r"optimizer\.params\.bias_correction: True has no effect"):
        microspeed.initialize(model=_mlp(), config=_config("onebitadam", {"bias_correction": True}))


def test_onebit_lamb_with_zero_is_attached_to_the_partitions():
    pytest.importorskip("microspeed_zero")
    cfg = _config("OneBitLamb", {"freeze_step": 10}, zero_optimization={"stage": 1})
    engine, *_ = microspeed.initialize(model=_mlp(), config=cfg)
    inner = engine.plugin_state("comm").optimizer
    assert type(inner).__name__ == "OneBitLamb" and inner.partitioned and inner.freeze_step == 10
