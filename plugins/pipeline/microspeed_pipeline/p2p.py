"""Point-to-point transfers between pipeline stages, with shapes negotiated once per batch.

An activation is a tensor or a tuple of tensors. Before the first transfer of each batch on a
channel (``(peer, kind)``), the sender sends a small header — for each tensor its dtype, whether
it needs a gradient, and its shape — so the receiver can allocate; the rest of the batch reuses
it, and the next batch negotiates again (so shapes may change from batch to batch). Within one
batch every micro-batch must have the same shapes (a clear error otherwise), unless the module
was built with ``dynamic_shape=True`` (DeepSpeed's argument): then every transfer sends its header.

With tensor parallelism, ``pipeline.pipe_partitioned`` / ``grad_partitioned`` (DeepSpeed's keys, on by
default as there) split each floating-point activation / gradient over the tensor-parallel group: every
tensor rank of a stage holds the same tensor, so each sends only its ``1/tp`` slice to the same tensor
rank of the peer stage, and the receiving stage's tensor ranks all-gather the slices back into the
whole tensor. The numbers are the same; each rank moves ``1/tp`` of the bytes between stages.

Sends are non-blocking (``isend``; their handles are kept, with the tensors, until
:meth:`P2P.wait_all` at the end of the batch); receives block. Every message carries a distinct
tag (kind, chunk, micro-batch, tensor index), so on gloo out-of-order arrival cannot mix them up.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int8, torch.int16]
_HEADER = 128
_KINDS = {"act": 0, "grad": 1}


def _tag(kind: str, chunk: int, micro_batch: int, index: int) -> int:
    return (_KINDS[kind] << 28) | ((chunk & 0xF) << 24) | ((micro_batch & 0xFFFF) << 8) | (index & 0xFF)


def as_tuple(x: Any) -> tuple[torch.Tensor, ...]:
    """``x`` as a tuple of tensors (a lone tensor becomes a 1-tuple); anything else is refused."""
    items = x if isinstance(x, tuple) else (x,)
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"pipeline: a stage must pass tensors (or tuples of tensors) to the next stage; item {i} "
                            f"is {type(t).__name__}.")
    return items


def encode_meta(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The header: ``[n, (dtype, requires_grad, ndim, *shape) per tensor]`` in an int64 tensor of fixed size."""
    body = [len(tensors)]
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise TypeError(f"pipeline: cannot send a tensor of dtype {t.dtype} between stages.")
        body += [_DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *t.shape]
    if len(body) > _HEADER:
        raise ValueError(f"pipeline: activation metadata needs {len(body)} slots (> {_HEADER}); send fewer or "
                         f"lower-rank tensors between stages.")
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[:len(body)] = torch.tensor(body, dtype=torch.int64)
    return header


def decode_meta(header: torch.Tensor) -> list[tuple[torch.dtype, bool, tuple[int, ...]]]:
    """Inverse of :func:`encode_meta`: ``[(dtype, requires_grad, shape), ...]``."""
    h = header.tolist()
    out, i = [], 1
    for _ in range(h[0]):
        dtype, grad, ndim = _DTYPES[h[i]], bool(h[i + 1]), h[i + 2]
        out.append((dtype, grad, tuple(h[i + 3:i + 3 + ndim])))
        i += 3 + ndim
    return out


def _meta_of(tensors: tuple[torch.Tensor, ...]) -> list[tuple[torch.dtype, bool, tuple[int, ...]]]:
    return [(t.dtype, t.requires_grad, tuple(t.shape)) for t in tensors]


