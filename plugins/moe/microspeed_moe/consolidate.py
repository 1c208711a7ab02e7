"""Every expert in the consolidated state dict that ``save_16bit_model`` writes on rank 0.

With ``ep_size`` > 1 each rank of an expert-parallel group holds different experts, so rank 0's own
state dict (or the one a partitioner gathered over the data-parallel group) lacks the others'.
:func:`gather_experts` brings them to rank 0, named by their global index as the full checkpoint
names them (see :mod:`microspeed_moe.experts`), so the file loads into a model with any ``ep_size``:

1. every rank lists its experts' prefixes and the expert tensors it offers (``name -> (shape,
   dtype)``): those of its state dict under an MoE layer's experts; one ``all_gather_object`` of
   these small lists;
2. each name rank 0 lacks is sent by the lowest rank offering it (the first copy in its
   expert-data-parallel group), one ``broadcast`` at a time, so no rank holds more than one extra
   tensor at once.

Every rank takes part (collective); ranks other than 0 keep what they had.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from microspeed.plugin_api import comm

Offer = dict[str, tuple[tuple[int, ...], torch.dtype]]


def expert_prefixes(module: nn.Module, experts: list[nn.Module]) -> tuple[str, ...]:
    """State-dict prefixes (``"moe.deepspeed_moe.experts."``) of the ``experts`` modules inside ``module``."""
    ids = {id(e) for e in experts}
    return tuple(f"{name}." if name else "" for name, m in module.named_modules() if id(m) in ids)


def gather_experts(local: dict[str, Any], prefixes: tuple[str, ...]) -> dict[str, Any]:
    """``local`` on rank 0 completed with the expert tensors (names starting with ``prefixes``) other ranks hold.

    ``local``: this rank's tensors (rank 0: the whole dict to write). Returns ``local`` itself (rank 0:
    with the others' experts added in global-index order after its own entries). Collective over the
    world: a rank without MoE layers (a pipeline stage) joins with empty ``prefixes``. Only experts of
    layers rank 0 holds are added (under a pipeline, rank 0 writes its own stage).
    """
    if not comm.is_initialized() or comm.get_world_size() == 1:
        return local
    rank = comm.get_rank()
    offer: Offer = {k: (tuple(v.shape), v.dtype) for k, v in local.items()
                    if prefixes and isinstance(v, torch.Tensor) and k.startswith(prefixes)}
    gathered: list[tuple[tuple[str, ...], Offer]] = comm.all_gather_object((prefixes, offer))
    first_prefixes, first_offer = gathered[0]
    offers = [o for _, o in gathered]
    wanted: dict[str, int] = {}
    for src, names in enumerate(offers[1:], start=1):
        for name in names:  # rank 0's layers only (a pipeline's rank 0 writes its own stage)
            if name not in first_offer and first_prefixes and name.startswith(first_prefixes):
                wanted.setdefault(name, src)
    device = comm.device()
    for name in sorted(wanted, key=_natural):
        src = wanted[name]
        shape, dtype = offers[src][name]
        if rank == src:
            buf = local[name].detach().to(device).contiguous()
        else:
            buf = torch.empty(shape, dtype=dtype, device=device)
        comm.broadcast(buf, src=src)
        if rank == 0:
            local[name] = buf.cpu()
    return local


def _natural(name: str) -> tuple:
    """Sort key that puts ``...experts.10.w`` after ``...experts.9.w``."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))
