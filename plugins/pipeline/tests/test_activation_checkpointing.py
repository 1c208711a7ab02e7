"""Activation checkpointing (``deepspeed.checkpointing``): same numbers, less memory, every option real.

Memory is measured with ``torch.autograd.graph.saved_tensors_hooks``: the bytes of the distinct
storages autograd holds for backward (parameters excluded), live and at their peak over forward and
backward — the recompute inside backward included.
"""

from __future__ import annotations

import json
import weakref

import pytest
import torch
import torch.nn.functional as F
from microspeed_pipeline import checkpointing as ckpt
from microspeed_pipeline.rng import get_rng_tracker, model_parallel_seed
from torch import nn

import microspeed
import microspeed as deepspeed
from microspeed.testing import run_distributed

# -- helpers -----------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    """Each test starts unconfigured, with an empty RNG tracker, and leaves nothing behind."""
    monkeypatch.setattr(ckpt, "_STATE", ckpt._State())
    tracker = get_rng_tracker()
    saved = (tracker.get_states(), set(tracker.seeds))
    model_parallel_seed(0, tensor_parallel_rank=0)  # the blocks' tracker dropout needs its state
    yield
    tracker.states, tracker.seeds = dict(saved[0]), saved[1]


class _Held:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class SavedBytes:
    """Bytes of the distinct storages autograd saves for backward: live now and at peak."""

    def __init__(self, exclude=()) -> None:
        self.exclude = {p.untyped_storage().data_ptr() for p in exclude}
        self.live: dict[int, list[int]] = {}
        self.current = self.peak = 0
        self.devices: list[torch.device] = []
        self.storages: list[tuple[int, int]] = []  # (storage ptr, storage offset) of each packed tensor

    def _pack(self, t: torch.Tensor):
        if t.numel() == 0:
            return t
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.exclude:
            return t
        self.devices.append(t.device)
        self.storages.append((ptr, t.storage_offset()))
        entry = self.live.setdefault(ptr, [t.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        held = _Held(t)
        weakref.finalize(held, self._release, ptr)
        return held

    def _release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[ptr]

    @staticmethod
    def _unpack(h):
        return h.t if isinstance(h, _Held) else h

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


class Block(nn.Module):
    """A pre-norm MLP block with dropout from the default RNG (``p``) and from the tracker's state (``tracker_p``)."""

    def __init__(self, d: int = 32, p: float = 0.5, tracker_p: float = 0.5) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.p, self.tracker_p = p, tracker_p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(self.ln(x)))
        if self.tracker_p:
            with get_rng_tracker().fork():
                h = F.dropout(h, self.tracker_p, self.training)
        return x + F.dropout(self.fc2(h), self.p, self.training)


class Stack(nn.Module):
    """``layers`` blocks, each run through ``checkpoint`` when ``mode`` says so."""

    def __init__(self, layers: int = 4, d: int = 32, **kw) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, **kw) for _ in range(layers))
        self.mode = "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.mode == "reentrant":
                x = ckpt.checkpoint(block, x)
            elif self.mode == "non_reentrant":
                x = ckpt.non_reentrant_checkpoint(block, x)
            else:
                x = block(x)
        return x


def _run(model: Stack, x: torch.Tensor, mode: str, seed: int = 7):
    """Loss, input gradient and parameter gradients of one forward/backward from fixed RNG states."""
    model.zero_grad(set_to_none=True)
    model.mode = mode
    model_parallel_seed(seed, tensor_parallel_rank=0)
    x = x.detach().requires_grad_(True)
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach(), x.grad, [p.grad for p in model.parameters()]


def _assert_same(a, b) -> None:
    assert torch.equal(a[0], b[0]), (a[0], b[0])
    assert torch.equal(a[1], b[1])
    assert len(a[2]) == len(b[2])
    for ga, gb in zip(a[2], b[2], strict=True):
        assert torch.equal(ga, gb)


def _model(layers: int = 4, d: int = 32, **kw) -> Stack:
    torch.manual_seed(0)
    return Stack(layers, d, **kw)


