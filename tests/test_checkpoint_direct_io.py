"""The streamed save's file writer (:mod:`microspeed.checkpoint.direct_io`): the same bytes past the page cache.

Items at increasing offsets with gaps between them, across staging-block boundaries and ending off the alignment,
written by :class:`DirectWriter` (``O_DIRECT``, two small blocks here so that both alternate many times) give the
file a buffered write gives; where ``O_DIRECT`` is missing (no flag) or refused (tmpfs), :func:`open_stream` falls
back to the buffered writer with the same result; a writer that goes backwards is an error, not a corrupt file.
"""

from __future__ import annotations

import os

import pytest

from microspeed.checkpoint import direct_io


def _items() -> list[tuple[int, bytes]]:
    """(offset, bytes) at increasing offsets: gaps, pieces larger than a block, an unaligned end."""
    out, at = [], 0
    for i, n in enumerate([5, 8192, 3000, 20_000, 1, 12_289]):
        at += 64 * (i % 3)  # a gap (zeros) before some items
        out.append((at, bytes((i * 37 + k) % 251 for k in range(n))))
        at += n
    return out


def _expected(items: list[tuple[int, bytes]], size: int) -> bytes:
    buf = bytearray(size)
    for at, data in items:
        buf[at:at + len(data)] = data
    return bytes(buf)


def _write(path: str, items: list[tuple[int, bytes]], size: int) -> str:
    out = direct_io.open_stream(path)
    for at, data in items:
        out.write_at(at, memoryview(data))
    out.close(size)
    return type(out).__name__


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(direct_io, "BLOCK", 8192)
    monkeypatch.setattr(direct_io, "_ZEROS", bytes(8192))


def test_direct_writer_gives_the_buffered_file(tmp_path, small_blocks):
    items = _items()
    size = items[-1][0] + len(items[-1][1]) + 7  # the file's length: past the last item
    kind = _write(str(tmp_path / "direct"), items, size)
    if kind != "DirectWriter":
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT")
    with open(tmp_path / "direct", "rb") as fh:
        assert fh.read() == _expected(items, size)


@pytest.mark.parametrize("why", ["no O_DIRECT flag", "EINVAL at the first aligned write"])
def test_without_o_direct_the_buffered_writer_writes_the_same(tmp_path, monkeypatch, small_blocks, why):
    """No ``O_DIRECT`` on this platform, or a file system that opens with it but fails the first aligned write
    with EINVAL (tmpfs on older kernels, some network file systems): the buffered writer takes over."""
    import errno

    def refuse(*_a):
        raise OSError(errno.EINVAL, "Invalid argument")

    if why == "no O_DIRECT flag":
        monkeypatch.delattr(os, "O_DIRECT", raising=False)
    else:
        monkeypatch.setattr(direct_io.os, "pwrite", refuse)
    items = _items()
    size = items[-1][0] + len(items[-1][1])
    assert _write(str(tmp_path / "buffered"), items, size) == "BufferedWriter"
    with open(tmp_path / "buffered", "rb") as fh:
        assert fh.read() == _expected(items, size)


def test_writing_backwards_is_refused(tmp_path, small_blocks):
    out = direct_io.open_stream(str(tmp_path / "f"))
    if not out.direct:
        out.abort()
        pytest.skip("no O_DIRECT here")
    out.write_at(100, memoryview(b"x" * 10))
    with pytest.raises(ValueError, match="writes must go forward"):
        out.write_at(50, memoryview(b"y"))
    out.abort()
