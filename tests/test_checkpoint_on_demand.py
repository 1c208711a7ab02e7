"""On-demand checkpoint pieces (:class:`microspeed.checkpoint.OnDemandPiece`) stream into the rank's file.

One process, the storage layer directly: a rank's items — a plain tensor, a non-contiguous one and a
:func:`flat_shard` over an on-demand piece — written by :func:`storage.stream_rank_file` through 16-byte
bounce buffers (two: the piece's next window is read ahead while one is written) give the same file bytes and
checksums as staging them whole (:class:`storage.Staging` and
:func:`storage.write_rank_file`); the piece is asked for at most the bounce buffer's worth at a time; and reading
the finished checkpoint back in windows of :data:`storage.STREAM_CHUNK_BYTES` returns every value, holding no
more than one window (or one row) beside the targets.
"""

from __future__ import annotations

import os

import torch

from microspeed.checkpoint import (
    OnDemandPiece,
    Reader,
    flat_shard,
    new_manifest,
    read_manifest,
    read_tensor_index,
    storage,
)
from microspeed.plugin_api import OnDemandPiece as PublicOnDemandPiece


class Counting:
    """``numel`` fp32 values ``base + index``, produced on demand; records the largest request."""

    def __init__(self, numel: int, base: float) -> None:
        self.numel, self.dtype, self.base, self.largest = numel, torch.float32, base, 0

    def read_into(self, out: torch.Tensor, offset: int = 0) -> None:
        """Fill ``out`` with elements ``[offset, offset + out.numel())``."""
        self.largest = max(self.largest, out.numel())
        torch.arange(offset, offset + out.numel(), dtype=torch.float32, out=out).add_(self.base)


def _tensors(piece: Counting) -> dict:
    plain = torch.arange(30, dtype=torch.float32).view(6, 5)
    return {"model/plain": plain, "model/transposed": plain.t(),
            "optim/w/exp_avg": flat_shard(piece, (4, 6), [[(0, 24)]], 0)}


def _write(tmp: str, stream: bool, piece: Counting) -> None:
    os.makedirs(tmp)
    items = storage.local_items(_tensors(piece))
    if stream:
        layout = storage.plan_layout(items)
        # two 16-byte buffers: the piece's next window is read ahead (a helper thread) while one is written
        assert storage.stream_rank_file(tmp, 0, layout, chunk_bytes=16) == 32
    else:
        staging = storage.Staging()
        layout = staging.stage(items)
        storage.write_rank_file(tmp, 0, staging.buffer, layout)
    storage.finalize(tmp, 1, new_manifest("t", 1, {}, {}, 1))


def test_streamed_file_equals_staged_file_and_reads_back_in_windows(tmp_path, monkeypatch):
    assert PublicOnDemandPiece is OnDemandPiece and isinstance(Counting(1, 0.0), OnDemandPiece)
    streamed, staged = Counting(24, 100.0), Counting(24, 100.0)
    _write(str(tmp_path / "streamed"), True, streamed)
    _write(str(tmp_path / "staged"), False, staged)
    assert streamed.largest == 4 and staged.largest == 24  # 16 bytes at a time against the whole piece
    name = storage.data_file(0)
    files = read_manifest(str(tmp_path / "streamed"))["tensor_files"]
    assert files == read_manifest(str(tmp_path / "staged"))["tensor_files"]  # offsets, lengths, crc32s
    with open(tmp_path / "streamed" / name, "rb") as a, open(tmp_path / "staged" / name, "rb") as b:
        streamed_bytes, staged_bytes = a.read(), b.read()  # the same items (the padding between is unspecified)
    assert len(streamed_bytes) == len(staged_bytes) == files[name]["bytes"]
    assert [streamed_bytes[at:at + n] for at, n, _crc in files[name]["items"]] == \
        [staged_bytes[at:at + n] for at, n, _crc in files[name]["items"]]

    monkeypatch.setattr(storage, "STREAM_CHUNK_BYTES", 24)  # a window: one row of 5 or 6 fp32 values (20 / 24 bytes)
    tag = str(tmp_path / "streamed")
    reader = Reader(tag, read_tensor_index(tag), read_manifest(tag))
    plain, transposed = torch.empty(6, 5), torch.empty(5, 6)
    state = torch.empty(24)
    reader.read_now([("model/plain", plain, "plain"), ("model/transposed", transposed, "transposed"),
                     ("optim/w/exp_avg", flat_shard(state[5:17], (4, 6), [[(5, 17)]], 0), "exp_avg")])
    assert torch.equal(plain, torch.arange(30, dtype=torch.float32).view(6, 5))
    assert torch.equal(transposed, plain.t())
    assert torch.equal(state[5:17], torch.arange(105, 117, dtype=torch.float32))
    assert reader.window_bytes == 24  # never a whole 120-byte tensor at once
