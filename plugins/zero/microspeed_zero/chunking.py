"""How the gradient reducer splits its work (no torch here: the peak-RSS prediction reads it too).

A reduction moves one segment (stages 2, 3: staged into a buffer and received into another); at most
:data:`MAX_IN_FLIGHT` are in flight. A segment larger than ``min(reduce_bucket_size, CHUNK_NUMEL)`` values goes in
column chunks: chunk ``[a, b)`` carries columns ``a:b`` of every rank's slice (:func:`column_width`).
"""

from __future__ import annotations

MAX_IN_FLIGHT = 2
"""Reductions in flight at once (each holds its pooled buffers)."""

CHUNK_NUMEL = 1 << 23
"""The most values one reduction moves at once (``reduce_bucket_size`` bounds it too): a larger segment goes in
column chunks (32 MiB of fp32), so the pool's buffers stay about this size whatever the largest layer."""


def chunk_cap(reduce_bucket_size: int | None) -> int:
    """The most values one reduction moves: ``reduce_bucket_size``, at most :data:`CHUNK_NUMEL`."""
    return min(int(reduce_bucket_size or CHUNK_NUMEL), CHUNK_NUMEL)


def column_width(padded: int, world: int, cap: int) -> int:
    """Columns per chunk of a segment of ``padded`` values over ``world`` ranks, or 0 when it goes whole (it fits
    ``cap``, or one rank): as few chunks as fit ``cap``, of even widths rounded up to 64 values (so a chunk's adds
    start on the same vector lanes as a whole slice's: the sums are bit-identical to reducing it whole)."""
    if world == 1 or padded <= cap:
        return 0
    chunks = -(-padded // cap)
    width = -(-(padded // world) // chunks)
    return -(-width // 64) * 64 if width >= 64 else width


SHM_SLOT_BYTES = 1 << 20
"""Bytes of one rank's slot in ZeRO's shared-memory exchange (:mod:`microspeed_zero.shm`): the most one round of a
gather or reduction moves from a rank. Measured on stage 3's 45M GPT, 2 ranks (forward / backward ms): 1 MiB 169 /
346, 2 MiB 168-176 / 331-359, 8 MiB 194 / 366, 512 KiB 170 / 368 (more signals): a slot is copied in and out while it
is in the cache. 1 MiB keeps the slots' RSS smallest (8 MiB a rank on 2 ranks, 16 on 4)."""

SHM_SLOTS = 4
"""Slots per rank in the shared-memory exchange: rounds in flight before a writer waits for its peers."""

SHM_ENV = "MICROSPEED_ZERO_SHM"
"""``0`` in the environment: ZeRO's collectives keep gloo's transport (no shared-memory exchange)."""


def shm_enabled() -> bool:
    """Whether the environment leaves the shared-memory exchange on (:data:`SHM_ENV` is not ``0``)."""
    import os

    return os.environ.get(SHM_ENV, "1").strip() != "0"


def shm_touched_bytes(world: int, round_bytes: int) -> int:
    """Bytes of the shared-memory exchange each of ``world`` ranks touches (its own slots, written, and its peers',
    read: all count in its RSS) when its largest round moves ``round_bytes``."""
    return world * SHM_SLOTS * min(SHM_SLOT_BYTES, int(round_bytes)) if world > 1 else 0
