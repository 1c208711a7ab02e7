"""``deepspeed.runtime.config_utils``: the pydantic base of DeepSpeed's config models, and its small readers.

:class:`DeepSpeedConfigModel` is a strict pydantic model (unknown keys, wrong types and bad values raise
``pydantic.ValidationError``; assignment is validated; fields may be given by name or alias) that also
understands DeepSpeed's deprecated-field convention: a field declared with
``json_schema_extra={"deprecated": True, "new_param": "other", "new_param_fn": f}`` moves its value
(through ``f``) to ``other`` and logs a warning; giving both is an ``AssertionError``. Values ``"auto"``
are dropped unless ``strict=True`` (a client such as Hugging Face fills them later), so the default stands.

pydantic is a dependency of the stand-in distribution only; microspeed itself does not use it.
"""

from __future__ import annotations

import collections
import copy
import json
from functools import reduce
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, create_model, model_validator
from pydantic import Field as PydanticField

from deepspeed.utils.logging import logger
from microspeed.config import AUTO, Field, Section
from microspeed.errors import ConfigError

__all__ = ["DeepSpeedConfigModel", "DeepSpeedConfigObject", "ScientificNotationEncoder",
           "dict_raise_error_on_duplicate_keys", "get_config_default", "get_dict_param", "get_list_param",
           "get_scalar_param", "pp_int", "schema_model"]


class DeepSpeedConfigModel(BaseModel):
    """Base of DeepSpeed's config models: strict pydantic validation plus deprecated fields that forward."""

    model_config = ConfigDict(validate_default=True, validate_assignment=True, use_enum_values=True,
                              populate_by_name=True, extra="forbid", arbitrary_types_allowed=True,
                              protected_namespaces=())

    def __init__(self, strict: bool = False, **data: Any) -> None:
        if not strict:
            data = {k: v for k, v in data.items() if not (isinstance(v, str) and v == AUTO)}
        super().__init__(**data)
        self._forward_deprecated()

    def _forward_deprecated(self) -> None:
        """Move each deprecated field the user gave to its replacement (see the module docstring)."""
        for name, info in type(self).model_fields.items():
            extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
            if not extra.get("deprecated") or name not in self.model_fields_set:
                continue
            target = str(extra.get("new_param", ""))
            note = extra.get("deprecated_msg", "")
            logger.warning(f"config key {name} is deprecated" + (f"; use {target} instead" if target else "")
                           + (f". {note}" if note else ""))
            if not target or not extra.get("set_new_param", True):
                continue
            convert = extra.get("new_param_fn") or (lambda v: v)
            value = convert(getattr(self, name))
            *parents, leaf = target.split(".")
            owner = reduce(getattr, parents, self)
            assert leaf not in owner.model_fields_set, (
                f"give either the deprecated config key {name!r} or its replacement {target!r}, not both")
            setattr(owner, leaf, value)


def get_config_default(config: type[BaseModel] | BaseModel, field_name: str) -> Any:
    """The default of ``field_name`` in a config model; ``AssertionError`` for an unknown or required field."""
    fields = type(config).model_fields if isinstance(config, BaseModel) else config.model_fields
    assert field_name in fields, f"{field_name!r} is not a field of {config}"
    assert not fields[field_name].is_required(), f"{field_name!r} is required: it has no default"
    return fields[field_name].get_default(call_default_factory=True)


class pp_int(int):  # noqa: N801 - DeepSpeed's name
    """An ``int`` that prints with thousands separators (``1,000,000``), or as ``custom_print_str`` when given."""

    custom_print_str: str | None

    def __new__(cls, val: float, custom_print_str: str | None = None) -> pp_int:
        """The integer value of ``val``, remembering how to print it."""
        inst = super().__new__(cls, val)
        inst.custom_print_str = custom_print_str
        return inst

    def __repr__(self) -> str:
        return self.custom_print_str or f"{int(self):,}"


class ScientificNotationEncoder(json.JSONEncoder):
    """JSON encoder writing numbers above 1000 as ``1.000000e+06`` (how DeepSpeed prints a config)."""

    def iterencode(self, o: Any, _one_shot: bool = False, level: int = 0) -> Any:  # noqa: D102 - json protocol
        pad = " " * (self.indent if isinstance(self.indent, int) else 4)
        if isinstance(o, bool):
            return "true" if o else "false"
        if isinstance(o, (int, float)):
            return f"{o:e}" if o > 1e3 else f"{o}"
        if isinstance(o, collections.abc.Mapping):
            inner = ", ".join(f'\n{pad * (level + 1)}"{k}": {self.iterencode(v, level=level + 1)}'
                              for k, v in o.items())
            return "{" + inner + f"\n{pad * level}" + "}"
        if isinstance(o, collections.abc.Sequence) and not isinstance(o, str):
            return "[" + ", ".join(self.iterencode(v, level=level) for v in o) + "]"
        return "\n, ".join(super().iterencode(o, _one_shot))


