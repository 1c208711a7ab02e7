"""Tests of the ZeRO memory estimator (``microspeed_zero.estimator``) and ``microspeed estimate-memory``."""

from __future__ import annotations

import os

import pytest
import torch
from microspeed_zero.estimator import (
    MemoryEstimate,
    Placement,
    count_parameters,
    estimate_memory,
    format_bytes,
    main,
    parse_count,
)
from torch import nn

PSI = 1_200_000_000  # divisible by 1, 2, 4, 8: the ideal figures are exact


def _ideal(stage: int, n: int, p: int, k: int) -> tuple[int, int, int]:
    """(params, grads, optimizer states) of the ZeRO paper's partitioning, per rank."""
    return (
        p * PSI // (n if stage == 3 else 1),
        p * PSI // (n if stage >= 2 else 1),
        k * PSI // (n if stage >= 1 else 1),
    )


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize(("precision", "p", "k"), [("bf16", 2, 12), ("fp16", 2, 12), ("fp32", 4, 8)])
def test_ideal_partition_figures(stage: int, n: int, precision: str, p: int, k: int) -> None:
    est = estimate_memory(PSI, n, stage, precision=precision)
    params, grads, states = _ideal(stage, n, p, k)
    assert (est.params, est.gradients, est.optimizer_states) == (
        Placement(device=params), Placement(device=grads), Placement(device=states))
    assert est.total_device == params + grads + states
    assert est.total_cpu == est.total_nvme == est.working == 0


