"""Tests of the sign compression: the PyTorch reference and dispatcher (:mod:`microspeed_comm.bitpack`) in this
process, the Triton kernels (:mod:`microspeed_comm.kernels`) against the reference in a child process.

Why a child process: ``@triton.jit`` picks the interpreter (the only way to run the kernels on CPU tensors)
when it decorates them, i.e. when ``microspeed_comm.kernels`` is first imported, and only if
``TRITON_INTERPRET=1`` is in the environment by then. This pytest process may already have imported the kernels
(or Triton) without it, so the comparison runs in ``python test_bitpack.py IN OUT`` started with
``TRITON_INTERPRET=1`` (see ``_run_triton_cases``, at the bottom): it runs the Triton kernels on the inputs
this process saved in ``IN`` and saves their outputs in ``OUT``, which the tests here compare with the reference.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from microspeed_comm import bitpack
from microspeed_comm.bitpack import (
    compress,
    compress_reference,
    decompress,
    decompress_reference,
    kernel_backend,
    pack_signs,
    server_combine,
    server_combine_reference,
    unpack_signs,
)

PACKAGE_ROOT = str(Path(bitpack.__file__).resolve().parents[1])  # the folder holding microspeed_comm/


@pytest.fixture(autouse=True)
def _automatic_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run every test with the backend chosen by the tensors, whatever the caller's environment says."""
    monkeypatch.delenv(bitpack.KERNELS_ENV, raising=False)


