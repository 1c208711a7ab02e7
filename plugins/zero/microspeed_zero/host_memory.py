"""Host memory policy: freed tensors go back to the operating system (budgeted) or stay for reuse; buffers refilled
without page faults.

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

The price of the fixed threshold is a page fault for every 4 KiB of every large tensor allocated again (autograd's
gradients, gathered layers, temporaries): about 5 s of system CPU per rank in each forward + backward of a 0.37B bf16
GPT on 2 ranks. torch puts its CPU allocations of 2 MiB or more on transparent huge pages (512x fewer faults) when
``THP_MEM_ALLOC_ENABLE=1`` is in the environment at its first allocation, which only the launch environment can promise;
:func:`huge_pages_hint` names that fix when it is missing (logged on rank 0 when the policy is first applied). It is not
set for you: without NVMe offload it measured no faster (0.96-1.16x per engine in paired runs).

Without a peak-RSS budget the opposite policy pays: :func:`keep_freed_memory` (ZeRO stages 2 and 3 on the CPU without
offload) keeps every freed block in glibc's heap for the next allocation of its size, as a GPU's caching allocator does.
Autograd allocates every gradient afresh in each backward, and a gradient over 32 MiB (an embedding's, a vocabulary
head's) is always mapped on its own by default and returned when freed, so each backward faulted in and zeroed the
model's gradients again, 4 KiB at a time: 40k faults and 150 ms of system CPU per backward of a 45M-parameter GPT on 2
ranks, and up to 2.6x that much zeroing when another model shared the process. With the heap kept, the backward's faults
fell to 50 and its time from 495 to 395 ms (stage 3). The peak RSS stays what it was (the same blocks are reused every
step); the RSS no longer falls back between steps. Stage 1 does not use it: its whole gradients and whole accumulators
fragmented the kept heap, and its peak rose from 1066 to 1123 MiB (the same GPT, 4 ranks). ``MALLOC_MMAP_MAX_``,
``MALLOC_TRIM_THRESHOLD_`` or ``MALLOC_MMAP_THRESHOLD_`` in the environment (the user's choice) leave glibc's policy
alone. A budget wins: once :func:`return_freed_memory` holds, a later engine does not keep memory, and an engine with a
budget built after one without gives the kept heap back (``malloc_trim``) before fixing the threshold.

:class:`ReleasablePages` is a flat CPU buffer that is emptied and refilled many times while tensors keep viewing it
(ZeRO-3's gathered parameters, released after use and gathered again). Giving its memory back by shrinking the storage
to zero bytes and growing it again (as FSDP does on GPUs, where the caching allocator keeps the memory) costs on CPU a
page fault for every 4 KiB touched on the refill: 11 ms of CPU for 16 MiB here, against 1.4 ms to write memory that
is still mapped, more than the all-gather that fills it. The buffer lives on an anonymous mapping of its own and a
release marks its pages free with ``MADV_FREE``: the kernel takes them back when it needs memory (they then read as
zeros and fault again when written), and until then the refill writes into them without a fault. They count in the
RSS until the kernel takes them. (Transparent huge pages, with ``MADV_DONTNEED``, returned the memory at once and cut
the refill to 2.6 ms, but under memory pressure every huge-page fault went into direct compaction and reclaim, and
the step took more CPU than with 4 KiB faults.) Where the peak RSS is budgeted (offloaded parameters) the pages must
leave at release, so there the buffer does use huge pages with ``MADV_DONTNEED`` (``returned=True``): on a 0.37B bf16
GPT with parameters and optimizer on NVMe, one rank, the forward's page faults fell from 156k to 102k and the
backward's from 143k to 66k, 4.9 to 4.6 s per step, the same peak RSS.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os

import torch

from microspeed.plugin_api import comm

THRESHOLD = 1 << 20
"""Bytes from which an allocation gets pages of its own (returned when freed)."""

HUGE_PAGE = 2 << 20
"""Bytes of a transparent huge page (x86-64, and arm64 with 4 KiB pages)."""

HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"
"""torch's switch for transparent huge pages under its CPU allocations of 2 MiB or more (read once, at its first)."""

