"""Tensors of which a rank holds only pieces: flat ranges (ZeRO) and boxes (tensor parallel), and placements.

A rank's pieces go to ``torch.distributed.checkpoint`` as a :class:`~torch.distributed.tensor.DTensor` of the
full shape. DTensor's placements describe even splits only, so its local tensor is a :class:`Pieces`:
this rank's pieces (views into the caller's storage) at their offsets in the full tensor, described to
DCP through the protocol DTensor itself implements (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``). DCP writes each piece once under the full tensor's key and reads back, into
the same views, what any other partition saved. The DTensor's one-dimensional mesh names the ranks; it
is built without process groups, because DCP asks it only whether this rank belongs to it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

_aten = torch.ops.aten


@runtime_checkable
class OnDemandPiece(Protocol):
    """A checkpoint piece whose values are produced when the checkpoint is written, not held in memory.

    Handed to :func:`flat_shard` in place of the local tensor (a piece of state that lives in files, say):
    ``numel`` elements of ``dtype``, in the flat order of the local tensor it stands for. The writer calls
    :meth:`read_into` item by item through a bounded buffer (:func:`~microspeed.checkpoint.storage.stream_rank_file`),
    so a save holding such pieces never stages the whole rank. It is read during ``save_checkpoint``, which
    is then synchronous even with ``checkpoint.async_save`` (the values change once training goes on).
    Loading never sees one: it reads into tensors.
    """

    numel: int
    dtype: torch.dtype

    def read_into(self, out: torch.Tensor, offset: int = 0) -> None:
        """Fill ``out`` (1-D, contiguous, CPU, ``dtype``) with elements ``[offset, offset + out.numel())``."""


class _Window:
    """Elements ``[start, start + prod(sizes))`` of an :class:`OnDemandPiece`, as a box of ``sizes``."""

    def __init__(self, source: OnDemandPiece, start: int, sizes: Sequence[int]) -> None:
        self.source, self.start, self.sizes = source, int(start), torch.Size(list(sizes))
        self.numel = self.sizes.numel()
        self.dtype = source.dtype
        self.device = torch.device("cpu")

    def size(self) -> torch.Size:
        """The box's sizes (as ``Tensor.size()``)."""
        return self.sizes

    def read_into(self, out: torch.Tensor, offset: int = 0) -> None:
        """Fill ``out`` (1-D) with the box's flat elements ``[offset, offset + out.numel())``."""
        if offset < 0 or offset + out.numel() > self.numel:
            raise ValueError(f"read_into: elements {offset}..{offset + out.numel()} of a piece of {self.numel}")
        self.source.read_into(out, self.start + offset)


def is_on_demand(piece: Any) -> bool:
    """Whether ``piece`` (a checkpoint item's source) is produced on demand rather than a tensor in memory."""
    return not isinstance(piece, torch.Tensor) and isinstance(piece, OnDemandPiece)


class Pieces(torch.Tensor):
    """This rank's pieces of a tensor of global ``shape``, as ``torch.distributed.checkpoint`` reads and writes them.

    ``pieces[i]`` is the box at ``offsets[i]`` of the full tensor (a view: saving reads it, loading
    writes it in place). No arithmetic: it only travels inside a DTensor to DCP (``detach`` and
    same-shape views give another :class:`Pieces` over the same views).
    """

    _pieces: list[Any]
    _chunks: list[ChunkStorageMetadata]
    _properties: TensorProperties

    @staticmethod
    def __new__(cls, pieces: Sequence[torch.Tensor], offsets: Sequence[Sequence[int]], shape: Sequence[int],
                dtype: torch.dtype, device: torch.device) -> Pieces:
        """Describe ``pieces`` at ``offsets`` of a tensor of ``shape`` (all pieces of ``dtype`` on ``device``).

        A piece is a tensor view, or (saving only) a box of an :class:`OnDemandPiece`.
        """
        r = torch.Tensor._make_wrapper_subclass(cls, torch.Size(list(shape)), dtype=dtype, device=device)
        r._pieces = list(pieces)
        r._chunks = [ChunkStorageMetadata(offsets=torch.Size(list(o)), sizes=p.size())
                     for p, o in zip(pieces, offsets, strict=True)]
        r._properties = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False,
                                         memory_format=torch.contiguous_format, pin_memory=False)
        return r

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Pieces(shape={list(self.shape)}, chunks={[(list(c.offsets), list(c.sizes)) for c in self._chunks]})"

    def _same(self) -> Pieces:
        return Pieces(self._pieces, [c.offsets for c in self._chunks], self.shape, self.dtype, self.device)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        """``detach``, ``alias`` and same-shape ``view``: another :class:`Pieces` over the same views; nothing else."""
        me = args[0]
        if func in (_aten.detach.default, _aten.alias.default):
            return me._same()
        if func is _aten.view.default and list(args[1]) == list(me.shape):
            return me._same()
        raise NotImplementedError(f"{func} is not supported on checkpoint pieces (microspeed.checkpoint.Pieces); "
                                  f"they only carry a rank's pieces to torch.distributed.checkpoint.")

    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        """DCP: one write item per piece, at its offset in the full tensor."""
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=self._properties, size=self.shape))
                for chunk in self._chunks]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """DCP: the boxes this rank holds (what it reads on load)."""
        return list(self._chunks)

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """DCP: the piece at ``index.offset``."""
        for piece, chunk in zip(self._pieces, self._chunks, strict=True):
            if chunk.offsets == index.offset:
                return piece
        raise ValueError(f"checkpoint pieces of {index.fqn!r} hold no piece at {index.offset}")


