"""``microspeed estimate-memory --probe-disk``: the bandwidth probe, the step-time arithmetic, bad arguments."""

from __future__ import annotations

import errno
import math
import os

import pytest
from microspeed_zero import diskprobe
from microspeed_zero.diskprobe import DiskBandwidth, matmul_flops, probe_disk, step_time
from microspeed_zero.estimator import estimate_memory, main, nvme_traffic, parse_size


def _finite_positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


def test_probe_measures_and_removes_its_file(tmp_path) -> None:
    disk = probe_disk(str(tmp_path), 1 << 20, request=256 << 10)
    assert disk.size == 1 << 20 and disk.request == 256 << 10
    assert _finite_positive(disk.write_bps) and _finite_positive(disk.read_bps)
    assert list(tmp_path.iterdir()) == []


def test_probe_falls_back_to_buffered_io_where_o_direct_is_refused(tmp_path, monkeypatch) -> None:
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(diskprobe.os, "open", no_direct)
    disk = probe_disk(str(tmp_path), 1 << 20)
    assert not disk.direct and _finite_positive(disk.write_bps) and _finite_positive(disk.read_bps)
    assert list(tmp_path.iterdir()) == []


def test_cli_prints_bandwidths_and_step_times(tmp_path, capsys) -> None:
    assert main(["--probe-disk", str(tmp_path), "--probe-size", "1M", "--params", "10M", "--stage", "3",
                 "--offload-optimizer", "nvme", "--offload-param", "nvme", "--max-in-cpu", "0"]) == 0
    out = capsys.readouterr().out
    assert "O_DIRECT" in out and " GB/s" in out and "GFLOP/s" in out
    row = [line for line in out.splitlines() if line.startswith("3 ") and "nvme/nvme" in line][-1]
    # 10M params, 1 rank, bf16 Adam: optimizer 12 B/param each way, bf16 gradients 2 B/param each way;
    # params 2 B/param read 3x, written once: 200e6 B read, 160e6 B written
    assert "190.7 MiB" in row and "152.6 MiB" in row and row.split()[-1] in ("I/O", "compute")
    assert list(tmp_path.iterdir()) == []


def test_step_time_arithmetic_equals_a_hand_computation() -> None:
    psi, n = 1_200_000_000, 2
    est = estimate_memory(psi, n, 3, offload_optimizer="nvme", offload_param="nvme")
    share = psi // n
    # optimizer: fp32 master + 2 Adam moments = 12 B per element, read once and written once per step;
    # gradients (bf16, in the optimizer's files): written by each of 2 micro-steps, read back by the second
    # and by the step; parameters (bf16, all in files): read by forward and backward of each micro-step and
    # by the step, written once
    grads = 2 * 2 * share
    assert nvme_traffic(est, grad_accum=2, max_in_cpu=0) == (12 * share + grads + 5 * 2 * share,
                                                             12 * share + grads + 2 * share)
    # max_in_cpu keeps 4e8 elements in memory: only the other 2e8 are in files
    assert nvme_traffic(est, grad_accum=2, max_in_cpu=400_000_000) == (12 * share + grads + 5 * 2 * 200_000_000,
                                                                       12 * share + grads + 2 * 200_000_000)
    # stage 1 keeps gradients in memory
    assert nvme_traffic(estimate_memory(psi, n, 1, offload_optimizer="nvme"), grad_accum=2) == (12 * psi // n,) * 2
    read, write = nvme_traffic(est, grad_accum=2, max_in_cpu=0)  # 15.6e9, 10.8e9
    disk = DiskBandwidth("/x", 10**9, 16 << 20, write_seconds=1.0, read_seconds=0.5, direct=True)  # 1 GB/s, 2 GB/s
    t = step_time(read, write, psi, 1000, disk, 1e12)
    assert t.io_seconds == pytest.approx(15.6e9 / 2e9 + 10.8e9 / 1e9)  # 18.6 s
    assert t.compute_seconds == pytest.approx(6 * psi * 1000 / 1e12)  # 7.2 s
    assert (t.seconds, t.serial_seconds, t.bound) == (pytest.approx(18.6), pytest.approx(25.8), "I/O")
    assert step_time(0, 0, psi, 1000, disk, 1e12).bound == "compute"
    # without NVMe offload nothing moves
    assert nvme_traffic(estimate_memory(psi, n, 3, offload_optimizer="cpu", offload_param="cpu")) == (0, 0)


def test_matmul_rate_is_measured() -> None:
    assert _finite_positive(matmul_flops(seconds=0.05, n=64))


@pytest.mark.parametrize(("args", "message"), [
    (["--probe-disk", "{missing}"], "--probe-disk: '{missing}' does not exist"),
    (["--probe-disk", "{file}"], "--probe-disk: '{file}' is not a directory"),
    (["--probe-disk", "{tmp}", "--probe-size", "1023K"], "--probe-size: 1047552 bytes is below the minimum of 1 MiB"),
    (["--probe-disk", "{tmp}", "--probe-size", "lots"], "--probe-size: 'lots' is not a size"),
    (["--probe-disk", "{tmp}", "--probe-size", "1P"], "--probe-size: '1P' is not a size"),
    (["--params", "1B", "--tokens-per-step", "9"], "--tokens-per-step goes with --probe-disk"),
    ([], "one of --params, --model or --probe-disk is required"),
])
def test_bad_arguments_name_the_argument(tmp_path, capsys, args, message) -> None:
    (tmp_path / "f").write_text("x")
    names = {"missing": str(tmp_path / "nope"), "file": str(tmp_path / "f"), "tmp": str(tmp_path)}
    assert main([a.format(**names) for a in args]) == 2
    assert message.format(**names) in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_unwritable_folder_is_named(tmp_path, capsys) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        if os.access(folder, os.W_OK):  # root ignores the mode: use a folder the kernel refuses files in
            folder = "/sys"
            if not os.path.isdir(folder):
                pytest.skip("running as root without /sys: no unwritable folder to try")
        assert main(["--probe-disk", str(folder), "--probe-size", "1M"]) == 2
        err = capsys.readouterr().err
        assert f"--probe-disk: {str(folder)!r}" in err and "writ" in err
    finally:
        (tmp_path / "ro").chmod(0o700)


def test_probe_size_parsing() -> None:
    assert parse_size("1G") == 1 << 30 and parse_size("256MiB") == 256 << 20 and parse_size("4096") == 4096
    assert parse_size("1.5k") == 1536
    with pytest.raises(ValueError, match="--probe-size"):
        parse_size("-1M")