class DeepSpeedConfigObject:
    """A config holder whose ``repr`` is its attributes as JSON."""

    def repr(self) -> dict[str, Any]:
        """The attributes as a dict."""
        return self.__dict__

    def __repr__(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True, indent=4, cls=ScientificNotationEncoder)


def get_scalar_param(param_dict: dict[str, Any], param_name: str, param_default_value: Any) -> Any:
    """``param_dict[param_name]``, or the default when absent."""
    return param_dict.get(param_name, param_default_value)


def get_list_param(param_dict: dict[str, Any], param_name: str, param_default_value: Any) -> Any:
    """``param_dict[param_name]``, or the default when absent."""
    return param_dict.get(param_name, param_default_value)


def get_dict_param(param_dict: dict[str, Any], param_name: str, param_default_value: Any) -> Any:
    """``param_dict[param_name]``, or the default when absent."""
    return param_dict.get(param_name, param_default_value)


def dict_raise_error_on_duplicate_keys(ordered_pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for json/hjson: the dict, or :class:`microspeed.ConfigError` (a ``ValueError``)
    naming every key given twice."""
    out = dict(ordered_pairs)
    if len(out) != len(ordered_pairs):
        counts = collections.Counter(k for k, _ in ordered_pairs)
        raise ConfigError(f"config: duplicate keys {sorted(k for k, n in counts.items() if n > 1)}; "
                          "give each key once.")
    return out


def _field_type(spec: Field) -> Any:
    """The annotation for a microspeed :class:`~microspeed.config.Field`: the union of its accepted types."""
    types = [t for t in spec.types if t is not type(None)]
    if spec.auto and str not in types:
        types.append(str)
    if float in types and int not in types:
        types.insert(0, int)
    annotation: Any = types[0] if len(types) == 1 else Union[tuple(types)]  # noqa: UP007 - built at run time
    if type(None) in spec.types or spec.default is None:
        annotation = Optional[annotation]  # noqa: UP045 - built at run time
    return annotation


def schema_model(dotted: str, name: str, doc: str) -> type[DeepSpeedConfigModel]:
    """A :class:`DeepSpeedConfigModel` class for the ds_config section at ``dotted`` (``"fp16"``, ``"tensorboard"``).

    Its fields, types and defaults are those of the section in microspeed's schema (the installed plugins'),
    keys the section only notices are fields too (default ``None``), and an instance is validated by
    :func:`microspeed.config.parse` first, so it accepts exactly what ``initialize()`` accepts.
    """
    from microspeed.compat.deepspeed_config import parse_config, schema

    node: Field | Section = schema()
    for part in dotted.split("."):
        assert isinstance(node, Section) and part in node.fields, f"{dotted}: not a section of microspeed's schema"
        node = node.fields[part]
    assert isinstance(node, Section), f"{dotted}: a key, not a section"
    fields: dict[str, Any] = {}
    for key, spec in node.fields.items():
        if isinstance(spec, Section):
            sub = schema_model(f"{dotted}.{key}", f"{name}_{key}", spec.doc)
            fields[key] = (sub, PydanticField(default_factory=sub))
        else:
            default = spec.default
            fields[key] = (_field_type(spec), PydanticField(default_factory=lambda d=default: copy.deepcopy(d))
                           if isinstance(default, (list, dict)) else default)
    for key in node.notices:
        fields.setdefault(key, (Any, None))

    def validate(cls: type, data: Any) -> Any:
        if isinstance(data, dict):
            given = {k: v for k, v in data.items() if v is not None}
            nested: dict[str, Any] = given
            for part in reversed(dotted.split(".")):
                nested = {part: nested}
            parse_config(nested)  # raises microspeed.ConfigError (a ValueError) naming the key
        return data

    validators = {"_microspeed_reads_it": model_validator(mode="before")(classmethod(validate))}
    made = create_model(name, __base__=DeepSpeedConfigModel, __validators__=validators, __doc__=doc or None,
                        __module__=__name__, **fields)
    return made