# glibc's mallopt parameter numbers, and its defaults for the two that keep_freed_memory changes
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
_DEFAULT_TRIM_THRESHOLD, _DEFAULT_MMAP_MAX = 128 * 1024, 65536
_KEPT_TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes a C int: keep a free top below 2 GiB
_USER_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
_state: dict[str, bool] = {}


def _mallopt(*settings: tuple[int, int]) -> bool:
    """Apply glibc ``mallopt`` settings (parameter, value) in order; whether every one was taken (``False`` with a C
    library that has no ``mallopt``)."""
    try:
        libc = ctypes.CDLL(None)
        return all(bool(libc.mallopt(param, value)) for param, value in settings)
    except (OSError, AttributeError):
        return False


def _user_chose(names: tuple[str, ...]) -> bool:
    """Whether the environment sets one of glibc's malloc variables ``names`` (the user's policy holds)."""
    return any(os.environ.get(name) for name in names)


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold at :data:`THRESHOLD` bytes for this process (once); whether the policy holds.

    ``False`` when the C library has no ``mallopt`` or refuses it; ``True`` without a change when
    ``MALLOC_MMAP_THRESHOLD_`` is set (the user chose). Undoes :func:`keep_freed_memory` first, giving the kept heap
    back (``malloc_trim``).
    """
    if "done" not in _state:
        if _user_chose(("MALLOC_MMAP_THRESHOLD_",)):
            _state["done"] = True
        else:
            if _state.get("kept"):
                _mallopt((_M_MMAP_MAX, _DEFAULT_MMAP_MAX), (_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD))
                _state["kept"] = False
                try:
                    ctypes.CDLL(None).malloc_trim(0)
                except (OSError, AttributeError):
                    pass
            _state["done"] = _mallopt((_M_MMAP_THRESHOLD, THRESHOLD))
        hint = huge_pages_hint() if _state["done"] else None
        if hint is not None and comm.get_rank() == 0:
            logging.getLogger("microspeed.zero").warning(hint)
    return _state["done"]


def keep_freed_memory() -> bool:
    """Keep freed blocks of every size in glibc's heap for reuse (``M_MMAP_MAX`` 0, ``M_TRIM_THRESHOLD`` 2 GiB),
    for this process, once; whether the policy holds (see the module docstring).

    ``False`` where :func:`return_freed_memory` holds (a budget wins), where the environment sets one of glibc's
    malloc variables (the user chose), or where the C library has no ``mallopt``.
    """
    if "kept" not in _state:
        _state["kept"] = ("done" not in _state and not _user_chose(_USER_MALLOC_ENV)
                          and _mallopt((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _KEPT_TRIM_THRESHOLD)))
    return _state["kept"]


def kernel_huge_pages() -> str:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``); ``""`` where it has none."""
    try:
        with open(_THP_MODE) as f:
            text = f.read()
    except OSError:
        return ""
    return text[text.find("[") + 1:text.find("]")] if "[" in text else ""


def torch_huge_pages() -> bool:
    """Whether torch advises huge pages for its CPU allocations of 2 MiB or more (``THP_MEM_ALLOC_ENABLE`` was on at
    its first allocation). Probed with an untouched 64 MiB allocation (no page of it is faulted in): torch then aligns
    it to a page, where glibc otherwise maps it on its own (above its largest mmap threshold, 32 MiB) and returns the
    address after the mapping's header, never on a page boundary."""
    probe = torch.empty(64 << 20, dtype=torch.uint8)
    return probe.data_ptr() % mmap.PAGESIZE == 0