COMBOS = {
    "defaults": {},
    "partition": {"partition_activations": True},
    "cpu": {"checkpoint_in_cpu": True},
    "partition+cpu": {"partition_activations": True, "checkpoint_in_cpu": True},
    "contiguous": {"partition_activations": True, "contiguous_checkpointing": True, "num_checkpoints": 4},
    "contiguous+cpu": {"partition_activations": True, "contiguous_checkpointing": True, "num_checkpoints": 4,
                       "checkpoint_in_cpu": True},
    "synchronize+profile": {"synchronize": True, "profile": True},
    "all": {"partition_activations": True, "contiguous_checkpointing": True, "num_checkpoints": 4,
            "checkpoint_in_cpu": True, "synchronize": True, "profile": True},
}


# -- same numbers --------------------------------------------------------------------------------


@pytest.mark.parametrize("options", list(COMBOS.values()), ids=list(COMBOS))
def test_same_loss_and_gradients_with_dropout(options):
    model = _model()
    x = torch.randn(6, 5, 32)
    base = _run(model, x, "none")
    ckpt.configure(None, **options)
    for _ in range(2):  # twice: contiguous buffers are let go at backward and taken afresh
        _assert_same(base, _run(model, x, "reentrant"))
    # the dropout masks really are random: another seed gives other numbers
    assert not torch.equal(base[0], _run(model, x, "none", seed=8)[0])


def test_non_reentrant_same_loss_and_gradients_with_dropout():
    model = _model()
    x = torch.randn(6, 5, 32)
    _assert_same(_run(model, x, "none"), _run(model, x, "non_reentrant"))
    # works with torch.autograd.grad and with inputs that need no grad (the reentrant one does not)
    model_parallel_seed(7, tensor_parallel_rank=0)
    out = ckpt.non_reentrant_checkpoint(model.blocks[0], x)
    grads = torch.autograd.grad(out.sum(), list(model.blocks[0].parameters()))
    assert all(g is not None for g in grads)
    ckpt.configure(None, partition_activations=True)
    with pytest.warns(UserWarning, match="partition_activations"):
        ckpt.non_reentrant_checkpoint(model.blocks[0], x.requires_grad_())


@pytest.mark.parametrize("part", ["tracker", "default"])
def test_restoring_rng_states_is_what_makes_them_equal(monkeypatch, part):
    """Control: without restoring the tracker's (or the default generator's) state the grads differ."""
    model = _model(p=0.0 if part == "tracker" else 0.5, tracker_p=0.5 if part == "tracker" else 0.0)
    x = torch.randn(6, 5, 32)
    base = _run(model, x, "none")
    _assert_same(base, _run(model, x, "reentrant"))

    def restore_all_but_one(self):
        if part == "tracker":
            torch.set_rng_state(self.cpu)
        else:
            get_rng_tracker().set_states(self.tracker)

    monkeypatch.setattr(ckpt._RNGStates, "restore", restore_all_but_one)
    broken = _run(model, x, "reentrant")
    assert torch.equal(base[0], broken[0])  # the forward is the same ...
    assert not all(torch.equal(a, b) for a, b in zip(base[2], broken[2], strict=True))  # ... the masks are not


