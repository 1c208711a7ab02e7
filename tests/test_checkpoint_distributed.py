"""Checkpoints across processes: exact resume, other world sizes, an interrupted save, DeepSpeed import.

Spawning ranks is the slow part (each rank imports torch, its optimizer machinery and DCP), so
three runs check everything:

* run 1, ``_save_run`` (2 ranks): for fp32 with dropout, fp32, fp16 (dynamic loss scale) and bf16,
  the reference 10 steps straight, then 5 steps and a save; it ends with rank 1 dying while DCP
  writes a second tag (``latest`` must keep the first);
* run 2, ``_second_run`` (2 ranks, a fresh process group): loads each checkpoint and trains 5 more
  steps — losses and parameters equal the reference bit for bit (optimizer, LR schedule, loss
  scaler, data position and per-rank RNG all restored: the dropout masks depend on it). Then, when
  DeepSpeed is installed, the same processes train a model with DeepSpeed 0.19.8 at ZeRO stage 0
  and 2 (``DS_ACCELERATOR=cpu``, fp32, ``torch_adam``) and save, recording DeepSpeed's own view of
  the weights and Adam state (``safe_get_full_*`` for ZeRO, ``optimizer.state`` for stage 0) and
  the weights after one more step; the main process converts those checkpoints with
  ``microspeed checkpoint import-deepspeed``, loads them into a microspeed engine on 1 rank and
  compares;
* run 3, ``_load_run`` (4 ranks): the fp32 checkpoint of 2 ranks continues on 4 (same global
  batches, so the losses match the reference up to float rounding), and a 4-rank checkpoint is
  saved that the main process continues on 1 rank (2 -> 1 and 4 -> 1).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from torch.utils.data import TensorDataset

import microspeed
from microspeed.cli.checkpoint import main as checkpoint_cli
from microspeed.testing import DistributedTestError, run_distributed

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None

SAVED_AT, TOTAL = 5, 10
VARIANTS = {  # name: (precision, dropout)
    "fp32_dropout": ("fp32", 0.1),
    "fp32": ("fp32", 0.0),
    "fp16": ("fp16", 0.1),
    "bf16": ("bf16", 0.0),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class Net(torch.nn.Module):
    """A small MLP with dropout; ``forward(x, y)`` returns the MSE loss."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 32)
        self.drop = torch.nn.Dropout(dropout)
        self.fc2 = torch.nn.Linear(32, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc2(self.drop(torch.tanh(self.fc1(x)))), y)


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(48, 6, generator=g), torch.randn(48, 1, generator=g))


def _config(precision: str) -> dict:
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
           "gradient_clipping": 1.0, "optimizer": {"type": "Adam", "params": {"lr": 0.02}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.02,
                                                         "warmup_num_steps": 8, "warmup_type": "linear"}}}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 6, "loss_scale_window": 2}
    elif precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _engine(variant: str, seed: int):
    precision, dropout = VARIANTS[variant]
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    torch.manual_seed(seed + rank)  # a different RNG stream per rank, as in real runs
    return microspeed.initialize(model=Net(dropout), config=_config(precision), training_data=_dataset())[0]


def _train(engine, steps: int) -> tuple[list[float], list[float]]:
    """``steps`` optimizer steps from the engine's loader; (this rank's losses, global mean loss per step)."""
    dtype = next(engine.module.parameters()).dtype
    data = microspeed.RepeatingLoader(engine.training_dataloader)
    mine, mean = [], []
    gas = engine.gradient_accumulation_steps()
    for _ in range(steps):
        total = torch.zeros(())
        for _ in range(gas):
            x, y = next(data)
            loss = engine(x.to(dtype), y.to(dtype))
            engine.backward(loss)
            engine.step()
            mine.append(loss.item())
            total += loss.detach().float() / gas
        microspeed.comm.all_reduce(total)
        mean.append(total.item() / microspeed.comm.get_world_size())
    return mine, mean


