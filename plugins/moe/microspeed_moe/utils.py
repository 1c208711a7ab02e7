"""DeepSpeed's MoE helpers for building optimizers: which parameters are experts, and param groups split by it.

DeepSpeed scripts build their optimizer with
``split_params_into_different_moe_groups_for_optimizer(params)`` so that expert parameters sit in
groups of their own (``moe: True``, ``name: <group name>``). microspeed needs no such split — expert
gradients are reduced by their parameters' marks, whatever group they sit in — but accepts it, so such
scripts run unchanged and their hyper-parameters (per-group lr, weight decay) are kept.
"""

from __future__ import annotations

from typing import Any

import torch


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` belongs to an expert (marked ``allreduce = False`` by ``Experts``)."""
    return getattr(param, "allreduce", True) is False


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: Any, max_group_size: int | None = None) -> list[dict[str, Any]]:
    """Split each param group into its dense parameters and one group per expert group name.

    Args:
        param_groups: a dict (one group), a list/tuple of dicts, or an iterable of parameters.
        max_group_size: if set, expert groups are cut into groups of at most this many elements.

    Returns:
        A list of groups: each input group's dense parameters (with ``moe: False``), then for each expert
        group name a copy of the group's settings with ``moe: True``, ``name`` set to the group name and
        only those experts' parameters.
    """
    if isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, (list, tuple)) and param_groups and isinstance(param_groups[0], dict):
        groups = list(param_groups)
    else:
        groups = [{"params": list(param_groups)}]
    if max_group_size is not None and (not isinstance(max_group_size, int) or max_group_size < 1):
        raise ValueError(f"split_params_into_different_moe_groups_for_optimizer(max_group_size={max_group_size!r}): "
                         f"expected a positive int or None.")
    out: list[dict[str, Any]] = []
    for group in groups:
        if "params" not in group:
            raise ValueError("split_params_into_different_moe_groups_for_optimizer: every param group needs a "
                             "'params' entry.")
        params = list(group["params"])
        settings = {k: v for k, v in group.items() if k != "params"}
        out.append({**settings, "params": [p for p in params if not is_moe_param(p)], "moe": False})
        by_name: dict[str, list[torch.Tensor]] = {}
        for p in params:
            if is_moe_param(p):
                by_name.setdefault(getattr(p, "group_name", "experts"), []).append(p)
        for name, members in by_name.items():
            for chunk in _chunks(members, max_group_size):
                out.append({**settings, "params": chunk, "moe": True, "name": name})
    return [g for g in out if g["params"] or not g.get("moe")]


def _chunks(params: list[torch.Tensor], max_size: int | None) -> list[list[torch.Tensor]]:
    if max_size is None:
        return [params]
    chunks: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in params:
        if chunks[-1] and size + p.numel() > max_size:
            chunks.append([])
            size = 0
        chunks[-1].append(p)
        size += p.numel()
    return chunks
