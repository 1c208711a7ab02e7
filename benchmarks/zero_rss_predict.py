"""Predicted against measured peak RSS per rank (``microspeed_zero.predict_peak_rss``), for ZeRO 1/2/3 and ZeRO-3 NVMe.

Usage::

    python benchmarks/zero_rss_predict.py --stage 2 --world 2 [--precision fp32|bf16] [--nvme DIR]
        [--vocab 32000] [--width 512] [--layers 4] [--heads 8] [--seq 64] [--micro 2] [--steps 3]
        [--sub-group 1e9] [--buffers 4] [--live 1e9] [--prefetch 5e7] [--reduce-bucket 5e8] [--tie]

Each rank (fresh processes, :func:`microspeed.testing.run_distributed`, one thread each) reads ``VmRSS``
after importing torch and microspeed (the baseline: this process's, measured before anything is built),
builds the demo GPT (under ``microspeed.zero.Init(remote_device="nvme")`` with ``--nvme``: ZeRO-3,
``offload_param`` and ``offload_optimizer`` on NVMe), ``initialize()``s it with AdamW
(``zero_optimization.host_memory_budget`` = ``--budget``, 20GiB: the runtime then returns freed memory to the
system, as the prediction assumes) and trains ``--steps`` steps, then reports ``VmHWM`` (the process's peak
resident set). The prediction is :func:`microspeed_zero.predict_for_config` on the same model and config with that
measured baseline.
Prints one row per rank (predicted, measured, error) and a ``BENCH_JSON`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero3_nvme_rss import _status  # noqa: E402  (VmRSS, VmHWM, RssAnon, RssFile of this process)

MIB = 2 ** 20


def ds_config(opts: argparse.Namespace, nvme_dir: str | None) -> dict:
    """The ds_config the run uses (and the prediction reads)."""
    zero: dict = {"stage": opts.stage, "reduce_bucket_size": opts.reduce_bucket, "sub_group_size": opts.sub_group,
                  "stage3_max_live_parameters": opts.live, "stage3_prefetch_bucket_size": opts.prefetch,
                  "host_memory_budget": opts.budget}
    if nvme_dir is not None:
        zero.update(stage=3, stage3_param_persistence_threshold=0,
                    offload_param={"device": "nvme", "nvme_path": nvme_dir, "max_in_cpu": 0},
                    offload_optimizer={"device": "nvme", "nvme_path": nvme_dir, "buffer_count": opts.buffers})
    cfg = {"train_micro_batch_size_per_gpu": opts.micro, "gradient_accumulation_steps": 1, "steps_per_print": 10_000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "gradient_clipping": 1.0,
           "zero_optimization": zero}
    if opts.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def rank_main(opts: argparse.Namespace, nvme_dir: str | None) -> dict:
    """One rank: baseline, build, initialize, train; the measured and predicted figures."""
    import torch
    from microspeed_zero import predict_for_config

    import microspeed
    from microspeed.demo.model import GPT, GPTConfig

    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # imports what the first optimizer imports
    base = _status()["VmRSS"]
    cfg = ds_config(opts, nvme_dir)
    gcfg = GPTConfig(vocab_size=opts.vocab, d_model=opts.width, n_layer=opts.layers, n_head=opts.heads,
                     seq_len=opts.seq, tie_weights=opts.tie)
    torch.manual_seed(0)
    if nvme_dir is not None:
        with microspeed.zero.Init(remote_device="nvme", config_dict_or_path=cfg):
            model = GPT(gcfg)
    else:
        model = GPT(gcfg)
    pred = predict_for_config(model, cfg, world_size=torch.distributed.get_world_size(), baseline=base,
                              seq_len=opts.seq)
    engine = microspeed.initialize(model=model, config=cfg)[0]
    gen = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    hwm, phases = [], []

    def phase(fn):
        if opts.phases:
            with open("/proc/self/clear_refs", "w") as fh:  # VmHWM restarts from VmRSS
                fh.write("5")
        out = fn()
        phases.append(_status()["VmHWM"] if opts.phases else 0)
        return out

    for _ in range(opts.steps):
        x = torch.randint(0, opts.vocab, (opts.micro, opts.seq + 1), generator=gen)
        loss = phase(lambda x=x: engine(x[:, :-1], x[:, 1:]))
        phase(lambda loss=loss: engine.backward(loss))
        phase(engine.step)
        hwm.append(_status()["VmHWM"])
    st = _status()
    return {"base": base, "peak": max([st["VmHWM"], *phases]), "hwm_steps": hwm, "phases": phases,
            "file": st["RssFile"],
            "predicted": pred.total, "parts": pred.parts(), "params": pred.num_params}


def main(argv: list[str] | None = None) -> int:
    """Run the ranks, print predicted vs measured per rank and one ``BENCH_JSON`` line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--nvme", default=None, metavar="DIR", help="ZeRO-3 with params and optimizer on NVMe under DIR "
                   "('tmp': a temporary folder)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tie", action="store_true")
    p.add_argument("--sub-group", type=float, default=1e9)
    p.add_argument("--buffers", type=int, default=4)
    p.add_argument("--live", type=float, default=1e9)
    p.add_argument("--prefetch", type=float, default=5e7)
    p.add_argument("--reduce-bucket", type=float, default=5e8)
    p.add_argument("--phases", action="store_true", help="reset VmHWM before each forward, backward and step "
                   "(/proc/self/clear_refs) and print each one's peak; the build's peak is then not measured")
    p.add_argument("--budget", default="20GiB", help="zero_optimization.host_memory_budget (set, the runtime returns "
                   "freed memory to the system, as the prediction assumes)")
    p.add_argument("--timeout", type=float, default=600.0)
    opts = p.parse_args(argv)

    from microspeed.testing import run_distributed

    nvme_dir = None
    if opts.nvme is not None:
        nvme_dir = tempfile.mkdtemp(prefix="microspeed-rss-") if opts.nvme == "tmp" else opts.nvme
    ranks = run_distributed(rank_main, world_size=opts.world, args=(opts, nvme_dir), timeout=opts.timeout)
    what = ("ZeRO-3 NVMe params+optimizer" if nvme_dir else f"ZeRO-{opts.stage}") + \
        f", {opts.precision}, {opts.world} rank(s), GPT {ranks[0]['params'] / 1e6:.1f}M " \
        f"(vocab {opts.vocab}, width {opts.width}, {opts.layers} layers, seq {opts.seq}, micro {opts.micro})"
    print(what)
    for r, res in enumerate(ranks):
        err = res["predicted"] / res["peak"] - 1
        parts = ", ".join(f"{k} {v / MIB:.0f}" for k, v in res["parts"].items())
        print(f"rank {r}: predicted {res['predicted'] / MIB:.0f} MiB, measured VmHWM {res['peak'] / MIB:.0f} MiB "
              f"({err:+.1%}); after each step {[round(h / MIB) for h in res['hwm_steps']]}; baseline "
              f"{res['base'] / MIB:.0f}; predicted parts (MiB): {parts}")
        if opts.phases:
            print("  phase peaks (forward, backward, step) MiB: "
                  + " | ".join(" ".join(f"{v / MIB:.0f}" for v in res["phases"][i:i + 3])
                               for i in range(0, len(res["phases"]), 3)))
    print("BENCH_JSON " + json.dumps({"config": vars(opts), "ranks": ranks}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
