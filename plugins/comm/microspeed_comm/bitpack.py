"""Sign ("1-bit") compression of fp32 tensors: PyTorch reference, and the dispatcher to the Triton kernels.

A flat fp32 tensor of ``nb * block`` values is cut into ``nb`` blocks of ``block`` values (a power of two,
64 to 8192). Each value becomes one bit, 1 where it is ``>= 0`` (``-0.0`` included) and 0 where it is
negative; the bits are packed 8 to a byte, most significant bit first, exactly as :func:`numpy.packbits`
packs them (value ``8*i + j`` is bit ``7 - j`` of byte ``i``), so block ``b`` owns bytes
``[b*block/8, (b+1)*block/8)``. Each block also keeps one fp32 *scale*, the block's RMS
``sqrt(sum(y*y) / block)``, so that the decoded block (``+scale`` for bit 1, ``-scale`` for bit 0) has the
L2 norm of the original, DeepSpeed's choice for 1-bit Adam.

:func:`compress`, :func:`decompress` and :func:`server_combine` run the Triton kernels of
:mod:`microspeed_comm.kernels` on CUDA tensors (when Triton imports) and the vectorized PyTorch code of
this module otherwise; ``MICROSPEED_COMM_KERNELS=triton`` or ``=torch`` forces one (see
:func:`kernel_backend`). Both give bit-identical signs; scales differ only by float summation order.

This module imports without Triton: the kernels are imported the first time they are used.

CPU timings of the PyTorch path, 8M values, block 2048, 2 threads (AMD EPYC VM, torch 2.13, best of 20-40 runs):
compress 8 ms, decompress into a given ``out`` 3 ms (2.5 ms accumulating), both ~10 ms; ``out=None`` adds ~11 ms.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch

# compress_triton, decompress_triton and server_combine_triton are attributes too (loaded on first use, see
# __getattr__), but not in __all__: a star import must not import Triton.
__all__ = [
    "KERNELS_ENV",
    "compress",
    "compress_reference",
    "decompress",
    "decompress_reference",
    "kernel_backend",
    "pack_signs",
    "server_combine",
    "server_combine_reference",
    "unpack_signs",
]

KERNELS_ENV = "MICROSPEED_COMM_KERNELS"
"""Environment variable that forces the implementation: ``triton``, ``torch``, or unset / ``auto``."""

_MIN_BLOCK, _MAX_BLOCK = 64, 8192

_CHUNK = 1 << 20
"""Values the PyTorch path works on at a time (whole blocks): a chunk of ``y`` is still in cache when it is
encoded, and the temporaries (signs, an fp32 scratch) stay small, instead of tensor-sized ones (a fresh 32 MB
buffer costs ~11 ms of page faults alone on the machine of the timings above)."""

_TRITON_NAMES = ("compress_triton", "decompress_triton", "server_combine_triton")


# -- argument checks (shared with microspeed_comm.kernels) ----------------------------------------


def _check_block(block: Any) -> int:
    """Return ``block`` if it is a power of two in [64, 8192], else raise ``ValueError``."""
    if (isinstance(block, bool) or not isinstance(block, int) or not _MIN_BLOCK <= block <= _MAX_BLOCK
            or block & (block - 1)):
        raise ValueError(f"block: expected a power of two between {_MIN_BLOCK} and {_MAX_BLOCK}, got {block!r}")
    return block


def _check_tensor(name: str, t: Any, dtype: torch.dtype, ndim: int = 1, device: torch.device | None = None,
                  shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """Check that ``t`` is a contiguous ``ndim``-D ``dtype`` tensor (on ``device``, of ``shape``); name it if not."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (call .contiguous() first)")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    return t


def _compress_args(x: Any, error: Any, block: Any, bits: Any, scales: Any
                   ) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Check ``compress``'s arguments; return ``(nb, bits, scales)``, allocating the outputs not given."""
    block = _check_block(block)
    _check_tensor("x", x, torch.float32)
    if x.numel() % block:
        raise ValueError(f"x: expected a multiple of block={block} values, got {x.numel()}")
    nb = x.numel() // block
    _check_tensor("error", error, torch.float32, device=x.device, shape=(x.numel(),))
    return nb, *_encode_outputs(nb, block, x.device, bits, scales)


