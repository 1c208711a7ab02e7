"""The peak-RSS prediction (``microspeed_zero.peak_rss``), ``zero_optimization.host_memory_budget`` and the CLI."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from microspeed_zero import peak_rss
from microspeed_zero.estimator import main
from microspeed_zero.peak_rss import parse_bytes, predict_for_config, predict_peak_rss

import microspeed
from microspeed.models import GPT, GPTConfig
from microspeed.plugin_api import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BENCH = os.path.join(ROOT, "benchmarks", "zero_rss_predict.py")
GPT45 = ["--vocab", "32000", "--width", "512", "--layers", "4", "--heads", "8"]  # 45.4M parameters, untied


def _run_bench(args: list[str], tmp_path) -> list[dict]:
    out = subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True, timeout=280,
                         cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = next(v for v in out.stdout.splitlines() if v.startswith("BENCH_JSON "))
    return json.loads(line[len("BENCH_JSON "):])["ranks"]


@pytest.mark.parametrize("args", [  # stages 2, 3 (10 s each) in the full suite only: the quick run keeps stage 1
    pytest.param(["--stage", "1", "--precision", "fp32"], id="stage1"),
    pytest.param(["--stage", "2", "--precision", "fp32"], id="stage2", marks=pytest.mark.slow),
    pytest.param(["--stage", "3", "--precision", "fp32"], id="stage3", marks=pytest.mark.slow),
])
def test_predicted_peak_within_10_percent_in_memory(args, tmp_path):
    """2 ranks, a 45M GPT whose states outweigh torch's baseline: predicted VmHWM within 10 % on every rank."""
    ranks = _run_bench([*args, *GPT45, "--world", "2", "--seq", "16", "--micro", "1", "--steps", "2"], tmp_path)
    for r in ranks:
        assert r["peak"] - r["base"] > r["base"], "the model's memory must dominate the baseline"
        assert abs(r["predicted"] / r["peak"] - 1) < 0.10, r


@pytest.mark.slow
def test_predicted_peak_within_10_percent_nvme(tmp_path):
    """ZeRO-3 with parameters and optimizer on NVMe, bf16, built under zero.Init(remote_device='nvme'): the swappers'
    buffers (sub_group_size 2e7, buffer_count 2) dominate what the process adds to its baseline."""
    ranks = _run_bench(["--nvme", str(tmp_path / "nvme"), "--precision", "bf16", "--world", "1", "--vocab", "16000",
                        "--width", "512", "--layers", "4", "--heads", "8", "--seq", "16", "--micro", "1",
                        "--sub-group", "2e7", "--buffers", "2", "--live", "1e7", "--prefetch", "5e6",
                        "--steps", "2"], tmp_path)
    r = ranks[0]
    assert r["parts"]["buffers"] > 200 * 2**20
    assert abs(r["predicted"] / r["peak"] - 1) < 0.10, r


def _config(zero: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": zero}


def test_budget_refused_at_initialize_naming_key_breakdown_and_fix():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=4000, d_model=128, n_layer=2, n_head=4, seq_len=16, tie_weights=False))
    with pytest.raises(ConfigError) as info:
        microspeed.initialize(model=model, config=_config({"stage": 2, "host_memory_budget": "300MiB"}))
    text = str(info.value)
    assert "zero_optimization.host_memory_budget = 300.0 MiB" in text
    assert "predicted peak RSS" in text and "model states in memory" in text and "buffers" in text
    assert "offload_optimizer.device 'nvme'" in text and "raise the budget" in text


def test_budget_that_fits_trains_and_warns_once_when_the_measured_peak_passes_it(monkeypatch, caplog):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=4000, d_model=128, n_layer=2, n_head=4, seq_len=16, tie_weights=False))
    engine, *_ = microspeed.initialize(model=model, config=_config({"stage": 1, "host_memory_budget": "4GiB"}))
    x = torch.randint(0, 4000, (1, 17))
    monkeypatch.setattr(peak_rss, "measured_peak", lambda: 5 * 2**30)
    with caplog.at_level(logging.WARNING, logger="microspeed.zero"):
        for _ in range(2):
            engine.backward(engine(x[:, :-1], x[:, 1:]))
            engine.step()
    warned = [r.getMessage() for r in caplog.records if "host_memory_budget" in r.getMessage()]
    assert len(warned) == 1 and "5.00 GiB" in warned[0] and "predicted at initialize()" in warned[0]


