"""Stage-3 gathering beyond a module's own parameters: external parameters and leaf modules.

DeepSpeed's names and signatures (``deepspeed.zero.register_external_parameter``,
``deepspeed.utils.set_z3_leaf_modules``, ...). Both only tell stage 3 *when* to gather:

* :func:`register_external_parameter` — ``module``'s forward reads ``parameter`` although the
  parameter belongs to another module (a tied embedding used through ``F.linear``): it is gathered
  with ``module`` (before its forward and again before its backward).
* leaf modules (:func:`set_z3_leaf_modules`) — a module whose forward reads its children's
  parameters without calling the children: all parameters of its sub-tree are gathered when it
  runs, and its children get no hooks of their own. ``nn.MultiheadAttention`` and PyTorch's
  Transformer layers are leaves by default (:data:`DEFAULT_LEAF_CLASSES`).

Neither is required for correctness here: a partitioned parameter that a forward uses while it
is released is gathered on access and registered as external to the running module, so the next
forward gathers (and prefetches) it with that module.
"""

from __future__ import annotations

import itertools
from enum import Enum
from typing import Any

import torch

DEFAULT_LEAF_CLASSES: tuple[type, ...] = (
    torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer,
)
"""Modules whose forward reads their children's parameters directly (``out_proj.weight`` inside
``multi_head_attention_forward``; the fused inference paths of the Transformer layers)."""


DEFAULT_LEAF_MODULE_CLASSES: tuple[str, ...] = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)
"""``zero_optimization.leaf_module.classes`` by default (DeepSpeed 0.19.8's): Hugging Face's sparse MoE blocks,
whose experts run depending on the routing -- as leaves their gradients reduce in one order on every rank."""


class ZeroParamStatus(Enum):
    """Where a stage-3 parameter's whole value is (DeepSpeed's ``ZeroParamStatus``)."""

    AVAILABLE = 1
    """Whole on every rank (``p.data`` is the full tensor)."""
    NOT_AVAILABLE = 2
    """Partitioned: ``p.data`` is an empty placeholder; ``p.ds_shape`` is the real shape."""
    INFLIGHT = 3
    """Being gathered (a prefetch is under way)."""


_IDS = itertools.count()


def assign_ds_id(p: Any) -> None:
    """Give ``p`` a process-unique ``ds_id`` (DeepSpeed numbers partitioned parameters) unless it has one."""
    if getattr(p, "ds_id", None) is None:
        p.ds_id = next(_IDS)


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Gather ``parameter`` with ``module``: before its forward and again before its backward.

    For a parameter ``module``'s forward reads although another module owns it. Stage 3 only;
    without ZeRO-3 the registration is kept and costs nothing.
    """
    if not isinstance(parameter, torch.nn.Parameter):
        raise RuntimeError("register_external_parameter: parameter is not a torch.nn.Parameter")
    if not hasattr(module, "_external_params"):
        module._external_params = {}
    module._external_params[id(parameter)] = parameter


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Undo :func:`register_external_parameter`."""
    if not isinstance(parameter, torch.nn.Parameter):
        raise RuntimeError("unregister_external_parameter: parameter is not a torch.nn.Parameter")
    if id(parameter) not in getattr(module, "_external_params", {}):
        raise RuntimeError("unregister_external_parameter: parameter is not a registered external parameter "
                           "of module.")
    del module._external_params[id(parameter)]


