"""A model bigger than the machine: ZeRO-3, parameters and optimizer on NVMe, against the disk's and the CPU's bounds.

Usage (the runs in BENCHMARKS.md)::

    python benchmarks/zero_infinity.py --nvme-path /work/nvme_big --ranks 1 --precision fp32 --verbose  # 2.44B
    python benchmarks/zero_infinity.py --nvme-path /work/nvme_big --ranks 2 --precision fp32 --steps 2
    python benchmarks/zero_infinity.py --nvme-path /work/nvme_big --ranks 1 --precision fp32 --steps 2 \
        --engine deepspeed                              # DeepSpeed 0.19.8 on the same model (libaio-dev needed)
    python benchmarks/zero_infinity.py --nvme-path /work/nvme_big --parity --layers 6 --width 2560 --seq 16 \
        --warmup 0 --steps 3 --precision bf16 --probe-size '' --compute-reps 0
        # 0.55B in bf16, trained again from the same seed and batches with ZeRO-3 in memory; the losses compared
    python benchmarks/zero_infinity.py --nvme-path /tmp/nvme --layers 2 --width 256 --heads 4 --vocab 1000 \
        --steps 2                                                                       # smoke
    LIMIT=$((4 << 30)) benchmarks/cgroup_run.sh python benchmarks/zero_infinity.py --nvme-path /work/nvme_small \
        --layers 24 --width 1024 --heads 16 --vocab 32000 --sub-group 5e7 --live 5e7 --steps 2 \
        --checkpoint /work/ckpt_small   # 0.37B in a 4 GiB cgroup: then a checkpoint saved, loaded, resumed

The model is the demo GPT (:class:`microspeed.demo.model.GPT`; default vocab 16000, width 2560, 30 layers, 20
heads, sequence 32, untied head: 2.44B parameters, 39 GB = 36.4 GiB of Adam state at 16 bytes per parameter in
bf16 mixed precision and in fp32 alike), built under ``microspeed.zero.Init(remote_device="nvme")`` straight into
partitioned swap files (never whole in memory) and trained with ZeRO stage 3, ``offload_param`` and
``offload_optimizer`` on NVMe, ``--precision`` (bf16 by default: weights, gradients and the parameter swap in
bf16, fp32 masters; on a CPU without ``avx512_bf16`` the linear layers' GEMMs run on fp32 copies of their bf16
inputs, ``--bf16-gemm``, because torch's bf16 kernels are slower there: ~35x for the backward's layout), AdamW,
clipping 1.0, on ``--ranks`` local processes (gloo; each rank 2 / ranks torch threads).

In the same run, before the model exists, it measures the two bounds a step cannot beat:

* **the disk**: :func:`microspeed_zero.diskprobe.probe_disk` on ``--nvme-path`` (``--probe-size``, O_DIRECT,
  16 MiB requests), rank 0 alone; the **I/O bound** of a step is the bytes every rank's swap store read per step
  over the read bandwidth plus the bytes written over the write bandwidth (one disk: ranks share it);
* **the CPU**: every rank at once (so they share the cores as in training) times the forward and backward of one
  transformer block and of the LM head in memory, in the run's precision, on the step's micro-batch, and torch's
  AdamW on a fp32 chunk; the **compute bound** is ``accumulation x (layers x block + head)`` plus AdamW's time per
  element times the rank's share of the parameters.

Then it trains ``--warmup`` + ``--steps`` optimizer steps and prints: parameters, bytes of training state, RAM,
peak RSS per rank (``VmHWM`` from after the bounds were measured to the end), bytes read and written per step
(the swap stores' counters, summed over ranks), seconds per step (median of the timed steps, slowest rank), the
two bounds and ``step / max(I/O bound, compute bound)`` (the issue's goal: within 1.3). One ``BENCH_JSON`` line
carries every figure, with the allocator variables of the run: ``THP_MEM_ALLOC_ENABLE`` is 1 unless the environment
says otherwise (``THP_MEM_ALLOC_ENABLE=0``: 4 KiB pages), as the runtime advises under NVMe offload.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before anything imports deepspeed
# Before torch's first allocation: its large CPU tensors on transparent huge pages, as the runtime's hint advises
# under NVMe offload (microspeed_zero.host_memory); THP_MEM_ALLOC_ENABLE=0 in the environment turns it off.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GIB = 2 ** 30
MIB = 2 ** 20
_ALLOCATOR_ENV = ("THP_MEM_ALLOC_ENABLE", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")
"""Variables that change how host memory is allocated (page faults, RSS): printed with the figures."""


def _status(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def _ram() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise KeyError("MemTotal")


def _native_bf16_gemm() -> bool:
    """Whether this CPU has bf16 dot-product instructions (``avx512_bf16`` or ``amx_bf16``)."""
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next((line for line in fh if line.startswith("flags")), "").split()
    except OSError:
        return True
    return "avx512_bf16" in flags or "amx_bf16" in flags


class _Fp32GemmLinear(torch.autograd.Function):
    """``F.linear`` whose GEMMs, forward and backward, take bf16 inputs to fp32, multiply, and round the result to
    bf16.

    A bf16 GEMM accumulates in fp32 and rounds its output the same way; this only chooses which kernel does it.
    torch 2.13 on an AVX2 CPU (no ``avx512_bf16``) sends a bf16 ``grad_output @ weight`` to a fallback that took
    6.4 s for (32 x 10240) @ (10240 x 2560) where the fp32 product took 0.18 s (BENCHMARKS.md), so a bf16 block's
    backward ran 13x slower than fp32's. Its bf16 ``F.linear`` is slower than the fp32 one with both casts too, for
    a 32-row input: 27 against 11 ms at 1024 x 4096, 161 against 119 ms at 2560 x 10240 (one thread).
    """

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).float()
        grad_x = (g @ weight.float()).to(x.dtype).view(*grad.shape[:-1], weight.shape[1])
        grad_w = (g.t() @ x.reshape(-1, x.shape[-1]).float()).to(weight.dtype)
        grad_b = g.sum(0).to(weight.dtype) if ctx.has_bias else None
        return grad_x, grad_w, grad_b


def fp32_gemm_linears(model: torch.nn.Module) -> torch.nn.Module:
    """Route every ``nn.Linear`` of ``model`` through :class:`_Fp32GemmLinear` (its parameters and hooks unchanged)."""
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.forward = (lambda m: lambda inp: _Fp32GemmLinear.apply(inp, m.weight, m.bias))(mod)
    return model


def _gemm_patch(opts, model: torch.nn.Module) -> torch.nn.Module:
    return fp32_gemm_linears(model) if opts.precision == "bf16" and opts.bf16_gemm == "fp32" else model


def _gpt_config(opts):
    from microspeed.demo.model import GPTConfig

    return GPTConfig(vocab_size=opts.vocab, d_model=opts.width, n_layer=opts.layers, n_head=opts.heads,
                     seq_len=opts.seq, tie_weights=False)


def ds_config(opts, path: str | None, world: int = 1) -> dict:
    """The run's config: ZeRO-3, parameters and optimizer on NVMe under ``path`` (``None``: in memory).

    The same dict for both engines; DeepSpeed's gets ``train_batch_size`` too (it wants the triad whole).
    """
    zero = {"stage": 3, "sub_group_size": int(opts.sub_group), "stage3_param_persistence_threshold": 0,
            "stage3_max_live_parameters": int(opts.live), "stage3_prefetch_bucket_size": int(opts.live // 3)}
    if path is not None:
        zero["offload_param"] = {"device": "nvme", "nvme_path": path, "max_in_cpu": 0}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": path, "buffer_count": opts.buffers}
    cfg = {"train_micro_batch_size_per_gpu": opts.micro, "gradient_accumulation_steps": opts.gas,
            "steps_per_print": 10 ** 9, "bf16": {"enabled": opts.precision == "bf16"}, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": opts.lr, "weight_decay": 0.0}},
            "zero_optimization": zero}
    if opts.engine == "deepspeed":
        cfg["train_batch_size"] = opts.micro * opts.gas * world
        if path is not None:  # its buffer_count counts tensors, not sub-groups: it needs 4 (its default) or more
            zero["offload_optimizer"]["buffer_count"] = max(4, opts.buffers)
            # Its parameter swapper holds one parameter per buffer: its default 5 buffers of 1e8 elements ran out
            # at the second forward of the 2.44B GPT ("Not enough buffers 0 for swapping 1"); one buffer per live
            # parameter, each of the largest parameter's size, as its docs advise.
            zero["offload_param"].update(buffer_count=opts.ds_param_buffers, buffer_size=opts.largest_param)
            # With its default reuse distance (1e9) the second forward keeps every traced parameter in a buffer and
            # runs out of them whatever their count (16 failed as 5 did): release each one after use.
            zero["stage3_max_reuse_distance"] = 0
    return cfg


def _time(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def compute_bound(opts, world: int) -> dict:
    """Seconds of this rank's compute per optimizer step, measured in memory (see the module docstring)."""
    import torch.nn.functional as F

    from microspeed.demo.model import GPT

    cfg = _gpt_config(opts)
    small = GPT(type(cfg)(**{**cfg.__dict__, "n_layer": 1}))  # one block, the embeddings and the head
    dtype = torch.bfloat16 if opts.precision == "bf16" else torch.float32
    small = _gemm_patch(opts, small.to(dtype))
    block = small.blocks[0] if hasattr(small, "blocks") else next(m for m in small.modules()
                                                                   if type(m).__name__ == "Block")
    x = torch.randn(opts.micro, opts.seq, opts.width, dtype=dtype, requires_grad=True)

    def block_pass():
        block(x).float().square().mean().backward()

    head = _gemm_patch(opts, torch.nn.Linear(opts.width, opts.vocab, bias=False).to(dtype))
    h = torch.randn(opts.micro, opts.seq, opts.width, dtype=dtype, requires_grad=True)
    y = torch.randint(0, opts.vocab, (opts.micro * opts.seq,))

    def head_pass():
        F.cross_entropy(head(h).float().view(-1, opts.vocab), y).backward()

    t_block = _time(block_pass, opts.compute_reps)
    t_head = _time(head_pass, opts.compute_reps)
    n = 1 << 24
    p = torch.nn.Parameter(torch.zeros(n))
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.0)
    t_adam = _time(opt.step, 2) / n
    n_params = opts.n_params
    forward_backward = opts.gas * (opts.layers * t_block + t_head)
    adam = t_adam * -(-n_params // world)
    return {"block_s": t_block, "head_s": t_head, "adam_s_per_elem": t_adam, "forward_backward_s": forward_backward,
            "adam_s": adam, "compute_s": forward_backward + adam}


def _stores(engine) -> list:
    rt = engine.plugin_state("zero")
    return [s for s in (getattr(rt.swapper, "store", None), getattr(rt.stage3, "store", None)) if s is not None]


def _moved(engine) -> tuple[int, int]:
    if engine is None:
        return 0, 0
    stores = list({id(s): s for s in _stores(engine)}.values())
    return sum(s.bytes_read for s in stores), sum(s.bytes_written for s in stores)


def _disk_sectors(path: str) -> tuple[int, int]:
    """Bytes read and written so far by the block device holding ``path`` (``/proc/diskstats``; whole machine)."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    with open("/proc/diskstats") as fh:
        for line in fh:
            f = line.split()
            if int(f[0]) == major and int(f[1]) == minor:
                return int(f[5]) * 512, int(f[9]) * 512
    return 0, 0


def _phase(into: list, engine, fn, *args):
    """Call ``fn(*args)``, adding to ``into`` its seconds, the bytes ``engine``'s swap stores read and wrote, this
    process's user and system CPU seconds and its minor page faults; return what ``fn`` returned."""
    m0, r0, t0 = _moved(engine), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    out = fn(*args)
    m1, r1 = _moved(engine), resource.getrusage(resource.RUSAGE_SELF)
    for i, v in enumerate((time.perf_counter() - t0, m1[0] - m0[0], m1[1] - m0[1], r1.ru_utime - r0.ru_utime,
                           r1.ru_stime - r0.ru_stime, r1.ru_minflt - r0.ru_minflt)):
        into[i] += v
    return out


def rank_main(opts, path: str | None) -> dict:
    """One rank: the bounds, then the build and the training steps; returns this rank's figures."""
    import torch.distributed as dist
    from common import make_batches

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.set_num_threads(max(1, opts.threads // world))
    out: dict = {"rank": rank, "threads": torch.get_num_threads()}
    if path is not None and rank == 0 and opts.probe_size:
        from microspeed_zero.diskprobe import probe_disk
        from microspeed_zero.estimator import parse_size

        disk = probe_disk(path, parse_size(opts.probe_size))
        out["disk"] = {"read_bps": disk.read_bps, "write_bps": disk.write_bps, "direct": disk.direct,
                       "size": disk.size}
    if dist.is_initialized():
        dist.barrier()
    if opts.compute_reps:
        out["compute"] = compute_bound(opts, world)
    if dist.is_initialized():
        dist.barrier()
    import gc

    gc.collect()
    out["baseline_rss"] = _status("VmRSS")
    _reset_peak()
    model, engine = _build(opts, path, world, out)
    out["params"] = sum(p.ds_numel for p in model.parameters())
    extra = 2 if opts.checkpoint else 0  # the steps after the save, run twice: continued and resumed
    batches = make_batches((opts.warmup + opts.steps + extra) * opts.gas * world, opts.micro, opts.seq)
    steps = []
    for step in range(opts.warmup + opts.steps):
        if dist.is_initialized():
            dist.barrier()
        counted = engine if opts.engine == "microspeed" and path is not None else None  # its swap stores' bytes
        moved0 = _moved(counted)
        disk0 = _disk_sectors(path) if path is not None else (0, 0)
        t0 = time.perf_counter()
        losses = []
        # per phase: seconds, bytes read, bytes written, process user and system CPU seconds, minor page faults
        phases = {name: [0.0, 0, 0, 0.0, 0.0, 0] for name in ("forward", "backward", "step")}
        for micro in range(opts.gas):
            x, y = batches[(step * opts.gas + micro) * world + rank]
            x, y = x % opts.vocab, y % opts.vocab
            loss = _phase(phases["forward"], counted, engine, x, y)
            _phase(phases["backward"], counted, engine.backward, loss)
            _phase(phases["step"], counted, engine.step)
            losses.append(float(loss.detach().float()))
        seconds = time.perf_counter() - t0
        moved1 = _moved(counted)
        disk1 = _disk_sectors(path) if path is not None else (0, 0)
        if opts.engine == "deepspeed":  # no counters of its own: the device's, whole machine (rank 0's view)
            moved0, moved1 = disk0, disk1
        steps.append({"s": seconds, "read": moved1[0] - moved0[0], "written": moved1[1] - moved0[1],
                      "disk_read": disk1[0] - disk0[0], "disk_written": disk1[1] - disk0[1],
                      "loss": statistics.fmean(losses), "peak": _status("VmHWM"), "phases": phases})
        if rank == 0 and opts.verbose:
            print(f"step {step}: {seconds:.1f} s, loss {steps[-1]['loss']:.4f}, "
                  f"read {steps[-1]['read'] / GIB:.2f} GiB, "
                  f"written {steps[-1]['written'] / GIB:.2f} GiB, peak RSS {steps[-1]['peak'] / MIB:.0f} MiB; "
                  + ", ".join(f"{k} {v[0]:.1f} s (read {v[1] / GIB:.2f}, written {v[2] / GIB:.2f} GiB; CPU user "
                              f"{v[3]:.1f} s, system {v[4]:.1f} s; {v[5] / 1000:.0f}k page faults)"
                              for k, v in phases.items()), flush=True)
    out["steps"] = steps
    out["peak_rss"] = _status("VmHWM")
    if opts.checkpoint:
        ck = out["checkpoint"] = {}
        _measured(ck, "save", engine, engine.save_checkpoint, opts.checkpoint, "bench")
        ck["bytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(opts.checkpoint) for f in fs)
        ck["continued"] = _after_save(opts, engine, batches, rank, world)
        engine.destroy()  # DeepSpeed's: hooks removed, swap files closed (removed); then the engine can go
        del engine, model
        gc.collect()
        ck["rss_released"] = _status("VmRSS")
        model, engine = _build(opts, path, world, {})
        _measured(ck, "load", engine, engine.load_checkpoint, opts.checkpoint, "bench")
        ck["resumed"] = _after_save(opts, engine, batches, rank, world)
    return out


def _build(opts, path: str | None, world: int, out: dict):
    """Build the model under ``zero.Init`` and its engine; record the seconds each took in ``out``."""
    import microspeed
    from microspeed.demo.model import GPT

    cfg = ds_config(opts, path, world)
    torch.manual_seed(opts.seed)
    lib = microspeed
    if opts.engine == "deepspeed":
        import deepspeed as lib
    t0 = time.perf_counter()
    with lib.zero.Init(remote_device="nvme" if path is not None else None, config_dict_or_path=cfg):
        model = _gemm_patch(opts, GPT(_gpt_config(opts)))
    out["build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if opts.engine == "deepspeed":
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints its whole config
            engine = lib.initialize(model=model, config=cfg, model_parameters=model.parameters())[0]
    else:
        engine = lib.initialize(model=model, config=cfg)[0]
    out["initialize_s"] = time.perf_counter() - t0
    return model, engine


def _measured(into: dict, name: str, engine, fn, *args) -> None:
    """Call ``fn(*args)`` between barriers; record in ``into`` its seconds (slowest rank's view), this process's
    peak RSS while it ran and the bytes ``engine``'s swap stores read and wrote meanwhile."""
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():
        dist.barrier()
    _reset_peak()
    counted = engine if getattr(engine, "plugin_state", None) is not None else None
    m0, t0 = _moved(counted), time.perf_counter()
    fn(*args)
    if dist.is_initialized():
        dist.barrier()
    m1 = _moved(counted)
    into[name] = {"s": time.perf_counter() - t0, "peak": _status("VmHWM"), "read": m1[0] - m0[0],
                  "written": m1[1] - m0[1]}


def _after_save(opts, engine, batches, rank: int, world: int) -> list[float]:
    """The losses of the optimizer step after the timed ones and of the forward after it: the same on an engine that
    saved and went on and on a fresh engine that loaded the save, when the checkpoint holds the whole state."""
    first = opts.warmup + opts.steps
    losses = []
    for step in (first, first + 1):
        for micro in range(opts.gas):
            x, y = batches[(step * opts.gas + micro) * world + rank]
            loss = engine(x % opts.vocab, y % opts.vocab)
            losses.append(float(loss.detach().float()))
            if step == first:
                engine.backward(loss)
                engine.step()
    return losses


def _run(opts, path: str | None) -> list[dict]:
    if opts.ranks == 1 and opts.engine == "microspeed":
        return [rank_main(opts, path)]
    from microspeed.testing import run_distributed

    return run_distributed(rank_main, world_size=opts.ranks, args=(opts, path), timeout=opts.timeout,
                           env={"OMP_NUM_THREADS": str(max(1, opts.threads // opts.ranks))})


def report(opts, ranks: list[dict], label: str) -> dict:
    """Print the figures of one run; return them as one dict."""
    disk = next(r["disk"] for r in ranks if "disk" in r) if any("disk" in r for r in ranks) else None
    n = ranks[0]["params"]
    timed = range(opts.warmup, opts.warmup + opts.steps)
    step_s = [max(r["steps"][i]["s"] for r in ranks) for i in timed]
    both = opts.engine == "deepspeed"  # the device's counters are the machine's: rank 0's figure is the total
    read = [sum(r["steps"][i]["read"] for r in (ranks[:1] if both else ranks)) for i in timed]
    written = [sum(r["steps"][i]["written"] for r in (ranks[:1] if both else ranks)) for i in timed]
    disk_read = statistics.median(ranks[0]["steps"][i]["disk_read"] for i in timed)
    disk_written = statistics.median(ranks[0]["steps"][i]["disk_written"] for i in timed)
    med = statistics.median(step_s)
    fig = {"label": label, "ranks": opts.ranks, "params": n, "state_bytes": 16 * n, "ram": _ram(),
           "peak_rss": [r["peak_rss"] for r in ranks], "baseline_rss": [r["baseline_rss"] for r in ranks],
           "step_s": step_s, "median_step_s": med, "read_per_step": statistics.median(read),
           "written_per_step": statistics.median(written),
           "device_read_per_step": disk_read, "device_written_per_step": disk_written,
           "losses": [s["loss"] for s in ranks[0]["steps"]],
           "build_s": max(r["build_s"] for r in ranks), "initialize_s": max(r["initialize_s"] for r in ranks),
           "precision": opts.precision, "bf16_gemm": opts.bf16_gemm if opts.precision == "bf16" else None,
           "allocator_env": {k: os.environ[k] for k in _ALLOCATOR_ENV if k in os.environ}}
    print(f"[{label}] GPT {n / 1e9:.3f}B parameters on {opts.ranks} rank(s); training state {16 * n / GIB:.1f} GiB "
          f"(16 B/param); RAM {fig['ram'] / GIB:.1f} GiB; state / RAM = {16 * n / fig['ram']:.2f}; {opts.precision}"
          + (f" (GEMMs: {opts.bf16_gemm})" if opts.precision == "bf16" else ""))
    print("  allocator environment: " + (", ".join(f"{k}={v}" for k, v in fig["allocator_env"].items()) or "none set"))
    print(f"  build {fig['build_s']:.0f} s, initialize {fig['initialize_s']:.0f} s; peak RSS per rank "
          + ", ".join(f"{p / MIB:.0f} MiB" for p in fig["peak_rss"])
          + " (baseline before the build " + ", ".join(f"{b / MIB:.0f}" for b in fig["baseline_rss"]) + " MiB)")
    print(f"  steps (s): {[round(s, 1) for s in step_s]}, median {med:.1f} s; losses "
          f"{[round(v, 4) for v in fig['losses']]}")
    if disk is not None:
        io = fig["read_per_step"] / disk["read_bps"] + fig["written_per_step"] / disk["write_bps"]
        comp = max(r["compute"]["compute_s"] for r in ranks) if all("compute" in r for r in ranks) else 0.0
        fig.update(disk=disk, io_bound_s=io, compute_bound_s=comp, ratio=med / max(io, comp),
                   serial_ratio=med / (io + comp))
        c = ranks[0].get("compute", {})
        print(f"  disk ({'O_DIRECT' if disk['direct'] else 'buffered'}): write {disk['write_bps'] / 1e9:.2f} GB/s, "
              f"read {disk['read_bps'] / 1e9:.2f} GB/s; moved per step: read {fig['read_per_step'] / GIB:.1f} GiB, "
              f"written {fig['written_per_step'] / GIB:.1f} GiB (the block device: read "
              f"{disk_read / GIB:.1f} GiB, written {disk_written / GIB:.1f} GiB)")
        if c:
            print(f"  compute (rank 0, {ranks[0]['threads']} thread(s)): block fwd+bwd {c['block_s']:.3f} s, head "
                  f"{c['head_s']:.3f} s, AdamW {c['adam_s_per_elem'] * 1e9:.2f} ns/param -> forward+backward "
                  f"{c['forward_backward_s']:.1f} s + optimizer {c['adam_s']:.1f} s")
        print(f"  I/O bound {io:.1f} s, compute bound {comp:.1f} s; step / max(bounds) = {fig['ratio']:.2f} "
              f"(goal <= 1.3); step / (I/O + compute) = {fig['serial_ratio']:.2f}")
    if "checkpoint" in ranks[0]:
        cks = [r["checkpoint"] for r in ranks]
        fig["checkpoint"] = cks
        for what in ("save", "load"):
            read, written = (sum(c[what][k] for c in cks) / GIB for k in ("read", "written"))
            print(f"  checkpoint {what}: {max(c[what]['s'] for c in cks):.1f} s; peak RSS per rank while it ran "
                  + ", ".join(f"{c[what]['peak'] / MIB:.0f}" for c in cks)
                  + f" MiB; swap files read {read:.2f} GiB, written {written:.2f} GiB"
                  + (f"; {cks[0]['bytes'] / GIB:.2f} GiB on disk ({opts.checkpoint})" if what == "save" else
                     "; RSS per rank before it, the first engine released: "
                     + ", ".join(f"{c['rss_released'] / MIB:.0f}" for c in cks) + " MiB"))
        cont, res = cks[0]["continued"], cks[0]["resumed"]
        fig["resume_equal"] = cont == res
        diffs = [f"{abs(a - b) / abs(a):.1e}" for a, b in zip(cont, res, strict=True)]
        print(f"  after the save, rank 0 (a step's losses, then the next forward's): went on "
              f"{[round(v, 6) for v in cont]}, loaded into a fresh engine {[round(v, 6) for v in res]}: "
              + ("equal" if cont == res else f"relative differences {diffs}"))
    return fig


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run, print the figures and one ``BENCH_JSON`` line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvme-path", required=True, help="folder for the swap files (its disk is probed)")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--engine", choices=("microspeed", "deepspeed"), default="microspeed",
                        help="deepspeed: DeepSpeed 0.19.8 on the same model and config (DS_ACCELERATOR=cpu; its "
                             "async_io op needs libaio-dev)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in all (split over the ranks)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--width", type=int, default=2560)
    parser.add_argument("--heads", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--micro", type=int, default=1, help="micro-batch per rank")
    parser.add_argument("--gas", type=int, default=1, help="micro-steps per optimizer step")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                        help="bf16: 16-bit weights and gradients with fp32 masters; fp32: fp32 throughout (the "
                             "weights are the masters); both 16 bytes of state per parameter with Adam")
    parser.add_argument("--bf16-gemm", choices=("auto", "native", "fp32"), default="auto",
                        help="bf16 runs: native = torch's bf16 GEMMs; fp32 = the linear layers' GEMMs "
                             "take their bf16 inputs to fp32 and round the product to bf16 (torch's bf16 "
                             "grad_output @ weight is ~35x slower than fp32 on a CPU without avx512_bf16, its "
                             "forward 1.4-2.5x); auto = "
                             "fp32 on such a CPU, else native")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sub-group", type=float, default=1e8, help="sub_group_size (elements)")
    parser.add_argument("--buffers", type=int, default=2, help="offload_optimizer.buffer_count")
    parser.add_argument("--live", type=float, default=1e8, help="stage3_max_live_parameters")
    parser.add_argument("--ds-param-buffers", type=int, default=16,
                        help="DeepSpeed's offload_param.buffer_count (buffers of the largest parameter's size)")
    parser.add_argument("--probe-size", default="2G", help="bytes for the disk probe ('' to skip)")
    parser.add_argument("--compute-reps", type=int, default=3, help="timed repetitions per compute probe (0: skip)")
    parser.add_argument("--parity", action="store_true",
                        help="train the same model again with ZeRO-3 in memory and compare the losses")
    parser.add_argument("--checkpoint", default="",
                        help="folder: after the timed steps save a checkpoint there, go on for a step and a forward, "
                             "then load it into a fresh engine (built again under zero.Init) and run the same; "
                             "prints the save's and the load's seconds, peak RSS and bytes, and both runs' losses")
    parser.add_argument("--timeout", type=float, default=7200)
    parser.add_argument("--verbose", action="store_true", help="print every step on rank 0")
    opts = parser.parse_args(argv)
    if opts.ranks < 1:
        parser.error("--ranks must be at least 1")
    if opts.width % opts.heads:
        parser.error(f"--width {opts.width} must be a multiple of --heads {opts.heads}")
    if opts.bf16_gemm == "auto":
        opts.bf16_gemm = "native" if _native_bf16_gemm() else "fp32"
    from microspeed.demo.model import GPT

    with torch.device("meta"):
        sizes = [p.numel() for p in GPT(_gpt_config(opts)).parameters()]
    opts.n_params, opts.largest_param = sum(sizes), max(sizes)
    os.makedirs(opts.nvme_path, exist_ok=True)
    if opts.ranks > 1:
        os.environ.setdefault("MICROSPEED_TEST_START_METHOD", "spawn")  # a fresh interpreter: its own peak RSS
    nvme = report(opts, _run(opts, opts.nvme_path), f"{opts.engine} nvme")
    out = {"nvme": nvme}
    if opts.parity:
        mem_opts = argparse.Namespace(**{**vars(opts), "probe_size": "", "compute_reps": 0})
        mem = report(mem_opts, _run(mem_opts, None), f"{opts.engine} in memory")
        diffs = [abs(a - b) / abs(b) for a, b in zip(nvme["losses"], mem["losses"], strict=True)]
        out["memory"], out["loss_rel_diff"] = mem, diffs
        print(f"losses NVMe vs in memory: relative differences {[f'{x:.2e}' for x in diffs]} (bf16: 2^-8 = 3.9e-3)")
    print("BENCH_JSON " + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