def _encode_outputs(nb: int, block: int, device: torch.device, bits: Any, scales: Any
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Check (or allocate) the ``bits`` and ``scales`` outputs of an encoding of ``nb`` blocks."""
    if bits is None:
        bits = torch.empty(nb * block // 8, dtype=torch.uint8, device=device)
    else:
        _check_tensor("bits", bits, torch.uint8, device=device, shape=(nb * block // 8,))
    if scales is None:
        scales = torch.empty(nb, dtype=torch.float32, device=device)
    else:
        _check_tensor("scales", scales, torch.float32, device=device, shape=(nb,))
    return bits, scales


def _decompress_args(bits: Any, scales: Any, block: Any, out: Any, accumulate: bool) -> tuple[int, torch.Tensor]:
    """Check ``decompress``'s arguments; return ``(nb, out)``, allocating ``out`` if not given."""
    block = _check_block(block)
    _check_tensor("bits", bits, torch.uint8)
    if bits.numel() % (block // 8):
        raise ValueError(f"bits: expected a multiple of block/8={block // 8} bytes, got {bits.numel()}")
    nb = bits.numel() // (block // 8)
    _check_tensor("scales", scales, torch.float32, device=bits.device, shape=(nb,))
    if out is None:
        if accumulate:
            raise ValueError("out: accumulate=True adds into out, so out must be given")
        out = torch.empty(nb * block, dtype=torch.float32, device=bits.device)
    else:
        _check_tensor("out", out, torch.float32, device=bits.device, shape=(nb * block,))
    return nb, out


def _server_combine_args(recv_bits: Any, recv_scales: Any, error: Any, block: Any, bits: Any, scales: Any
                         ) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """Check ``server_combine``'s arguments; return ``(N, K, bits, scales)``, allocating the outputs not given."""
    block = _check_block(block)
    _check_tensor("recv_bits", recv_bits, torch.uint8, ndim=2)
    n_workers, row = recv_bits.shape
    if n_workers < 1:
        raise ValueError(f"recv_bits: expected at least one worker's row, got shape {tuple(recv_bits.shape)}")
    if row % (block // 8):
        raise ValueError(f"recv_bits: expected rows of a multiple of block/8={block // 8} bytes, got {row}")
    k = row // (block // 8)
    _check_tensor("recv_scales", recv_scales, torch.float32, ndim=2, device=recv_bits.device, shape=(n_workers, k))
    _check_tensor("error", error, torch.float32, device=recv_bits.device, shape=(k * block,))
    return n_workers, k, *_encode_outputs(k, block, recv_bits.device, bits, scales)


# -- dispatch ---------------------------------------------------------------------------------------


def kernel_backend(t: torch.Tensor) -> str:
    """``'triton'`` or ``'torch'``: which implementation compress/decompress/server_combine use for tensors like t.

    ``MICROSPEED_COMM_KERNELS=triton`` forces the Triton kernels (on CPU tensors they need the Triton
    interpreter, ``TRITON_INTERPRET=1`` set before :mod:`microspeed_comm.kernels` is imported);
    ``MICROSPEED_COMM_KERNELS=torch`` forces the PyTorch reference. Otherwise (unset, empty or ``auto``)
    the kernels run for CUDA tensors when Triton imports, the reference for everything else.
    """
    from microspeed.plugin_api import kernel_backend as choose

    return choose(t, KERNELS_ENV)


def _kernels() -> Any:
    """Import :mod:`microspeed_comm.kernels`, explaining a failure to import Triton."""
    try:
        from microspeed_comm import kernels
    except ImportError as exc:
        raise ImportError(f"microspeed_comm's Triton kernels were selected ({KERNELS_ENV}="
                          f"{os.environ.get(KERNELS_ENV, 'auto')!r}) but cannot be imported: {exc}. "
                          f"Install triton, or set {KERNELS_ENV}=torch") from exc
    return kernels


def __getattr__(name: str) -> Any:
    """Load ``compress_triton``, ``decompress_triton`` and ``server_combine_triton`` on first use."""
    if name in _TRITON_NAMES:
        return getattr(_kernels(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def compress(x: torch.Tensor, error: torch.Tensor, block: int, bits: torch.Tensor | None = None,
             scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Error-feedback sign compression. y = x + error (fp32, len nb*block); returns (bits uint8[nb*block//8],
    scales float32[nb]); error is overwritten IN PLACE with y - decode(bits, scales). x is not modified.
    bits/scales: optional preallocated outputs to write into."""
    if kernel_backend(x) == "triton":
        return _kernels().compress_triton(x, error, block, bits, scales)
    return compress_reference(x, error, block, bits, scales)


def decompress(bits: torch.Tensor, scales: torch.Tensor, block: int, out: torch.Tensor | None = None,
               alpha: float = 1.0, accumulate: bool = False) -> torch.Tensor:
    """out (fp32, len nb*block) = alpha * scale_b * (±1) per element; with accumulate=True, out += that.

    ``bits`` is uint8[nb*block//8], ``scales`` float32[nb]; ``out`` is allocated when not given (it must
    be given with ``accumulate=True``). Returns ``out``.
    """
    if kernel_backend(bits) == "triton":
        return _kernels().decompress_triton(bits, scales, block, out, alpha, accumulate)
    return decompress_reference(bits, scales, block, out, alpha, accumulate)


def server_combine(recv_bits: torch.Tensor, recv_scales: torch.Tensor, error: torch.Tensor, block: int,
                   bits: torch.Tensor | None = None, scales: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The server side of a compressed all-reduce. recv_bits uint8[N, K*block//8] and recv_scales fp32[N, K]
    are N workers' compressed copies of the same K blocks. y = (1/N) * sum_j decode(recv_bits[j], recv_scales[j])
    + error (error fp32[K*block], in place updated to y - decode(result)); returns compress(y) as (bits, scales).

    Both implementations add the workers' decoded copies, each already scaled by ``1/N``, onto the error in
    worker order (``y = ((error + d_0/N) + d_1/N) + ...``), without materializing the decoded copies.
    """
    if kernel_backend(recv_bits) == "triton":
        return _kernels().server_combine_triton(recv_bits, recv_scales, error, block, bits, scales)
    return server_combine_reference(recv_bits, recv_scales, error, block, bits, scales)


# -- PyTorch reference --------------------------------------------------------------------------------

# 0x8040201008040201 as a signed int64: multiplying a little-endian word of eight 0/1 bytes by it sends
# byte j's bit to bit 63 - j; the 64 partial products land on distinct bits, so nothing carries into the
# top byte, which ends up holding the 8 bits MSB first (the wrap-around of the product is intended).
_GATHER_BITS = 0x8040201008040201 - (1 << 64)


@functools.cache
def _sign_table(device: torch.device) -> torch.Tensor:
    """int64[256]: entry ``v`` holds, as raw memory, the 8 int8 signs (+1/-1) of byte ``v``, MSB first."""
    bit = (torch.arange(256, device=device)[:, None] >> torch.arange(7, -1, -1, device=device)) & 1
    return (bit * 2 - 1).to(torch.int8).view(torch.int64).view(256)


@functools.cache
def _bit_weights(device: torch.device) -> torch.Tensor:
    return torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=device)


def _pack_into(positive: torch.Tensor, out: torch.Tensor) -> None:
    """Pack the fresh bool tensor ``positive`` (n values, n a multiple of 8; overwritten) into ``out`` (uint8[n//8])."""
    ones = positive.view(torch.uint8)
    if sys.byteorder == "little" and ones.storage_offset() % 8 == 0:
        word = ones.view(torch.int64).mul_(_GATHER_BITS).bitwise_right_shift_(56)
        out.copy_(word)  # int64 -> uint8 keeps the low byte
    else:
        torch.sum(ones.view(-1, 8) * _bit_weights(ones.device), dim=1, dtype=torch.uint8, out=out)


def _signs_int8(bits: torch.Tensor) -> torch.Tensor:
    """int8[8 * len(bits)] of +1 (bit 1) / -1 (bit 0), MSB first within each byte."""
    return _sign_table(bits.device).index_select(0, bits.to(torch.int64)).view(torch.int8)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """uint8[n//8]: the signs of the floating-point 1-D tensor ``x`` (n a multiple of 8), 1 where ``x >= 0``,
    packed 8 to a byte MSB first like ``numpy.packbits``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"x: expected a floating-point tensor, got dtype {x.dtype}")
    _check_tensor("x", x, x.dtype)
    if x.numel() % 8:
        raise ValueError(f"x: expected a multiple of 8 values, got {x.numel()}")
    out = torch.empty(x.numel() // 8, dtype=torch.uint8, device=x.device)
    _pack_into(x >= 0, out)
    return out


def unpack_signs(bits: torch.Tensor, n: int) -> torch.Tensor:
    """float32[n] of +1.0 / -1.0: the first ``n`` signs packed in ``bits`` (uint8, 1-D), the inverse of
    :func:`pack_signs`."""
    _check_tensor("bits", bits, torch.uint8)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 8 * bits.numel():
        raise ValueError(f"n: expected an int between 0 and 8 * bits.numel() = {8 * bits.numel()}, got {n!r}")
    return _signs_int8(bits[:(n + 7) // 8])[:n].to(torch.float32)


def _chunks(n: int, block: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` ranges of at most ``_CHUNK`` values (and whole blocks) covering ``range(n)``."""
    step = max(_CHUNK, block)
    for start in range(0, n, step):
        yield start, min(start + step, n)


def _scratch(n: int, block: int, like: torch.Tensor) -> torch.Tensor:
    """An fp32 buffer for one chunk of a tensor of ``n`` values."""
    return torch.empty(min(max(_CHUNK, block), n), dtype=torch.float32, device=like.device)


def _decode_into(bits: torch.Tensor, coef: torch.Tensor, block: int, out: torch.Tensor,
                 tmp: torch.Tensor | None) -> None:
    """``out = coef_b * (±1)`` (``tmp`` None) or ``out += coef_b * (±1)`` (``tmp`` an fp32 scratch of at least
    ``out.numel()`` values) for whole blocks; ``coef`` is fp32[nb, 1]. Signs go through an int8 byte table."""
    signs = _signs_int8(bits)
    if tmp is None:
        out.copy_(signs).view(-1, block).mul_(coef)
    else:
        out.view(-1, block).addcmul_(tmp[:out.numel()].copy_(signs).view(-1, block), coef)


def _encode_(y: torch.Tensor, block: int, bits: torch.Tensor, scales: torch.Tensor, tmp: torch.Tensor) -> None:
    """Write the signs and scales of ``y`` (whole blocks) into ``bits``/``scales``; replace ``y`` by
    ``y - decode(bits, scales)`` in place."""
    torch.linalg.vector_norm(y.view(-1, block), dim=1, out=scales)
    scales.div_(math.sqrt(block))
    _pack_into(y >= 0, bits)
    _decode_into(bits, scales.neg()[:, None], block, y, tmp)


def compress_reference(x: torch.Tensor, error: torch.Tensor, block: int, bits: torch.Tensor | None = None,
                       scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch implementation of :func:`compress` (same arguments and result), for any device.

    Vectorized over chunks of about a million values, so that ``y`` is still in cache when it is encoded.
    """
    nb, bits, scales = _compress_args(x, error, block, bits, scales)
    tmp = _scratch(x.numel(), block, x)
    for start, stop in _chunks(x.numel(), block):
        y = error[start:stop].add_(x[start:stop])
        _encode_(y, block, bits[start // 8:stop // 8], scales[start // block:stop // block], tmp)
    return bits, scales


def decompress_reference(bits: torch.Tensor, scales: torch.Tensor, block: int, out: torch.Tensor | None = None,
                         alpha: float = 1.0, accumulate: bool = False) -> torch.Tensor:
    """The PyTorch implementation of :func:`decompress` (same arguments and result), for any device."""
    nb, out = _decompress_args(bits, scales, block, out, accumulate)
    coef = (scales * float(alpha))[:, None]  # rounded to fp32 before the sign, like the Triton kernel
    tmp = _scratch(out.numel(), block, out) if accumulate else None
    for start, stop in _chunks(out.numel(), block):
        _decode_into(bits[start // 8:stop // 8], coef[start // block:stop // block], block, out[start:stop], tmp)
    return out


def server_combine_reference(recv_bits: torch.Tensor, recv_scales: torch.Tensor, error: torch.Tensor, block: int,
                             bits: torch.Tensor | None = None, scales: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch implementation of :func:`server_combine` (same arguments and result), for any device."""
    n_workers, k, bits, scales = _server_combine_args(recv_bits, recv_scales, error, block, bits, scales)
    coef = (recv_scales * (1.0 / n_workers))[:, :, None]  # fp32 (1/N) * scale, like the Triton kernel
    tmp = _scratch(error.numel(), block, error)
    for start, stop in _chunks(error.numel(), block):
        y, blocks = error[start:stop], slice(start // block, stop // block)
        for j in range(n_workers):
            _decode_into(recv_bits[j, start // 8:stop // 8], coef[j, blocks], block, y, tmp)
        _encode_(y, block, bits[start // 8:stop // 8], scales[blocks], tmp)
    return bits, scales
