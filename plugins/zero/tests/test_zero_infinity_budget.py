"""ZeRO-3 with parameters and optimizer on NVMe trains a model whose state is >= 5x what may stay in memory.

One process. A GPT built under ``zero.Init(remote_device="nvme")`` trains with ``offload_param`` (``max_in_cpu:
0``) and ``offload_optimizer`` on NVMe, small sub-groups, two micro-steps per step and gradient clipping that
acts. The budget is what the offload keeps in memory by construction — the optimizer's slots, the gradient
buffers, the gathered parameters allowed by ``stage3_max_live_parameters`` and the step's writes into parameter
files in flight — and the training state (fp32 weights, gradients, masters and two moments: 20 bytes per
parameter) is >= 5x it. Checked:

* the bytes the runtime accounts in memory (``memory_breakdown``, with the shards read ahead or kept for reuse,
  plus gathered parameters and the step's staging ring for its writes into them), sampled after every forward,
  backward and step and at every piece the step writes, stay within the budget; nothing holds the partition (no
  masters, no accumulator of an optimized segment, no shard in memory);
* prefetches read most shards ahead of their gathers, and the parameter files are read exactly once per gather;
* the swap files' traffic per step is exactly the streamed state: the optimizer files read masters, moments
  and gradients once and the gradients once more per extra micro-step, write masters, moments and one
  gradient pass per micro-step; the parameter files receive the new weights once;
* losses and final weights equal an in-memory ZeRO-3 run of the same model in fp32;
* in fp16, a loss scale that overflows vetoes the same steps as in memory (from the finiteness kept as each
  slice was written).
"""

from __future__ import annotations

import pytest
import torch

import microspeed
from microspeed.demo.model import GPT, GPTConfig

STEPS, GAS = 3, 2
GPT_CONFIG = GPTConfig(vocab_size=512, seq_len=16, n_layer=5, n_head=4, d_model=64, tie_weights=False)
SUB_GROUP, LIVE = 4096, 40_000


def _config(nvme: str | None) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": SUB_GROUP,
            "stage3_max_live_parameters": LIVE, "stage3_prefetch_bucket_size": LIVE // 2}
    if nvme is not None:
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": 2}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "steps_per_print": 10_000,
            "gradient_clipping": 0.05, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}}}


def _held(rt) -> int:
    """Bytes the runtime accounts in memory: parameters, gradients, optimizer state and buffers, plus gathered
    parameters and the step's writes into parameter files in flight."""
    s3 = rt.stage3
    gathered = sum(s3.flats[s.index].untyped_storage().nbytes() for s in s3.segments if not s.persistent)
    return sum(v for k, v in rt.memory_breakdown().items() if not k.endswith("_nvme")) + gathered + s3.staging_bytes()


def _train(engine, samples: list[int] | None) -> tuple[list[float], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, GPT_CONFIG.vocab_size, (2, GPT_CONFIG.seq_len + 1), generator=gen) for _ in range(GAS)]
    rt = engine.plugin_state("zero")
    losses = []
    for i in range(STEPS * GAS):
        x = batches[i % GAS]  # the same window every step: the loss must fall
        loss = engine(x[:, :-1], x[:, 1:])
        if samples is not None:
            samples.append(_held(rt))
        engine.backward(loss)
        if samples is not None:
            samples.append(_held(rt))
        engine.step()
        if samples is not None:
            samples.append(_held(rt))
        losses.append(loss.item())
    params = list(engine.module.parameters())
    with microspeed.zero.GatheredParameters(params):
        weights = [p.detach().clone() for p in params]
    return losses, weights


