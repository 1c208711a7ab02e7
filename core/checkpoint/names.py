"""How checkpoint tensors are named: optimizer parameters by FQN, tied weights as aliases, module tensors."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from microspeed.checkpoint.errors import CheckpointWarning


def optimizer_param_names(engine: Any) -> dict[int, str]:
    """``{id(tensor): fqn}`` for the module's parameters and what plugins name (fp32 masters)."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    for extra in engine.hook.microspeed_optimizer_param_names(engine=engine):
        names.update(extra or {})
    return names


def _optimizer_fqns(optimizer: Any, names: dict[int, str]) -> list[str]:
    fqns = []
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            fqns.append(names.get(id(p), f"_unnamed.group{g}.{i}"))
    unnamed = [f for f in fqns if f.startswith("_unnamed.")]
    if unnamed:
        warnings.warn(f"checkpoint: {len(unnamed)} optimizer parameter(s) are not parameters of engine.module and "
                      f"no plugin named them; their state is keyed by position ({', '.join(unnamed[:5])}) and "
                      f"only reloads into the same optimizer layout.", CheckpointWarning, stacklevel=3)
    return fqns


def _identity(t: torch.Tensor) -> tuple | None:
    try:
        if t.numel() == 0 or type(t) is not torch.Tensor:
            return None
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
    except Exception:
        return None


def _aliases(sd: dict[str, Any]) -> dict[str, str]:
    """Keys of ``sd`` whose tensor is the very same as an earlier key's (tied weights)."""
    seen: dict[tuple, str] = {}
    aliases = {}
    for k, t in sd.items():
        ident = _identity(t) if isinstance(t, torch.Tensor) else None
        if ident is None:
            continue
        if ident in seen:
            aliases[k] = seen[ident]
        else:
            seen[ident] = k
    return aliases


def _ordered_union(lists: list[list[Any]]) -> list[Any]:
    seen, out = set(), []
    for items in lists:
        for x in items:
            if x not in seen:
                seen.add(x)
                out.append(x)
    return out


def _module_tensors(engine: Any, saving: bool = False) -> dict[str, Any]:
    tensors = engine.hook.microspeed_checkpoint_module_tensors(engine=engine, saving=saving)
    return tensors if tensors is not None else engine.module.state_dict()
