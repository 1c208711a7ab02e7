"""ZeRO-Infinity-style NVMe offload at a larger scale: optimizer state several times the RAM budget.

Usage::

    python benchmarks/zero_nvme.py [--nvme-path DIR] [--steps 4] [--sub-group 2.5e6] [--buffers 2]

Trains the demo GPT (vocab 32000, width 512, 4 layers: 45.4M parameters) in bf16 at ZeRO stage 2 on
2 ranks (gloo), once with the optimizer state in memory and once with ``offload_optimizer.device:
nvme``, same seed and batches, and prints per rank: the fp32 optimizer state (masters + 2 moments,
12 bytes per parameter over the rank's half), the in-memory budget (``buffer_count`` slots of the
largest sub-group), what the engine accounts resident and on disk, peak RSS (VmHWM) and its growth
over the model build, the step time, and the largest relative loss difference between the two runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _hwm_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _rss_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _run(offload: bool, nvme_path: str, steps: int, sub_group: float, buffers: int) -> dict:
    import torch.distributed as dist

    import microspeed
    from microspeed.demo.model import GPT, GPTConfig
    from microspeed.zero import memory_breakdown

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32000, d_model=512, n_layer=4, n_head=8, seq_len=64, tie_weights=False))
    built = _rss_mib()
    zero = {"stage": 2, "reduce_bucket_size": 5e6, "sub_group_size": sub_group}
    if offload:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": buffers}
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "steps_per_print": 10_000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "gradient_clipping": 1.0,
           "zero_optimization": zero}
    engine, *_ = microspeed.initialize(model=model, config=cfg)
    gen = torch.Generator().manual_seed(1)
    losses, times = [], []
    for _ in range(steps):
        x = torch.randint(0, 32000, (2 * world, 65), generator=gen)[2 * rank:2 * rank + 2]
        dist.barrier()
        t0 = time.perf_counter()
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        t = loss.detach().float().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    rt = engine.plugin_state("zero")
    numel = sum(s.real_len(rank) for s in rt.optimized)
    out = {"losses": losses, "step_s": sorted(times)[len(times) // 2], "peak_mib": _hwm_mib(),
           "growth_mib": _hwm_mib() - built, "state_mib": numel * 12 / 2**20, "breakdown": memory_breakdown(engine)}
    if rt.swapper is not None:
        out["budget_mib"] = rt.swapper.budget_bytes() / 2**20
        out["disk_mib"] = rt.swapper.bytes_on_disk() / 2**20
        rt.swapper.close()
    return out


def main(argv: list[str] | None = None) -> int:
    """Run both configurations and print the comparison."""
    from microspeed.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvme-path", default=None, help="folder for the swap files (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--sub-group", type=float, default=2.5e6, help="sub_group_size (elements)")
    parser.add_argument("--buffers", type=int, default=2, help="offload_optimizer.buffer_count")
    opts = parser.parse_args(argv)
    path = opts.nvme_path or tempfile.mkdtemp(prefix="microspeed-nvme-")
    results = {}
    for name, offload in (("in_memory", False), ("nvme", True)):
        results[name] = run_distributed(_run, world_size=2, args=(offload, path, opts.steps, opts.sub_group,
                                                                  opts.buffers), timeout=1200)
    mem, nvme = results["in_memory"], results["nvme"]
    rel = max(abs(a - b) / abs(b) for a, b in zip(nvme[0]["losses"], mem[0]["losses"], strict=True))
    print(f"{'run':10s} {'rank':>4s} {'state MiB':>9s} {'budget':>7s} {'resident':>8s} {'on disk':>8s} "
          f"{'peak MiB':>8s} {'growth':>7s} {'step s':>7s}")
    for name, per_rank in results.items():
        for r, o in enumerate(per_rank):
            bd = o["breakdown"]
            print(f"{name:10s} {r:4d} {o['state_mib']:9.1f} {o.get('budget_mib', float('nan')):7.1f} "
                  f"{bd['optimizer_states'] / 2**20:8.1f} {o.get('disk_mib', 0.0):8.1f} {o['peak_mib']:8.0f} "
                  f"{o['growth_mib']:7.0f} {o['step_s']:7.2f}")
    print(f"state / budget: {nvme[0]['state_mib'] / nvme[0]['budget_mib']:.1f}x; max relative loss difference "
          f"nvme vs in memory: {rel:.1e}")
    print("BENCH_JSON " + json.dumps({"in_memory": mem, "nvme": nvme, "max_rel_loss_diff": rel}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