@pytest.mark.timeout(300)
def test_model_five_times_over_the_budget_trains_as_in_memory(tmp_path):
    microspeed.init_distributed()
    nvme = str(tmp_path / "swap")
    cfg = _config(nvme)
    torch.manual_seed(0)
    with microspeed.zero.Init(remote_device="nvme", config_dict_or_path=cfg):
        model = GPT(GPT_CONFIG)
    engine = microspeed.initialize(model=model, config=cfg)[0]
    rt = engine.plugin_state("zero")
    s3, swapper, files = rt.stage3, rt.swapper, rt.gradients
    n = sum(p.ds_numel for p in engine.module.parameters())
    largest = max(s.shard_size for s in s3.segments)
    budget = (swapper.budget_bytes() + files.budget_bytes() + 4 * LIVE
              + 4 * (LIVE // 2 + largest)  # shards read ahead or kept for reuse (one rank: whole)
              + 3 * 4 * min(SUB_GROUP, largest) + 2 * 4096)  # the step's staging ring (stage3.write_piece)
    state = 20 * n
    assert state >= 5 * budget, (state, budget)

    # nothing holds the partition: masters, accumulators of optimized segments, shards in memory
    assert rt.masters == {} and not any(i in rt.acc for i in files.layout) and set(files.layout) == {
        s.index for s in rt.optimized}
    assert all(v is None for v in s3.shards.values()) and s3.in_files == {s.index for s in s3.segments}

    samples: list[int] = []
    store_params = rt.store_params

    def sampled(*args, **kwargs):  # also inside the step, at every piece it writes
        store_params(*args, **kwargs)
        samples.append(_held(rt))

    rt.store_params = sampled
    elements = sum(sg.numel for sg in swapper.subgroups)
    io = [(swapper.store.bytes_read, swapper.store.bytes_written, s3.store.bytes_written)]
    stepped = engine.step

    def step_and_count():
        boundary = engine.is_gradient_accumulation_boundary()
        stepped()
        if boundary:
            io.append((swapper.store.bytes_read, swapper.store.bytes_written, s3.store.bytes_written))

    engine.step = step_and_count
    launched = []  # the shard bytes each gather needs (all shards are in files)
    launch = s3._launch

    def counted_launch(seg, async_op):
        launched.append(seg.shard_size * seg.dtype.itemsize)
        launch(seg, async_op)

    s3._launch = counted_launch
    params_read = s3.store.bytes_read
    buffered0, direct0 = s3.store.stats.buffered_bytes, s3.store.stats.direct_bytes
    partial = [0]  # the bytes of partial pages the parameter files' transfers move: at either end of each
    read_async, write_async = s3.store.read_async, s3.store.write_async

    def _partial(t: torch.Tensor, offset: int | None) -> None:
        first = (-(offset or 0) * t.element_size()) % 4096
        head = min(first, t.nbytes)
        partial[0] += head + (t.nbytes - head) % 4096

    def counted_read(key, out, after=(), offset=None):
        _partial(out, offset)
        return read_async(key, out, after, offset)

    def counted_write(key, tensor, after=(), offset=None):
        _partial(tensor, offset)
        return write_async(key, tensor, after, offset)

    s3.store.read_async, s3.store.write_async = counted_read, counted_write
    losses, weights = _train(engine, samples)
    if s3.store.direct:  # the folder's file system takes O_DIRECT (tmpfs does not)
        # shards are read into page-aligned buffers and the new weights written from the step's staging ring, placed
        # within a page as their file offsets: every whole page moves O_DIRECT, only partial ones buffered
        assert s3.store.stats.buffered_bytes - buffered0 == partial[0], (s3.store.stats.buffered_bytes, partial)
        assert s3.store.stats.direct_bytes - direct0 > 0
    # prefetches read shards ahead of their gathers, and every read serves exactly one gather (none wasted)
    assert s3.stats["read_ahead"] > len(launched) // 2, (s3.stats, len(launched))
    assert s3.store.bytes_read - params_read == sum(launched), (s3.store.bytes_read - params_read, sum(launched))
    assert max(samples) <= budget, (max(samples), budget)
    assert rt.masters == {} and s3.loaded == {} and all(v is None for v in s3.shards.values())

    per_step = [tuple(b - a for a, b in zip(io[i], io[i + 1], strict=True)) for i in range(STEPS)]
    for read, written, params_written in per_step:
        assert read == 4 * elements * (3 + 1 + (GAS - 1)), (read, elements)  # state + gradients + read-backs
        assert written == 4 * elements * (3 + GAS), (written, elements)  # state + a gradient pass per micro-step
        assert params_written == 4 * elements, (params_written, elements)

    torch.manual_seed(0)
    reference = microspeed.initialize(model=GPT(GPT_CONFIG), config=_config(None))[0]
    ref_losses, ref_weights = _train(reference, None)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    assert losses[-1] < losses[GAS - 1] - 0.05, losses  # it trains
    for got, want in zip(weights, ref_weights, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    swapper.close()


@pytest.mark.timeout(300)
def test_fp16_overflow_skips_the_step_as_in_memory(tmp_path):
    """fp16 with a loss scale that overflows first: the finiteness kept as gradients were written vetoes the same
    steps as the in-memory run (losses and loss scales equal), and a skipped window leaves nothing behind."""
    microspeed.init_distributed()

    def run(nvme: str | None) -> tuple[list[float], list[float]]:
        cfg = _config(nvme)
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 19, "loss_scale_window": 2, "hysteresis": 1}
        torch.manual_seed(0)
        engine = microspeed.initialize(model=GPT(GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=16,
                                                           tie_weights=False)), config=cfg)[0]
        gen = torch.Generator().manual_seed(1)
        losses, scales = [], []
        for _ in range(8 * GAS):
            x = torch.randint(0, 64, (2, 9), generator=gen)
            loss = engine(x[:, :-1], x[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            scales.append(engine.metrics.get("loss_scale"))
        if engine.plugin_state("zero").swapper is not None:
            engine.plugin_state("zero").swapper.close()
        return losses, scales

    losses, scales = run(str(tmp_path / "swap"))
    ref_losses, ref_scales = run(None)
    assert scales == ref_scales, (scales, ref_scales)
    moves = [b / a for a, b in zip(scales[1:], scales[2:], strict=False) if a != b]
    assert 0.5 in moves and 2.0 in moves, scales  # steps vetoed by an overflow, and windows applied
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)


@pytest.mark.timeout(120)
def test_init_nvme_leaves_no_file_of_a_replaced_parameter(tmp_path):
    """A tied GPT built under zero.Init(remote_device="nvme") replaces its head's own weight by the embedding's:
    the replaced parameter's file goes with it, and the engine's adoption removes the others."""
    import gc
    import os

    microspeed.init_distributed()
    cfg = _config(str(tmp_path / "swap"))
    with microspeed.zero.Init(remote_device="nvme", config_dict_or_path=cfg):
        model = GPT(GPTConfig(vocab_size=64, seq_len=8, n_layer=1, n_head=2, d_model=16, tie_weights=True))
    gc.collect()

    def files() -> list[str]:
        return [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "swap") if "zero_init" in d for f in fs]

    assert len(files()) == len(list(model.parameters()))  # one per partitioned parameter, the head's own gone
    engine = microspeed.initialize(model=model, config=cfg)[0]
    assert files() == []
    engine.plugin_state("zero").swapper.close()
