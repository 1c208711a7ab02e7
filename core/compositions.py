"""Which features combine: what the plugins declare, gathered into one matrix the user can read.

Every plugin names the features it provides (:class:`Feature`, collected hook ``microspeed_features``) and
the pairs of features it cannot run together (:class:`Refusal`, collected hook ``microspeed_refusals``).
:func:`composition_matrix` gathers both from the installed plugins; ``microspeed plugins --matrix`` prints
it, and ``docs/compositions.md`` is its Markdown form (a test keeps the two equal).

The declarations are the single source of truth: a plugin that refuses a declared pair at
``initialize()`` raises with :meth:`Refusal.message` (so the text the user reads is the text the matrix
shows), and lifting a refusal means deleting its declaration together with the code that raises it.

Two refinements the plain pair list cannot say:

* features that share a :attr:`Feature.choice` are *alternatives* of one setting (ZeRO stages,
  fp16/bf16, the 1-bit optimizers): they are never on together, so the matrix leaves their pairs out;
* a refusal with a :attr:`Refusal.when` applies only under that condition (e.g. tied weights with
  clipping); the pair is otherwise supported, and the matrix shows it as *conditional*.

This module is light (no torch); plugins import its names from :mod:`microspeed.plugin_api`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import combinations
from typing import Any

from microspeed.errors import ConfigError, PluginError

__all__ = ["Feature", "Matrix", "Refusal", "composition_matrix", "refuse_pairs"]


@dataclass(frozen=True)
class Feature:
    """A feature a plugin provides, as the composition matrix lists it."""

    name: str
    """Stable id, e.g. ``"zero-3"`` (lower case, words joined by ``-``)."""
    title: str
    """Human title, e.g. ``"ZeRO stage 3"``."""
    enable: str
    """One line: how a user turns it on (a config key, a model class)."""
    choice: str = ""
    """The setting that picks one of several features (e.g. ``"zero_optimization.stage"``): features with the
    same choice are alternatives, never on together; empty when the feature combines with all its siblings."""
    plugin: str = ""
    """The plugin that declared it (filled in by :func:`composition_matrix`)."""


@dataclass(frozen=True)
class Refusal:
    """A pair of features that cannot combine, why, and what to use instead."""

    features: tuple[str, str]
    """The two feature names (order irrelevant)."""
    reason: str
    """One sentence: why the combination is unsound (not "not built yet")."""
    instead: str
    """What to use instead."""
    when: str = ""
    """Empty: the pair is always refused. Otherwise the condition under which it is (e.g. ``"tied weights
    across stages and gradient_clipping > 0"``); the pair is supported without it."""
    plugin: str = ""
    """The plugin that declared it (filled in by :func:`composition_matrix`)."""

    def message(self) -> str:
        """``"<reason>; <instead>"``: the text ``initialize()`` raises for this pair."""
        return f"{self.reason.rstrip('. ')}; {self.instead}"

    def error(self, key: str) -> ConfigError:
        """The :class:`ConfigError` to raise for this pair, naming ``key`` (the setting that turned it on)."""
        return ConfigError(f"{key}: {self.message()}")

    def names(self, a: str, b: str) -> bool:
        """Whether this refusal is about the (unordered) pair ``a``, ``b``."""
        return frozenset(self.features) == frozenset((a, b))


def refuse_pairs(firsts: Iterable[str], seconds: Iterable[str], reason: str, instead: str,
                 when: str = "") -> tuple[Refusal, ...]:
    """One :class:`Refusal` per pair ``(a, b)`` of ``firsts`` x ``seconds``, all with the same reason (so the same
    :meth:`Refusal.message`): how a plugin maps one refusal onto every feature pair it affects."""
    return tuple(Refusal((a, b), reason, instead, when) for a in firsts for b in seconds)


class Matrix:
    """The installed plugins' features and refusals (build it with :func:`composition_matrix`)."""

    def __init__(self, features: list[Feature], refusals: list[Refusal]) -> None:
        self.features = features
        self.refusals = refusals
        self.absent: list[Refusal] = []
        """Refusals whose other feature no installed plugin declares (``composition_matrix(strict=False)``)."""
        self._by_name = {f.name: f for f in features}
        self._refused: dict[frozenset[str], list[Refusal]] = {}
        for r in refusals:
            self._refused.setdefault(frozenset(r.features), []).append(r)

    def feature(self, name: str) -> Feature:
        """The feature called ``name`` (``KeyError`` naming the known ones otherwise)."""
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no installed plugin declares the feature {name!r}; known: "
                           f"{', '.join(self._by_name)}") from None

    def alternatives(self, a: str, b: str) -> bool:
        """Whether ``a`` and ``b`` are alternatives of one setting (never on together)."""
        fa, fb = self.feature(a), self.feature(b)
        return a != b and bool(fa.choice) and fa.choice == fb.choice

    def status(self, a: str, b: str) -> Refusal | None:
        """The refusal of the pair ``a``, ``b`` (in either order), or ``None`` when it is supported.

        Only unconditional refusals count; a pair refused under a condition is supported
        (see :meth:`conditions`).
        """
        self.feature(a), self.feature(b)
        return next((r for r in self._refused.get(frozenset((a, b)), []) if not r.when), None)

    def conditions(self, a: str, b: str) -> list[Refusal]:
        """The refusals of the pair ``a``, ``b`` that apply only under a condition (:attr:`Refusal.when`)."""
        self.feature(a), self.feature(b)
        return [r for r in self._refused.get(frozenset((a, b)), []) if r.when]

    def pairs(self) -> list[tuple[Feature, Feature, Refusal | None]]:
        """Every pair of features that can be on together (alternatives left out), with its status."""
        return [(fa, fb, self.status(fa.name, fb.name)) for fa, fb in combinations(self.features, 2)
                if not self.alternatives(fa.name, fb.name)]

    def summary(self) -> dict[str, int]:
        """Counts: ``features``, ``pairs``, ``supported``, ``refused``, ``conditional`` (supported, refused when)."""
        pairs = self.pairs()
        refused = sum(r is not None for _, _, r in pairs)
        conditional = sum(r is None and bool(self.conditions(a.name, b.name)) for a, b, r in pairs)
        return {"features": len(self.features), "pairs": len(pairs), "supported": len(pairs) - refused,
                "refused": refused, "conditional": conditional}

    def _cell(self, a: str, b: str) -> str:
        if a == b:
            return "·"
        if self.alternatives(a, b):
            return "alt"
        if self.status(a, b) is not None:
            return "NO"
        return "if" if self.conditions(a, b) else "ok"

    def groups(self, features: Iterable[str] | None = None) -> list[tuple[str, Refusal]]:
        """The shown refusals grouped by message: ``[(pairs, refusal)]``, ``pairs`` as text (``"a, b × c"``).

        A pair refused outright shows that refusal only; a supported pair shows its conditional ones.
        ``features``: only refusals involving one of these.
        """
        wanted = set(features) if features is not None else None
        grouped: dict[tuple[str, str, str], list[Refusal]] = {}
        for r in self.refusals:
            a, b = r.features
            if wanted is not None and not wanted & {a, b}:
                continue
            if r.when and self.status(a, b) is not None:
                continue  # refused outright anyway
            grouped.setdefault((r.plugin, r.message(), r.when), []).append(r)
        out = []
        for rs in grouped.values():
            firsts = list(dict.fromkeys(r.features[0] for r in rs))
            seconds = list(dict.fromkeys(r.features[1] for r in rs))
            if len(rs) == len(firsts) * len(seconds):
                pairs = f"{', '.join(firsts)} × {', '.join(seconds)}"
            else:
                pairs = "; ".join(f"{r.features[0]} × {r.features[1]}" for r in rs)
            out.append((pairs, rs[0]))
        return out

    def text(self) -> str:
        """The matrix as plain text: features, a grid, then every refusal with its reason."""
        s = self.summary()
        width = max((len(f.name) for f in self.features), default=4)
        lines = [f"composition matrix: {s['features']} features, {s['pairs']} pairs: {s['supported']} supported "
                 f"({s['conditional']} refused under a condition), {s['refused']} refused", "",
                 "features:"]
        for f in self.features:
            lines.append(f"  {f.name:{width}s}  {f.title} [plugin {f.plugin}] - {f.enable}")
        lines += ["", "grid (ok: supported, NO: refused, if: refused under a condition, alt: alternatives of "
                  "one setting):"]
        names = [f.name for f in self.features]
        lines.append(" " * (width + 4) + "".join(f"{i:>4d}" for i in range(1, len(names) + 1)))
        for i, a in enumerate(names, 1):
            lines.append(f"{i:>2d} {a:<{width}s} " + "".join(f"{self._cell(a, b):>4s}" for b in names))
        lines += ["", "refusals (refused at initialize() with this message):"]
        for pairs, r in self.groups():
            when = f", when {r.when}" if r.when else ""
            lines += [f"  {pairs} [plugin {r.plugin}{when}]:", f"      {r.message()}"]
        if not self.refusals:
            lines.append("  (none)")
        if self.absent:
            lines += ["", "refusals naming features no installed plugin declares (check the spelling if you expected "
                      "them):"]
            lines += [f"  {r.features[0]} x {r.features[1]} [plugin {r.plugin}]" for r in self.absent]
        return "\n".join(lines) + "\n"

    def markdown(self) -> str:
        """The matrix as Markdown (``docs/compositions.md``): generated, so regenerate rather than edit."""
        s = self.summary()
        names = [f.name for f in self.features]
        out = [
            "# Composition matrix",
            "",
            "<!-- Generated from the installed plugins' declarations (hooks microspeed_features and "
            "microspeed_refusals). Do not edit: regenerate with "
            "`microspeed plugins --matrix --markdown > docs/compositions.md` (or "
            "python scripts/update_compositions.py, which also rewrites the plugin READMEs' Compositions blocks); "
            "tests/test_compositions.py checks that this file equals what the plugins declare. -->",
            "",
            "Which features combine, as the installed plugins declare them (`microspeed plugins --matrix` prints "
            "the same for your installation). A refused pair is refused at `initialize()` with the message below; "
            "each plugin's README argues its refusals under \"Compositions\".",
            "",
            f"{s['features']} features, {s['pairs']} pairs that can be on together: **{s['supported']} supported** "
            f"({s['conditional']} of them refused under a condition), **{s['refused']} refused**.",
            "",
            "## Features",
            "",
            "| # | feature | title | plugin | how to turn it on |",
            "|---|---|---|---|---|",
        ]
        for i, f in enumerate(self.features, 1):
            out.append(f"| {i} | `{f.name}` | {_md(f.title)} | {f.plugin} | {_md(f.enable)} |")
        out += ["", "## Matrix", "",
                "✓ supported, ✗ refused, ◐ refused under a condition, – alternatives of one setting "
                "(never on together).", "",
                "| | " + " | ".join(str(i) for i in range(1, len(names) + 1)) + " |",
                "|---" * (len(names) + 1) + "|"]
        symbols = {"·": " ", "alt": "–", "NO": "✗", "if": "◐", "ok": "✓"}
        for i, a in enumerate(names, 1):
            out.append(f"| **{i}** `{a}` | " + " | ".join(symbols[self._cell(a, b)] for b in names) + " |")
        out += ["", "## Refusals", ""]
        groups = self.groups()
        if groups:
            out += ["| pairs | when | plugin | why, and what to use instead |", "|---|---|---|---|"]
            for pairs, r in groups:
                out.append(f"| {pairs} | {_md(r.when) or 'always'} | {r.plugin} | {_md(r.message())} |")
        else:
            out.append("None: every pair combines.")
        return "\n".join(out) + "\n"

    def readme_section(self, plugins: Iterable[str]) -> str:
        """The generated "Compositions" block of a distribution's README: the refusals involving ``plugins``' features.

        Delimited by :data:`README_BEGIN` / :data:`README_END`; ``scripts/update_compositions.py`` rewrites it
        and ``tests/test_compositions.py`` checks it. Each line argues one refusal in one sentence.
        """
        plugins = set(plugins)
        features = [f.name for f in self.features if f.plugin in plugins]
        lines = [README_BEGIN,
                 f"Features: {', '.join(f'`{n}`' for n in features) or 'none'}. What is refused at `initialize()` "
                 f"with them, why the combination is unsound, and what to use instead (every other pair combines; "
                 f"the whole matrix: `microspeed plugins --matrix`, or docs/compositions.md in the repository):", ""]
        groups = self.groups(features)
        for pairs, r in groups:
            when = f" when {r.when}" if r.when else ""
            lines.append(f"- {pairs}{when} (refused by the plugin `{r.plugin}`): {r.message()}.")
        if not groups:
            lines.append("- none: each of these features combines with every installed feature.")
        lines.append(README_END)
        return "\n".join(lines) + "\n"


