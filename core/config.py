"""ds_config parsing: DeepSpeed's keys, strict validation, sections owned by plugins.

The schema is assembled at ``initialize()`` from the sections every plugin claims through
``microspeed_config_sections``. Validation is strict: an unknown key at any depth, a wrong type,
a value out of range, or a section whose plugin is not installed is a :class:`ConfigError` that
names the key path, what was given, what is accepted and the fix.
"""

from __future__ import annotations

import base64
import difflib
import hashlib
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from microspeed.compat import deepspeed_keys
from microspeed.errors import ConfigError

AUTO = "auto"
_REQUIRED = object()

#: Sections DeepSpeed users write that belong to a plugin distribution, and that distribution.
PLUGIN_SECTIONS: dict[str, str] = {
    "zero_optimization": "microspeed-zero",
    "zero_force_ds_cpu_optimizer": "microspeed-zero",
    "zero_allow_untested_optimizer": "microspeed-zero",
    "aio": "microspeed-zero",
    "pipeline": "microspeed-pipeline",
    "activation_checkpointing": "microspeed-pipeline",
    "sparse_attention": "microspeed-sparse-attn",
    "curriculum_learning": "microspeed-efficiency",
    "data_efficiency": "microspeed-efficiency",
    "progressive_layer_drop": "microspeed-efficiency",
    "flops_profiler": "microspeed-efficiency",
}


@dataclass(frozen=True)
class Field:
    """One scalar (or list) config key: accepted types, default, check and documentation.

    ``check(value)`` returns ``None`` when the value is fine, else the text "what is accepted".
    ``auto=True`` lets the user write ``"auto"``; the owner resolves it (the value stays
    ``"auto"`` in the parsed config until then).
    """

    types: tuple[type, ...]
    default: Any = None
    doc: str = ""
    check: Callable[[Any], str | None] | None = None
    choices: tuple[Any, ...] | None = None
    auto: bool = False
    required: bool = False
    infinite: bool = False
    """Accepts ``inf`` (``steps_per_print``: never). NaN is refused everywhere, inf unless this is set."""


@dataclass(frozen=True)
class Section:
    """A nested config section: named fields and subsections.

    ``open=True`` accepts any keys below it (their owner validates them, for example
    ``optimizer.params`` is checked against the optimizer's signature). ``notices`` names keys
    DeepSpeed knows that this section accepts without acting on them: ``key -> why it has no
    effect here``; the user gets that reason in a one-line notice (logged once, on rank 0).
    """

    fields: Mapping[str, Field | Section] = field(default_factory=dict)
    doc: str = ""
    open: bool = False
    notices: Mapping[str, str] = field(default_factory=dict)


def positive(v: Any) -> str | None:
    """Check: a number > 0."""
    return None if v > 0 else "a number > 0"


def non_negative(v: Any) -> str | None:
    """Check: a number >= 0."""
    return None if v >= 0 else "a number >= 0"


def _type_name(types: tuple[type, ...]) -> str:
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string",
             list: "a list", dict: "an object", type(None): "null"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def _type_ok(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int) and float in types:
        return True
    return isinstance(value, types)