def _is_sharded(t: Any) -> bool:
    return isinstance(t, DTensor)


@functools.lru_cache(maxsize=16)
def _mesh(device_type: str, world: int, rank: int) -> DeviceMesh:
    """A one-dimensional mesh over ranks ``0 .. world - 1`` seen from ``rank``, without process groups.

    DCP reads a DTensor's mesh only for this rank's coordinate (is it part of the mesh?); the pieces
    are described by :class:`Pieces`. A pure function of its arguments, hence cached.
    """
    return DeviceMesh(device_type, list(range(world)), _init_backend=False, _rank=rank)


def _pieces_tensor(pieces: list[Any], offsets: list[tuple[int, ...]], shape: Sequence[int], rank: int,
                   world: int, like: Any) -> DTensor:
    """A DTensor of global ``shape`` whose local tensor is :class:`Pieces` (``pieces`` at ``offsets``)."""
    shape = torch.Size(list(shape))
    stride, acc = [], 1
    for size in reversed(shape):
        stride.insert(0, acc)
        acc *= size
    device = getattr(like, "device", torch.device("cpu"))
    local = Pieces(pieces, offsets, shape, like.dtype, device)
    mesh = _mesh(device.type, max(world, rank + 1), rank)
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=tuple(stride))


def _world(named: int) -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else named


def flat_range_boxes(shape: tuple[int, ...] | list[int], start: int, end: int) -> list[tuple[list[int], list[int]]]:
    """Split the row-major flat range ``[start, end)`` of a tensor of ``shape`` into boxes.

    Returns ``[(offsets, sizes), ...]`` in flat order; each box is contiguous in the flat
    order, so its data is ``flat[a:a + prod(sizes)].view(sizes)``. At most ``2 * ndim - 1`` boxes.
    """
    shape = list(shape)
    if not shape:
        return [([], [])] if start < end else []
    boxes: list[tuple[list[int], list[int]]] = []

    def rec(prefix: list[int], dims: list[int], s: int, e: int) -> None:
        if s >= e:
            return
        inner = 1
        for d in dims[1:]:
            inner *= d
        i0, r0 = divmod(s, inner)
        i1, r1 = divmod(e, inner)
        if i0 == i1:
            rec(prefix + [i0], dims[1:], r0, r1)
            return
        if r0:
            rec(prefix + [i0], dims[1:], r0, inner)
            i0 += 1
        if i1 > i0:
            boxes.append((prefix + [i0] + [0] * (len(dims) - 1), [1] * len(prefix) + [i1 - i0] + dims[1:]))
        if r1:
            rec(prefix + [i1], dims[1:], 0, r1)

    rec([], shape, start, end)
    return boxes


def flat_shard(local: torch.Tensor | OnDemandPiece, shape: tuple[int, ...] | list[int],
               ranges_by_rank: list[list[tuple[int, int]]], rank: int) -> Any:
    """A sharded tensor (a DTensor) of global ``shape`` whose pieces are flat ranges of its row-major order.

    ``ranges_by_rank[q]`` lists the flat ranges rank ``q`` (global rank) holds, together covering
    the tensor exactly once; ``local`` is this ``rank``'s pieces concatenated (1-D, a view into
    the caller's storage: saving reads it, loading writes it in place). Checkpoints key it like
    the full tensor, so it reloads under any other partition, or as a plain tensor.

    ``local`` may instead be an :class:`OnDemandPiece` (saving only): its elements are read when the
    checkpoint is written, through a bounded buffer; the checkpoint is the same as for the tensor.
    """
    shape = list(shape)
    pieces, offsets = [], []
    offset = 0
    for start, end in ranges_by_rank[rank] if rank < len(ranges_by_rank) else []:
        for offs, sizes in flat_range_boxes(shape, start, end):
            n = 1
            for x in sizes:
                n *= x
            pieces.append(local[offset:offset + n].view(sizes) if isinstance(local, torch.Tensor)
                          else _Window(local, offset, sizes))
            offsets.append(tuple(offs))
            offset += n
    return _pieces_tensor(pieces, offsets, shape, rank, _world(len(ranges_by_rank)), local)


