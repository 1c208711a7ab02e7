"""``deepspeed.utils``: the ``"DeepSpeed"`` logger, process groups, ZeRO helpers and ``zero_to_fp32``.

ZeRO-3 leaf modules and the ``safe_get_*`` / ``safe_set_*`` functions are :mod:`microspeed.zero`'s, looked up
when first used (the ZeRO plugin is imported only then).
"""

from __future__ import annotations

from typing import Any

from deepspeed.utils import groups
from deepspeed.utils.logging import log_dist, log_dist_once, logger, set_log_level_from_string
from microspeed import comm as _comm
from microspeed.data import RepeatingLoader

#: Names served by the ZeRO plugin (``microspeed.zero``).
ZERO_NAMES = ("set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module",
              "z3_leaf_parameter", "set_z3_leaf_module", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix",
              "register_external_parameter", "unregister_external_parameter", "safe_get_full_fp32_param",
              "safe_get_full_grad", "safe_get_full_optimizer_state", "safe_set_full_fp32_param", "safe_set_full_grad",
              "safe_set_full_optimizer_state", "safe_get_local_fp32_param", "safe_get_local_grad",
              "safe_get_local_optimizer_state", "safe_set_local_fp32_param", "safe_set_local_grad",
              "safe_set_local_optimizer_state", "safe_update_full_grad_vectorized", "ZeroParamStatus")

__all__ = ["RepeatingLoader", "groups", "is_initialized", "log_dist", "log_dist_once", "logger",
           "set_log_level_from_string", "zero_to_fp32", *ZERO_NAMES]


def is_initialized() -> bool:
    """Whether torch.distributed is started (DeepSpeed re-exports its comm's ``is_initialized`` here)."""
    return _comm.is_initialized()


def __getattr__(name: str) -> Any:
    import importlib

    from deepspeed import _aliases

    found = _aliases.submodule(__name__, name)
    if found is not None:
        return found
    if name in ZERO_NAMES:
        zero = importlib.import_module("microspeed.zero")
        try:
            return getattr(zero, name)
        except AttributeError:
            raise AttributeError(f"deepspeed.utils.{name}: the installed microspeed-zero plugin does not provide "
                                 f"{name}; update it (pip install -e plugins/zero)") from None
    raise AttributeError(f"module 'deepspeed.utils' (microspeed stand-in) has no attribute {name!r}")