class P2P:
    """Sends and receives one rank's activations and gradients; see the module docstring."""

    def __init__(self, device: torch.device, dynamic_shape: bool = False) -> None:
        self.device = device
        self.dynamic_shape = dynamic_shape  # a shape header before every transfer, not once per batch
        self.pending: list[tuple[Any, torch.Tensor]] = []
        self.sent_meta: dict[tuple[int, str], list] = {}
        self.recv_meta: dict[tuple[int, str], list] = {}
        self.bytes_sent = 0  # everything this rank sent, headers included
        self.header_bytes = 0
        self.split_group: Any = None  # the tensor-parallel group the partitioned kinds are split over
        self.split_kinds: frozenset[str] = frozenset()

    def partition(self, group: Any, kinds: set[str] | frozenset[str]) -> None:
        """Split the floating-point tensors of ``kinds`` ("act", "grad") over ``group`` (the tensor-parallel
        group, whose ranks all send and receive the same tensors); a group of one rank splits nothing."""
        self.split_group = group if group is not None and dist.get_world_size(group) > 1 else None
        self.split_kinds = frozenset(kinds) if self.split_group is not None else frozenset()

    def _split(self, kind: str, t: torch.Tensor) -> bool:
        return kind in self.split_kinds and t.is_floating_point() and t.numel() >= dist.get_world_size(
            self.split_group)

    def _slice(self, t: torch.Tensor) -> torch.Tensor:
        """This tensor rank's slice of ``t`` flattened and zero-padded to a multiple of the group size."""
        n, r = dist.get_world_size(self.split_group), dist.get_rank(self.split_group)
        per = -(-t.numel() // n)
        flat = t.reshape(-1)
        piece = flat[r * per:(r + 1) * per]
        if piece.numel() < per:
            piece = torch.cat([piece, piece.new_zeros(per - piece.numel())])
        return piece

    def _gather(self, piece: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The whole tensor of ``shape`` from every tensor rank's slice."""
        n = dist.get_world_size(self.split_group)
        whole = piece.new_empty(piece.numel() * n)
        dist.all_gather_into_tensor(whole, piece, group=self.split_group)
        numel = 1
        for d in shape:
            numel *= d
        return whole[:numel].view(shape).clone()

    def new_batch(self) -> None:
        """Forget negotiated shapes: the next transfer on each channel sends its header again."""
        self.sent_meta.clear()
        self.recv_meta.clear()

    def _isend(self, t: torch.Tensor, dst: int, tag: int) -> None:
        t = t.contiguous()
        self.pending.append((dist.isend(t, dst=dst, tag=tag), t))
        self.bytes_sent += t.numel() * t.element_size()

    def send(self, x: Any, dst: int, kind: str, chunk: int, micro_batch: int) -> None:
        """Send a tensor or tuple to global rank ``dst`` (non-blocking); a header first in each batch."""
        tensors = as_tuple(x)
        meta = _meta_of(tensors)
        key = (dst, kind)
        if key not in self.sent_meta or self.dynamic_shape:
            header = encode_meta(tensors)
            self._isend(header, dst, _tag(kind, chunk, micro_batch, 255))
            self.header_bytes += header.numel() * header.element_size()
            self.sent_meta[key] = meta
        elif self.sent_meta[key] != meta:
            raise ValueError(f"pipeline: micro-batch {micro_batch} sends {kind} of shapes "
                             f"{[m[2] for m in meta]} to rank {dst}, but this batch started with "
                             f"{[m[2] for m in self.sent_meta[key]]}; all micro-batches of one batch must have the "
                             f"same shapes (they may change between batches; PipelineModule(dynamic_shape=True) "
                             f"lets them change per micro-batch).")
        for i, t in enumerate(tensors):
            t = self._slice(t.detach()) if self._split(kind, t) else t.detach()
            self._isend(t, dst, _tag(kind, chunk, micro_batch, i))

    def recv(self, src: int, kind: str, chunk: int, micro_batch: int) -> tuple[torch.Tensor, ...]:
        """Receive what :meth:`send` sent from global rank ``src`` (blocking); activations keep ``requires_grad``."""
        key = (src, kind)
        if key not in self.recv_meta or self.dynamic_shape:
            header = torch.zeros(_HEADER, dtype=torch.int64)
            dist.recv(header, src=src, tag=_tag(kind, chunk, micro_batch, 255))
            self.recv_meta[key] = decode_meta(header)
        out = []
        for i, (dtype, grad, shape) in enumerate(self.recv_meta[key]):
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            if self._split(kind, buf):
                piece = torch.empty(-(-buf.numel() // dist.get_world_size(self.split_group)), dtype=dtype,
                                    device=self.device)
                dist.recv(piece, src=src, tag=_tag(kind, chunk, micro_batch, i))
                buf = self._gather(piece, shape)
            else:
                dist.recv(buf, src=src, tag=_tag(kind, chunk, micro_batch, i))
            if grad and kind == "act" and buf.is_floating_point():
                buf.requires_grad_(True)
            out.append(buf)
        return tuple(out)

    def wait_all(self) -> None:
        """Wait for every pending send (end of a batch)."""
        for work, _t in self.pending:
            work.wait()
        self.pending.clear()
