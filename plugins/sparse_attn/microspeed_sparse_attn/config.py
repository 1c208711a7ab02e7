"""The ds_config ``"sparse_attention"`` section: strict parsing into a :class:`SparsityConfig`.

DeepSpeed's keys and defaults (``deepspeed/runtime/config.py::get_sparse_attention`` and
``deepspeed/runtime/constants.py`` before sparse attention was removed): ``mode`` is one of
``dense``, ``fixed`` (default), ``variable``, ``bigbird``, ``bslongformer``; each mode reads its own
keys, listed with their defaults in :data:`SPARSE_ATTENTION_KEYS`. Note that DeepSpeed's section
default for ``num_random_blocks`` is 0 for every mode, also for ``bigbird`` (whose class default
is 1).

Stricter or extended than DeepSpeed, on purpose:

* A key the mode does not read (DeepSpeed silently ignored it), a wrong type or an unknown mode
  raises :class:`~microspeed.errors.ConfigError` (a :class:`ValueError`) naming
  ``sparse_attention.<key>`` and the valid keys of the mode.
* ``bigbird`` and ``bslongformer`` also read ``attention`` (DeepSpeed dropped it, so a
  unidirectional BigBird section silently became bidirectional).
* ``variable`` and ``bigbird`` also read ``seed`` (default null): an integer makes the random
  blocks identical on every rank and call; see :mod:`microspeed_sparse_attn.sparsity_config`.

``LocalSlidingWindowSparsityConfig`` has no ds_config mode in DeepSpeed either; build it in code.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from microspeed.plugin_api import ConfigError
from microspeed_sparse_attn.sparsity_config import (
    SUPPORTED_BLOCK_SIZES,
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)

__all__ = ["SPARSE_ATTENTION_KEYS", "DEFAULT_MODE", "parse_sparse_attention_section", "sparsity_config_from_section"]

#: Mode used when the section has no ``mode`` key (DeepSpeed's default).
DEFAULT_MODE = "fixed"

_COMMON = {"block": 16, "different_layout_per_head": False}

#: For each ``mode``: the keys that mode reads (besides ``mode``) and their defaults.
SPARSE_ATTENTION_KEYS: dict[str, dict[str, Any]] = {
    "dense": {"block": 16},
    "fixed": {
        **_COMMON,
        "num_local_blocks": 4,
        "num_global_blocks": 1,
        "attention": "bidirectional",
        "horizontal_global_attention": False,
        "num_different_global_patterns": 1,
    },
    "variable": {
        **_COMMON,
        "num_random_blocks": 0,
        "local_window_blocks": [4],
        "global_block_indices": [0],
        "global_block_end_indices": None,
        "attention": "bidirectional",
        "horizontal_global_attention": False,
        "seed": None,
    },
    "bigbird": {
        **_COMMON,
        "num_random_blocks": 0,
        "num_sliding_window_blocks": 3,
        "num_global_blocks": 1,
        "attention": "bidirectional",
        "seed": None,
    },
    "bslongformer": {
        **_COMMON,
        "num_sliding_window_blocks": 3,
        "global_block_indices": [0],
        "global_block_end_indices": None,
        "attention": "bidirectional",
    },
}

_CLASSES: dict[str, type[SparsityConfig]] = {
    "dense": DenseSparsityConfig,
    "fixed": FixedSparsityConfig,
    "variable": VariableSparsityConfig,
    "bigbird": BigBirdSparsityConfig,
    "bslongformer": BSLongformerSparsityConfig,
}

_INT_KEYS = {"num_local_blocks", "num_global_blocks", "num_different_global_patterns", "num_random_blocks",
             "num_sliding_window_blocks"}
_BOOL_KEYS = {"different_layout_per_head", "horizontal_global_attention"}
_LIST_KEYS = {"local_window_blocks", "global_block_indices"}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(v) for v in value)


def _check_type(key: str, value: Any) -> None:
    path = f"sparse_attention.{key}"
    if key == "block":
        if not _is_int(value) or value not in SUPPORTED_BLOCK_SIZES:
            raise ConfigError(f"{path}: expected one of {', '.join(map(str, SUPPORTED_BLOCK_SIZES))}, got {value!r}.")
    elif key in _INT_KEYS and not _is_int(value):
        raise ConfigError(f"{path}: expected an integer, got {value!r} ({type(value).__name__}).")
    elif key in _BOOL_KEYS and not isinstance(value, bool):
        raise ConfigError(f"{path}: expected true/false, got {value!r} ({type(value).__name__}).")
    elif key == "attention" and value not in ("unidirectional", "bidirectional"):
        raise ConfigError(f"{path}: expected \"unidirectional\" or \"bidirectional\", got {value!r}.")
    elif key in _LIST_KEYS and not _is_int_list(value):
        raise ConfigError(f"{path}: expected a list of integers, got {value!r}.")
    elif key == "global_block_end_indices" and value is not None and not _is_int_list(value):
        raise ConfigError(f"{path}: expected null or a list of integers (one end per start), got {value!r}.")
    elif key == "seed" and value is not None and not _is_int(value):
        raise ConfigError(f"{path}: expected null or an integer, got {value!r} ({type(value).__name__}).")


def _unknown_key(mode: str, key: str) -> ConfigError:
    valid = ["mode", *SPARSE_ATTENTION_KEYS[mode]]
    owners = [m for m, keys in SPARSE_ATTENTION_KEYS.items() if key in keys]
    if owners:
        hint = (f" It is read by mode {' / '.join(repr(m) for m in owners)}, not by {mode!r}: set "
                f"\"mode\" accordingly or remove the key.")
    else:
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]!r}?" if close else ""
    return ConfigError(
        f"sparse_attention.{key}: unknown key for mode {mode!r}.{hint} Valid keys for mode {mode!r}: "
        f"{', '.join(valid)}."
    )


def parse_sparse_attention_section(section: Mapping[str, Any]) -> dict[str, Any]:
    """Validate a ``"sparse_attention"`` section; return it with ``mode`` and every default filled in.

    The result is what DeepSpeed's ``get_sparse_attention`` returned (plus the extension keys).
    Values are checked as the config class checks them (for example ``num_local_blocks`` must be
    divisible by ``num_global_blocks``), so a bad section fails here, before any model exists.
    Raises :class:`~microspeed.errors.ConfigError` (a :class:`ValueError`).
    """
    if not isinstance(section, Mapping):
        raise ConfigError(
            f"sparse_attention: expected an object such as {{\"mode\": \"fixed\", \"block\": 16}}, got {section!r}."
        )
    mode = section.get("mode", DEFAULT_MODE)
    if not isinstance(mode, str) or mode not in SPARSE_ATTENTION_KEYS:
        raise ConfigError(
            f"sparse_attention.mode: got {mode!r}; accepted modes: {', '.join(SPARSE_ATTENTION_KEYS)} "
            f"(default {DEFAULT_MODE!r}). Other patterns, such as LocalSlidingWindowSparsityConfig, are built "
            "in code and passed to SparseSelfAttention."
        )
    defaults = SPARSE_ATTENTION_KEYS[mode]
    parsed: dict[str, Any] = {"mode": mode}
    for key, value in section.items():
        if key == "mode":
            continue
        if key not in defaults:
            raise _unknown_key(mode, key)
        _check_type(key, value)
        parsed[key] = list(value) if isinstance(value, list) else value
    for key, default in defaults.items():
        parsed.setdefault(key, list(default) if isinstance(default, list) else default)
    _build(parsed, num_heads=1)
    return parsed


def _build(parsed: Mapping[str, Any], num_heads: int) -> SparsityConfig:
    mode = parsed["mode"]
    kwargs = {key: value for key, value in parsed.items() if key != "mode"}
    try:
        return _CLASSES[mode](num_heads, **kwargs)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        first = message.split(" ", 1)[0].split("[", 1)[0].split("=", 1)[0]
        where = f"sparse_attention.{message}" if first in kwargs else f"sparse_attention (mode {mode!r}): {message}"
        raise ConfigError(where) from exc


def sparsity_config_from_section(section: Mapping[str, Any], num_heads: int) -> SparsityConfig:
    """Build the :class:`SparsityConfig` a ds_config ``"sparse_attention"`` section describes, for ``num_heads`` heads.

    ``dense`` → :class:`DenseSparsityConfig`, ``fixed`` → :class:`FixedSparsityConfig`,
    ``variable`` → :class:`VariableSparsityConfig`, ``bigbird`` → :class:`BigBirdSparsityConfig`,
    ``bslongformer`` → :class:`BSLongformerSparsityConfig`; missing keys take DeepSpeed's section
    defaults (:data:`SPARSE_ATTENTION_KEYS`). Raises :class:`~microspeed.errors.ConfigError` (a
    :class:`ValueError`) naming ``sparse_attention.<key>`` for an unknown key, a key of another
    mode, a wrong type or a bad value.
    """
    return _build(parse_sparse_attention_section(section), num_heads)