def test_auto_budget_holds_offloaded_runs_to_the_machines_ram(monkeypatch):
    # The default, "auto": with offloading, 80 % of MemTotal over the node's ranks; without it, or with null, no check.
    def budget(zero: dict) -> int | None:
        engine, *_ = microspeed.initialize(model=GPT(GPTConfig.tiny()), config=_config(zero))
        return engine.plugin_state("zero").cfg.host_memory_budget

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with open("/proc/meminfo") as fh:
        total = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemTotal:"))
    total = min(total, peak_rss.cgroup_memory_limit() or total)
    cpu = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert budget(cpu) == int(0.8 * total / 4)
    assert budget({"stage": 2}) is None and budget({**cpu, "host_memory_budget": None}) is None
    monkeypatch.setattr(peak_rss, "AUTO_FRACTION", 1e-6)  # a machine far too small for this model: refused at once
    model = GPT(GPTConfig(vocab_size=4000, d_model=128, n_layer=2, n_head=4, seq_len=16, tie_weights=False))
    with pytest.raises(ConfigError, match=r'zero_optimization.host_memory_budget \("auto": .* over 4 local rank\(s\)\) '
                                          r'= .*predicted peak RSS'):
        microspeed.initialize(model=model, config=_config(cpu))


def _fake_cgroups(tmp_path, proc: str, files: dict[str, str]) -> tuple[str, str]:
    for rel, value in files.items():
        os.makedirs(os.path.dirname(tmp_path / "fs" / rel), exist_ok=True)
        (tmp_path / "fs" / rel).write_text(value + "\n")
    (tmp_path / "cgroup").write_text(proc)
    return str(tmp_path / "cgroup"), str(tmp_path / "fs")


def test_cgroup_limit_v1_and_v2_the_tightest_ancestor_wins(tmp_path):
    unlimited = str(2**63 - 4096)
    v1 = _fake_cgroups(tmp_path / "v1", "4:memory:/jobs/run7\n1:cpu:/\n0::/\n", {
        "memory/memory.limit_in_bytes": unlimited, "memory/jobs/memory.limit_in_bytes": str(6 << 30),
        "memory/jobs/run7/memory.limit_in_bytes": str(4 << 30)})
    assert peak_rss.cgroup_memory_limit(*v1) == 4 << 30
    v2 = _fake_cgroups(tmp_path / "v2", "0::/user.slice/train.scope\n", {
        "cgroup.controllers": "memory", "user.slice/memory.max": str(3 << 30),
        "user.slice/train.scope/memory.max": "max"})
    assert peak_rss.cgroup_memory_limit(*v2) == 3 << 30
    none = _fake_cgroups(tmp_path / "none", "0::/\n", {"cgroup.controllers": "memory", "memory.max": "max"})
    assert peak_rss.cgroup_memory_limit(*none) is None
    assert peak_rss.cgroup_memory_limit(str(tmp_path / "missing"), str(tmp_path)) is None


def test_auto_budget_takes_a_cgroup_limit_below_the_ram(monkeypatch):
    """In a 2 GiB container the "auto" budget is 80 % of 2 GiB, not of the machine: a config that would be
    OOM-killed there is refused at initialize() instead."""
    monkeypatch.setattr(peak_rss, "cgroup_memory_limit", lambda: 2 << 30)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert peak_rss.default_budget() == int(0.8 * (2 << 30))
    monkeypatch.setattr(peak_rss, "cgroup_memory_limit", lambda: 64 << 20)
    model = GPT(GPTConfig(vocab_size=4000, d_model=128, n_layer=2, n_head=4, seq_len=16, tie_weights=False))
    with pytest.raises(ConfigError, match=r'zero_optimization.host_memory_budget \("auto": 80% of the cgroup\'s '
                                          r'memory limit 64.0 MiB over 1 local rank\(s\)\) = .*predicted peak RSS'):
        microspeed.initialize(model=model, config=_config({"stage": 2, "offload_optimizer": {"device": "cpu"}}))