class Attention(nn.Module):
    """A transformer block whose checkpointed function takes a mask, a float and returns a tuple."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, dropout=0.5, batch_first=True)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Dropout(0.5), nn.Linear(2 * d, d))

    def forward(self, x, bias, scale, *, keep):
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=bias, need_weights=False)
        x = x + scale * a
        x = x + self.mlp(self.ln2(x))
        return x, int(keep.sum()), keep.long()


def test_transformer_block_tuple_outputs_non_tensor_and_no_grad_inputs():
    torch.manual_seed(0)
    blocks = nn.ModuleList(Attention() for _ in range(3))
    x0 = torch.randn(2, 6, 32)
    bias = torch.triu(torch.full((6, 6), float("-inf")), 1)  # float mask: needs no grad
    keep = torch.ones(6, dtype=torch.bool)

    def run(use: bool):
        blocks.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        x = x0.clone().requires_grad_(True)
        h, counts = x, []
        for block in blocks:
            if use:
                h, n, kept = ckpt.checkpoint(block, h, bias, 0.5, keep=keep)
                assert not kept.requires_grad
            else:
                h, n, kept = block(h, bias, 0.5, keep=keep)
            counts.append(n)
        loss = h.pow(2).mean()
        loss.backward()
        return loss.detach(), x.grad, [p.grad for p in blocks.parameters()], counts

    base, ck = run(False), run(True)
    _assert_same(base[:3], ck[:3])
    single = ckpt.checkpoint(lambda t: (t * 2,), x0.clone().requires_grad_(True))
    assert torch.is_tensor(single)  # a one-item tuple comes back as its item, as in DeepSpeed
    assert ck[3] == [6, 6, 6]
    assert bias.grad is None


def test_no_grad_and_no_input_requiring_grad():
    block = _model(layers=1).blocks[0].eval()
    model_parallel_seed(1, tensor_parallel_rank=0)
    x = torch.randn(3, 32)
    with torch.no_grad():
        assert torch.equal(ckpt.checkpoint(block, x), block(x))
    with pytest.warns(UserWarning, match="no tensor input requires grad"):
        out = ckpt.checkpoint(block, x)
    assert not out.requires_grad  # reentrant: as DeepSpeed's and torch's use_reentrant=True


# -- less memory ---------------------------------------------------------------------------------


def _peak(model: Stack, x: torch.Tensor, mode: str) -> tuple[int, torch.Tensor]:
    model.mode = mode
    model_parallel_seed(7, tensor_parallel_rank=0)
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    with SavedBytes(exclude=list(model.parameters())) as meter:
        model(x).square().mean().backward()
    assert meter.current == 0  # everything saved was let go
    return meter.peak, x.grad


def test_peak_saved_activation_memory_is_lower():
    model = _model(layers=8, d=128)
    x = torch.randn(16, 16, 128)  # one activation: 128 KiB
    base, g0 = _peak(model, x, "none")
    checkpointed, g1 = _peak(model, x, "reentrant")
    print(f"\npeak saved bytes, 8 layers: none {base / 2**20:.2f} MiB, checkpoint {checkpointed / 2**20:.2f} MiB "
          f"({checkpointed / base:.2f}x)")
    assert checkpointed < 0.6 * base
    assert torch.equal(g0, g1)
    # what is left: the 8 saved inputs plus one layer recomputed at a time
    one_layer = base / 8
    assert 8 * x.numel() * 4 <= checkpointed <= 8 * x.numel() * 4 + 1.5 * one_layer


def test_cpu_checkpointing_saves_on_cpu_and_restores_the_device():
    model = _model(layers=3)
    x = torch.randn(4, 32, requires_grad=True)
    ckpt.configure(None, checkpoint_in_cpu=True)
    with SavedBytes(exclude=list(model.parameters())) as meter:
        model.mode = "reentrant"
        out = model(x)
    assert meter.devices and all(d.type == "cpu" for d in meter.devices)
    out.sum().backward()
    # the round trip: a saved CPU tensor goes back to the device it came from
    plan = ckpt._Plan(ckpt.get_settings(), 0, 1, None)
    entry = ckpt._SavedInput(0, "offloaded", torch.Size([2, 3]), torch.device("meta"), True, 6)
    back = ckpt._restore_input(torch.randn(2, 3), entry, plan)
    assert back.device.type == "meta" and back.shape == (2, 3)
    entry = ckpt._SavedInput(0, "partitioned", torch.Size([5]), torch.device("meta"), True, 5)
    assert ckpt._restore_input(torch.randn(5), entry, plan).device.type == "meta"


def test_partition_with_one_tensor_parallel_rank_is_a_no_op():
    model = _model(layers=3)
    x = torch.randn(4, 32, requires_grad=True)
    ckpt.configure(None, partition_activations=True)
    with SavedBytes(exclude=list(model.parameters())) as meter:
        model.mode = "reentrant"
        model(x).sum().backward()
    # the first block saved its input itself, not a copy
    assert meter.storages[0][0] == x.untyped_storage().data_ptr()


def test_contiguous_buffers_hold_every_checkpoint_of_a_pass():
    model = _model(layers=4)
    x = torch.randn(4, 32, requires_grad=True)
    ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=4)
    model.mode = "reentrant"
    with SavedBytes(exclude=list(model.parameters())) as meter:
        out = model(x)
    ptrs = {p for p, _ in meter.storages}
    assert len(ptrs) == 1  # one buffer ...
    assert [o for _, o in meter.storages] == [i * x.numel() for i in range(4)]  # ... one row per checkpoint
    assert len(ckpt._STATE.buffers) == 1
    out.sum().backward()
    assert ckpt._STATE.buffers == {}  # let go at backward, as in DeepSpeed

    # more checkpoints in one pass than number_checkpoints: refused, naming the key
    ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=3)
    with pytest.raises(RuntimeError, match="activation_checkpointing.number_checkpoints = 3"):
        model(x)
    # forward passes without backward (evaluation with gradients on) fill the buffers: reset() between them
    ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=4)
    model(x)
    with pytest.raises(RuntimeError, match="reset"):
        model(x)
    ckpt.reset()
    model(x)
    ckpt.reset()
    _assert_same(_run(model, x, "none"), _run(model, x, "reentrant"))


def test_synchronize_at_each_boundary(monkeypatch):
    calls = []
    monkeypatch.setattr(ckpt, "_synchronize", lambda devices: calls.append(list(devices)))
    model = _model(layers=3)
    ckpt.configure(None, synchronize=True)
    _run(model, torch.randn(4, 32), "reentrant")
    assert calls == [[torch.device("cpu")]] * (3 * 4)  # start and end of each forward and backward
    calls.clear()
    ckpt.configure(None)
    _run(model, torch.randn(4, 32), "reentrant")
    assert calls == []


def test_profile_times_each_checkpoint():
    model = _model(layers=3)
    ckpt.configure(None, profile=True)
    _run(model, torch.randn(4, 32), "reentrant")
    t = ckpt.checkpoint_timings()
    assert t.forward_count == t.backward_count == 3
    assert len(t.forward) == len(t.backward) == 3 and all(s > 0 for s in t.forward + t.backward)
    assert t.backward_total_s == pytest.approx(sum(t.backward))
    ckpt.reset_checkpoint_timings()
    assert ckpt.checkpoint_timings().forward == ()
    ckpt.configure(None)
    _run(model, torch.randn(4, 32), "reentrant")
    assert ckpt.checkpoint_timings().forward_count == 0


# -- configure() ---------------------------------------------------------------------------------


def test_configure_from_ds_config_dict_path_and_arguments(tmp_path):
    assert not ckpt.is_configured()
    assert ckpt.get_settings() == ckpt.CheckpointingSettings()
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                        "contiguous_memory_optimization": True, "number_checkpoints": 4,
                                        "synchronize_checkpoint_boundary": True, "profile": True}}
    deepspeed.checkpointing.configure(None, deepspeed_config=cfg)
    assert ckpt.is_configured()
    assert ckpt.get_settings() == ckpt.CheckpointingSettings(True, True, True, 4, True, True)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    # the explicit arguments win over the file; every call starts from the defaults
    ckpt.configure(None, deepspeed_config=str(path), profile=False, num_checkpoints=8)
    assert ckpt.get_settings() == ckpt.CheckpointingSettings(True, True, True, 8, True, False)
    ckpt.configure(None, deepspeed_config={"train_batch_size": 4})
    assert ckpt.get_settings() == ckpt.CheckpointingSettings()
    ckpt.set_num_layers(3)
    ckpt.partition_activations_in_checkpoint(True)
    assert ckpt.get_settings().number_checkpoints == 3 and ckpt.get_settings().partition_activations
    # mpu: None keeps the one configured before (DeepSpeed)
    mpu = FakeMpu()
    ckpt.configure(mpu)
    ckpt.configure(None)
    assert ckpt._STATE.mpu is mpu
    assert deepspeed.checkpointing.get_cuda_rng_tracker() is get_rng_tracker()
    assert callable(deepspeed.checkpointing.model_parallel_cuda_manual_seed)


class FakeMpu:
    """Megatron's mpu interface, for one tensor-parallel rank."""

    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return 1

    def get_model_parallel_group(self):
        return None