def huge_pages_hint() -> str | None:
    """What to set so that large tensors fault once per 2 MiB instead of once per 4 KiB (see the module docstring);
    ``None`` where nothing is to gain: huge pages on already, the kernel's mode ``never`` or ``always``, or
    ``THP_MEM_ALLOC_ENABLE=0`` set (the user chose)."""
    if os.environ.get(HUGE_PAGES_ENV, "").strip() == "0" or kernel_huge_pages() != "madvise" or torch_huge_pages():
        return None
    return (f"host memory: freed tensors go back to the system (glibc mmap threshold {THRESHOLD >> 20} MiB), so "
            f"every 4 KiB page of each large tensor torch allocates faults when first touched; set {HUGE_PAGES_ENV}=1 "
            f"in the launch environment (torch reads it once, at its first allocation: `{HUGE_PAGES_ENV}=1 microspeed "
            f"run ...`) to put them on transparent huge pages: a 2.44B-parameter GPT with NVMe offload on 2 ranks took "
            f"69 s per step with it, 85 s without ({HUGE_PAGES_ENV}=0 silences this)")


def _advise_huge(pages: mmap.mmap, start: int = 0, length: int = 0) -> None:
    """Advise bytes ``start:start+length`` of ``pages`` (all of them with ``length`` 0) onto transparent huge pages;
    nothing where the kernel or Python has no ``MADV_HUGEPAGE``."""
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            pages.madvise(mmap.MADV_HUGEPAGE, start, length or len(pages) - start)
        except OSError:  # a kernel without transparent huge pages: 4 KiB pages
            pass


def anonymous_pages(nbytes: int) -> mmap.mmap:
    """``nbytes`` of private anonymous memory, page-aligned, unmapped until touched; from 2 MiB on, advised onto
    transparent huge pages, so that filling it faults once per 2 MiB instead of once per 4 KiB. (``mmap.mmap(-1, n)``
    alone maps *shared* memory: shmem, on 4 KiB pages, each fault costlier.) The swappers' buffers
    (:func:`microspeed_zero.aio.aligned_empty`, the staging rings) live on it."""
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= HUGE_PAGE:
        _advise_huge(pages)
    return pages


class ReleasablePages:
    """A flat CPU tensor of ``numel`` elements on pages of its own, given back by :meth:`release` (see the module
    docstring). The tensor, and every view of it, stays valid throughout; after a release its values are undefined
    (the old ones, or zeros where the kernel took the pages) until written again. Starts zero-filled, unmapped.

    ``returned=True`` (for a process whose peak RSS is budgeted: offloaded parameters) gives the pages back at once
    (``MADV_DONTNEED``) instead of when the kernel needs them, and puts the buffer's whole 2 MiB ranges on transparent
    huge pages (the buffer starts on a 2 MiB boundary; ``MADV_HUGEPAGE``), so that the refill faults once per 2 MiB
    rather than once per 4 KiB (its last partial 2 MiB stays on 4 KiB pages: no byte beyond the buffer is touched)."""

    __slots__ = ("tensor", "_map", "_returned")

    def __init__(self, numel: int, dtype: torch.dtype, returned: bool = False) -> None:
        nbytes = int(numel) * dtype.itemsize
        self._returned = returned
        slack = HUGE_PAGE if returned else 0
        self._map = mmap.mmap(-1, max(nbytes, 1) + slack, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        skip = (-raw.data_ptr()) % HUGE_PAGE if returned else 0
        self.tensor = raw[skip:skip + nbytes].view(dtype)
        whole = nbytes // HUGE_PAGE * HUGE_PAGE
        if returned and whole:
            _advise_huge(self._map, skip, whole)

    def release(self) -> None:
        """Give the pages back: at once (``returned``), or mark them free for the kernel to reclaim when it needs
        memory (``MADV_DONTNEED`` at once where the kernel has no ``MADV_FREE``)."""
        if not self._returned and _state.get("madv_free", True):
            try:
                self._map.madvise(mmap.MADV_FREE)
                return
            except (AttributeError, OSError):  # before Linux 4.5, or not Linux
                _state["madv_free"] = False
        self._map.madvise(mmap.MADV_DONTNEED)
