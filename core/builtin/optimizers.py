"""Build the optimizer named by a ds_config ``optimizer`` section, with DeepSpeed's semantics.

``{"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "weight_decay": 0.01}}`` gives the
same update rule DeepSpeed's ``_configure_basic_optimizer`` would pick, run by torch's kernels:

* Type names are case-insensitive. ``Adam`` and ``AdamW`` accept DeepSpeed's extra parameters
  ``adam_w_mode`` (default ``True``: decoupled weight decay, i.e. AdamW) and ``torch_adam``;
  type ``AdamW`` is AdamW whatever ``adam_w_mode`` says, as in DeepSpeed.
* With ``torch_adam`` unset or false DeepSpeed builds its ``FusedAdam``, whose ``weight_decay``
  defaults to 0 (torch's ``AdamW`` defaults to 0.01); that default is kept. ``FusedAdam``'s
  ``bias_correction`` (true only) and ``set_grad_none`` are accepted too.
* ``Lamb`` is :class:`microspeed.builtin.lamb.Lamb` (DeepSpeed's ``FusedLamb``); ``Adagrad`` and any
  other ``torch.optim`` class name (``SGD``, ``RMSprop``, ``NAdam``, ...) get their params as kwargs.
* ``max_grad_norm`` is refused for every type, as DeepSpeed does: use ``gradient_clipping``.
* The 1-bit optimizers (``OneBitAdam``, ``ZeroOneAdam``, ``OneBitLamb``) come from the
  ``microspeed-comm`` plugin distribution, not from here.

Adam and AdamW default to torch's ``fused=True`` kernels where every parameter allows it: on CPU,
for a 10M-parameter model, one AdamW step took about 12 ms fused against 50 ms with ``foreach=True``
(and 61 ms with neither) on 2 cores with torch 2.13.
"""

from __future__ import annotations

import difflib
import inspect
import math
import numbers
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from microspeed.builtin.lamb import Lamb
from microspeed.errors import ConfigError

__all__ = ["OPTIMIZER_NAMES", "PLUGIN_OPTIMIZER_NAMES", "build_optimizer"]


def _torch_optimizers() -> dict[str, type[torch.optim.Optimizer]]:
    """Every public optimizer class of ``torch.optim``, by its name."""
    found = {}
    for name in dir(torch.optim):
        obj = getattr(torch.optim, name)
        if (
            not name.startswith("_")
            and isinstance(obj, type)
            and issubclass(obj, torch.optim.Optimizer)
            and obj is not torch.optim.Optimizer
        ):
            found[name] = obj
    return found


_CLASSES: dict[str, type[torch.optim.Optimizer]] = {**_torch_optimizers(), "Lamb": Lamb}
_BY_LOWER: dict[str, str] = {name.lower(): name for name in _CLASSES}

#: The ``optimizer.type`` values this module builds (matched case-insensitively).
OPTIMIZER_NAMES: tuple[str, ...] = tuple(sorted(_CLASSES, key=str.lower))

#: DeepSpeed optimizer names that the ``microspeed-comm`` plugin distribution supplies.
PLUGIN_OPTIMIZER_NAMES: tuple[str, ...] = ("OneBitAdam", "ZeroOneAdam", "OneBitLamb")
_PLUGIN_DISTRIBUTION = "microspeed-comm"

# DeepSpeed's extra parameters for type Adam/AdamW, consumed here rather than passed to torch.
_ADAM_EXTRA_PARAMS = ("adam_w_mode", "torch_adam", "bias_correction", "set_grad_none")
_SECTION_KEYS = ("type", "params", "legacy_fusion")
# Parameters that must be non-negative numbers wherever an optimizer takes them.
_NON_NEGATIVE = ("lr", "eps", "weight_decay", "momentum", "max_coeff", "min_coeff")
# Words torch's ValueError messages use for a parameter, when they do not spell its name.
_MESSAGE_PHRASES = (("learning rate", "lr"), ("epsilon", "eps"), ("beta", "betas"))