def test_configure_refuses_an_mpu_without_the_accessors():
    with pytest.raises(TypeError, match="get_model_parallel_group"):
        ckpt.configure(object())


@pytest.mark.parametrize(("kwargs", "key"), [
    ({"contiguous_checkpointing": True, "partition_activations": True}, "activation_checkpointing.number_checkpoints"),
    ({"contiguous_checkpointing": True, "num_checkpoints": 2},
     "activation_checkpointing.contiguous_memory_optimization"),
    ({"num_checkpoints": 0}, "activation_checkpointing.number_checkpoints"),
    ({"partition_activations": "yes"}, "activation_checkpointing.partition_activations"),
    ({"deepspeed_config": {"activation_checkpointing": {"cpu_checkpoint": True}}}, "cpu_checkpoint"),
])
def test_configure_refuses_naming_the_key(kwargs, key):
    with pytest.raises(microspeed.ConfigError, match=key.replace(".", r"\.")):
        ckpt.configure(None, **kwargs)
    assert not ckpt.is_configured()


# -- two tensor-parallel ranks ---------------------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        torch.distributed.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class _TPBlock(nn.Module):
    """A Megatron-style MLP split over the tensor-parallel group: replicated in, replicated out."""

    def __init__(self, d: int, tp: int, rank: int, group) -> None:
        super().__init__()
        torch.manual_seed(11)  # the full layer, the same on every rank; this rank keeps its shard
        fc1, fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        shard = 4 * d // tp
        self.w1 = nn.Parameter(fc1.weight[rank * shard:(rank + 1) * shard].detach().clone())
        self.b1 = nn.Parameter(fc1.bias[rank * shard:(rank + 1) * shard].detach().clone())
        self.w2 = nn.Parameter(fc2.weight[:, rank * shard:(rank + 1) * shard].detach().clone())
        self.b2 = nn.Parameter(fc2.bias.detach().clone())
        self.ln = nn.LayerNorm(d)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(F.linear(_CopyToTP.apply(self.ln(x), self.group), self.w1, self.b1))
        with get_rng_tracker().fork():  # a different mask on each shard
            h = F.dropout(h, 0.5, True)
        y = _ReduceFromTP.apply(F.linear(h, self.w2), self.group) + self.b2
        return x + F.dropout(y, 0.3, True)  # the same mask on every rank


