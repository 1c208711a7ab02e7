"""DeepSpeed 0.19.8's CPU accelerator behaviours that DeepSpeed's own unit tests rely on.

Found by ``benchmarks/deepspeed_unit_tests.py``: DeepSpeed's test harness (``tests/unit/common.py``) skips every
multi-rank test when ``get_accelerator().device_count()`` is below the test's world size. DeepSpeed's CPU
accelerator counts ``LOCAL_SIZE`` (the launcher sets it to the number of local ranks) as its device count, so
on CPU a 2- or 4-rank test runs; with microspeed's accelerator (count 1) all of them were skipped.
"""

from __future__ import annotations

import pytest

from microspeed.compat.accelerator import get_accelerator


def test_cpu_device_count_defaults_to_one_without_local_size(monkeypatch):
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    if get_accelerator().device_name() != "cpu":
        pytest.skip("CPU accelerator only")
    assert get_accelerator().device_count() >= 1


def test_cpu_device_count_follows_local_size(monkeypatch):
    """DeepSpeed's CPU accelerator returns int(LOCAL_SIZE) when set (its harness skips world_size > count)."""
    if get_accelerator().device_name() != "cpu":
        pytest.skip("CPU accelerator only")
    monkeypatch.setenv("LOCAL_SIZE", "4")
    assert get_accelerator().device_count() == 4