def _params(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def _masters(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for g in engine.optimizer.param_groups for p in g["params"]]


def _scale(engine):
    scaler = engine.plugins.get_plugin("mixed_precision").scaler
    return None if scaler is None else scaler.loss_scale


def _save_run(root: str, variants: list[str]) -> None:
    """Reference runs (10 steps) and 5-step runs saved under ``root/<variant>``; then a save that dies.

    The results go to ``root/refs_rank<r>.pt`` because the run ends with rank 1 killing itself in
    the middle of a save (``os._exit`` while DCP writes its tensors), to check that ``latest``
    still names the previous tag. One spawn serves both, as spawning ranks is the slow part.
    """
    rank = torch.distributed.get_rank()
    out = {}
    for variant in variants:
        ref = _engine(variant, seed=100)
        mine, mean = _train(ref, TOTAL)
        scales = [_scale(ref)]
        saving = _engine(variant, seed=100)
        first_mine, _ = _train(saving, SAVED_AT)
        assert first_mine == mine[:len(first_mine)]  # same seeds, same start
        saving.save_checkpoint(os.path.join(root, variant),
                               client_state={"variant": variant, "ids": torch.arange(3) + rank})  # rank 0's is kept
        scales.append(_scale(saving))
        out[variant] = {"mine": mine, "mean": mean, "params": _params(ref), "masters": _masters(ref),
                        "lr": ref.get_lr(), "scales": scales, "steps_per_rank": len(first_mine)}
    torch.save(out, os.path.join(root, f"refs_rank{rank}.pt"))

    crash = os.path.join(root, "crash")
    engine = _engine("fp32", seed=1)
    _train(engine, 1)
    engine.save_checkpoint(crash, tag="good")
    _train(engine, 1)
    torch.distributed.barrier()
    if rank == 1:
        import torch.distributed.checkpoint as dcp

        def die(self, *args, **kwargs):
            os._exit(17)

        dcp.FileSystemWriter.write_data = die  # rank 1 dies while writing its tensors
    engine.save_checkpoint(crash, tag="bad")
    raise AssertionError("unreachable: rank 1 died, so the save cannot complete")


def _load_run(root: str, variants: list[str], save_variant: str | None) -> dict:
    """Load each variant with different initial weights and RNG, train to step 10; maybe save a copy."""
    out = {}
    for variant in variants:
        engine = _engine(variant, seed=555)
        path, client = engine.load_checkpoint(os.path.join(root, variant), load_rng_state=True)
        assert path.endswith(f"global_step{SAVED_AT}") and client["variant"] == variant
        assert torch.equal(client["ids"], torch.arange(3))
        assert engine.global_steps == SAVED_AT and engine.global_samples == SAVED_AT * 8
        assert engine.micro_steps == SAVED_AT * engine.gradient_accumulation_steps()
        scale = _scale(engine)
        state = torch.get_rng_state()
        draw = torch.rand(4)  # ranks saved as r < N continue r's stream; others get a derived, distinct one
        torch.set_rng_state(state)
        mine, mean = _train(engine, TOTAL - SAVED_AT)
        out[variant] = {"mine": mine, "mean": mean, "params": _params(engine), "masters": _masters(engine),
                        "lr": engine.get_lr(), "scale_after_load": scale, "draw": draw}
    if save_variant is not None:
        engine = _engine(save_variant, seed=100)
        _train(engine, SAVED_AT)
        engine.save_checkpoint(os.path.join(root, f"{save_variant}_w{torch.distributed.get_world_size()}"))
    return out


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(x, y, rtol=1e-4, atol=1e-5) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of every variant at step 5 on 2 ranks, the 10-step references, and a crashed save."""
    root = str(tmp_path_factory.mktemp("ckpt"))
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_save_run, world_size=2, args=(root, list(VARIANTS)), timeout=150, grace_period=0.5)
    kinds = {f.rank: (f.kind, f.exitcode) for f in info.value.failures}
    assert kinds.get(1) == ("died", 17), info.value  # anything else is a real failure: show it
    refs = [torch.load(os.path.join(root, f"refs_rank{r}.pt"), weights_only=False) for r in range(2)]
    return root, refs


def _second_run(root: str, variants: list[str], ds_root: str | None) -> dict:
    """Run 2: resume each variant in a fresh process group; then DeepSpeed's checkpoints (``ds_root``)."""
    out = {"resume": _load_run(root, variants, None), "deepspeed": None}
    if ds_root is not None:
        out["deepspeed"] = _deepspeed_run(ds_root)
    return out


@pytest.fixture(scope="module")
def second_run(saved, tmp_path_factory):
    root, _ = saved
    ds_root = str(tmp_path_factory.mktemp("ds")) if HAVE_DEEPSPEED else None
    results = run_distributed(_second_run, world_size=2, args=(root, ["fp32_dropout", "fp16", "bf16"], ds_root),
                              timeout=480, env={"DS_ACCELERATOR": "cpu"})  # DeepSpeed JIT-builds its CPU
    # comm extension on a fresh machine (about 100 s on 2 idle cores, several minutes under load)
    return ds_root, results


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resume_on_the_same_world_size_is_exact(saved, second_run):
    """2 ranks -> save at 5 -> a fresh 2-rank group loads -> steps 6..10 equal the straight run, bit for bit."""
    _, refs = saved
    got = [r["resume"] for r in second_run[1]]
    for rank in range(2):
        for variant in got[rank]:
            ref, res = refs[rank][variant], got[rank][variant]
            assert res["mine"] == ref["mine"][ref["steps_per_rank"]:], (variant, rank)
            assert _equal(res["params"], ref["params"]), variant
            assert _equal(res["masters"], ref["masters"]), variant
            assert res["lr"] == ref["lr"], variant
    fp16 = refs[0]["fp16"]["scales"]
    assert fp16[1] != 2.0 ** 6 and got[0]["fp16"]["scale_after_load"] == fp16[1]  # the scaler moved and came back


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_resume_on_other_world_sizes(saved):
    """2 -> 4 and 2 -> 1, and a 4-rank checkpoint -> 1: same global batches, same losses (float rounding)."""
    root, refs = saved
    ref = refs[0]["fp32"]
    got = run_distributed(_load_run, world_size=4, args=(root, ["fp32"], "fp32"), timeout=150)
    assert all(torch.allclose(torch.tensor(g["fp32"]["mean"]), torch.tensor(ref["mean"][SAVED_AT:]), rtol=1e-5)
               for g in got)
    assert _close(got[0]["fp32"]["params"], ref["params"])
    assert got[0]["fp32"]["lr"] == ref["lr"]
    draws = [tuple(g["fp32"]["draw"].tolist()) for g in got]
    assert len(set(draws)) == 4  # four distinct RNG streams

    for source in ("fp32", "fp32_w4"):  # 2 -> 1 and 4 -> 1, in this process
        engine = _engine("fp32", seed=555)
        engine.load_checkpoint(os.path.join(root, source), load_rng_state=True)
        assert engine.gradient_accumulation_steps() == 4 and engine.micro_steps == SAVED_AT * 4
        _, mean = _train(engine, TOTAL - SAVED_AT)
        assert torch.allclose(torch.tensor(mean), torch.tensor(ref["mean"][SAVED_AT:]), rtol=1e-5), source
        assert _close(_params(engine), ref["params"]), source


@pytest.mark.slow
def test_bf16_checkpoint_loads_into_fp32_from_the_masters(saved):
    """A bf16 run's checkpoint loads into an fp32 engine with the exact fp32 master weights."""
    root, _ = saved
    engine = _engine("fp32", seed=3)
    engine.load_checkpoint(os.path.join(root, "bf16"))
    masters = microspeed.checkpoint.get_fp32_state_dict(os.path.join(root, "bf16"))
    for name, p in engine.module.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, masters[name])
    bf16 = microspeed.checkpoint.get_fp32_state_dict(os.path.join(root, "bf16"))
    assert any(not torch.equal(v, v.bfloat16().float()) for v in bf16.values())  # really the fp32 masters


