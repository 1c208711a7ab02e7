"""return_freed_memory(): under NVMe offload, a 1-32 MiB tensor gets pages of its own, returned when it is freed.

Each case runs in a fresh interpreter (the policy is process-wide). A 16 MiB tensor is freed first: glibc's dynamic
policy then raises its mmap threshold to 16 MiB, and a 2 MiB tensor allocated next comes from the heap (whose pages
stay with the process after it is freed, once other allocations sit above it). With the policy the 2 MiB tensor is
mapped on its own, outside the heap. The policy leaves a ``MALLOC_MMAP_THRESHOLD_`` the user set alone.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from microspeed_zero.host_memory import kernel_huge_pages

PROBE = """
import sys, torch
from microspeed_zero.host_memory import return_freed_memory
policy = return_freed_memory() if sys.argv[1] == 'on' else None
big = torch.ones(4 << 20)
del big
t = torch.ones(2 << 18)
heap = [line.split()[0].split('-') for line in open('/proc/self/maps') if line.rstrip().endswith('[heap]')]
inside = any(int(lo, 16) <= t.data_ptr() < int(hi, 16) for lo, hi in heap)
print(policy, inside)
"""


def _run(mode: str, env: dict) -> list[str]:
    return subprocess.run([sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, timeout=120,
                          check=True).stdout.split()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps") or not hasattr(os, "confstr")
                    or "glibc" not in (os.confstr("CS_GNU_LIBC_VERSION") or ""), reason="glibc's malloc on Linux")
@pytest.mark.timeout(240)
def test_tensors_of_a_mebibyte_or_more_get_their_own_pages():
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    assert _run("off", env) == ["None", "True"]  # the dynamic threshold: from the heap
    assert _run("on", env) == ["True", "False"]
    assert _run("on", {**env, "MALLOC_MMAP_THRESHOLD_": "4194304"}) == ["True", "True"]  # the user's setting holds



HUGE = """
import logging, resource, torch
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from microspeed_zero.host_memory import huge_pages_hint, return_freed_memory, torch_huge_pages
on = torch_huge_pages()
assert return_freed_memory()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.ones(16 << 20)  # 64 MiB, on pages of its own (the policy)
print(on, huge_pages_hint() is None, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(kernel_huge_pages() != "madvise", reason="the kernel's transparent huge pages in madvise mode")
@pytest.mark.timeout(240)
def test_the_fixed_threshold_names_huge_pages_when_torch_has_them_off():
    """Under the policy, a 64 MiB tensor faults per 4 KiB page without THP_MEM_ALLOC_ENABLE (16384 faults) and
    the policy's first use logs the variable to set; with it, per 2 MiB (fewer than 1000 faults: only its ends,
    which torch aligns to a page, not to 2 MiB, take 4 KiB pages), and no hint. Set to 0: no hint."""
    env = {k: v for k, v in os.environ.items() if k not in ("THP_MEM_ALLOC_ENABLE", "MALLOC_MMAP_THRESHOLD_")}
    for value, huge in (("", False), ("1", True), ("0", False)):
        out = subprocess.run([sys.executable, "-c", HUGE], env={**env, "THP_MEM_ALLOC_ENABLE": value} if value else env,
                             capture_output=True, text=True, timeout=120, check=True)
        on, quiet, faults = out.stdout.split()
        assert on == str(huge) and quiet == str(huge or value == "0"), (value, out.stdout)
        assert int(faults) < 1000 if huge else int(faults) >= 16 << 10, (value, faults)
        assert ("THP_MEM_ALLOC_ENABLE=1 in the launch environment" in out.stderr) == (quiet == "False"), out.stderr


def _mapping_kib(address: int, field: str) -> int:
    """``field`` (``Rss``, ``Anonymous``, ``AnonHugePages``, ``LazyFree``) of the mapping at ``address``, in KiB."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == field + ":":
                return int(line.split()[1])
    raise AssertionError("no mapping holds the address")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux")
def test_releasable_pages_are_given_back_and_the_tensor_stays():
    """A 16 MiB ReleasablePages buffer: released, its pages are the kernel's to take (LazyFree, or gone at once where
    there is no MADV_FREE); the tensor and a view taken before stay usable, and values written after the release
    are read back."""
    import torch
    from microspeed_zero.host_memory import ReleasablePages

    pages = ReleasablePages(4 << 20, torch.float32)
    t = pages.tensor
    assert t.numel() == 4 << 20 and t.dtype == torch.float32 and t.data_ptr() % os.sysconf("SC_PAGE_SIZE") == 0
    assert not t.any()  # starts zero-filled
    view = t[1 << 20:2 << 20].view(1024, 1024)
    t.fill_(1.5)
    pages.release()
    assert _mapping_kib(t.data_ptr(), "LazyFree") >= 15 << 10 or not t.any()
    t.zero_()
    view.fill_(2.0)
    assert float(t[1 << 20]) == 2.0 and float(t.sum()) == 2.0 * (1 << 20)


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux")
def test_returned_pages_start_on_a_huge_page_and_leave_at_once():
    """``returned=True`` (offloaded parameters): the buffer starts on a 2 MiB boundary, its whole 2 MiB ranges are
    on huge pages where the kernel gives them (madvise mode), a release gives every page back at once (not lazily),
    and the tensor and a view taken before stay usable."""
    import torch
    from microspeed_zero.host_memory import HUGE_PAGE, ReleasablePages

    pages = ReleasablePages((5 << 20) + 3, torch.float32, returned=True)  # 20 MiB + 12 bytes
    t = pages.tensor
    assert t.numel() == (5 << 20) + 3 and t.data_ptr() % HUGE_PAGE == 0 and not t.any()
    view = t[-4:]
    t.fill_(1.5)
    start = t.data_ptr()
    assert _mapping_kib(start, "Rss") >= 20 << 10
    if kernel_huge_pages() in ("madvise", "always"):
        assert _mapping_kib(start, "AnonHugePages") > 0
    pages.release()
    assert _mapping_kib(start, "Rss") == 0 and not t.any()  # gone at once: zeros
    view.fill_(2.0)
    assert float(t.sum()) == 8.0 and float(t[-1]) == 2.0


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux")
def test_swap_buffers_are_private_memory_on_huge_pages():
    """The swappers' page-aligned buffers (``aligned_empty``, the staging rings) are private anonymous memory — not
    shmem, which ``mmap.mmap(-1, n)`` maps by default and which faults per 4 KiB — advised onto huge pages."""
    import torch
    from microspeed_zero.aio import aligned_empty

    t = aligned_empty(16 << 20, torch.float32)  # 64 MiB
    assert t.data_ptr() % 4096 == 0
    t.fill_(1.0)
    assert _mapping_kib(t.data_ptr(), "Anonymous") >= 64 << 10
    if kernel_huge_pages() in ("madvise", "always"):
        assert _mapping_kib(t.data_ptr(), "AnonHugePages") >= 32 << 10


KEEP = """
import resource, sys, torch
from microspeed_zero import host_memory
order = sys.argv[1]
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
policy = []
for step in order.split(","):
    policy.append(host_memory.keep_freed_memory() if step == "keep" else host_memory.return_freed_memory())
