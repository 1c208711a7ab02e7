"""The ZeRO user API, checked as DeepSpeed's tests check it: ``zero.Init``, ``GatheredParameters``, ``safe_get_full_*``.

Every multi-rank check runs on spawned gloo ranks (:func:`microspeed.testing.run_distributed`);
spawning costs a few seconds, so each rank body checks several things in one process group.
References are built without ZeRO from the same seed: a model built inside ``zero.Init`` must be
the model built outside it, and the whole tensors ZeRO hands back must be the ones a stage-0
single-process run on the same global batch has.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch import nn

import microspeed
from microspeed.errors import ConfigError
from microspeed.testing import run_distributed

STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
GLOBAL_BATCH = 4
STEPS = 3


def _config(micro: int, zero: dict | None = None, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    if zero is not None:
        cfg["zero_optimization"] = zero
    cfg.update(extra)
    return cfg


class ScaledLinear(nn.Module):
    """Registers its parameters, then initialises them in ``reset_parameters()`` (as ``nn.Linear`` does)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.scale = nn.Parameter(torch.empty(()))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform weight from the fan-in, unit scale."""
        bound = 1.0 / math.sqrt(self.weight.shape[1])
        nn.init.uniform_(self.weight, -bound, bound)
        nn.init.ones_(self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``scale * x @ weight.T``."""
        return self.scale * x @ self.weight.t()


class Nested(nn.Module):
    """Modules inside modules; the outer constructor re-initialises a child's bias after building it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Sequential(ScaledLinear(5, 3), nn.Tanh()))
        self.head = nn.Linear(3, 1)
        nn.init.constant_(self.head.bias, 0.25)  # touches a child's parameter after it was partitioned

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The body, then the head."""
        return self.head(self.body(x))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 1))


def _batch(step: int, d_in: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, d_in, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g)


def _my_slice(t: torch.Tensor) -> torch.Tensor:
    world, rank = microspeed.comm.get_world_size(), microspeed.comm.get_rank()
    micro = t.shape[0] // world
    return t[rank * micro:(rank + 1) * micro]


def _train_mlp(engine, steps: int, start: int = 0) -> list[float]:
    """``steps`` steps on this rank's slice of the global batches; returns the global mean losses."""
    losses = []
    dtype = next(engine.module.parameters()).dtype  # bf16 runs take bf16 inputs
    for step in range(start, start + steps):
        x, y = _batch(step)
        out = engine(_my_slice(x).to(dtype))
        loss = nn.functional.mse_loss(out.float(), _my_slice(y))
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        microspeed.comm.all_reduce(total)
        losses.append(total.item() / microspeed.comm.get_world_size())
    return losses


def _gpt_config():
    from microspeed.models import GPTConfig

    return GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=16)


