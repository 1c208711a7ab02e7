"""Each test here that starts a one-process gloo group (ZeRO, ``zero.Init``) ends it, so test order never matters."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _own_process_group():
    had_group = dist.is_available() and dist.is_initialized()
    yield
    if not had_group and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