def _data(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """n random fp32 values with exact zeros of both signs sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * scale
    x[::13] = 0.0
    x[5::17] = -0.0
    return x


def _np_decode(bits: torch.Tensor, scales: torch.Tensor, block: int) -> np.ndarray:
    """float64 ``±scale`` per value, the slow obvious way (numpy.unpackbits, one block at a time)."""
    signs = np.unpackbits(bits.numpy()).astype(np.float64) * 2 - 1
    out = np.empty_like(signs)
    for b, s in enumerate(scales.numpy().astype(np.float64)):
        out[b * block:(b + 1) * block] = s * signs[b * block:(b + 1) * block]
    return out


# -- pack_signs / unpack_signs --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pack_signs_matches_numpy_packbits(dtype: torch.dtype) -> None:
    x = _data(8 * 37, seed=1).to(dtype)
    bits = pack_signs(x)
    assert bits.dtype == torch.uint8 and bits.shape == (37,)
    np.testing.assert_array_equal(bits.numpy(), np.packbits(x.numpy() >= 0))
    zeros = torch.tensor([0.0, -0.0, 1.0, -1.0, 0.0, -2.0, -0.0, 3.0])  # exact zeros of both signs are +1
    assert pack_signs(zeros).tolist() == [0b11101011]


def test_pack_fallback_matches_multiply_trick() -> None:
    """The byte-sum packing (big-endian hosts, unaligned views) agrees with the int64 multiply trick."""
    positive = _data(8 * 50, seed=2) >= 0
    fast = torch.empty(50, dtype=torch.uint8)
    bitpack._pack_into(positive.clone(), fast)
    unaligned = torch.empty(8 * 50 + 1, dtype=torch.bool)[1:].copy_(positive)
    slow = torch.empty(50, dtype=torch.uint8)
    bitpack._pack_into(unaligned, slow)
    np.testing.assert_array_equal(fast.numpy(), np.packbits(positive.numpy()))
    np.testing.assert_array_equal(slow.numpy(), fast.numpy())


def test_unpack_signs_round_trip() -> None:
    x = _data(8 * 21, seed=3)
    bits = pack_signs(x)
    expected = np.where(x.numpy() >= 0, 1.0, -1.0).astype(np.float32)
    signs = unpack_signs(bits, x.numel())
    assert signs.dtype == torch.float32
    np.testing.assert_array_equal(signs.numpy(), expected)
    np.testing.assert_array_equal(signs.numpy(), np.unpackbits(bits.numpy()).astype(np.float32) * 2 - 1)
    np.testing.assert_array_equal(unpack_signs(bits, 13).numpy(), expected[:13])  # n need not be a multiple of 8
    assert unpack_signs(bits, 0).shape == (0,)


# -- compress / decompress (reference) --------------------------------------------------------------------


@pytest.mark.parametrize("block", [64, 256, 2048])
def test_compress_reference(block: int) -> None:
    nb = 5
    x, error = _data(nb * block, seed=4), _data(nb * block, seed=5, scale=0.1)
    x_before, error_before = x.clone(), error.clone()
    bits, scales = compress_reference(x, error, block)
    y = x_before.double() + error_before.double()
    assert torch.equal(x, x_before)
    assert bits.dtype == torch.uint8 and bits.shape == (nb * block // 8,)
    np.testing.assert_array_equal(bits.numpy(), np.packbits((x_before + error_before).numpy() >= 0))
    assert scales.dtype == torch.float32 and scales.shape == (nb,)
    rms = y.view(nb, block).pow(2).mean(dim=1).sqrt()
    torch.testing.assert_close(scales.double(), rms, rtol=1e-5, atol=1e-7)
    # The error-feedback identity: what was not sent is kept.
    torch.testing.assert_close(decompress_reference(bits, scales, block) + error, x_before + error_before,
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(error.double(), y - torch.from_numpy(_np_decode(bits, scales, block)),
                               rtol=1e-5, atol=1e-6)


def test_compress_writes_into_given_outputs_and_handles_zeros() -> None:
    block = 64
    x = torch.zeros(3 * block)
    x[block:2 * block] = _data(block, seed=6)
    error = torch.full((3 * block,), -0.0)
    x[:block] = -0.0  # y = -0.0 + -0.0 = -0.0: still bit 1
    bits = torch.full((3 * block // 8,), 7, dtype=torch.uint8)
    scales = torch.full((3,), 7.0)
    out_bits, out_scales = compress(x, error, block, bits=bits, scales=scales)
    assert out_bits is bits and out_scales is scales
    assert bits[:block // 8].eq(255).all() and bits[2 * block // 8:].eq(255).all()
    assert scales[0] == 0 and scales[2] == 0 and scales[1] > 0
    assert error[:block].eq(0).all() and error[2 * block:].eq(0).all()


def test_repeated_compression_keeps_the_sum() -> None:
    """Error feedback: over many calls the decoded values add up to the inputs, less the final error."""
    block, steps = 128, 20
    error = torch.zeros(4 * block)
    sent = torch.zeros(4 * block, dtype=torch.float64)
    total = torch.zeros(4 * block, dtype=torch.float64)
    for step in range(steps):
        x = _data(4 * block, seed=100 + step)
        total += x.double()
        bits, scales = compress(x, error, block)
        sent += decompress(bits, scales, block).double()
    torch.testing.assert_close(sent + error.double(), total, rtol=1e-5, atol=1e-4)
    assert error.abs().max() < 10  # bounded, not growing with the number of steps


@pytest.mark.parametrize("alpha", [1.0, 0.5, -0.25])
def test_decompress_reference(alpha: float) -> None:
    block, nb = 256, 4
    bits = pack_signs(_data(nb * block, seed=7))
    scales = torch.rand(nb, generator=torch.Generator().manual_seed(8)) + 0.1
    expected = alpha * _np_decode(bits, scales, block)
    out = decompress_reference(bits, scales, block, alpha=alpha)
    assert out.dtype == torch.float32 and out.shape == (nb * block,)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6)
    given = _data(nb * block, seed=9)
    base = given.double().numpy()
    assert decompress_reference(bits, scales, block, out=given, alpha=alpha, accumulate=True) is given
    np.testing.assert_allclose(given.numpy(), base + expected, rtol=1e-5, atol=1e-6)
    assert decompress_reference(bits, scales, block, out=given, alpha=alpha) is given  # overwrites
    np.testing.assert_allclose(given.numpy(), expected, rtol=1e-6)


def test_reference_spans_several_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunked processing (the reference works a chunk of values at a time) changes nothing."""
    block, nb = 64, 10
    x, error = _data(nb * block, seed=10), _data(nb * block, seed=11, scale=0.1)
    error_chunked = error.clone()
    bits, scales = compress_reference(x, error, block)
    monkeypatch.setattr(bitpack, "_CHUNK", 3 * block)  # 10 blocks in chunks of 3, 3, 3, 1
    bits_chunked, scales_chunked = compress_reference(x, error_chunked, block)
    assert torch.equal(bits, bits_chunked) and torch.equal(scales, scales_chunked)
    assert torch.equal(error, error_chunked)
    out = torch.ones(nb * block)
    decompress_reference(bits, scales, block, out=out, alpha=0.5, accumulate=True)
    np.testing.assert_allclose(out.numpy(), 1 + 0.5 * _np_decode(bits, scales, block), rtol=1e-6)


# -- server_combine (reference) -----------------------------------------------------------------------------


@pytest.mark.parametrize(("n_workers", "block"), [(1, 64), (2, 64), (3, 256), (4, 128)])
def test_server_combine_matches_explicit_formula(n_workers: int, block: int) -> None:
    k = 3
    workers = [compress(_data(k * block, seed=20 + j), torch.zeros(k * block), block) for j in range(n_workers)]
    recv_bits = torch.stack([b for b, _ in workers])
    recv_scales = torch.stack([s for _, s in workers])
    error = _data(k * block, seed=30, scale=0.1)
    # The reference of the reference: decode each worker's copy, one block at a time, in float64.
    y = error.double().numpy().copy()
    for j in range(n_workers):
        for b in range(k):
            signs = np.unpackbits(recv_bits[j, b * block // 8:(b + 1) * block // 8].numpy()) * 2.0 - 1.0
            y[b * block:(b + 1) * block] += float(recv_scales[j, b]) * signs / n_workers
    bits, scales = server_combine_reference(recv_bits, recv_scales, error, block)
    np.testing.assert_array_equal(bits.numpy(), np.packbits(y >= 0))
    np.testing.assert_allclose(scales.numpy(), np.sqrt((y.reshape(k, block) ** 2).mean(axis=1)), rtol=1e-5)
    np.testing.assert_allclose(error.numpy(), y - _np_decode(bits, scales, block), rtol=1e-5, atol=1e-6)


# -- argument checks ------------------------------------------------------------------------------------------

_F = torch.zeros(128)
_B = torch.zeros(16, dtype=torch.uint8)
_S = torch.zeros(2)

BAD_CALLS = {
    "block not a power of two": (lambda: compress(_F, _F.clone(), 96), "block"),
    "block too small": (lambda: decompress(_B, _S, 32), "block"),
    "block too large": (lambda: compress(torch.zeros(16384), torch.zeros(16384), 16384), "block"),
    "x float64": (lambda: compress(_F.double(), _F.clone(), 64), "x"),
    "x 2-D": (lambda: compress(_F.view(2, 64), _F.clone(), 64), "x"),
    "x not whole blocks": (lambda: compress(torch.zeros(96), torch.zeros(96), 64), "x"),
    "x not contiguous": (lambda: compress(torch.zeros(256)[::2], _F.clone(), 64), "x"),
    "error too short": (lambda: compress(_F, torch.zeros(64), 64), "error"),
    "error dtype": (lambda: compress(_F, _F.half(), 64), "error"),
    "bits wrong size": (lambda: compress(_F, _F.clone(), 64, bits=torch.zeros(8, dtype=torch.uint8)), "bits"),
    "scales wrong dtype": (lambda: compress(_F, _F.clone(), 64, scales=_S.double()), "scales"),
    "decompress bits dtype": (lambda: decompress(_B.float(), _S, 64), "bits"),
    "decompress bits partial block": (lambda: decompress(_B[:12], _S, 64), "bits"),
    "decompress scales count": (lambda: decompress(_B, torch.zeros(3), 64), "scales"),
    "decompress out size": (lambda: decompress(_B, _S, 64, out=torch.zeros(64)), "out"),
    "accumulate without out": (lambda: decompress(_B, _S, 64, accumulate=True), "out"),
    "recv_bits 1-D": (lambda: server_combine(_B, _S.view(1, 2), _F.clone(), 64), "recv_bits"),
    "recv_bits no workers": (lambda: server_combine(_B.view(1, 16)[:0], _S.view(1, 2)[:0], _F.clone(), 64),
                             "recv_bits"),
    "recv_scales shape": (lambda: server_combine(_B.view(2, 8), _S.view(1, 2), _F.clone(), 64), "recv_scales"),
    "server error size": (lambda: server_combine(_B.view(2, 8), _S.view(2, 1), _F.clone(), 64), "error"),
    "pack_signs n": (lambda: pack_signs(torch.zeros(12)), "x"),
    "pack_signs int": (lambda: pack_signs(torch.zeros(16, dtype=torch.int32)), "x"),
    "unpack_signs n": (lambda: unpack_signs(_B, 16 * 8 + 1), "n"),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_arguments_raise_value_error_naming_the_argument(name: str) -> None:
    call, argument = BAD_CALLS[name]
    with pytest.raises(ValueError, match=rf"^{argument}:"):
        call()


def test_non_tensor_raises_type_error() -> None:
    with pytest.raises(TypeError, match=r"^x:"):
        compress([0.0] * 64, torch.zeros(64), 64)  # type: ignore[arg-type]


# -- dispatch ----------------------------------------------------------------------------------------------------


def test_kernel_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.zeros(8)
    assert kernel_backend(t) == "torch"
    monkeypatch.setenv(bitpack.KERNELS_ENV, "auto")
    assert kernel_backend(t) == "torch"
    monkeypatch.setenv(bitpack.KERNELS_ENV, "triton")
    assert kernel_backend(t) == "triton"
    monkeypatch.setenv(bitpack.KERNELS_ENV, "torch")
    assert kernel_backend(t) == "torch"
    monkeypatch.setenv(bitpack.KERNELS_ENV, "cuda")
    with pytest.raises(ValueError, match=bitpack.KERNELS_ENV):
        kernel_backend(t)


def test_dispatcher_runs_the_reference_on_cpu() -> None:
    block = 64
    x, error = _data(2 * block, seed=40), _data(2 * block, seed=41)
    error_ref = error.clone()
    bits, scales = compress(x, error, block)
    bits_ref, scales_ref = compress_reference(x, error_ref, block)
    assert torch.equal(bits, bits_ref) and torch.equal(scales, scales_ref) and torch.equal(error, error_ref)


def _expect_ok(script: str) -> None:
    """Run ``script`` in a fresh interpreter (its own import state); it must print ``ok``."""
    done = subprocess.run([sys.executable, "-c", script], env=_child_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def _child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", bitpack.KERNELS_ENV)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return {**env, **extra}


def test_bitpack_imports_and_runs_without_triton() -> None:
    script = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # as if Triton were not installed
        import os, torch
        from microspeed_comm import bitpack
        x = torch.randn(128)
        assert bitpack.kernel_backend(x) == "torch"
        bits, scales = bitpack.compress(x, torch.zeros(128), 64)
        os.environ["MICROSPEED_COMM_KERNELS"] = "triton"
        try:
            bitpack.compress(x, torch.zeros(128), 64)
        except ImportError as exc:
            assert "MICROSPEED_COMM_KERNELS=torch" in str(exc), exc
        else:
            raise AssertionError("forcing the kernels without Triton should fail")
        print("ok")
    """)
    _expect_ok(script)


# -- Triton kernels vs the reference (interpreted, in a child process) -----------------------------------------------

COMPRESS_CASES = {f"block{b}": (b, nb) for b, nb in [(64, 3), (256, 3), (1024, 2), (8192, 1)]}
DECOMPRESS_CASES = {f"block{b}-alpha{a}-{'acc' if acc else 'set'}": (b, a, acc)
                    for b in (64, 256, 1024) for a, acc in [(1.0, False), (0.5, False), (1.0, True), (-0.25, True)]}
SERVER_CASES = {f"N{n}-block{b}": (n, b) for n, b in [(2, 64), (3, 64), (2, 256), (3, 256), (3, 1024)]}


@functools.cache
def _triton_inputs() -> dict[str, dict[str, torch.Tensor | float | int | bool]]:
    """The inputs of every Triton case, deterministic (the reference recomputes from the same tensors)."""
    cases: dict[str, dict[str, torch.Tensor | float | int | bool]] = {}
    for i, (name, (block, nb)) in enumerate(COMPRESS_CASES.items()):
        x, error = _data(nb * block, seed=50 + i), _data(nb * block, seed=60 + i, scale=0.1)
        error[7::19] = -x[7::19]  # y exactly 0
        x[:block // 2] = 0.0  # half a block of zeros: y = error
        cases[f"compress-{name}"] = {"x": x, "error": error, "block": block}
    for i, (name, (block, alpha, acc)) in enumerate(DECOMPRESS_CASES.items()):
        nb = 3
        cases[f"decompress-{name}"] = {
            "bits": pack_signs(_data(nb * block, seed=70 + i)), "scales": torch.rand(nb) + 0.01,
            "out": _data(nb * block, seed=80 + i), "block": block, "alpha": alpha, "accumulate": acc}
    for i, (name, (n, block)) in enumerate(SERVER_CASES.items()):
        k = 3
        recv = [compress(_data(k * block, seed=90 + 10 * i + j), torch.zeros(k * block), block) for j in range(n)]
        cases[f"server-{name}"] = {"recv_bits": torch.stack([b for b, _ in recv]),
                                   "recv_scales": torch.stack([s for _, s in recv]),
                                   "error": _data(k * block, seed=99 + 10 * i, scale=0.1), "block": block}
    return cases


def _run_case(name: str, case: dict, kernels: bool) -> tuple[torch.Tensor, ...]:
    """Run one case (on copies of its tensors) through the dispatcher, or through the reference."""
    c = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    if name.startswith("compress-"):
        bits, scales = (compress if kernels else compress_reference)(c["x"], c["error"], c["block"])
        return bits, scales, c["error"], c["x"]
    if name.startswith("decompress-"):
        out = c["out"] if c["accumulate"] or c["alpha"] != 1.0 else None
        res = (decompress if kernels else decompress_reference)(c["bits"], c["scales"], c["block"], out=out,
                                                               alpha=c["alpha"], accumulate=c["accumulate"])
        return (res,)
    fn = server_combine if kernels else server_combine_reference
    bits, scales = fn(c["recv_bits"], c["recv_scales"], c["error"], c["block"])
    return bits, scales, c["error"]


@pytest.fixture(scope="module")
def triton_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.Tensor, ...]]:
    """Run all the Triton cases in one interpreted child process; return their outputs by case name."""
    pytest.importorskip("triton", reason="triton is not installed: the kernels cannot be compared")
    folder = tmp_path_factory.mktemp("triton")
    inputs, outputs = folder / "inputs.pt", folder / "outputs.pt"
    torch.save(_triton_inputs(), inputs)
    done = subprocess.run([sys.executable, __file__, str(inputs), str(outputs)], capture_output=True, text=True,
                          env=_child_env(TRITON_INTERPRET="1", MICROSPEED_COMM_KERNELS="triton"), timeout=300)
    assert done.returncode == 0, f"the interpreted Triton run failed:\n{done.stdout}\n{done.stderr}"
    return torch.load(outputs)


def _reference(name: str) -> tuple[torch.Tensor, ...]:
    return _run_case(name, _triton_inputs()[name], kernels=False)


@pytest.mark.parametrize("name", list(COMPRESS_CASES))
def test_triton_compress(triton_results: dict, name: str) -> None:
    bits, scales, error, x = triton_results[f"compress-{name}"]
    ref_bits, ref_scales, ref_error, ref_x = _reference(f"compress-{name}")
    assert torch.equal(bits, ref_bits)
    torch.testing.assert_close(scales, ref_scales, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(error, ref_error, rtol=1e-5, atol=1e-6)
    assert torch.equal(x, ref_x)  # not modified


@pytest.mark.parametrize("name", list(DECOMPRESS_CASES))
def test_triton_decompress(triton_results: dict, name: str) -> None:
    (out,), (ref,) = triton_results[f"decompress-{name}"], _reference(f"decompress-{name}")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(SERVER_CASES))
def test_triton_server_combine(triton_results: dict, name: str) -> None:
    bits, scales, error = triton_results[f"server-{name}"]
    ref_bits, ref_scales, ref_error = _reference(f"server-{name}")
    assert torch.equal(bits, ref_bits)
    torch.testing.assert_close(scales, ref_scales, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(error, ref_error, rtol=1e-5, atol=1e-6)


def test_triton_dispatch_and_lazy_names(triton_results: dict) -> None:
    """In the child, MICROSPEED_COMM_KERNELS=triton selected the kernels, and bitpack re-exports them."""
    assert triton_results["meta"] == ("triton", True)


def test_triton_kernels_refuse_cpu_tensors_without_the_interpreter() -> None:
    pytest.importorskip("triton", reason="triton is not installed")
    script = textwrap.dedent("""
        import torch
        from microspeed_comm import kernels
        assert not kernels.INTERPRETED
        try:
            kernels.compress_triton(torch.zeros(64), torch.zeros(64), 64)
        except ValueError as exc:
            assert str(exc).startswith("x:") and "TRITON_INTERPRET" in str(exc), exc
        else:
            raise AssertionError("CPU tensors should be refused")
        print("ok")
    """)
    _expect_ok(script)


def _run_triton_cases(inputs: str, outputs: str) -> None:
    """The child process: run every case of ``inputs`` through the (interpreted) kernels, save to ``outputs``."""
    from microspeed_comm import kernels

    assert kernels.INTERPRETED, "TRITON_INTERPRET=1 must be set before microspeed_comm.kernels is imported"
    cases = torch.load(inputs)
    results = {name: _run_case(name, case, kernels=True) for name, case in cases.items()}
    results["meta"] = (kernel_backend(torch.zeros(1)), bitpack.compress_triton is kernels.compress_triton)
    torch.save(results, outputs)


if __name__ == "__main__":
    _run_triton_cases(sys.argv[1], sys.argv[2])