def _suggest(key: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


class _Report:
    """What validation found: typos, other problems (each one message), and notices."""

    def __init__(self) -> None:
        self.typos: list[str] = []
        self.problems: list[str] = []
        self.notices: list[str] = []

    def error(self) -> ConfigError | None:
        """One :class:`ConfigError` listing every problem, typos first (``None`` when there is none)."""
        found = self.typos + self.problems
        if not found:
            return None
        if len(found) == 1:
            return ConfigError(found[0], problems=found)
        listed = "\n".join(f"  - {msg}" for msg in found)
        return ConfigError(f"the ds_config has {len(found)} problems:\n{listed}", problems=found)


def _validate(path: str, value: Any, spec: Field | Section, report: _Report) -> Any:
    if isinstance(spec, Section):
        if not isinstance(value, Mapping):
            report.problems.append(f"{path}: expected an object (section), got {value!r}.")
            return value
        return _validate_section(path, value, spec, report)
    if value == AUTO and isinstance(value, str):
        if spec.auto:
            return AUTO
        report.problems.append(f'{path}: "auto" cannot be resolved for this key; give {_type_name(spec.types)} '
                               f"(default: {spec.default!r}).")
        return value
    if not _type_ok(value, spec.types):
        report.problems.append(f"{path}: expected {_type_name(spec.types)}, got {value!r} ({type(value).__name__}).")
        return value
    bad = _nonfinite(path, value, spec.infinite)
    if bad is not None:
        report.problems.append(bad)
        return value
    if spec.choices is not None and value not in spec.choices:
        hint = _suggest(value, [c for c in spec.choices if isinstance(c, str)]) if isinstance(value, str) else ""
        msg = f"{path}: got {value!r};{hint} accepted values: {', '.join(map(repr, spec.choices))}."
        (report.typos if hint else report.problems).append(msg)
        return value
    if spec.check is not None and value is not None:
        problem = spec.check(value)
        if problem:
            msg = f"{path}: got {value!r}; expected {problem}."
            (report.typos if "did you mean" in problem.lower() else report.problems).append(msg)
            return value
    if isinstance(value, int) and not isinstance(value, bool) and float in spec.types and int not in spec.types:
        value = float(value)
    return value


def _nonfinite(path: str, value: Any, inf_ok: bool = False) -> str | None:
    """The problem with the first NaN or infinity in ``value`` (a number, or lists and objects of them), or ``None``.

    A non-finite number is never a setting: ``lr: inf`` turns every weight into NaN at the first step. The
    message names the key path (``optimizer.params.lr``, ``...betas[1]``).
    """
    if isinstance(value, float) and not math.isfinite(value) and not (inf_ok and value == math.inf):
        return (f"{path}: got {value!r}; expected a finite number (NaN and infinity are refused in every numeric "
                f"key: `lr: inf` would make every weight non-finite at the first step).")
    if isinstance(value, Mapping):
        items = ((f"{path}.{k}", v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for where, item in items:
        bad = _nonfinite(where, item)
        if bad is not None:
            return bad
    return None


def _validate_section(path: str, given: Mapping[str, Any], section: Section, report: _Report,
                      present: bool = True) -> dict[str, Any]:
    if section.open:  # its owner checks the keys; numbers must be finite whoever owns them
        report.problems.extend(p for p in (_nonfinite(f"{path}.{k}", v) for k, v in given.items()) if p)
        return dict(given)
    out: dict[str, Any] = {}
    for key, value in given.items():
        sub = f"{path}.{key}" if path else key
        spec = section.fields.get(key)
        if spec is None:
            if _known_elsewhere(path, key, value, section, report):
                out[key] = value
            continue
        out[key] = _validate(sub, value, spec, report)
    for key, spec in section.fields.items():
        if key in out or key in given:
            continue
        sub = f"{path}.{key}" if path else key
        if isinstance(spec, Section):
            out[key] = _validate_section(sub, {}, spec, report, present=False)
        elif spec.required and present:
            report.problems.append(f"{sub}: required key is missing ({spec.doc or _type_name(spec.types)}).")
        else:
            out[key] = spec.default
    return out


def _known_elsewhere(path: str, key: str, value: Any, section: Section, report: _Report) -> bool:
    """Classify a key no schema lists (see :mod:`microspeed.compat.deepspeed_keys`); ``True`` when it is accepted."""
    where = f"{path}.{key}" if path else key
    if key in section.notices:
        report.notices.append(f"{where}: accepted, no effect here: {section.notices[key]}.")
        return True
    if not path and key in deepspeed_keys.REFUSED:
        if not deepspeed_keys.turns_on(key, value):
            return True
        report.problems.append(f"{where}: a DeepSpeed key microspeed does not support: "
                               f"{deepspeed_keys.REFUSED[key]}. Remove it.")
        return False
    if not path and key in deepspeed_keys.NO_EFFECT:
        known = deepspeed_keys.subkeys(key)
        typos = [k for k in value if k not in known] if isinstance(value, Mapping) and known else []
        report.typos.extend(f"{key}.{k}: unknown key.{_suggest(k, known)} Valid keys here: {', '.join(known)}."
                            for k in typos)
        report.notices.append(f"{where}: accepted, no effect here: {deepspeed_keys.NO_EFFECT[key]}.")
        return not typos
    if deepspeed_keys.is_deepspeed_key(where) and not (not path and key in PLUGIN_SECTIONS):
        owner = f"the {path.split('.')[0]!r} section's plugin" if path else "microspeed"
        report.problems.append(f"{where}: a DeepSpeed 0.19.8 key that {owner} does not implement; remove it "
                               f"(see the README's table of ds_config keys for what is supported).")
        return False
    error = _unknown_key(path, key, section)
    (report.problems if not path and key in PLUGIN_SECTIONS else report.typos).append(str(error))
    return False


def plugin_folder(dist: str) -> str:
    """The folder under ``plugins/`` that holds a plugin distribution (``microspeed-sparse-attn`` → ``sparse_attn``)."""
    return dist.removeprefix("microspeed-").replace("-", "_")


def _unknown_key(path: str, key: str, section: Section) -> ConfigError:
    where = f"{path}.{key}" if path else key
    if not path and key in PLUGIN_SECTIONS:
        dist = PLUGIN_SECTIONS[key]
        return ConfigError(
            f"{where}: this section belongs to the plugin distribution {dist!r}, which is not "
            f"installed (or is disabled). Install it (pip install ./plugins/{plugin_folder(dist)}"
            f" or pip install {dist}), or remove the section."
        )
    candidates = list(section.fields)
    hint = _suggest(key, candidates)
    if not hint and not path:
        hint = _suggest(key, list(PLUGIN_SECTIONS))
    valid = ", ".join(sorted(candidates)) if len(candidates) <= 12 else f"{len(candidates)} keys (see README)"
    return ConfigError(f"{where}: unknown key.{hint} Valid keys here: {valid}.")


class Config:
    """A validated ds_config: the user's raw dict and the parsed values with defaults."""

    def __init__(self, raw: Mapping[str, Any], values: dict[str, Any]) -> None:
        self.raw = dict(raw)
        self.values = values
        self.notices: list[str] = []

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def __contains__(self, key: str) -> bool:
        return key in self.values

    def get(self, dotted: str, default: Any = None) -> Any:
        """The parsed value at a dotted path (``"fp16.enabled"``), or ``default``."""
        node: Any = self.values
        for part in dotted.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return default
            node = node[part]
        return node

    def is_set(self, dotted: str) -> bool:
        """Whether the *user* wrote the key at this dotted path."""
        node: Any = self.raw
        for part in dotted.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return False
            node = node[part]
        return True

    def set(self, dotted: str, value: Any) -> None:
        """Set a parsed value (used when resolving ``"auto"``)."""
        *parents, last = dotted.split(".")
        node = self.values
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value

    def digest(self) -> str:
        """A short hash of the parsed config: what ranks compare at ``initialize()``."""
        text = json.dumps(self.values, sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        """The parsed config as a plain dict (a copy)."""
        return json.loads(json.dumps(self.values, default=repr))


def load_raw(config: Any = None, args: Any = None) -> dict[str, Any]:
    """The user's ds_config as a dict: from ``config`` (dict or JSON path) or ``args``.

    ``args.deepspeed_config`` (or ``args.deepscale_config``) is used when ``config`` is None.
    """
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is None:
        raise ConfigError(
            "no ds_config: pass initialize(config=<dict or path to JSON>) or "
            "args.deepspeed_config (see microspeed.add_config_arguments)."
        )
    if isinstance(config, (str, os.PathLike)):
        config = _read_config_text(os.fspath(config))
    if not isinstance(config, Mapping):
        raise ConfigError(f"config: expected a dict or a path to a JSON file, got {type(config).__name__}.")
    return dict(config)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = sorted({k for k, _ in pairs if k in seen or seen.add(k)})
        raise ConfigError(f"config: duplicate keys {twice}; give each key once.")
    return out


def _read_config_text(path: str) -> Any:
    """Read a ds_config file as DeepSpeed 0.19.8 does: with ``hjson``, so ``//`` and ``#`` comments and
    trailing commas are accepted and a duplicate key is an error; a string that is no file may be the
    config itself, base64-encoded (as DeepSpeed's launcher passes it)."""
    import hjson

    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as fh:
                return hjson.load(fh, object_pairs_hook=_no_duplicate_keys)
        except hjson.HjsonDecodeError as exc:
            raise ConfigError(f"config: {path!r} is not valid JSON (comments and trailing commas are fine): "
                              f"{exc}") from exc
    try:
        text = base64.urlsafe_b64decode(path).decode("utf-8")
        decoded = hjson.loads(text, object_pairs_hook=_no_duplicate_keys)
    except (ValueError, UnicodeDecodeError, hjson.HjsonDecodeError):
        decoded = None
    if not isinstance(decoded, Mapping):
        raise ConfigError(f"config: file {path!r} does not exist (nor is it a base64-encoded config).")
    return decoded


def merge_schema(claims: list[dict[str, Field | Section]]) -> Section:
    """Merge the sections claimed by plugins into one top-level schema; refuse double claims."""
    fields: dict[str, Field | Section] = {}
    for claim in claims:
        for name, spec in (claim or {}).items():
            if name in fields:
                raise ConfigError(f"config section {name!r} is claimed by two plugins; disable one of them.")
            fields[name] = spec
    return Section(fields=fields)


#: DeepSpeed's old section names it still reads when the new name is absent: old -> new.
RENAMED_SECTIONS = {"bfloat16": "bf16"}


def _renamed_sections(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """Read DeepSpeed's old section names as the new ones, as DeepSpeed does (the new name wins when both are given)."""
    if not any(old in raw and new not in raw for old, new in RENAMED_SECTIONS.items()):
        return raw
    out = dict(raw)
    for old, new in RENAMED_SECTIONS.items():
        if old in out and new not in out:
            out[new] = out.pop(old)
    return out


def parse(raw: Mapping[str, Any], schema: Section, extra_problems: list[str] = ()) -> Config:
    """Validate ``raw`` against ``schema`` and fill defaults.

    Raises one :class:`ConfigError` listing every problem (typos first, then ``extra_problems``
    found by the caller, e.g. arguments of ``initialize()``). Keys DeepSpeed knows that have
    no effect here become :attr:`Config.notices`.
    """
    raw = _renamed_sections(raw)
    report = _Report()
    values = _validate_section("", raw, schema, report)
    report.problems.extend(extra_problems)
    error = report.error()
    if error is not None:
        raise error
    config = Config(raw, values)
    config.notices = report.notices
    return config


SAMPLE_COUNTER_MAX = 2**63 - 1
"""Largest ``train_batch_size``: ``engine.global_samples`` is saved in checkpoints as a signed 64-bit integer."""


def resolve_batch_triad(config: Config, dp_world_size: int) -> tuple[int, int, int]:
    """Resolve DeepSpeed's batch triad in place; return ``(train_batch, micro_batch, gas)``.

    ``train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps *
    data-parallel world size``; any two give the third; one alone assumes 1 accumulation step.
    """

    def given(key: str) -> int | None:
        v = config.get(key)
        return None if v in (None, AUTO) else int(v)

    tbs, mbs, gas = given("train_batch_size"), given("train_micro_batch_size_per_gpu"), given(
        "gradient_accumulation_steps"
    )
    ws = dp_world_size
    if tbs is not None and mbs is not None and gas is not None:
        pass
    elif tbs is not None and mbs is not None:
        gas = max(tbs // mbs // ws, 1)
    elif tbs is not None and gas is not None:
        mbs = max(tbs // ws // gas, 1)
    elif mbs is not None and gas is not None:
        tbs = mbs * gas * ws
    elif tbs is not None:
        gas, mbs = 1, max(tbs // ws, 1)
    elif mbs is not None:
        gas = gas or 1
        tbs = mbs * gas * ws
    else:
        raise ConfigError(
            "train_batch_size / train_micro_batch_size_per_gpu: give at least one of them "
            "(with gradient_accumulation_steps optional)."
        )
    if tbs != mbs * gas * ws:
        raise ConfigError(
            f"batch size mismatch: train_batch_size={tbs} must equal train_micro_batch_size_per_gpu={mbs}"
            f" x gradient_accumulation_steps={gas} x data-parallel world size={ws} (= {mbs * gas * ws}). "
            "Fix one of the three, or give only two and let the third be derived."
        )
    if tbs > SAMPLE_COUNTER_MAX:
        raise ConfigError(
            f"train_batch_size={tbs} (train_micro_batch_size_per_gpu={mbs} x gradient_accumulation_steps={gas} x "
            f"data-parallel world size={ws}) does not fit the 64-bit sample counter (at most {SAMPLE_COUNTER_MAX} "
            "samples per step); give a batch a step can hold."
        )
    config.set("train_batch_size", tbs)
    config.set("train_micro_batch_size_per_gpu", mbs)
    config.set("gradient_accumulation_steps", gas)
    return tbs, mbs, gas


def markdown_table(schema: Section, owners: Mapping[str, str] | None = None) -> str:
    """The supported ds_config keys as a Markdown table (key, type, default, plugin, meaning)."""
    owners = owners or {}
    rows = ["| key | type | default | plugin | meaning |", "|---|---|---|---|---|"]

    def walk(prefix: str, section: Section, owner: str) -> None:
        for name, spec in section.fields.items():
            path = f"{prefix}.{name}" if prefix else name
            who = owners.get(name, owner) if not prefix else owner
            if isinstance(spec, Section):
                if spec.open or not spec.fields:
                    rows.append(f"| `{path}` | object | | {who} | {spec.doc} |")
                walk(path, spec, who)
            else:
                kinds = _type_name(spec.types) + (" or \"auto\"" if spec.auto else "")
                if spec.choices:
                    kinds = " / ".join("null" if c is None else f"`{c}`" for c in spec.choices)
                default = "required" if spec.required else ("" if spec.default is None else f"`{spec.default!r}`")
                rows.append(f"| `{path}` | {kinds} | {default} | {who} | {spec.doc} |")

    walk("", schema, "")
    return "\n".join(rows)