@pytest.mark.parametrize(("value", "match"), [("8 parsecs", "is not a size"), (-5, "positive"), (True, "got True")])
def test_bad_budget_is_refused_naming_the_key(value, match):
    model = GPT(GPTConfig.tiny())
    with pytest.raises(ConfigError, match=rf"host_memory_budget.*{match}"):
        microspeed.initialize(model=model, config=_config({"stage": 1, "host_memory_budget": value}))


def test_parse_bytes_units():
    assert parse_bytes("8GiB") == 8 * 2**30
    assert parse_bytes("500MB") == 500 * 10**6
    assert parse_bytes("1.5G") == 3 * 2**29
    assert parse_bytes(4096) == 4096


def test_mirrored_constants_match_the_runtime():
    """The prediction's copies of the gradient swapper's sizes are the ones the runtime uses (the reducer's chunking
    is one module both import)."""
    from microspeed_zero import grad_swap

    assert (peak_rss._SWAP_BUFFERS, peak_rss._NORM_CHUNK) == (grad_swap.BUFFERS, grad_swap.NORM_CHUNK)


def test_big_nvme_config_prediction_terms():
    """The 2.4B GPT under ZeRO-3 NVMe (sub_group_size 1e8, buffer_count 2): slots, gradient buffers, step."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=16000, d_model=2560, n_layer=30, n_head=20, seq_len=32, tie_weights=False))
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "optimizer": {"type": "AdamW"},
           "zero_optimization": {"stage": 3, "sub_group_size": 1e8,
                                 "offload_param": {"device": "nvme", "nvme_path": "/x", "max_in_cpu": 0},
                                 "offload_optimizer": {"device": "nvme", "nvme_path": "/x", "buffer_count": 2}}}
    one, two = (predict_for_config(model, cfg, world_size=n) for n in (1, 2))
    assert one.num_params == 2_442_301_440 and one.model_states == 0
    slots = 2 * 10**8 * 4 * 3  # two slots of master + two moments
    grad_fixed = 2 * 10**8 * 2 + 10**8 * 4 + 2**20 * 4  # bf16 gradient slots, the fp32 sub-group, the norm chunk
    # one rank: no reducer pool (the gradients go straight into the partition), one gradient-swap buffer of the
    # largest slice (the 40.96M-element embedding)
    assert one.buffers == slots + grad_fixed + 2 * 40_960_000
    # two ranks: the pool keeps the bf16 staging and receive buffers of two reductions in flight, each as large as
    # the largest column chunk (every module but the layer norms and the position embedding exceeds 2**23 values:
    # the 40.96M-value embedding goes in 5 chunks of 2 x 4.096M), and the gradient-swap buffer holds half the
    # embedding
    pool = 2 * 2 * 2 * 8_192_000
    exchange = 2 * 4 * (1 << 20)  # the shared-memory exchange: 4 slots of 1 MiB per rank, every rank's touched
    assert two.buffers == slots + grad_fixed + pool + 2 * 20_480_000 + exchange
    assert one.total == predict_peak_rss(
        model, 1, 3, "nvme", "nvme", "bf16", "adamw", sub_group_size=10**8, buffer_count=2, max_in_cpu=0).total


def test_cli_prints_prediction_breakdown_and_budget_verdict(capsys):
    args = ["--model", "demo:gpt", "--model-arg", "vocab_size=32000", "--model-arg", "d_model=512",
            "--model-arg", "n_layer=4", "--model-arg", "n_head=8", "--model-arg", "tie_weights=false",
            "--precision", "fp32", "--stage", "2,3", "--world-size", "2", "--seq-len", "16"]
    assert main(args + ["--budget", "64GiB"]) == 0
    out = capsys.readouterr().out
    assert "predicted peak RSS per rank" in out and "activations" in out and "every row fits" in out
    assert main(args + ["--budget", "500MB"]) == 1
    out = capsys.readouterr().out
    assert "OVER" in out and "host_memory_budget" in out
    assert main(["--params", "1e9", "--stage", "3", "--budget", "8 parsecs"]) == 2
