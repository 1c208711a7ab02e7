"""Shared fixtures: a tiny model and a base config; every test runs with torch on 1 thread."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)
    yield


class TinyNet(torch.nn.Module):
    """Two linear layers; returns the MSE loss for ``(x, y)``."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(d, 16)
        self.fc2 = torch.nn.Linear(16, 1)

    def forward(self, x, y=None):
        out = self.fc2(torch.tanh(self.fc1(x)))
        return out if y is None else torch.nn.functional.mse_loss(out, y)


@pytest.fixture
def tiny_model():
    torch.manual_seed(0)
    return TinyNet()


@pytest.fixture
def base_config():
    return {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