def _train_gpt(model: nn.Module, steps: int) -> list[float]:
    """Stage-3 training of the tiny GPT on fixed token batches; returns the global mean losses."""
    world = microspeed.comm.get_world_size()
    engine, *_ = microspeed.initialize(model=model, config=_config(GLOBAL_BATCH // world, STAGE3))
    losses = []
    for step in range(steps):
        del step  # the same batch every step: the loss must go down
        tokens = torch.randint(0, 64, (GLOBAL_BATCH, 9), generator=torch.Generator().manual_seed(0))
        loss = engine(_my_slice(tokens[:, :-1]), _my_slice(tokens[:, 1:]))
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        microspeed.comm.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _same_as(model: nn.Module, ref: nn.Module) -> None:
    """Gathered, ``model``'s parameters equal ``ref``'s (same names, shapes, values)."""
    from microspeed.zero import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        got = dict(model.named_parameters())
        want = dict(ref.named_parameters())
        assert got.keys() == want.keys()
        for name, p in got.items():
            assert p.shape == want[name].shape, name
            assert torch.equal(p.detach(), want[name].detach()), name


# ------------------------------------------------------------------------------------- zero.Init


def _init_body(gpt_steps: int) -> None:
    """zero.Init on every rank: partitioned at construction, same values and losses as without it."""
    from microspeed.models import GPT
    from microspeed.zero import GatheredParameters, Init

    microspeed.init_distributed()  # the harness leaves it to us (init_process_group=False)
    world = microspeed.comm.get_world_size()
    linear_init = nn.Linear.__init__

    # Nested modules, a module that initialises its own parameters in reset_parameters(), and an
    # outer constructor that re-initialises a child's parameter after the child was partitioned.
    with Init():
        torch.manual_seed(0)
        net = Nested()
    torch.manual_seed(0)
    ref = Nested()
    for name, p in net.named_parameters():
        assert p.numel() == 0, name
        assert p.ds_shape == tuple(ref.get_parameter(name).shape), name
        assert p.ds_numel == ref.get_parameter(name).numel(), name
        assert p._zero_init_shard.numel() == -(-p.ds_numel // world), name
    _same_as(net, ref)
    for p in net.parameters():  # GatheredParameters without modifier_rank: partitioned again, as before
        assert p.numel() == 0 and p._zero_init_shard.numel() == -(-p.ds_numel // world)

    # The demo GPT: its constructor ties the LM head to the embedding and ends with reset_parameters()
    # over every sub-module, after they were partitioned. Same weights, then the same stage-3 losses.
    with Init():
        torch.manual_seed(1)
        gpt = GPT(_gpt_config())
    torch.manual_seed(1)
    ref_gpt = GPT(_gpt_config())
    assert gpt.lm_head.weight is gpt.tok_emb.weight
    assert all(p.numel() == 0 for p in gpt.parameters())
    _same_as(gpt, ref_gpt)
    # remote_device="nvme": the shards in files (zero-padded on the last rank), gathered and partitioned again by
    # reset_parameters() over the whole model: the same values again
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        with Init(remote_device="nvme", config_dict_or_path={"zero_optimization": {
                "offload_param": {"device": "nvme", "nvme_path": folder}}}):
            torch.manual_seed(1)
            gpt_nvme = GPT(_gpt_config())
            torch.manual_seed(3)
            odd = nn.Linear(5, 3)  # 15 and 3 values: the last rank's shard is padded
        assert all(p.numel() == 0 and os.path.exists(p._zero_init_file) for p in gpt_nvme.parameters())
        _same_as(gpt_nvme, ref_gpt)
        torch.manual_seed(3)
        _same_as(odd, nn.Linear(5, 3))
        assert all(p._zero_init_shard.numel() == -(-p.ds_numel // world) for p in odd.parameters())
        del gpt_nvme, odd
    losses = _train_gpt(gpt, gpt_steps)
    ref_losses = _train_gpt(ref_gpt, gpt_steps)
    assert losses == ref_losses  # same values, same partitions: bit for bit
    assert losses[-1] < losses[0]

    # dtype: given directly or read from a ds_config
    for kwargs in ({"dtype": torch.bfloat16}, {"config_dict_or_path": {"bf16": {"enabled": True}}}):
        with Init(**kwargs):
            torch.manual_seed(2)
            lin = nn.Linear(5, 3)
        for p in lin.parameters():
            assert p.dtype == torch.bfloat16 and p._zero_init_shard.dtype == torch.bfloat16, kwargs
        torch.manual_seed(2)
        want = nn.Linear(5, 3).to(torch.bfloat16)
        with GatheredParameters([lin.weight, lin.bias]):
            assert torch.equal(lin.weight, want.weight) and torch.equal(lin.bias, want.bias)

    # enabled=False does nothing
    with Init(enabled=False):
        plain = nn.Linear(5, 3)
    assert plain.weight.numel() == 15 and not hasattr(plain.weight, "_zero_init_shard")

    # After the block constructors are restored: a module built now is not partitioned.
    assert nn.Linear.__init__ is linear_init
    after = nn.Linear(4, 2)
    assert after.weight.shape == (2, 4) and not hasattr(after.weight, "ds_shape")

    class Later(nn.Module):  # a class defined inside a block is restored as well
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

    with Init():
        inside = Later()
    assert inside.w.numel() == 0
    assert Later().w.numel() == 3


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_init_partitions_at_construction_and_trains_like_a_plain_model():
    """zero.Init on 2 ranks: partitioned at construction, same model, same stage-3 losses; dtype, enabled, restore."""
    run_distributed(_init_body, world_size=2, args=(3,), timeout=100, init_process_group=False)


def test_init_nvme_needs_a_folder_and_unknown_arguments_are_refused():
    """remote_device='nvme' without offload_param.nvme_path names the key; unknown keywords are refused."""
    from microspeed.zero import Init

    with pytest.raises(ConfigError, match=r"remote_device='nvme'.*offload_param.nvme_path"):
        Init(remote_device="nvme")
    with pytest.raises(TypeError, match="unsupported argument"):
        Init(sequence_data_parallel_group=None)
    assert Init(enabled=False).enabled is False


def test_init_on_one_rank_module_argument_nesting_and_errors():
    """One rank (this process): Init(module=...), nested blocks, a raising block restores, a raising Gathered keeps."""
    from microspeed.zero import GatheredParameters, Init

    microspeed.init_distributed()
    linear_init = nn.Linear.__init__
    torch.manual_seed(0)
    built = _mlp()
    want = [p.detach().clone() for p in built.parameters()]
    Init(module=built)  # an already-built module is partitioned on the spot
    assert all(p.numel() == 0 and p._zero_init_shard.numel() == p.ds_numel for p in built.parameters())
    with GatheredParameters(built.parameters()):
        assert all(torch.equal(p, w) for p, w in zip(built.parameters(), want, strict=True))

    with Init(dtype=torch.float16):
        with Init(dtype=torch.bfloat16):  # nested: the outermost block's settings apply
            inner = nn.Linear(3, 2)
        outer = nn.Linear(3, 2)
        assert nn.Linear.__init__ is not linear_init
    assert inner.weight.numel() == 0 and outer.weight.numel() == 0
    assert inner.weight.dtype == outer.weight.dtype == torch.float16
    assert nn.Linear.__init__ is linear_init

    with pytest.raises(RuntimeError, match="boom"), Init():
        raise RuntimeError("boom")
    assert nn.Linear.__init__ is linear_init and nn.Linear(2, 2).weight.numel() == 4

    lin = outer
    shard = lin.weight._zero_init_shard.clone()
    with pytest.raises(RuntimeError, match="boom"), GatheredParameters(lin.weight, modifier_rank=0):
        with torch.no_grad():
            lin.weight.fill_(3.0)
        raise RuntimeError("boom")
    assert lin.weight.numel() == 0 and torch.equal(lin.weight._zero_init_shard, shard)


# ------------------------------------------------------------------------------ GatheredParameters


def _gathered_body() -> None:
    """GatheredParameters at stage 3 (fp32 and bf16), on zero.Init parameters, and as a no-op at stages 0-2."""
    import torch.distributed as dist

    from microspeed.zero import (
        GatheredParameters,
        Init,
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
    )

    rank, world = dist.get_rank(), dist.get_world_size()
    micro = GLOBAL_BATCH // world

    for extra in ({}, {"bf16": {"enabled": True}}):
        # Inside the block stage-3 parameters are whole and equal to the consolidated weights.
        torch.manual_seed(3)
        model = _mlp()
        engine, *_ = microspeed.initialize(model=model, config=_config(micro, STAGE3, **extra))
        _train_mlp(engine, 1)
        assert all(p.numel() == 0 for p in model.parameters())
        full = {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
        with GatheredParameters(model.parameters()):
            for name, p in model.named_parameters():
                assert p.shape == p.ds_shape, name
                torch.testing.assert_close(p.detach().float(), full[name], rtol=0, atol=0 if not extra else 1e-2)
                everyone = [torch.empty_like(p) for _ in range(world)]
                dist.all_gather(everyone, p.detach().contiguous())
                assert all(torch.equal(e, everyone[0]) for e in everyone), name
        assert all(p.numel() == 0 for p in model.parameters())

        # modifier_rank=0 after a step: rank 0's values (the others write garbage) reach the
        # partitions, the fp32 masters and the next forward.
        last = model[4]
        with GatheredParameters([last.weight, last.bias], modifier_rank=0):
            with torch.no_grad():
                last.weight.fill_(0.0 if rank == 0 else 7.0)
                last.bias.fill_(0.0 if rank == 0 else 7.0)
        assert torch.equal(safe_get_full_fp32_param(last.weight), torch.zeros(1, 3))
        assert torch.equal(safe_get_full_fp32_param(last.bias), torch.zeros(1))
        x, y = _batch(1)
        out = engine(_my_slice(x).to(next(model.parameters()).dtype))
        assert torch.equal(out.float(), torch.zeros(micro, 1))
        engine.backward(nn.functional.mse_loss(out.float(), _my_slice(y)))
        engine.step()
        moved = safe_get_full_fp32_param(last.weight)  # one Adam step from zero: |w| <= lr (+ slack)
        assert 0 < moved.abs().max() <= 1.1e-2

        # modifier_rank=0 before training == the weight set before initialize()
        runs = []
        for set_before in (False, True):
            torch.manual_seed(4)
            model = _mlp()
            if set_before:
                with torch.no_grad():
                    model[0].weight.fill_(0.5)
            engine, *_ = microspeed.initialize(model=model, config=_config(micro, STAGE3, **extra))
            if not set_before:
                with GatheredParameters(model[0].weight, modifier_rank=0):
                    if rank == 0:
                        with torch.no_grad():
                            model[0].weight.fill_(0.5)
                assert torch.equal(safe_get_full_fp32_param(model[0].weight), torch.full((5, 7), 0.5))
            losses = _train_mlp(engine, 2)
            runs.append((losses, {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()}))
        assert runs[0][0] == runs[1][0], extra
        for name, value in runs[0][1].items():
            assert torch.equal(value, runs[1][1][name]), (name, extra)

    # zero.Init parameters before initialize(): gathered whole, modified by rank 0, partitioned again.
    with Init():
        torch.manual_seed(5)
        model = _mlp()
    torch.manual_seed(5)
    ref = _mlp()
    with GatheredParameters(model[0].weight, modifier_rank=0):
        assert torch.equal(model[0].weight, ref[0].weight)
        with torch.no_grad():
            model[0].weight.fill_(0.25 if rank == 0 else 9.0)
    assert model[0].weight.numel() == 0 and model[0].weight._zero_init_shard.numel() == math.ceil(35 / world)
    with GatheredParameters([model[0].weight, model[0].weight]):  # no modifier_rank: changes are dropped
        assert torch.equal(model[0].weight, torch.full((5, 7), 0.25))
        with torch.no_grad():
            model[0].weight.fill_(100.0)
    with GatheredParameters(model[0].weight):
        assert torch.equal(model[0].weight, torch.full((5, 7), 0.25))
    engine, *_ = microspeed.initialize(model=model, config=_config(micro, STAGE3))
    assert torch.equal(safe_get_full_fp32_param(model[0].weight), torch.full((5, 7), 0.25))
    assert torch.equal(safe_get_full_fp32_param(model[2].weight), ref[2].weight)

    # A frozen layer at stage 3: no master, no gradient, no state -- None, as DeepSpeed answers.
    torch.manual_seed(8)
    model = _mlp()
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    model[0].requires_grad_(False)
    engine, *_ = microspeed.initialize(model=model, config=_config(micro, STAGE3))
    _train_mlp(engine, 1)
    assert safe_get_full_fp32_param(model[0].weight) is None
    assert not torch.equal(safe_get_full_fp32_param(model[2].weight), ref["2.weight"])
    assert safe_get_full_grad(model[0].weight) is None
    assert safe_get_full_optimizer_state(model[0].weight, "exp_avg") is None
    assert safe_get_full_optimizer_state(model[2].weight, "exp_avg").abs().sum() > 0

    # Stages 0, 1, 2: parameters are whole; the block changes nothing and communicates nothing, so
    # one rank alone may enter it. (With overlap_comm, stages 1 and 2 finish the step's parameter
    # all-gather lazily; the block waits for it, so inside it the values are the stepped ones.)
    for stage in (0, 1, 2):
        torch.manual_seed(6)
        model = _mlp()
        if stage:
            engine, *_ = microspeed.initialize(model=model, config=_config(micro, {"stage": stage}))
            _train_mlp(engine, 1)
        ptrs = [p.data_ptr() for p in model.parameters()]
        if rank == 0:
            with GatheredParameters(list(model.parameters()), modifier_rank=0):
                inside = [p.detach().clone() for p in model.parameters()]
            for p, ptr, value in zip(model.parameters(), ptrs, inside, strict=True):
                assert p.data_ptr() == ptr and torch.equal(p, value)
        dist.barrier()
        full = [safe_get_full_fp32_param(p) for p in model.parameters()]  # collective at stages 1, 2
        assert [p.data_ptr() for p in model.parameters()] == ptrs
        if rank == 0:
            assert all(torch.equal(f, v) for f, v in zip(full, inside, strict=True)), stage
        if stage:
            _train_mlp(engine, 1)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_gathered_parameters():
    """GatheredParameters on 2 ranks: whole stage-3 weights, modifier_rank reaches masters, zero.Init, no-op at 0-2."""
    run_distributed(_gathered_body, world_size=2, timeout=100)


# -------------------------------------------------------------------------------- safe_get_full_*

WATCHED = ("0.weight", "0.bias", "2.weight", "4.weight", "4.bias")


def _reference_run(stage: int, world: int) -> dict:
    """Train the MLP; the grads just before the last step, then fp32 weights and Adam state after it."""
    from microspeed.zero import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state

    torch.manual_seed(7)
    model = _mlp()
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    engine, optimizer, *_ = microspeed.initialize(model=model, config=_config(GLOBAL_BATCH // world, zero))
    params = dict(model.named_parameters())
    out: dict = {"grad": {}, "fp32": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for step in range(STEPS):
        x, y = _batch(step)
        engine.backward(nn.functional.mse_loss(engine(_my_slice(x)), _my_slice(y)))
        if step == STEPS - 1:
            for name in WATCHED:
                if stage == 0:
                    out["grad"][name] = params[name].grad.detach().clone()
                else:
                    out["grad"][name] = safe_get_full_grad(params[name])
        engine.step()
    for name in WATCHED:
        p = params[name]
        if stage == 0:
            out["fp32"][name] = p.detach().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                out[key][name] = optimizer.state[p][key].clone()
        else:
            out["fp32"][name] = safe_get_full_fp32_param(p)
            for key in ("exp_avg", "exp_avg_sq"):
                out[key][name] = safe_get_full_optimizer_state(p, key)
    return out


def _safe_get_body(stages: tuple[int, ...], check_init: bool) -> dict:
    """Every stage in one process group; every rank returns what it got (they must agree).

    With ``check_init``, first the cheap zero.Init checks at this world size (shard sizes, values).
    """
    world = microspeed.comm.get_world_size()
    if check_init:
        from microspeed.zero import Init

        with Init():
            torch.manual_seed(0)
            net = Nested()
        torch.manual_seed(0)
        _same_as(net, Nested())
        assert all(p.numel() == 0 and p._zero_init_shard.numel() == -(-p.ds_numel // world) for p in net.parameters())
    return {stage: _reference_run(stage, world) for stage in stages}


@pytest.fixture(scope="module")
def single_process_reference():
    """Stage 0 in this process (one rank) on the whole global batch."""
    return _reference_run(0, 1)


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 4])
def test_safe_get_full_matches_single_process(world, single_process_reference):
    """safe_get_full_grad / fp32_param / optimizer_state at stages 1-3 equal the stage-0 one-process values.

    On 4 ranks (stage 3 only, to stay cheap) zero.Init's shards are checked at that world size too.
    """
    stages = (1, 2, 3) if world == 2 else (3,)
    per_rank = run_distributed(_safe_get_body, world_size=world, args=(stages, world == 4), timeout=140)
    for rank, results in enumerate(per_rank):
        for stage, got in results.items():
            for kind, want in single_process_reference.items():
                for name in WATCHED:
                    assert got[kind][name].shape == want[name].shape, (rank, stage, kind, name)
                    torch.testing.assert_close(got[kind][name], want[name], rtol=1e-5, atol=1e-7,
                                               msg=lambda m, r=rank, s=stage, k=kind, n=name: f"{r} {s} {k} {n}: {m}")


def test_init_remote_device_nvme_keeps_shards_in_files_and_trains(tmp_path):
    """zero.Init(remote_device="nvme"): shards are memory-mapped files under offload_param.nvme_path (removed when
    the engine adopts the model); training equals a model built without Init."""
    import os

    from microspeed.zero import Init

    microspeed.init_distributed()
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10_000,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "offload_optimizer": {"device": "cpu"},
                                 "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}}

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))

    with Init(remote_device="nvme", config_dict_or_path=cfg):
        model = build()
    files = [p._zero_init_file for p in model.parameters()]
    assert all(p.numel() == 0 and os.path.exists(f) for p, f in zip(model.parameters(), files, strict=True))
    assert torch.equal(model[0].weight._zero_init_shard.view(8, 6), build()[0].weight.detach())

    def train(m):
        engine, *_ = microspeed.initialize(model=m, config=cfg)
        out = []
        for i in range(2):
            x = torch.randn(2, 6, generator=torch.Generator().manual_seed(i))
            loss = engine(x).square().mean()
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        return out

    assert train(model) == train(build())
    assert not any(os.path.exists(f) for f in files)