def _tensor_parallel_rank() -> dict:
    import microspeed_pipeline
    from microspeed_pipeline.checkpointing import checkpoint, configure

    grid = microspeed_pipeline.initialize_model_parallel(tensor_model_parallel_size=2)
    rank, group = grid.get_model_parallel_rank(), grid.get_model_parallel_group()
    d, layers = 37, 4
    blocks = nn.ModuleList(_TPBlock(d, 2, rank, group) for _ in range(layers))
    x0 = torch.randn(5, 5, d, generator=torch.Generator().manual_seed(3))  # 925 elements: odd, padded

    def run(use: bool, meter: SavedBytes | None = None):
        blocks.zero_grad(set_to_none=True)
        ckpt.model_parallel_cuda_manual_seed(1234)  # tracker state seeded by the tensor-parallel rank
        x = x0.clone().requires_grad_(True)
        h = x
        with meter if meter is not None else torch.enable_grad():
            for block in blocks:
                h = checkpoint(block, h) if use else block(h)
        loss = h.square().mean()
        loss.backward()
        return loss.detach(), x.grad, [p.grad for p in blocks.parameters()]

    def same(a, b) -> bool:
        return (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                and all(torch.equal(u, v) for u, v in zip(a[2], b[2], strict=True)))

    out = {"tp": grid.get_model_parallel_world_size()}
    base = run(False)
    configure(grid)
    plain_meter = SavedBytes(exclude=list(blocks.parameters()))
    out["plain_same"] = same(base, run(True, plain_meter))
    configure(grid, partition_activations=True)
    part_meter = SavedBytes(exclude=list(blocks.parameters()))
    out["partition_same"] = same(base, run(True, part_meter))
    out["plain_bytes"], out["partition_bytes"] = plain_meter.peak, part_meter.peak
    configure(grid, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=layers,
              checkpoint_in_cpu=True)
    out["contiguous_cpu_same"] = same(base, run(True))
    # the recompute sees the full input: a rank-local slice would change the loss
    configure(grid, deepspeed_config={"activation_checkpointing": {"partition_activations": True}})
    out["config_same"] = same(base, run(True))
    # the shards' dropout masks differ between ranks (the tracker), so do their weight gradients
    other = [torch.empty_like(base[2][0]) for _ in range(2)]
    torch.distributed.all_gather(other, base[2][0], group=group)
    out["shard_grads_differ"] = not torch.equal(other[0], other[1])
    return out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_partition_activations_on_two_tensor_parallel_ranks():
    results = run_distributed(_tensor_parallel_rank, world_size=2, timeout=150)
    for r in results:
        assert r["tp"] == 2
        assert r["plain_same"] and r["partition_same"] and r["contiguous_cpu_same"] and r["config_same"]
        assert r["shard_grads_differ"]
        # each rank keeps ceil(925 / 2) = 463 of 925 elements of each of the 4 saved inputs
        assert r["plain_bytes"] == 4 * 925 * 4
        assert r["partition_bytes"] == 4 * 463 * 4
        print(f"\nsaved per rank: {r['partition_bytes']} of {r['plain_bytes']} bytes "
              f"({r['partition_bytes'] / r['plain_bytes']:.3f})")


