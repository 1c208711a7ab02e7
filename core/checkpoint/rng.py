"""Every rank's random-number states (Python, numpy, torch, CUDA): captured at save, restored on request."""

from __future__ import annotations

import hashlib
import random
import sys
from typing import Any

import torch


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state().numpy().tobytes()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (name, keys.tobytes(), int(pos), int(has_gauss), float(cached))
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in state["cuda"]])
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.frombuffer(keys, dtype=np.uint32).copy(), pos, has_gauss, cached))


def _restore_rng(saved: list[dict[str, Any]], rank: int) -> None:
    if not saved:
        return
    if rank < len(saved):
        _set_rng_state(saved[rank])
        return
    digest = hashlib.sha256(saved[0]["torch"] + rank.to_bytes(4, "little")).digest()
    seed = int.from_bytes(digest[:8], "little") & (2**63 - 1)
    random.seed(seed)
    torch.manual_seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed % 2**32)
