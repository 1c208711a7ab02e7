"""Triton kernels of the sign ("1-bit") compression: compress, decompress and the fused server combine.

Same arguments, results and in-place updates as the PyTorch reference in :mod:`microspeed_comm.bitpack`
(which documents the format and dispatches here); one program per block of ``BLOCK`` values, the block
size a compile-time constant. Signs are bit-identical to the reference; scales differ only by summation
order. On CPU tensors the kernels run only under the Triton interpreter: ``TRITON_INTERPRET=1`` must be
in the environment before this module is first imported (it is read when ``@triton.jit`` decorates them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from microspeed_comm import bitpack

__all__ = ["compress_triton", "decompress_triton", "server_combine_triton"]


@triton.jit
def _decode_bits(byte_ptr, BLOCK: tl.constexpr):
    """int32[BLOCK] of 0/1: the bits of the BLOCK // 8 bytes at ``byte_ptr``, MSB first."""
    packed = tl.load(byte_ptr + tl.arange(0, BLOCK // 8)).to(tl.int32)
    shifts = 7 - tl.arange(0, 8)
    return tl.reshape((packed[:, None] >> shifts[None, :]) & 1, (BLOCK,))


@triton.jit
def _encode(y, err_ptrs, bits_ptr, scale_ptr, BLOCK: tl.constexpr):
    """Store the block ``y``'s packed signs at ``bits_ptr``, its RMS at ``scale_ptr`` and ``y - decode`` at
    ``err_ptrs``."""
    scale = tl.sqrt_rn(tl.sum(y * y, axis=0) / BLOCK)
    positive = y >= 0
    tl.store(err_ptrs, y - tl.where(positive, scale, -scale))
    weights = 1 << (7 - tl.arange(0, 8))
    packed = tl.sum(tl.reshape(positive.to(tl.int32), (BLOCK // 8, 8)) * weights[None, :], axis=1)
    tl.store(bits_ptr + tl.arange(0, BLOCK // 8), packed.to(tl.uint8))
    tl.store(scale_ptr, scale)


@triton.jit
def _compress_kernel(x_ptr, err_ptr, bits_ptr, scales_ptr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    y = tl.load(x_ptr + offs) + tl.load(err_ptr + offs)
    _encode(y, err_ptr + offs, bits_ptr + b * (BLOCK // 8), scales_ptr + b, BLOCK)


@triton.jit
def _decompress_kernel(bits_ptr, scales_ptr, out_ptr, alpha, BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    coef = alpha * tl.load(scales_ptr + b)
    value = tl.where(_decode_bits(bits_ptr + b * (BLOCK // 8), BLOCK) != 0, coef, -coef)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    if ACCUMULATE:
        value = tl.load(out_ptr + offs) + value
    tl.store(out_ptr + offs, value)


@triton.jit
def _server_combine_kernel(recv_bits_ptr, recv_scales_ptr, err_ptr, bits_ptr, scales_ptr, n_workers, n_blocks,
                           inv_n, BLOCK: tl.constexpr):
    k = tl.program_id(0).to(tl.int64)
    offs = k * BLOCK + tl.arange(0, BLOCK)
    y = tl.load(err_ptr + offs)
    for j in range(0, n_workers):
        row = j * n_blocks + k  # block k of worker j (int64, as k is)
        coef = inv_n * tl.load(recv_scales_ptr + row)
        y += tl.where(_decode_bits(recv_bits_ptr + row * (BLOCK // 8), BLOCK) != 0, coef, -coef)
    _encode(y, err_ptr + offs, bits_ptr + k * (BLOCK // 8), scales_ptr + k, BLOCK)


def _num_warps(block: int) -> int:
    """Warps per program: about 16 values per thread (64..512 -> 1 warp, 2048 -> 4, 4096 and up -> 8); untuned."""
    return max(1, min(8, block // 512))


INTERPRETED = type(_compress_kernel).__name__ == "InterpretedFunction"
"""Whether the kernels run in the Triton interpreter (``TRITON_INTERPRET=1`` when this module was imported)."""


def _check_device(t: torch.Tensor, name: str) -> None:
    if not t.is_cuda and not INTERPRETED:
        raise ValueError(f"{name}: the Triton kernels need CUDA tensors (got one on {t.device}); for CPU tensors "
                         f"use the PyTorch path ({bitpack.KERNELS_ENV}=torch), or set TRITON_INTERPRET=1 "
                         "before microspeed_comm.kernels is imported")


def compress_triton(x: torch.Tensor, error: torch.Tensor, block: int, bits: torch.Tensor | None = None,
                    scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton implementation of :func:`microspeed_comm.bitpack.compress` (same arguments and result)."""
    nb, bits, scales = bitpack._compress_args(x, error, block, bits, scales)
    _check_device(x, "x")
    if nb:
        _compress_kernel[(nb,)](x, error, bits, scales, BLOCK=block, num_warps=_num_warps(block))
    return bits, scales


def decompress_triton(bits: torch.Tensor, scales: torch.Tensor, block: int, out: torch.Tensor | None = None,
                      alpha: float = 1.0, accumulate: bool = False) -> torch.Tensor:
    """The Triton implementation of :func:`microspeed_comm.bitpack.decompress` (same arguments and result)."""
    nb, out = bitpack._decompress_args(bits, scales, block, out, accumulate)
    _check_device(bits, "bits")
    if nb:
        _decompress_kernel[(nb,)](bits, scales, out, float(alpha), BLOCK=block, ACCUMULATE=bool(accumulate),
                                  num_warps=_num_warps(block))
    return out


def server_combine_triton(recv_bits: torch.Tensor, recv_scales: torch.Tensor, error: torch.Tensor, block: int,
                          bits: torch.Tensor | None = None, scales: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton implementation of :func:`microspeed_comm.bitpack.server_combine` (same arguments and result),
    fused: one program per block decodes the N copies, averages, adds the error and re-encodes."""
    n_workers, k, bits, scales = bitpack._server_combine_args(recv_bits, recv_scales, error, block, bits, scales)
    _check_device(recv_bits, "recv_bits")
    if k:
        _server_combine_kernel[(k,)](recv_bits, recv_scales, error, bits, scales, n_workers, k, 1.0 / n_workers,
                                     BLOCK=block, num_warps=_num_warps(block))
    return bits, scales
