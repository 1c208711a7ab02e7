"""Helpers shared by the benchmark scripts (run as ``python benchmarks/<script>.py``)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

import microspeed
from microspeed.demo.data import ByteSequenceDataset, stdlib_corpus


def core_fingerprint() -> str:
    """A short hash of microspeed's installed sources, to tell which state of the core a result measured."""
    root = Path(microspeed.__file__).parent
    h = hashlib.sha1()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def make_batches(n: int, micro: int, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` fixed batches ``(x, y)`` of shape ``(micro, seq_len)`` from the stdlib corpus (wrapping)."""
    data = ByteSequenceDataset(stdlib_corpus(max_bytes=min(n * micro * seq_len + 1, 8_000_000)), seq_len)
    out, k = [], 0
    for _ in range(n):
        rows = [data[(k + j) % len(data)] for j in range(micro)]
        k += micro
        out.append((torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])))
    return out