@pytest.mark.parametrize("n", [1, 2, 4])
def test_named_totals(n: int) -> None:
    # mixed precision Adam: 2+2+12 ; 2+2+12/N ; 2+(2+12)/N ; 16/N — fp32 Adam: 4+4+8 ; ... ; 16/N
    mixed = [16 * PSI, 4 * PSI + 12 * PSI // n, 2 * PSI + 14 * PSI // n, 16 * PSI // n]
    full = [16 * PSI, 8 * PSI + 8 * PSI // n, 4 * PSI + 12 * PSI // n, 16 * PSI // n]
    assert [estimate_memory(PSI, n, s).total_device for s in range(4)] == mixed
    assert [estimate_memory(PSI, n, s, precision="fp32").total_device for s in range(4)] == full


@pytest.mark.parametrize(("optimizer", "states"), [("adam", 2), ("adamw", 2), ("sgd", 0), ("sgd_momentum", 1),
                                                   ("adagrad", 1)])
def test_optimizer_state_counts(optimizer: str, states: int) -> None:
    assert estimate_memory(PSI, 4, 1, optimizer=optimizer).optimizer_states.device == (4 + 4 * states) * PSI // 4
    assert estimate_memory(PSI, 4, 1, optimizer=optimizer, precision="fp32").optimizer_states.device == \
        4 * states * PSI // 4


def test_uneven_partitions_round_up() -> None:
    est = estimate_memory(10, 4, 3)
    assert est.params.device == 2 * 3 and est.optimizer_states.device == 12 * 3


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 8)  # 800
        self.proj = nn.Linear(8, 8)  # 72
        self.head = nn.Linear(8, 100, bias=False)
        self.head.weight = self.emb.weight  # tied: counted once
        self.frozen = nn.Linear(8, 4)
        self.frozen.requires_grad_(False)


def test_tied_weights_counted_once() -> None:
    model = _Tied()
    assert count_parameters(model) == (872, 800)
    est = estimate_memory(model, 2, 3)
    assert est.num_params == 872 and est.largest_layer_params == 800
    assert est.params.device == 2 * 436 and est.working == 2 * 800
    assert est.total_device == 16 * 436 + 2 * 800
    with torch.device("meta"):
        meta = _Tied()
    assert count_parameters(meta) == (872, 800)
    assert estimate_memory(model, 2, 3, largest_layer_params=10).working == 20


def test_demo_gpt_tied_head() -> None:
    from dataclasses import replace

    from microspeed.models import GPT, GPTConfig

    tied, untied = GPT(GPTConfig.tiny()), GPT(replace(GPTConfig.tiny(), tie_weights=False))
    n_tied, _ = count_parameters(tied)
    n_untied, _ = count_parameters(untied)
    assert n_untied - n_tied == tied.config.vocab_size * tied.config.d_model
    assert n_tied == sum(p.numel() for p in tied.parameters())


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dest", ["cpu", "nvme"])
def test_offload_optimizer_moves_bytes(precision: str, stage: int, dest: str) -> None:
    n = 4
    base = estimate_memory(PSI, n, stage, precision=precision)
    off = estimate_memory(PSI, n, stage, offload_optimizer=dest, precision=precision)
    share = PSI // n
    assert off.params == base.params  # parameters stay put
    assert off.optimizer_states == Placement(**{dest: 12 * share})  # fp32 master + Adam moments, moved
    # gradients: the CPU step reads an fp32 copy of the partition; stage 2/3 keep none on the device
    assert off.gradients.at(dest) == 4 * share
    assert off.gradients.device == (base.gradients.device if stage == 1 else 0)
    assert off.total_device < base.total_device
    moved = base.total_device - off.total_device
    added_fp32_grad = 4 * share - (0 if stage == 1 else base.gradients.device)
    added_master = 4 * share if precision == "fp32" else 0
    assert off.total_cpu + off.total_nvme == moved + added_fp32_grad + added_master
    if precision == "bf16":  # the optimizer state (masters included) is moved, not lost or duplicated
        assert off.optimizer_states.total == base.optimizer_states.total


@pytest.mark.parametrize("dest", ["cpu", "nvme"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_offload_param_moves_exactly(dest: str, precision: str) -> None:
    base = estimate_memory(PSI, 8, 3, offload_optimizer="cpu", precision=precision, largest_layer_params=1000)
    off = estimate_memory(PSI, 8, 3, offload_optimizer="cpu", offload_param=dest, precision=precision,
                          largest_layer_params=1000)
    assert off.params == Placement(**{dest: base.params.device})
    assert off.total == base.total
    assert off.total_device == off.working == base.working  # only the gathered layer stays
    assert off.total_device + off.params.total == base.total_device


def test_table_and_str() -> None:
    est = estimate_memory(PSI, 8, 3, offload_optimizer="cpu", largest_layer_params=10**7)
    text = est.table()
    assert str(est) == text
    for word in ("ZeRO-3", "params (bf16)", "gradients", "optimizer states", "working", "total", "cpu", "nvme"):
        assert word in text
    assert format_bytes(est.total_cpu) in text
    assert isinstance(est, MemoryEstimate)
    with pytest.raises(AttributeError):
        est.stage = 2  # type: ignore[misc]  # frozen


def test_format_and_parse() -> None:
    assert format_bytes(0) == "0 B" and format_bytes(3 * 2**30) == "3.00 GiB" and format_bytes(2**21) == "2.0 MiB"
    assert parse_count("45e6") == 45_000_000 and parse_count("1.3B") == 1_300_000_000
    assert parse_count("350m") == 350_000_000 and parse_count("7_000") == 7000 and parse_count("125K") == 125_000
    for bad in ("", "x", "-5", "1.3Q", "inf"):
        with pytest.raises(ValueError):
            parse_count(bad)


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"world_size": 0}, "world_size"),
    ({"world_size": 1.5}, "world_size"),
    ({"stage": 4}, "stage"),
    ({"stage": -1}, "stage"),
    ({"precision": "fp8"}, "precision"),
    ({"optimizer": "lamb"}, "optimizer"),
    ({"offload_optimizer": "disk"}, "offload_optimizer"),
    ({"stage": 0, "offload_optimizer": "cpu"}, "offload_optimizer"),
    ({"offload_param": "gpu"}, "offload_param"),
    ({"stage": 2, "offload_param": "cpu"}, "offload_param"),
    ({"stage": 3, "offload_param": "nvme"}, "offload_param"),
    ({"model_or_numel": -1}, "model_or_numel"),
    ({"model_or_numel": "1B"}, "model_or_numel"),
    ({"largest_layer_params": -3}, "largest_layer_params"),
])
def test_bad_arguments_name_the_argument(kwargs: dict, name: str) -> None:
    args = {"model_or_numel": 1000, "world_size": 2, "stage": 3} | kwargs
    with pytest.raises(ValueError, match=name):
        estimate_memory(**args)


