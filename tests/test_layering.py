"""Layering, checked on the source (a plain AST scan): who may import what.

* the core (``core/``, import name ``microspeed``) never imports a plugin package;
* a plugin's library code imports from ``microspeed`` only its top-level names, the declared plugin API
  (:mod:`microspeed.plugin_api`) and the shared models (:mod:`microspeed.models`) — never
  ``microspeed.builtin.*``, ``microspeed.demo.*``, another kernel module, a private name, or another
  plugin (directly or through a DeepSpeed-style alias such as ``microspeed.zero``);
* ``core/engine.py`` imports only kernel modules;
* ``zero_optimization`` is read only by the ZeRO plugin, and no plugin compares another plugin's name.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import microspeed
from microspeed.namespaces import ALIASES
from microspeed.plugins import BUILTIN_PLUGINS

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core"
PLUGIN_ROOTS = sorted(p for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").is_file())
PLUGIN_ROOTS += sorted(p for p in (ROOT / "examples" / "plugins").iterdir() if (p / "pyproject.toml").is_file())

#: The kernel: the top-level modules of core/ (subsystems live in packages).
KERNEL = {"microspeed." + p.stem for p in CORE.glob("*.py") if p.stem != "__init__"} | {"microspeed"}
ALLOWED_FOR_PLUGINS = {"microspeed", "microspeed.plugin_api", "microspeed.models"}
PLUGIN_ALIASES = {f"microspeed.{alias}" for alias, (target, _) in ALIASES.items()
                  if not target.startswith("microspeed.")}


def _plugin_packages() -> dict[Path, str]:
    """``source folder -> import package`` of every plugin distribution in the repository."""
    found = {}
    for root in PLUGIN_ROOTS:
        for pkg in root.iterdir():
            if (pkg / "__init__.py").is_file() and pkg.name.startswith("microspeed_"):
                found[pkg] = pkg.name
    return found


PACKAGES = _plugin_packages()


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """``(line, module, imported names)`` of every absolute import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module, [a.name for a in node.names]))
    return out


def _library_files(pkg_dir: Path) -> list[Path]:
    return sorted(p for p in pkg_dir.rglob("*.py") if "tests" not in p.relative_to(pkg_dir).parts)


def test_the_scan_sees_every_plugin():
    assert {"microspeed_zero", "microspeed_comm", "microspeed_pipeline", "microspeed_moe",
            "microspeed_sparse_attn", "microspeed_efficiency", "microspeed_early_stopping"} <= set(PACKAGES.values())
    assert "microspeed.engine" in KERNEL and "microspeed.plugin_api" in KERNEL


def test_core_never_imports_a_plugin_package():
    plugin_names = set(PACKAGES.values())
    bad = [f"{path.relative_to(ROOT)}:{line} imports {module}"
           for path in sorted(CORE.rglob("*.py")) for line, module, _ in _imports(path)
           if module.split(".")[0] in plugin_names]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("pkg_dir", sorted(PACKAGES), ids=lambda p: PACKAGES[p])