# -- through the engine ----------------------------------------------------------------------------


class CheckpointedNet(nn.Module):
    """Linear in, 4 blocks through ``deepspeed.checkpointing.checkpoint``, linear out, MSE loss."""

    def __init__(self, use: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(Block(32, p=0.5, tracker_p=0.0) for _ in range(4))
        self.out = nn.Linear(32, 1)
        self.use = use

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = deepspeed.checkpointing.checkpoint(block, h) if self.use else block(h)
        return F.mse_loss(self.out(h), y)


def _engine_config(section: dict | None) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    if section is not None:
        cfg["activation_checkpointing"] = section
    return cfg


def _train(use: bool, section: dict | None, steps: int = 4):
    engine, *_ = microspeed.initialize(model=CheckpointedNet(use), config=_engine_config(section))
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(9)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(2, 8, generator=gen), torch.randn(2, 1, generator=gen)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    return engine, torch.stack(losses), [p.detach().clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("section", [
    {},
    {"partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": True,
     "number_checkpoints": 4, "synchronize_checkpoint_boundary": True, "profile": True},
], ids=["defaults", "all"])
def test_engine_trains_identically(section):
    _, base_losses, base_params = _train(False, None)
    engine, losses, params = _train(True, section)
    assert torch.equal(base_losses, losses)
    assert all(torch.equal(a, b) for a, b in zip(base_params, params, strict=True))
    state = engine.plugin_state("activation_checkpointing")
    assert not ckpt.is_configured()  # the engine's settings are its own: the script's stay untouched
    with ckpt.using(state.state):  # what the model's code sees while this engine runs it
        assert state.active and ckpt.is_configured()
        assert ckpt.get_settings() == ckpt.CheckpointingSettings.from_section(section)
        if section.get("profile"):
            assert ckpt.checkpoint_timings().forward_count == 4 * 4


def test_engine_without_the_section_leaves_the_configuration_alone():
    ckpt.configure(None, partition_activations=True)
    engine, *_ = microspeed.initialize(model=CheckpointedNet(True), config=_engine_config(None))
    assert not engine.plugin_state("activation_checkpointing").active
    assert ckpt.get_settings().partition_activations


def test_plugin_configures_with_the_users_mpu_without_a_default_grid(monkeypatch):
    from microspeed_pipeline import checkpointing_plugin

    monkeypatch.setattr(checkpointing_plugin, "get_default_grid", lambda: None)
    plugin = checkpointing_plugin.ActivationCheckpointingPlugin()
    mpu = FakeMpu()
    wrapper = plugin.microspeed_make_topology(mpu=mpu)  # a hook wrapper: sees initialize(mpu=...)
    next(wrapper)
    with pytest.raises(StopIteration) as stop:
        wrapper.send("the topology")
    assert stop.value.value == "the topology" and plugin.mpu is mpu
    plugin.active = True

    class Engine:
        def set_plugin_state(self, name, state):
            self.state = (name, state)

    plugin.microspeed_setup(Engine())
    assert plugin.state.mpu is mpu and plugin.state.configured  # the engine's own state ...
    assert ckpt._STATE.mpu is None and not ckpt.is_configured()  # ... not the script's


class SettingsRecorder(CheckpointedNet):
    """CheckpointedNet that records, at each forward, the checkpointing settings its code sees."""

    def __init__(self) -> None:
        super().__init__(True)
        self.seen: list[ckpt.CheckpointingSettings] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.seen.append(ckpt.get_settings())
        return super().forward(x, y)


def test_two_engines_keep_their_own_checkpointing_configuration():
    """Two engines with different sections, trained in turns in one process: neither sees the other's."""
    ckpt.configure(None, checkpoint_in_cpu=True)  # the script's own configuration, outside any engine
    a_section = {"profile": True}
    b_section = {"partition_activations": True, "contiguous_memory_optimization": True, "number_checkpoints": 4}
    a_model, b_model = SettingsRecorder(), SettingsRecorder()
    a, *_ = microspeed.initialize(model=a_model, config=_engine_config(a_section))
    b, *_ = microspeed.initialize(model=b_model, config=_engine_config(b_section))
    gen = torch.Generator().manual_seed(5)
    batches = [(torch.randn(2, 8, generator=gen), torch.randn(2, 1, generator=gen)) for _ in range(3)]
    losses: dict = {"a": [], "b": []}
    for x, y in batches:
        for name, engine in (("a", a), ("b", b)):
            torch.manual_seed(9 + len(losses[name]))
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses[name].append(loss.detach())
    assert torch.equal(torch.stack(losses["a"]), torch.stack(losses["b"]))  # same model, same data: same run
    assert a_model.seen == [ckpt.CheckpointingSettings.from_section(a_section)] * 3
    assert b_model.seen == [ckpt.CheckpointingSettings.from_section(b_section)] * 3
    a_state = a.plugin_state("activation_checkpointing").state
    b_state = b.plugin_state("activation_checkpointing").state
    with ckpt.using(a_state):
        assert ckpt.checkpoint_timings().forward_count == 3 * 4  # only a's checkpoints were timed
    with ckpt.using(b_state):
        assert ckpt.checkpoint_timings().forward_count == 0 and ckpt.get_settings().partition_activations
    assert b_state.buffers == {}  # b's contiguous buffers let go at its backward; a never had any
    assert ckpt.get_settings() == ckpt.CheckpointingSettings(cpu_checkpointing=True)  # the script's, untouched
    assert ckpt.checkpoint_timings().forward_count == 0


def test_a_pipeline_module_puts_its_grid_in_effect_only_while_it_builds_and_runs():
    from microspeed_pipeline import LayerSpec, PipelineModule, get_default_grid, set_default_grid

    saved = get_default_grid()
    set_default_grid(None)
    try:
        seen = []

        class Probe(nn.Module):
            def forward(self, x):
                seen.append(get_default_grid())
                return x

        module = PipelineModule([LayerSpec(nn.Linear, 4, 4), LayerSpec(Probe)], num_stages=1)
        assert get_default_grid() is None  # not left behind for the process
        module(torch.randn(2, 4))
        assert seen == [module.mpu()] and get_default_grid() is None
    finally:
        set_default_grid(saved)


@pytest.mark.parametrize(("section", "key"), [
    ({"partition_activations": True, "contiguous_memory_optimization": True},
     "activation_checkpointing.number_checkpoints"),
    ({"contiguous_memory_optimization": True, "number_checkpoints": 4},
     "activation_checkpointing.contiguous_memory_optimization"),
    ({"profile": "yes"}, "activation_checkpointing.profile"),
    ({"number_checkpoints": -1}, "activation_checkpointing.number_checkpoints"),
    ({"partition_activation": True}, "activation_checkpointing.partition_activation"),
])
def test_engine_refuses_bad_values_naming_the_key(section, key):
    with pytest.raises(microspeed.ConfigError, match=key.replace(".", r"\.")):
        microspeed.initialize(model=CheckpointedNet(True), config=_engine_config(section))


def test_section_belongs_to_the_plugin():
    with pytest.raises(microspeed.ConfigError, match="microspeed-pipeline"):
        microspeed.initialize(model=CheckpointedNet(True), config={
            **_engine_config({}), "plugins": {"disable": ["activation_checkpointing"]}})


# -- on a GPU ----------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_cpu_checkpointing_moves_inputs_off_the_device(monkeypatch):
    torch.manual_seed(0)
    model = Stack(8, 256).cuda()
    x = torch.randn(32, 64, 256, device="cuda")
    base = _run(model, x, "none")
    synced = []
    real_sync = ckpt._synchronize
    monkeypatch.setattr(ckpt, "_synchronize", lambda devices: (synced.extend(devices), real_sync(devices)))
    ckpt.configure(None, checkpoint_in_cpu=True, partition_activations=True, contiguous_checkpointing=True,
                   num_checkpoints=8, synchronize=True)
    assert torch.allclose(base[0], _run(model, x, "reentrant")[0], rtol=1e-6)
    assert synced and all(d.type == "cuda" for d in synced)

    def device_peak(mode: str) -> tuple[int, list]:
        model.mode = mode
        model_parallel_seed(7, tensor_parallel_rank=0)
        xx = x.detach().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        with SavedBytes(exclude=list(model.parameters())) as meter:
            out = model(xx)
        after_forward = torch.cuda.memory_allocated() - start
        out.square().mean().backward()
        return after_forward, meter.devices

    held_ckpt, devices = device_peak("reentrant")
    ckpt.configure(None)
    held_plain, _ = device_peak("reentrant")
    held_none, _ = device_peak("none")
    assert all(d.type == "cpu" for d in devices)
    assert held_ckpt < held_plain < held_none
