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