def external_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters registered on ``module`` with :func:`register_external_parameter`."""
    return list(getattr(module, "_external_params", {}).values())


def z3_leaf_module(model: torch.nn.Module) -> bool:
    """Whether ``model`` is flagged as a leaf module (see :func:`set_z3_leaf_modules`)."""
    return bool(getattr(model, "_z3_leaf", False))


def z3_leaf_parameter(model: torch.nn.Parameter) -> bool:
    """Whether the parameter belongs to a leaf module (DeepSpeed marks them ``ds_z3_leaf_module``)."""
    return hasattr(model, "ds_z3_leaf_module")


def is_leaf(module: torch.nn.Module) -> bool:
    """Flagged a leaf, or (not explicitly un-flagged) one of :data:`DEFAULT_LEAF_CLASSES`."""
    flag = getattr(module, "_z3_leaf", None)
    return bool(flag) if flag is not None else isinstance(module, DEFAULT_LEAF_CLASSES)


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` flagged as leaves."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: torch.nn.Module, flag: bool) -> None:
    """Flag (or un-flag) one module as a leaf."""
    model._z3_leaf = flag


def _matches(module: torch.nn.Module, spec: type | str) -> bool:
    if isinstance(spec, type):
        return isinstance(module, spec)
    cls = type(module)
    return cls.__name__ == spec or f"{cls.__module__}.{cls.__qualname__}" == spec


def _set_flags(model: torch.nn.Module, classes: list[Any], flag: bool, raise_if_not_found: bool) -> list:
    if not all(isinstance(c, (type, str)) for c in classes):
        raise TypeError(f"leaf_module_classes must be a list of types or class names, got {classes!r}")
    found = []
    for m in model.modules():
        if any(_matches(m, c) for c in classes):
            m._z3_leaf = flag
            found.append(m)
    if not found and raise_if_not_found:
        raise ValueError(f"No modules of type {classes} found in model {type(model).__name__}")
    return found


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: list[Any],
                        raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    """Flag every module of ``model`` that is an instance of (or named like) one of ``leaf_module_classes``.

    A leaf gathers its whole sub-tree when it runs and its children get no hooks (for modules that
    read children's parameters directly, or whose children run in a data-dependent order, as MoE
    experts). Returns the flagged modules; ``ValueError`` when none matched and ``raise_if_not_found``.
    """
    return _set_flags(model, leaf_module_classes, True, raise_if_not_found)


def _set_by(model: torch.nn.Module, keys: list[str], flag: bool, raise_if_not_found: bool, what: str,
            match: Any) -> tuple[list[torch.nn.Module], list[str]]:
    if isinstance(keys, str) or not all(isinstance(k, str) for k in keys):
        raise TypeError(f"{what} must be a list of strings, got {keys!r}")
    found: list[torch.nn.Module] = []
    missing: list[str] = []
    named = list(model.named_modules())
    for key in keys:
        hits = [m for name, m in named if match(name, key)]
        if not hits:
            missing.append(key)
        for m in hits:
            m._z3_leaf = flag
            if not any(m is f for f in found):
                found.append(m)
    if missing and raise_if_not_found:
        raise ValueError(f"No modules matching {what} {missing} found in model {type(model).__name__} "
                         f"(names as model.named_modules() gives them)")
    return found, missing


def set_z3_leaf_modules_by_name(model: torch.nn.Module, module_names: list[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[torch.nn.Module], list[str]]:
    """Flag (``flag``) the modules named exactly ``module_names`` in ``model.named_modules()``.

    Returns ``(matched modules, names that matched none)``; ``ValueError`` when some matched none and
    ``raise_if_not_found``.
    """
    return _set_by(model, module_names, flag, raise_if_not_found, "module_names", lambda name, key: name == key)


def set_z3_leaf_modules_by_suffix(model: torch.nn.Module, module_name_suffixes: list[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[torch.nn.Module], list[str]]:
    """Flag (``flag``) the modules whose ``named_modules()`` name ends with one of ``module_name_suffixes``.

    Returns ``(matched modules, suffixes that matched none)``; ``ValueError`` when some matched none and
    ``raise_if_not_found``.
    """
    return _set_by(model, module_name_suffixes, flag, raise_if_not_found, "module_name_suffixes",
                   lambda name, key: name.endswith(key))


def mark_leaf_parameters(model: torch.nn.Module) -> None:
    """Give every parameter of a flagged leaf module ``ds_z3_leaf_module`` (the outermost leaf holding it), as
    DeepSpeed does when stage 3 registers the model (read by :func:`z3_leaf_parameter`)."""
    def visit(module: torch.nn.Module) -> None:
        if z3_leaf_module(module):
            for p in module.parameters():
                p.ds_z3_leaf_module = module
            return
        for child in module.children():
            visit(child)
    visit(model)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: list[Any],
                          raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    """Un-flag the modules :func:`set_z3_leaf_modules` flagged (also the default leaves named here)."""
    return _set_flags(model, leaf_module_classes, False, raise_if_not_found)
