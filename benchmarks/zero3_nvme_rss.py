"""Where the memory of ZeRO-3 with parameters and optimizer on NVMe goes: peak RSS per phase, one rank.

Usage::

    python benchmarks/zero3_nvme_rss.py [--nvme-path DIR] [--layers 8] [--width 768] [--vocab 16000]
                                        [--steps 3] [--sub-group 4e6] [--buffers 2] [--max-in-cpu 0]
                                        [--gas 1] [--precision bf16] [--heads 12] [--tie] [--live 3e7]

Builds the demo GPT (default: vocab 16000, width 768, 8 layers, no tied weights: 81M parameters) under
``microspeed.zero.Init(remote_device="nvme")``, trains it with ZeRO-3, ``offload_param`` and
``offload_optimizer`` on NVMe in one process, and prints for each phase (build, ``initialize``, and every
forward, backward and optimizer step) the resident set after it and its peak (``VmHWM``, reset before each
phase through ``/proc/self/clear_refs``), the bytes the process read and wrote through system calls
(``/proc/self/io`` ``rchar``/``wchar``: the swap files' traffic), and the bytes of tensors each ZeRO structure
holds at the end of the phase (gradient partitions, parameter shards in memory, gathered parameters,
fp32 masters, the swappers' buffers, the inner optimizer's state). Once the engine exists, read and written
are the swap stores' own counters (``TensorFileStore.bytes_read`` / ``bytes_written``: kernel AIO is not in
``/proc/self/io``). Prints the model's training state
(16 bytes per parameter in bf16: weights, gradients, fp32 masters, two moments) beside them.
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

MIB = 2 ** 20


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(line.split()[1]) * 1024
    return out


def _io() -> dict[str, int]:
    with open("/proc/self/io") as fh:
        return {k: int(v) for k, v in (line.split(": ") for line in fh)}


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def _storage_bytes(tensors, seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        st = t.untyped_storage()
        if st.nbytes() == 0 or st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        total += st.nbytes()
    return total


def held(engine) -> dict[str, int]:
    """Bytes of tensors each ZeRO structure holds now (each storage counted once, in this order)."""
    rt = engine.plugin_state("zero")
    s3 = rt.stage3
    seen: set[int] = set()
    out = {}
    grads = getattr(rt, "gradients", None)
    out["gradients"] = _storage_bytes(rt.acc.values(), seen)
    if grads is not None:
        out["gradients"] += grads.resident_bytes()
    out["param_shards"] = _storage_bytes([s for s in s3.shards.values()], seen)
    out["params_loaded"] = _storage_bytes(s3.loaded.values(), seen)
    out["params_gathered"] = _storage_bytes(s3.flats.values(), seen)
    out["masters"] = _storage_bytes(rt.masters.values(), seen)
    state = [v for st in rt.optimizer.run_states() for v in st.values()]
    out["optimizer_state"] = _storage_bytes(state, seen)
    out["optimizer_slots"] = rt.swapper.resident_bytes() if rt.swapper is not None else 0
    out["reduce_pool"] = _storage_bytes([b for bufs in rt.reducer.pool.free.values() for b in bufs], seen)
    return out


def _swapped(engine) -> tuple[int, int] | None:
    """Bytes the engine's swap stores read and wrote so far (``TensorFileStore`` counters)."""
    if engine is None:
        return 0, 0
    rt = engine.plugin_state("zero")
    stores = [s for s in (getattr(rt.swapper, "store", None), getattr(rt.stage3, "store", None)) if s is not None]
    if not all(hasattr(s, "bytes_read") for s in stores):
        return None  # a store without counters (an older microspeed): /proc/self/io says it (no kernel AIO there)
    return (sum(s.bytes_read for s in stores), sum(s.bytes_written for s in stores))


def _phase(name: str, fn, engine, log: list) -> object:
    """Run ``fn`` as one phase; ``engine``: a callable returning the engine (or raising KeyError before it exists)."""
    def current():
        try:
            return engine()
        except KeyError:
            return None

    _reset_peak()
    swap0 = _swapped(current())
    io0 = _io()
    t0 = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - t0
    st, io1 = _status(), _io()
    row = {"phase": name, "rss": st["VmRSS"], "peak": st["VmHWM"], "anon": st.get("RssAnon", 0),
           "read": io1["rchar"] - io0["rchar"], "written": io1["wchar"] - io0["wchar"], "s": seconds}
    eng = current()
    if eng is not None:
        row["held"] = held(eng)
        swap1 = _swapped(eng)
        if swap0 is not None and swap1 is not None:
            row["read"], row["written"] = swap1[0] - swap0[0], swap1[1] - swap0[1]
    log.append(row)
    return result


