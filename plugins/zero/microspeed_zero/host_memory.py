"""Host memory policy: freed large tensors go back to the operating system; buffers refilled without page faults.

glibc serves an allocation from its heap unless it is at least its *mmap threshold*, which starts at 128 KiB and
rises (up to 32 MiB) each time a larger block that was served by ``mmap`` is freed. With NVMe offload most of what
the process allocates is transient and between 1 and 32 MiB — a module's parameters while ``zero.Init`` builds
it, gathered layers, gradient staging, activations — so after the first frees those come from the heap, which
keeps their pages once they are freed (small long-lived objects between them stop it from shrinking). Measured on
an 81M-parameter bf16 GPT with parameters and optimizer on NVMe (``benchmarks/zero3_nvme_rss.py``): peak RSS
1077 MiB with the dynamic threshold, 742 MiB with it fixed at 1 MiB, the same step time (the build 4x faster).

:func:`return_freed_memory` fixes the threshold at :data:`THRESHOLD` for the process, once, as the environment
variable ``MALLOC_MMAP_THRESHOLD_`` would; a value the user set in that variable is left alone, and so is any C
library without ``mallopt`` (not glibc).

:class:`ReleasablePages` is a flat CPU buffer that is emptied and refilled many times while tensors keep viewing it
(ZeRO-3's gathered parameters, released after use and gathered again). Giving its memory back by shrinking the storage
to zero bytes and growing it again (as FSDP does on GPUs, where the caching allocator keeps the memory) costs on CPU a
page fault for every 4 KiB touched on the refill: 11 ms of CPU for 16 MiB here, against 1.4 ms to write memory that
is still mapped, more than the all-gather that fills it. The buffer lives on an anonymous mapping of its own and a
release marks its pages free with ``MADV_FREE``: the kernel takes them back when it needs memory (they then read as
zeros and fault again when written), and until then the refill writes into them without a fault. They count in the
RSS until the kernel takes them. (Transparent huge pages, with ``MADV_DONTNEED``, returned the memory at once and cut
the refill to 2.6 ms, but under memory pressure every huge-page fault went into direct compaction and reclaim, and
the step took more CPU than with 4 KiB faults.)
"""

from __future__ import annotations

import ctypes
import mmap
import os

import torch

THRESHOLD = 1 << 20
"""Bytes from which an allocation gets pages of its own (returned when freed)."""

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
_state: dict[str, bool] = {}


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold at :data:`THRESHOLD` bytes for this process (once); whether the policy holds.

    ``False`` when the C library has no ``mallopt`` or refuses it; ``True`` without a change when
    ``MALLOC_MMAP_THRESHOLD_`` is set (the user chose).
    """
    if "done" not in _state:
        if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
            _state["done"] = True
        else:
            try:
                libc = ctypes.CDLL(None)
                _state["done"] = bool(libc.mallopt(_M_MMAP_THRESHOLD, THRESHOLD))
            except (OSError, AttributeError):
                _state["done"] = False
    return _state["done"]


class ReleasablePages:
    """A flat CPU tensor of ``numel`` elements on pages of its own, given back by :meth:`release` (see the module
    docstring). The tensor, and every view of it, stays valid throughout; after a release its values are undefined
    (the old ones, or zeros where the kernel took the pages) until written again. Starts zero-filled, unmapped."""

    __slots__ = ("tensor", "_map")

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        nbytes = int(numel) * dtype.itemsize
        self._map = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)[:nbytes].view(dtype)

    def release(self) -> None:
        """Mark the pages free: the kernel reclaims them when it needs memory (``MADV_DONTNEED`` at once where the
        kernel has no ``MADV_FREE``)."""
        if _state.get("madv_free", True):
            try:
                self._map.madvise(mmap.MADV_FREE)
                return
            except (AttributeError, OSError):  # before Linux 4.5, or not Linux
                _state["madv_free"] = False
        self._map.madvise(mmap.MADV_DONTNEED)