README_BEGIN = "<!-- compositions: generated by scripts/update_compositions.py from microspeed_refusals -->"
"""First line of the generated block in a plugin README (see :meth:`Matrix.readme_section`)."""
README_END = "<!-- /compositions -->"
"""Last line of that block."""


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def _as_list(plugin: str, hook: str, answer: Any, kind: type) -> list[Any]:
    if answer is None:
        return []
    if not isinstance(answer, (list, tuple)) or not all(isinstance(x, kind) for x in answer):
        raise PluginError(f"plugin {plugin!r}: {hook} must return a list of {kind.__name__} or None, "
                          f"got {answer!r}")
    return list(answer)


def _answers(pm: Any, hook: str) -> list[tuple[str, Any]]:
    """``(plugin, answer)`` for each implementation of the collected ``hook``, plugins in registration order."""
    order = {name: i for i, name in enumerate(pm.names())}
    answers = [(plugin, answer) for plugin, answers in pm.call_each(hook) for answer in answers]
    return sorted(answers, key=lambda pa: order.get(pa[0], len(order)))


def composition_matrix(plugin_manager: Any = None, strict: bool = True) -> Matrix:
    """The matrix of the installed plugins (``plugin_manager``: a loaded :class:`~microspeed.plugins.PluginManager`;
    ``None`` loads the built-ins and the installed entry points).

    A refusal must name one of its own plugin's features. Its other feature may belong to a plugin that is not
    installed (``microspeed-comm`` without ``microspeed-zero``): with ``strict=False`` such a refusal is kept
    aside in :attr:`Matrix.absent` (the pair cannot arise here); with ``strict`` (the default, what the
    repository's tests use, so a misspelt name fails) it is an error.

    Raises:
        PluginError: two plugins declare one feature name (naming both); a refusal names a feature no
            installed plugin declares (``strict``), a pair of one feature with itself, or none of its plugin's
            features; a hook answers something other than a list of declarations.
    """
    if plugin_manager is None:
        from microspeed.plugins import PluginManager

        plugin_manager = PluginManager()
        plugin_manager.load_all()
    pm = plugin_manager
    features: list[Feature] = []
    owner: dict[str, str] = {}
    for plugin, answer in _answers(pm, "microspeed_features"):
        for f in _as_list(plugin, "microspeed_features", answer, Feature):
            if f.name in owner:
                raise PluginError(f"the feature {f.name!r} is declared twice: by the plugin {owner[f.name]!r} and "
                                  f"by the plugin {plugin!r}; rename one of them (feature names are global)")
            owner[f.name] = plugin
            features.append(dataclasses.replace(f, plugin=plugin))
    refusals: list[Refusal] = []
    absent: list[Refusal] = []
    for plugin, answer in _answers(pm, "microspeed_refusals"):
        for r in _as_list(plugin, "microspeed_refusals", answer, Refusal):
            if len(r.features) != 2 or r.features[0] == r.features[1]:
                raise PluginError(f"plugin {plugin!r}: a refusal names two different features, got {r.features!r}")
            if not r.reason.strip() or not r.instead.strip():
                raise PluginError(f"plugin {plugin!r}: the refusal of {r.features!r} needs a reason and what to "
                                  f"use instead")
            if plugin not in (owner.get(r.features[0]), owner.get(r.features[1])):
                raise PluginError(f"plugin {plugin!r} refuses {r.features[0]!r} with {r.features[1]!r}, neither of "
                                  f"which it declares (microspeed_features); a plugin declares refusals of its own "
                                  f"features only")
            unknown = [n for n in r.features if n not in owner]
            if unknown and strict:
                raise PluginError(f"plugin {plugin!r} refuses {r.features[0]!r} with {r.features[1]!r}, but no "
                                  f"installed plugin declares the feature {unknown[0]!r} (microspeed_features); "
                                  f"declared: {', '.join(owner) or 'none'}")
            (absent if unknown else refusals).append(dataclasses.replace(r, plugin=plugin))
    matrix = Matrix(features, refusals)
    matrix.absent = absent
    return matrix