@pytest.mark.timeout(60)
def test_a_rank_dying_mid_save_leaves_latest_on_the_previous_tag(saved):
    """Rank 1 died inside DCP's write of tag "bad": ``latest`` names "good", which loads; "bad" does not exist."""
    crash = os.path.join(saved[0], "crash")
    with open(os.path.join(crash, "latest")) as fh:
        assert fh.read() == "good"
    assert not os.path.exists(os.path.join(crash, "bad"))
    assert any(name.startswith("bad.tmp-") for name in os.listdir(crash))  # the partial write, unpublished
    engine = _engine("fp32", seed=2)
    path, _ = engine.load_checkpoint(crash)
    assert path.endswith("good") and engine.global_steps == 1
    with pytest.raises(FileNotFoundError, match="bad"):
        engine.load_checkpoint(crash, tag="bad")


# ---------------------------------------------------------------------------- DeepSpeed import

STAGES = (0, 2)


def _ds_model() -> torch.nn.Module:
    torch.manual_seed(0)  # odd sizes: ZeRO pads each parameter and the partitions
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3), torch.nn.Tanh(),
                               torch.nn.Linear(3, 1))


def _ds_config(stage: int, micro: int) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
            "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}}}


def _ds_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 7, generator=g), torch.randn(4, 1, generator=g)