def test_a_plugin_imports_only_the_plugin_api_and_top_level_names(pkg_dir):
    own = PACKAGES[pkg_dir]
    others = set(PACKAGES.values()) - {own}
    public = set(microspeed.__all__)
    bad = []
    for path in _library_files(pkg_dir):
        for line, module, names in _imports(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            top = module.split(".")[0]
            if top in others:
                bad.append(f"{where} imports another plugin: {module}")
            elif any(module == a or module.startswith(a + ".") for a in PLUGIN_ALIASES):
                bad.append(f"{where} imports another plugin through its alias: {module}")
            elif top == "microspeed":
                if module not in ALLOWED_FOR_PLUGINS:
                    bad.append(f"{where} imports {module} (allowed: microspeed.plugin_api, microspeed.models, "
                               f"microspeed's top-level names)")
                elif module == "microspeed" and any(n not in public for n in names):
                    bad.append(f"{where} imports {[n for n in names if n not in public]} from microspeed, which "
                               f"are not top-level public names (take them from microspeed.plugin_api)")
                elif any(n.startswith("_") for n in names):
                    bad.append(f"{where} imports a private name from {module}: {names}")
    assert not bad, "\n".join(bad)


def test_engine_imports_only_kernel_modules():
    bad = [f"core/engine.py:{line} imports {module}" for line, module, _ in _imports(CORE / "engine.py")
           if module.split(".")[0] == "microspeed" and module not in KERNEL]
    assert not bad, "\n".join(bad)


ZERO_KEY = re.compile(r"^zero_optimization(\.[a-z_]+)*$")

#: DeepSpeed-format translators: DeepSpeed's own key table and config object, and the converters between its
#: checkpoint layout (which records the ZeRO stage in the saved config) and ours.
DEEPSPEED_FORMAT = {CORE / "compat", CORE / "checkpoint" / "deepspeed_format.py", CORE / "checkpoint" / "export.py"}


def _zero_reads(path: Path) -> list[str]:
    """Where ``path`` reads a ``zero_optimization`` key: ``x.get("zero_optimization...")``, ``x.is_set(...)``,
    ``x["zero_optimization..."]`` (naming the key in prose or as a section's owner is not reading it)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                "get", "is_set", "pop", "setdefault") and node.args:
            key = node.args[0]
        elif isinstance(node, ast.Subscript):
            key = node.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str) and ZERO_KEY.match(key.value):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_zero_read_scan_finds_reads(tmp_path):
    sample = ROOT / "tests" / "_layering_sample.py"
    try:
        sample.write_text('s = config.get("zero_optimization.stage", 0)\nt = raw["zero_optimization"]\n'
                          'u = "zero_optimization"  # a name, not a read\n')
        assert len(_zero_reads(sample)) == 2
    finally:
        sample.unlink()


def test_zero_optimization_is_read_only_by_the_zero_plugin():
    bad = []
    for pkg_dir, pkg in PACKAGES.items():
        if pkg != "microspeed_zero":
            for path in _library_files(pkg_dir):
                bad += _zero_reads(path)
    for path in sorted(CORE.rglob("*.py")):
        if not any(path == d or d in path.parents for d in DEEPSPEED_FORMAT):
            bad += _zero_reads(path)
    assert not bad, "\n".join(bad)


def _plugin_names() -> set[str]:
    names = set(BUILTIN_PLUGINS)
    for root in PLUGIN_ROOTS:
        text = (root / "pyproject.toml").read_text()
        block = text.split('[project.entry-points."microspeed.plugins"]', 1)
        if len(block) == 2:
            names |= set(re.findall(r"^\s*([A-Za-z_][\w-]*)\s*=", block[1].split("\n[", 1)[0], re.M))
    return names


def _foreign_name_comparisons(path: Path, names: set[str]) -> list[str]:
    """Comparisons of an owner/provider/plugin name with a plugin name that is not this file's own."""
    text = path.read_text()
    own = set(re.findall(r'set_plugin_state\("([\w-]+)"', text)) | set(re.findall(r'claim\([^,]+,\s*"([\w-]+)"', text))
    found = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.Compare):
            continue
        source = ast.unparse(node)
        if not any(word in source for word in ("owner", "provider", "plugin_name")):
            continue
        consts = [c for side in [node.left, *node.comparators]
                  for c in [side, *(side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [])]
                  if isinstance(c, ast.Constant) and isinstance(c.value, str)]
        if any(c.value in names and c.value not in own for c in consts):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {source}")
    return found


def test_the_name_comparison_scan_finds_comparisons():
    sample = ROOT / "tests" / "_layering_sample.py"
    try:
        sample.write_text('engine.set_plugin_state("moe", x)\na = engine.owner(role) == "zero"\n'
                          'b = engine.owner(role) in (None, "moe")\nc = name == "zero"\n')
        assert [f.split(": ", 1)[1] for f in _foreign_name_comparisons(sample, {"zero", "moe"})] == [
            "engine.owner(role) == 'zero'"]
    finally:
        sample.unlink()


def test_no_plugin_compares_another_plugins_name():
    """``owner(...) == "zero"``-style tests: a plugin may compare only its own name."""
    names = _plugin_names()
    assert {"zero", "comm", "pipeline", "moe", "data_parallel"} <= names
    bad = [hit for pkg_dir in PACKAGES for path in _library_files(pkg_dir)
           for hit in _foreign_name_comparisons(path, names)]
    assert not bad, "\n".join(bad)