@dataclass(frozen=True)
class Placement:
    """Where this rank's piece of a parameter sits in the full tensor (see ``microspeed_checkpoint_placements``).

    ``shape``: the full tensor's; ``offsets``/``local``: this rank's box; ``pieces``: ``(global rank,
    offsets, sizes)`` of one complete copy that includes this rank's piece (its replica's ranks);
    ``write``: whether this rank's data-parallel replica writes the box (exactly one replica should);
    ``duplicate``: another rank of the same replica holds and writes the same values (a tied copy on
    a later pipeline stage, a replicated parameter on tensor rank > 0), so this rank never writes it.

    **Composition with data-axis sharding.** When another plugin already presents the tensor as
    pieces of the local box (ZeRO's :func:`flat_shard` of a tensor-parallel shard, each data-parallel
    rank holding different flat ranges), those pieces are moved into the full tensor at ``offsets``
    (:func:`place_pieces`) and every data-parallel rank writes its own; ``write`` is then moot,
    ``duplicate`` still holds. Loading composes the same way, so a checkpoint written under
    pp × tp × dp with any ZeRO stage reads back under any other pp, tp, dp and stage.
    """

    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    local: tuple[int, ...]
    pieces: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]
    write: bool = True
    duplicate: bool = False

    @property
    def whole(self) -> bool:
        """Whether this rank's box is the whole tensor (a placement that only says who writes)."""
        return tuple(self.local) == tuple(self.shape)


def box_shard(local: torch.Tensor, shape: tuple[int, ...] | list[int],
              pieces: Sequence[tuple[int, Sequence[int], Sequence[int]]], rank: int) -> Any:
    """A sharded tensor (a DTensor) of global ``shape`` made of boxes ``(global rank, offsets, sizes)``.

    ``local`` is ``rank``'s box.

    Like :func:`flat_shard`, but each piece is a rectangular box (a tensor-parallel split along any
    dimension). Saving reads ``local``; loading writes it in place.
    """
    mine = [(local.view(list(sizes)), tuple(offsets)) for q, offsets, sizes in pieces if q == rank]
    named = max((q for q, _o, _s in pieces), default=rank) + 1
    return _pieces_tensor([m[0] for m in mine], [m[1] for m in mine], shape, rank, _world(named), local)


def placement_of(key: str, placements: dict[str, Placement]) -> Placement | None:
    """The placement of the parameter a checkpoint key belongs to (``model/``, ``master/``, ``optim/<fqn>/``)."""
    if not placements:
        return None
    head, _, rest = key.partition("/")
    if head in ("model", "master"):
        return placements.get(rest)
    if head == "optim":
        return placements.get(rest.rpartition("/")[0])
    return None


def place_pieces(sharded: Any, where: Placement, rank: int) -> Any:
    """The pieces of ``sharded`` (a tensor of shape ``where.local`` split by another plugin) inside the full tensor.

    ``sharded`` is a DTensor made by :func:`flat_shard` or :func:`box_shard` over this rank's box; the
    result is a DTensor of ``where.shape`` over the very same views, each piece moved by
    ``where.offsets`` (a ZeRO flat range of a tensor-parallel shard becomes a box of the full tensor).
    """
    local = sharded._local_tensor
    if not isinstance(local, Pieces):
        raise TypeError(f"place_pieces: expected checkpoint pieces inside the sharded tensor, got {type(local)}")
    offsets = [tuple(int(o) + int(w) for o, w in zip(chunk.offsets, where.offsets, strict=True))
               for chunk in local._chunks]
    return _pieces_tensor(local._pieces, offsets, where.shape, rank, _world(rank + 1), local)


def apply_placements(tensors: dict[str, Any], placements: dict[str, Placement], rank: int) -> None:
    """Replace each placed piece in ``tensors`` by its sharded view; drop it where another rank writes it.

    A tensor another plugin already split into pieces (a DTensor of the local box) keeps its
    pieces, moved into the full tensor (:func:`place_pieces`): each data-parallel rank writes its own.
    """
    for key in list(tensors):
        where = placement_of(key, placements)
        t = tensors[key]
        if where is None or not isinstance(t, torch.Tensor) or tuple(t.shape) != where.local:
            continue
        if where.duplicate:
            del tensors[key]
        elif _is_sharded(t):
            if not where.whole:
                tensors[key] = place_pieces(t, where, rank)
        elif not where.write:
            del tensors[key]
        elif not where.whole:
            tensors[key] = box_shard(t.contiguous(), where.shape, where.pieces, rank)


def collect_placements(engine: Any) -> dict[str, Placement]:
    """Every plugin's ``microspeed_checkpoint_placements`` answer, merged."""
    out: dict[str, Placement] = {}
    for part in engine.hook.microspeed_checkpoint_placements(engine=engine):
        out.update(part or {})
    return out
