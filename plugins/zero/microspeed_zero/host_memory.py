"""Host memory policy under NVMe offload: freed large tensors go back to the operating system.

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
"""

from __future__ import annotations

import ctypes
import os

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