counts = []
for _ in range(4):  # autograd's pattern: large tensors allocated afresh, freed, allocated again
    before = faults()
    a = torch.ones(16 << 20)  # 64 MiB: above glibc's largest dynamic mmap threshold (32 MiB)
    b = torch.ones(2 << 20)
    del a, b
    counts.append(faults() - before)
print(policy, counts[-1])
"""


@pytest.mark.skipif(not hasattr(os, "confstr") or "glibc" not in (os.confstr("CS_GNU_LIBC_VERSION") or ""),
                    reason="glibc's malloc")
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_kept_memory_is_reused_without_faults_and_a_budget_wins():
    """keep_freed_memory(): a 64 MiB and an 8 MiB tensor allocated again fault no page once the heap holds them
    (without the policy: all 18k pages every time). After return_freed_memory() (a budget) the policy is refused,
    and return_freed_memory() after it gives the heap back and faults again. glibc's variables set by the user
    leave the process alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}

    def run(order: str, extra: dict | None = None) -> tuple[str, int]:
        out = subprocess.run([sys.executable, "-c", KEEP, order], env={**env, **(extra or {})}, capture_output=True,
                             text=True, timeout=120, check=True).stdout.rsplit(" ", 1)
        return out[0], int(out[1])

    assert run("keep") == ("[True]", 0)
    policy, faults = run("return")
    assert policy == "[True]" and faults >= 18 << 10  # every page of both, every time
    policy, faults = run("return,keep")
    assert policy == "[True, False]" and faults >= 18 << 10  # the budget wins
    policy, faults = run("keep,return")
    assert policy == "[True, True]" and faults >= 18 << 10  # kept, then given back
    policy, faults = run("keep", {"MALLOC_TRIM_THRESHOLD_": "131072"})
    assert policy == "[False]"  # the user's setting holds


def _policy_body(zero: dict) -> dict:
    import torch
    from microspeed_zero import host_memory

    import microspeed

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    microspeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero,
                                               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    return dict(host_memory._state)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_zero_stages_2_3_on_the_cpu_keep_freed_memory_unless_a_budget_is_set():
    from microspeed.testing import run_distributed

    env = {"MALLOC_TRIM_THRESHOLD_": "", "MALLOC_MMAP_MAX_": "", "MALLOC_MMAP_THRESHOLD_": ""}
    assert run_distributed(_policy_body, world_size=1, args=({"stage": 2},), env=env) == [{"kept": True}]
    assert run_distributed(_policy_body, world_size=1, args=({"stage": 1},), env=env) == [{}]  # stage 1: glibc's
    state = run_distributed(_policy_body, world_size=1, args=({"stage": 2, "host_memory_budget": "8GiB"},), env=env)
    assert state[0].get("done") is True and not state[0].get("kept")