def test_cli_params(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--params", "1.3B", "--world-size", "1", "--world-size", "2,4"]) == 0
    out, rss = capsys.readouterr().out.split("predicted peak RSS per rank")
    lines = [ln for ln in out.splitlines() if ln[:1].isdigit()]
    assert len(lines) == 4 * 3  # every stage x every world size
    assert len([ln for ln in rss.splitlines() if ln[:1].isdigit()]) == 4 * 3  # and each one's peak RSS
    assert "total device" in out and "total cpu" in out and "GiB" in out
    # stage 3 on 4 ranks: 16 * 1.3e9 / 4 bytes
    assert any(ln.split()[:2] == ["3", "4"] and format_bytes(16 * 1_300_000_000 // 4) in ln for ln in lines)


def test_cli_offload_rows_and_skips(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--params", "45e6", "--world-size", "8", "--offload-optimizer", "none,cpu",
                 "--offload-param", "none,nvme", "--precision", "fp16", "--optimizer", "adamw",
                 "--largest-layer", "1M"]) == 0
    out = capsys.readouterr().out.split("predicted peak RSS per rank")[0]
    rows = [ln.split() for ln in out.splitlines() if ln[:1].isdigit()]
    # stage 0: none/none; stages 1, 2: none/none, cpu/none; stage 3: those plus cpu/nvme
    assert [(r[0], r[2]) for r in rows] == [("0", "none/none"), ("1", "none/none"), ("1", "cpu/none"),
                                            ("2", "none/none"), ("2", "cpu/none"), ("3", "none/none"),
                                            ("3", "cpu/none"), ("3", "cpu/nvme")]
    assert "total nvme" in out and "skipped" in out


def test_cli_model_demo_gpt(capsys: pytest.CaptureFixture[str]) -> None:
    from microspeed.models import GPT, GPTConfig

    assert main(["--model", "demo:gpt", "--model-arg", "n_layer=2", "--model-arg", "d_model=64",
                 "--stage", "3", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    numel, _ = count_parameters(GPT(GPTConfig(n_layer=2, d_model=64)))
    assert f"({numel:,})" in out


def test_cli_model_factory(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "mymodel.py").write_text(
        "import torch\n"
        "from torch import nn\n\n"
        "def build():\n"
        "    net = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))\n"
        "    net[1].weight = net[0].weight  # shared\n"
        "    return net\n\n"
        "def not_meta():  # fails on the meta device: the command builds it for real instead\n"
        "    net = nn.Linear(4, 4)\n"
        "    assert not net.weight.is_meta\n"
        "    return net\n")
    assert main(["--model", f"{tmp_path / 'mymodel.py'}:build", "--stage", "0"]) == 0
    assert "(120)" in capsys.readouterr().out  # 100 + 10 + 10, the shared weight once
    assert main(["--model", f"{tmp_path / 'mymodel.py'}:not_meta", "--stage", "0"]) == 0
    assert "(20)" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    [],
    ["--params", "lots"],
    ["--params", "1B", "--stage", "5"],
    ["--params", "1B", "--world-size", "0"],
    ["--params", "1B", "--world-size", "two"],
    ["--params", "1B", "--precision", "fp8"],
    ["--params", "1B", "--optimizer", "lamb"],
    ["--params", "1B", "--offload-optimizer", "disk"],
    ["--params", "1B", "--stage", "1", "--offload-param", "cpu"],
    ["--params", "1B", "--model", "demo:gpt"],
    ["--params", "1B", "--model-arg", "n_layer=2"],
    ["--model", "demo:gpt", "--model-arg", "n_layers=2"],
    ["--model", "demo:gpt", "--model-arg", "d_model=65"],
    ["--model", "no_such_module_xyz:f"],
    ["--model", "os:no_such_factory"],
    ["--model", "nofactory"],
    ["--model", "os:getcwd"],
])
def test_cli_rejects_bad_input(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error" in err


@pytest.mark.timeout(300)
def test_matches_deepspeed_where_comparable() -> None:
    """DeepSpeed 0.19.8's own estimators on the same Ψ: equal where the models agree, documented gaps elsewhere.

    DeepSpeed returns node-level CPU bytes times ``additional_buffer_factor`` (we pass 1.0) and
    device bytes per GPU; we compare per rank. Differences (see the estimator's module docstring):
    without offload DeepSpeed adds an fp32 gradient partition at stage 2 (4Ψ/N) and 2 bytes/param/N
    at stage 3, and reserves 4 bytes per largest-layer parameter where we reserve 2 (bf16).
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as ds_zero3
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as ds_zero2

    layer = 50_000_000
    for gpus, nodes in [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2)]:
        n = gpus * nodes
        share = PSI // n

        # stage 2, optimizer on the CPU: device 2Ψ; CPU 16Ψ/N per rank (for N<4 DeepSpeed's max(4N, 16) is 16)
        ds_cpu, ds_gpu = ds_zero2(PSI, gpus, nodes, cpu_offload=True, additional_buffer_factor=1.0)
        ours = estimate_memory(PSI, n, 2, offload_optimizer="cpu")
        assert ds_gpu == ours.total_device == 2 * PSI
        if 4 * n <= 16:
            assert ds_cpu == ours.total_cpu * n

        # stage 2 without offload: DeepSpeed's 18 bytes/param/N = our 14 + an fp32 gradient partition
        _, ds_gpu = ds_zero2(PSI, gpus, nodes, cpu_offload=False)
        ours = estimate_memory(PSI, n, 2)
        assert ds_gpu == ours.total_device + 4 * share

        # stage 3, optimizer on the CPU, parameters on the device (zero_init): per-node CPU = 16Ψ * gpus / N
        ds_cpu, ds_gpu, ds_layer = ds_zero3(PSI, layer, gpus, nodes, cpu_offload=True, cpu_offload_params=False,
                                            zero_init=True, additional_buffer_factor=1.0)
        ours = estimate_memory(PSI, n, 3, offload_optimizer="cpu", largest_layer_params=layer)
        assert ds_gpu - ds_layer == ours.total_device - ours.working == 2 * share
        assert ds_cpu == pytest.approx(ours.total_cpu * gpus)
        assert ds_layer == 2 * ours.working

        # stage 3, optimizer and parameters on the CPU: device holds only the gathered layer; CPU 18Ψ/N
        ds_cpu, ds_gpu, ds_layer = ds_zero3(PSI, layer, gpus, nodes, cpu_offload=True, cpu_offload_params=True,
                                            zero_init=True, additional_buffer_factor=1.0)
        ours = estimate_memory(PSI, n, 3, offload_optimizer="cpu", offload_param="cpu", largest_layer_params=layer)
        assert ds_gpu - ds_layer == ours.total_device - ours.working == 0
        assert ds_cpu == pytest.approx(ours.total_cpu * gpus)

        # stage 3 without offload: DeepSpeed's 18 bytes/param/N vs our 16
        _, ds_gpu, ds_layer = ds_zero3(PSI, layer, gpus, nodes, cpu_offload=False, cpu_offload_params=False)
        ours = estimate_memory(PSI, n, 3, largest_layer_params=layer)
        assert ds_gpu - ds_layer == ours.total_device - ours.working + 2 * share