def main(argv: list[str] | None = None) -> int:
    """Build, train, print the per-phase table and one ``BENCH_JSON`` line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvme-path", default=None, help="folder for the swap files (default: a temp dir)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--tie", action="store_true", help="share the LM head with the token embedding")
    parser.add_argument("--live", type=float, default=3e7, help="stage3_max_live_parameters")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--gas", type=int, default=1, help="micro-steps per optimizer step")
    parser.add_argument("--sub-group", type=float, default=4e6, help="sub_group_size (elements)")
    parser.add_argument("--buffers", type=int, default=2, help="offload_optimizer.buffer_count")
    parser.add_argument("--max-in-cpu", type=float, default=0, help="offload_param.max_in_cpu (elements)")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    opts = parser.parse_args(argv)

    import microspeed
    from microspeed.demo.model import GPT, GPTConfig

    path = opts.nvme_path or tempfile.mkdtemp(prefix="microspeed-nvme-")
    zero = {"stage": 3, "sub_group_size": opts.sub_group, "stage3_param_persistence_threshold": 0,
            "stage3_max_live_parameters": opts.live, "stage3_prefetch_bucket_size": opts.live / 3,
            "offload_param": {"device": "nvme", "nvme_path": path, "max_in_cpu": opts.max_in_cpu},
            "offload_optimizer": {"device": "nvme", "nvme_path": path, "buffer_count": opts.buffers}}
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": opts.gas, "steps_per_print": 10_000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "gradient_clipping": 1.0,
           "zero_optimization": zero}
    if opts.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    gcfg = GPTConfig(vocab_size=opts.vocab, d_model=opts.width, n_layer=opts.layers, n_head=opts.heads,
                     seq_len=opts.seq, tie_weights=opts.tie)
    log: list = []
    base = _status()["VmRSS"]
    torch.manual_seed(0)

    def build():
        with microspeed.zero.Init(remote_device="nvme", config_dict_or_path=cfg):
            return GPT(gcfg)

    box: dict = {}
    model = _phase("build (zero.Init nvme)", build, lambda: box["engine"], log)
    n = sum(p.ds_numel for p in model.parameters())

    def init():
        box["engine"] = microspeed.initialize(model=model, config=cfg)[0]

    _phase("initialize", init, lambda: box["engine"], log)
    engine = box["engine"]
    gen = torch.Generator().manual_seed(1)
    losses = []
    for step in range(opts.steps):
        for micro in range(opts.gas):
            x = torch.randint(0, opts.vocab, (1, opts.seq + 1), generator=gen)
            tag = f"step {step}" + (f".{micro}" if opts.gas > 1 else "")
            loss = _phase(f"{tag} forward", lambda x=x: engine(x[:, :-1], x[:, 1:]), lambda: engine, log)
            _phase(f"{tag} backward", lambda loss=loss: engine.backward(loss), lambda: engine, log)
            _phase(f"{tag} step", engine.step, lambda: engine, log)
            losses.append(float(loss.detach().float()))
    state = n * (16 if opts.precision == "bf16" else 20)
    print(f"GPT {n / 1e6:.1f}M parameters, {opts.precision}; training state {state / MIB:.0f} MiB; "
          f"RSS before the build {base / MIB:.0f} MiB; losses {[round(v, 4) for v in losses]}")
    keys = list(log[-1]["held"])
    print(f"{'phase':24s} {'rss':>6s} {'anon':>6s} {'peak':>6s} {'read':>7s} {'written':>7s} {'sec':>6s} "
          + " ".join(f"{k[:12]:>12s}" for k in keys) + "   (MiB)")
    for row in log:
        h = row.get("held", {})
        print(f"{row['phase']:24s} {row['rss'] / MIB:6.0f} {row['anon'] / MIB:6.0f} {row['peak'] / MIB:6.0f} "
              f"{row['read'] / MIB:7.0f} "
              f"{row['written'] / MIB:7.0f} {row['s']:6.2f} " + " ".join(f"{h.get(k, 0) / MIB:12.1f}" for k in keys))
    peak = max(row["peak"] for row in log)
    print(f"peak RSS {peak / MIB:.0f} MiB = {peak / state:.2f} x the training state; growth over the "
          f"torch baseline {(peak - base) / MIB:.0f} MiB")
    print("BENCH_JSON " + json.dumps({"params": n, "state": state, "base": base, "peak": peak, "losses": losses,
                                      "phases": log}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