def build_optimizer(
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], section: Mapping[str, Any]
) -> torch.optim.Optimizer:
    """Build the optimizer that the ds_config ``optimizer`` section ``section`` describes.

    Args:
        params: tensors, or parameter-group dicts, to optimize (consumed once).
        section: the ``optimizer`` section, ``{"type": NAME, "params": {...}}``.

    Returns:
        A ``torch.optim.Optimizer``: ``torch.optim.AdamW`` for DeepSpeed's default ``Adam``,
        :class:`~microspeed.builtin.lamb.Lamb` for ``Lamb``, the ``torch.optim`` class otherwise.

    Raises:
        ConfigError: the type is unknown (or needs a plugin distribution), a parameter is unknown,
            or a value is of the wrong type or out of range; the message names the key path.
    """
    if not isinstance(section, Mapping):
        raise ConfigError(
            f"optimizer: expected a mapping like {{'type': 'AdamW', 'params': {{'lr': 0.001}}}}, "
            f"got {type(section).__name__} {section!r}"
        )
    for key in section:
        if key not in _SECTION_KEYS:
            raise ConfigError(
                f"optimizer.{key}: unknown key{_suggest(key, _SECTION_KEYS)}; accepted: "
                f"{', '.join(_SECTION_KEYS)}. Optimizer hyperparameters go under optimizer.params"
            )
    type_name = section.get("type")
    if not isinstance(type_name, str) or not type_name:
        raise ConfigError(
            f"optimizer.type: expected an optimizer name such as 'AdamW', got {type_name!r}; "
            f"known names: {', '.join(OPTIMIZER_NAMES)}"
        )
    canonical = _resolve_type(type_name)

    raw = section.get("params")
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping) or not all(isinstance(k, str) for k in raw):
        raise ConfigError(
            f"optimizer.params: expected a mapping of parameter names to values, got {raw!r}"
        )
    kwargs = dict(raw)
    if "max_grad_norm" in kwargs:
        raise ConfigError(
            f"optimizer.params.max_grad_norm: got {kwargs['max_grad_norm']!r}, but gradient clipping is not "
            "an optimizer parameter (DeepSpeed refuses it too); remove it and set the top-level "
            "'gradient_clipping' key instead"
        )

    if canonical in ("Adam", "AdamW"):
        cls, extra = _adam_class(canonical, kwargs)
    else:
        cls, extra = _CLASSES[canonical], ()

    accepted = _accepted_params(cls)
    for key in kwargs:
        if key not in accepted:
            names = sorted(accepted) + list(extra)
            raise ConfigError(
                f"optimizer.params.{key}: unknown parameter for optimizer '{type_name}'"
                f"{_suggest(key, names)}; accepted: {', '.join(names)}"
            )
    for key, value in list(kwargs.items()):
        kwargs[key] = _check_value(key, value, accepted[key])

    param_list = _materialize(params)
    if cls in (torch.optim.Adam, torch.optim.AdamW) and _fused_ok(param_list, kwargs):
        kwargs["fused"] = True
    try:
        return cls(param_list, **kwargs)
    except (ValueError, TypeError, RuntimeError) as err:
        key = _key_in_message(str(err), kwargs)
        if key is None:
            raise
        raise ConfigError(
            f"optimizer.params.{key}: got {kwargs[key]!r}, which {cls.__module__}.{cls.__qualname__} "
            f"rejects: {err}. Set optimizer.params.{key} to an accepted value"
        ) from err


def _resolve_type(type_name: str) -> str:
    """The canonical name for ``type_name``, or a ConfigError naming the closest one."""
    lower = type_name.lower()
    if lower in _BY_LOWER:
        return _BY_LOWER[lower]
    plugin = {name.lower(): name for name in PLUGIN_OPTIMIZER_NAMES}
    if lower in plugin:
        raise ConfigError(
            f"optimizer.type: '{type_name}' is provided by the plugin distribution "
            f"'{_PLUGIN_DISTRIBUTION}', which is not handling it here; install it "
            f"(pip install {_PLUGIN_DISTRIBUTION}) or choose a built-in optimizer: "
            f"{', '.join(OPTIMIZER_NAMES)}"
        )
    candidates = {**_BY_LOWER, **plugin}
    close = difflib.get_close_matches(lower, list(candidates), n=1)
    hint = f" (did you mean '{candidates[close[0]]}'?)" if close else ""
    raise ConfigError(
        f"optimizer.type: unknown optimizer '{type_name}'{hint}; known names (case-insensitive): "
        f"{', '.join(OPTIMIZER_NAMES)}; {', '.join(PLUGIN_OPTIMIZER_NAMES)} need the "
        f"'{_PLUGIN_DISTRIBUTION}' distribution"
    )


def _adam_class(
    canonical: str, kwargs: dict[str, Any]
) -> tuple[type[torch.optim.Optimizer], tuple[str, ...]]:
    """Consume DeepSpeed's Adam-only parameters from ``kwargs``; pick torch's Adam or AdamW."""
    flags = {}
    for key, default in (("adam_w_mode", True), ("torch_adam", False), ("set_grad_none", True),
                         ("bias_correction", True)):
        value = kwargs.pop(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"optimizer.params.{key}: got {value!r}; accepted: true or false")
        flags[key] = value
    if not flags["bias_correction"]:
        raise ConfigError(
            "optimizer.params.bias_correction: got False, but torch's Adam/AdamW always correct the "
            "moment bias; accepted: true (or remove the key)"
        )
    # DeepSpeed: type AdamW forces decoupled weight decay; type Adam follows adam_w_mode (default True).
    decoupled = canonical == "AdamW" or flags["adam_w_mode"]
    if not flags["torch_adam"]:
        # DeepSpeed's FusedAdam (and its CPU Adam) default weight_decay to 0, torch's AdamW to 0.01.
        kwargs.setdefault("weight_decay", 0.0)
    return (torch.optim.AdamW if decoupled else torch.optim.Adam), _ADAM_EXTRA_PARAMS


