"""Data for the demo model: a byte corpus every machine already has, and tiny synthetic sets.

The corpus is the Python standard library's own ``.py`` source, read as raw bytes - no
download, no cache on disk. It differs between Python versions (and installations), but
for one interpreter it is the same on every call and every rank.

Example::

    data = stdlib_corpus(max_bytes=1_000_000)
    train, val = train_val_split(data, val_fraction=0.05)
    loader = DataLoader(ByteSequenceDataset(train, seq_len=128), batch_size=8, shuffle=True)
    for batch in loader:            # batch == (x, y), each (8, 128) int64
        loss = model(batch)
"""

from __future__ import annotations

import os
import random
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

__all__ = [
    "ByteSequenceDataset",
    "random_token_dataset",
    "stdlib_corpus",
    "stdlib_source_files",
    "train_val_split",
]

# Directories never read: third-party code and byte-code caches.
_ALWAYS_SKIPPED = frozenset({"site-packages", "dist-packages", "__pycache__"})
# Test suites: large, full of deliberately odd files; skipped unless include_tests=True.
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})


def stdlib_source_files(
    include_tests: bool = False, root: str | os.PathLike[str] | None = None
) -> list[Path]:
    """List the standard library's ``.py`` files, sorted by their path relative to ``root``.

    Args:
        include_tests: also include files under ``test``/``tests``/``idle_test`` folders.
        root: directory to scan; defaults to ``sysconfig.get_paths()["stdlib"]``.
            ``site-packages``, ``dist-packages`` and ``__pycache__`` are always skipped.

    Returns:
        Absolute paths, ordered by relative POSIX path so the order is platform-independent.
    """
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    skipped = _ALWAYS_SKIPPED if include_tests else _ALWAYS_SKIPPED | _TEST_DIRS
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in skipped]  # prune in place: never descend
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath, name)
                found.append((path.relative_to(base).as_posix(), path))
    found.sort(key=lambda item: item[0])
    return [path for _, path in found]


def stdlib_corpus(
    max_bytes: int = 4_000_000,
    seed: int | None = 0,
    *,
    include_tests: bool = False,
) -> torch.Tensor:
    """Concatenate the standard library's ``.py`` sources as one 1-D tensor of byte values.

    Files are listed in sorted order (:func:`stdlib_source_files`); if ``seed`` is not None
    that list is then shuffled with ``random.Random(seed)`` so that a ``max_bytes`` prefix
    samples the whole library rather than its alphabetically first packages. Files are read
    in that order, concatenated, and the result is cut at exactly ``max_bytes`` bytes (or
    is shorter if the library is smaller). Nothing is cached on disk.

    Args:
        max_bytes: upper bound on the corpus length in bytes.
        seed: shuffle seed for the file order; ``None`` keeps sorted path order.
        include_tests: also read the standard library's test suites.

    Returns:
        An int64 tensor of shape ``(n,)`` with values in ``[0, 255]``; deterministic for a
        given Python installation and arguments.

    Raises:
        ValueError: if ``max_bytes`` is not positive.
        FileNotFoundError: if no ``.py`` source is found (e.g. a zipped standard library).
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    files = stdlib_source_files(include_tests=include_tests)
    if not files:
        raise FileNotFoundError(
            f"no .py files found under {sysconfig.get_paths()['stdlib']!r}; "
            "this interpreter's standard library is not available as source"
        )
    if seed is not None:
        random.Random(seed).shuffle(files)
    buf = bytearray()
    for path in files:
        try:
            buf += path.read_bytes()
        except OSError:  # unreadable file (permissions, broken link): skip it, deterministically
            continue
        if len(buf) >= max_bytes:
            break
    del buf[max_bytes:]
    if not buf:
        raise FileNotFoundError("the standard library's .py files could not be read")
    return torch.frombuffer(buf, dtype=torch.uint8).to(torch.int64)


def train_val_split(data: torch.Tensor, val_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a 1-D token tensor into a leading train part and a trailing validation part.

    The split is contiguous (no shuffling), so no sequence straddles both parts. Both parts
    are views of ``data``.

    Args:
        data: 1-D tensor of token ids.
        val_fraction: share of tokens for validation, in ``[0, 1)``.

    Returns:
        ``(train, val)``; ``val`` has ``int(len(data) * val_fraction)`` tokens.
    """
    if data.dim() != 1:
        raise ValueError(f"data must be 1-D, got shape {tuple(data.shape)}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_val = int(data.numel() * val_fraction)
    n_train = data.numel() - n_val
    return data[:n_train], data[n_train:]


class ByteSequenceDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping next-token-prediction samples cut from a 1-D token tensor.

    Sample ``i`` is ``(x, y)`` with ``x = data[i*L : i*L + L]`` and
    ``y = data[i*L + 1 : i*L + L + 1]`` (``y`` is ``x`` shifted left by one), where
    ``L = seq_len``; both int64 of shape ``(L,)``. There are ``(len(data) - 1) // L`` samples;
    the tail that does not fill a whole sample is dropped. Works for any token ids, not only
    bytes.

    Args:
        data: 1-D integer tensor of token ids (e.g. from :func:`stdlib_corpus`).
        seq_len: length of each sample.
    """

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        if data.dim() != 1:
            raise ValueError(f"data must be 1-D, got shape {tuple(data.shape)}")
        if data.dtype.is_floating_point or data.dtype.is_complex or data.dtype == torch.bool:
            raise TypeError(f"data must hold integer token ids, got {data.dtype}")
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if data.numel() < seq_len + 1:
            raise ValueError(f"need at least seq_len + 1 = {seq_len + 1} tokens, got {data.numel()}")
        self.data = data.long()
        self.seq_len = seq_len

    def __len__(self) -> int:
        """Number of whole ``(x, y)`` samples."""
        return (self.data.numel() - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return sample ``index`` as ``(x, y)``; negative indices count from the end."""
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"index {index} out of range for {n} samples")
        start = index * self.seq_len
        chunk = self.data[start : start + self.seq_len + 1]
        return chunk[:-1], chunk[1:]


def random_token_dataset(
    n_samples: int, seq_len: int, vocab: int = 256, seed: int = 0
) -> ByteSequenceDataset:
    """A tiny synthetic dataset of uniformly random tokens, for tests.

    Draws ``n_samples * seq_len + 1`` tokens in ``[0, vocab)`` from a private
    :class:`torch.Generator` seeded with ``seed`` (the global RNG is untouched), so it has
    exactly ``n_samples`` samples and is identical for the same arguments.
    """
    if n_samples <= 0 or seq_len <= 0 or vocab <= 0:
        raise ValueError("n_samples, seq_len and vocab must be positive")
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n_samples * seq_len + 1,), generator=gen, dtype=torch.int64)
    return ByteSequenceDataset(tokens, seq_len)