def _deepspeed_run(root: str) -> dict:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    rank = dist.get_rank()
    out = {}
    for stage in STAGES:
        model = _ds_model()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_ds_config(stage, 2))
        for step in range(3):
            x, y = _ds_batch(step)
            engine.backward(torch.nn.functional.mse_loss(engine(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2]))
            engine.step()
        engine.save_checkpoint(os.path.join(root, f"stage{stage}"), client_state={"epoch": 7})
        if stage == 0:
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
            exp_avg = {n: engine.optimizer.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
        else:
            weights = {n: safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()}
            exp_avg = {n: safe_get_full_optimizer_state(p, "exp_avg").clone() for n, p in model.named_parameters()}
        x, y = _ds_batch(3)
        engine.backward(torch.nn.functional.mse_loss(engine(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2]))
        engine.step()
        after = {n: p.detach().clone() for n, p in model.named_parameters()} if stage == 0 else \
            {n: safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()}
        out[stage] = {"weights": weights, "exp_avg": exp_avg, "after": after}
    return out


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed is not installed (pip install deepspeed==0.19.8)")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", STAGES)
def test_import_deepspeed_then_load_and_continue(second_run, tmp_path, stage):
    """DeepSpeed's checkpoint, converted, loads with DeepSpeed's weights and exp_avg, and trains on alike."""
    root, results = second_run
    ref = results[0]["deepspeed"][stage]
    out = str(tmp_path / "converted")
    assert checkpoint_cli(["import-deepspeed", os.path.join(root, f"stage{stage}"), out]) == 0
    assert (tmp_path / "converted" / "latest").read_text() == "global_step3"

    engine = _microspeed_engine()
    path, client = engine.load_checkpoint(out)
    assert path.endswith("global_step3") and client == {"epoch": 7}
    assert engine.global_steps == 3 and engine.global_samples == 12
    state = engine.optimizer.state_dict()["state"]
    for i, (name, p) in enumerate(engine.module.named_parameters()):
        assert torch.equal(p, ref["weights"][name]), name
        assert torch.equal(state[i]["exp_avg"], ref["exp_avg"][name]), name
        assert float(state[i]["step"]) == 3.0

    x, y = _ds_batch(3)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    for name, p in engine.module.named_parameters():
        assert torch.allclose(p, ref["after"][name], rtol=1e-5, atol=1e-7), name


def _microspeed_engine():
    torch.manual_seed(123)  # other initial weights than DeepSpeed's run
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3), torch.nn.Tanh(),
                                torch.nn.Linear(3, 1))
    cfg = _ds_config(0, 4)
    del cfg["zero_optimization"]
    return microspeed.initialize(model=model, config=cfg)[0]