def _accepted_params(cls: type[torch.optim.Optimizer]) -> dict[str, inspect.Parameter]:
    """The keyword parameters of ``cls``'s constructor, other than ``params``."""
    signature = inspect.signature(cls.__init__)
    return {
        name: p
        for name, p in signature.parameters.items()
        if name not in ("self", "params")
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }


def _is_number(value: Any) -> bool:
    """A real number that is not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_value(key: str, value: Any, param: inspect.Parameter) -> Any:
    """Check ``value`` against the default of ``param`` and known ranges; return it normalised."""
    default = param.default
    path = f"optimizer.params.{key}"
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: got {value!r}; accepted: true or false")
    elif isinstance(default, numbers.Real) or (key == "lr" and default is not inspect.Parameter.empty):
        if isinstance(value, torch.Tensor) and key == "lr":
            return value
        integer_only = isinstance(default, int) and param.annotation in (int, "int")
        if integer_only and not (isinstance(value, int) and not isinstance(value, bool)):
            raise ConfigError(f"{path}: got {value!r}; accepted: an integer")
        if not _is_number(value) or (isinstance(value, float) and math.isnan(value)):
            raise ConfigError(f"{path}: got {value!r}; accepted: a number")
        if key in _NON_NEGATIVE and value < 0:
            raise ConfigError(f"{path}: got {value!r}; accepted: a number >= 0")
    elif isinstance(default, tuple):
        if not isinstance(value, (list, tuple)) or len(value) != len(default):
            raise ConfigError(
                f"{path}: got {value!r}; accepted: a list of {len(default)} values like {list(default)}"
            )
        value = tuple(float(v) if isinstance(v, int) and not isinstance(v, bool) else v for v in value)
        if key == "betas" and not all(_is_number(b) and 0.0 <= b < 1.0 for b in value):
            raise ConfigError(
                f"{path}: got {list(value)!r}; accepted: two numbers in [0, 1), like [0.9, 0.999]"
            )
    return value


def _materialize(params: Iterable[Any]) -> list[Any]:
    """``params`` as a list, with each group's ``params`` as a list, so it can be inspected and reused."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors or parameter-group dicts, not a single tensor")
    out = []
    for item in params:
        if isinstance(item, Mapping):
            group = dict(item)
            inner = group.get("params")
            group["params"] = [inner] if isinstance(inner, torch.Tensor) else list(inner or [])
            out.append(group)
        else:
            out.append(item)
    return out


def _tensors(param_list: list[Any]) -> Iterable[torch.Tensor]:
    """The tensors of a materialised param list (plain, named ``(name, tensor)``, or in groups)."""
    for item in param_list:
        items = item["params"] if isinstance(item, dict) else [item]
        for p in items:
            yield p[1] if isinstance(p, tuple) else p


def _fused_ok(param_list: list[Any], kwargs: dict[str, Any]) -> bool:
    """Whether torch's fused Adam kernel can run every parameter, and the user chose no kernel."""
    if "fused" in kwargs or "foreach" in kwargs or kwargs.get("differentiable"):
        return False
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        devices = set(_get_fused_kernels_supported_devices())
    except ImportError:  # pragma: no cover - older torch
        devices = {"cpu", "cuda"}
    tensors = list(_tensors(param_list))
    return bool(tensors) and all(
        isinstance(p, torch.Tensor) and torch.is_floating_point(p) and p.device.type in devices
        for p in tensors
    )


def _key_in_message(message: str, kwargs: Mapping[str, Any]) -> str | None:
    """The parameter, among ``kwargs``, that a torch error message is about; None if it names none."""
    for key in sorted(kwargs, key=len, reverse=True):
        if re.search(rf"\b{re.escape(key)}\b", message, re.IGNORECASE):
            return key
    lowered = message.lower()
    for phrase, key in _MESSAGE_PHRASES:
        if phrase in lowered and key in kwargs:
            return key
    return None


def _suggest(word: str, names: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the name closest to ``word``, or an empty string."""
    close = difflib.get_close_matches(word, list(names), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""
