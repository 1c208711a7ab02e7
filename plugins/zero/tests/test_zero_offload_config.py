"""ZeRO-Offload to CPU trains like no offload; bad ZeRO configs fail at initialize() naming the key."""

from __future__ import annotations

import pytest
import torch

import microspeed
from microspeed import ConfigError
from microspeed.testing import run_distributed


def _model():
    from microspeed.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32))


def _losses(zero, steps=4):
    import torch.distributed as dist

    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "gradient_clipping": 1.0, "steps_per_print": 10_000, "zero_optimization": zero}
    engine, *_ = microspeed.initialize(model=_model(), config=cfg)
    gen = torch.Generator().manual_seed(3)
    world, rank = dist.get_world_size(), dist.get_rank()
    out = []
    for _ in range(steps):
        x = torch.randint(0, 64, (2 * world, 17), generator=gen)[2 * rank:2 * rank + 2]
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        out.append(t.item() / world)
    rt = engine.plugin_state("zero")
    if rt is not None and rt.swapper is not None:
        return out, {"nvme"}, {f"files:{len(rt.stage3.in_files) > 0}"}
    where = {m.device.type for m in rt.masters.values()} if rt is not None else set()
    shard_where = ({s.device.type for s in rt.stage3.shards.values() if s is not None}
                   if rt is not None and rt.stage3 else set())
    return out, where, shard_where


def _offload_body(path):
    cpu = {"device": "cpu"}
    nvme = {"device": "nvme", "nvme_path": path}
    return [_losses({"stage": 0}),
            _losses({"stage": 1, "offload_optimizer": cpu}),
            _losses({"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}),
            _losses({"stage": 3, "offload_optimizer": cpu, "offload_param": cpu,
                     "stage3_param_persistence_threshold": 0}),
            _losses({"stage": 3, "offload_optimizer": nvme, "offload_param": {**nvme, "max_in_cpu": 2000},
                     "stage3_param_persistence_threshold": 0})]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_offload_matches_no_offload(tmp_path):
    """offload_optimizer cpu (stages 1-3), offload_param cpu (stage 3), and both on NVMe (stage 3, parameter
    shards beyond max_in_cpu in files): the same losses as stage 0."""
    (ref, _, _), *runs = run_distributed(_offload_body, world_size=2, args=(str(tmp_path),), timeout=280)[0]
    for losses, _masters_on, _shards_on in runs:
        for a, b in zip(losses, ref, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (losses, ref)
    assert [r[1] for r in runs] == [{"cpu"}, {"cpu"}, {"cpu"}, {"nvme"}]
    assert runs[2][2] == {"cpu"} and runs[3][2] == {"files:True"}


def _config(zero, **extra):
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": zero, **extra}


@pytest.mark.parametrize(("zero", "extra", "match"), [
    ({"stage": 2, "offload_param": {"device": "cpu"}}, {},
     r"offload_param\.device='cpu' needs zero_optimization\.stage 3 \(got stage 2\)"),
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, {}, r"offload_optimizer\.device='cpu' needs .*stage >= 1"),
    ({"stage": 3, "offload_optimizer": {"device": "nvme"}}, {}, r"offload_optimizer\.nvme_path"),
    ({"stage": 4}, {}, r"zero_optimization\.stage: got 4; accepted values: 0, 1, 2, 3"),
    ({"stage": 2, "reduce_bucket_sise": 5}, {}, r"reduce_bucket_sise: unknown key\. Did you mean 'reduce_bucket_size'"),
    ({"stage": 2, "allgather_partitions": False}, {}, r"allgather_partitions: false"),
    ({"stage": 3, "prefetch_bucket_size": 10, "stage3_prefetch_bucket_size": 20}, {}, r"same key with different"),
    ({"stage": 1}, {"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, r"element-wise.*zero_allow_untested"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
     r"zero_force_ds_cpu_optimizer"),
])
def test_bad_zero_config_is_refused_at_initialize(zero, extra, match):
    with pytest.raises(ConfigError, match=match):
        microspeed.initialize(model=_model(), config={**_config(zero), **extra})


def test_no_sync_is_refused_at_stage_2():
    engine, *_ = microspeed.initialize(model=_model(), config=_config({"stage": 2}))
    x = torch.randint(0, 64, (2, 17))
    with pytest.raises(AssertionError, match=r"no_sync.*ZeRO stage 2"):  # on entry, as DeepSpeed asserts
        with engine.no_sync():
            pass
    with pytest.raises(RuntimeError, match=r"allreduce_gradients=False.*stage 2"):
        engine.backward(engine(x[:, :-1], x[:, 1:]), allreduce_gradients=False)


@pytest.mark.parametrize("zero", [{"stage": 1}, {"stage": 2, "cpu_offload": True},
                                  {"stage": 3, "stage3_param_persistence_threshold": 0}])
def test_optimizer_state_dict_round_trip(zero):
    """optimizer.state_dict() is this rank's partition (as Lightning saves it); load_state_dict restores it:
    the steps after the load repeat the steps after the save exactly."""
    import io

    engine, optimizer, *_ = microspeed.initialize(model=_model(), config=_config(zero))
    gen = torch.Generator().manual_seed(4)
    batches = [torch.randint(0, 64, (2, 17), generator=gen) for _ in range(4)]

    def run(xs):
        out = []
        for x in xs:
            loss = engine(x[:, :-1], x[:, 1:])
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        return out

    run(batches[:2])
    buf = io.BytesIO()
    torch.save(optimizer.state_dict(), buf)
    sd = optimizer.state_dict()
    assert sd["zero_stage"] == zero["stage"] and sd["partition_count"] == 1
    assert sd["base_optimizer_state"]["state"], "Adam state after two steps"
    after_save = run(batches[2:])
    buf.seek(0)
    optimizer.load_state_dict(torch.load(buf, weights_only=False))
    assert run(batches[2:]) == after_save
    if zero["stage"] == 2:
        assert engine.zero_cpu_offload() and engine.zero_offload_optimizer()["device"] == "cpu"
    bad = dict(sd, partition_count=2)
    with pytest.raises(ValueError, match="partition_count"):
        optimizer.load_state_dict(bad)


class _WithUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x).square().mean()


@pytest.mark.parametrize("stage", [2, 3])
def test_ignore_unused_parameters(stage):
    """Default: a parameter without a gradient is fine; with false, the error names it."""
    cfg = _config({"stage": stage, "stage3_param_persistence_threshold": 0})
    engine, *_ = microspeed.initialize(model=_WithUnused(), config=cfg)
    engine.backward(engine(torch.randn(2, 4)))
    engine.step()
    cfg["zero_optimization"]["ignore_unused_parameters"] = False
    engine, *_ = microspeed.initialize(model=_WithUnused(), config=cfg)
    engine.backward(engine(torch.randn(2, 4)))
    with pytest.raises(AssertionError, match=r"unused\.weight"):  # at the step, DeepSpeed's type
        engine.step()


@pytest.mark.parametrize("stage", [0, 2])
def test_init_built_model_trains_below_stage_3(stage):
    """A model built under zero.Init is made whole again when the engine does not partition parameters."""
    import microspeed.zero

    with microspeed.zero.Init():
        model = _model()
    assert all(p.numel() == 0 for p in model.parameters())
    engine, *_ = microspeed.initialize(model=model, config=_config({"stage": stage}))
    x = torch.randint(0, 64, (2, 17))
    engine.backward(engine(x[:, :-1], x[:, 1:]))
    engine.step()
    assert engine.module.tok_emb.weight.shape == (64, 32)
