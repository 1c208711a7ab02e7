"""Regenerate what the composition declarations document: ``docs/compositions.md`` and each plugin README's block.

Usage: ``python scripts/update_compositions.py`` (rewrite) or ``--check`` (exit 1 naming the stale files).
``tests/test_compositions.py`` runs the check. ``docs/compositions.md`` is also what
``microspeed plugins --matrix --markdown`` prints; a plugin README's block (between
:data:`microspeed.compositions.README_BEGIN` and ``README_END``, under a "Compositions" heading) lists what the
plugins of that distribution refuse (:meth:`microspeed.compositions.Matrix.readme_section`).
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

from microspeed.compositions import README_BEGIN, README_END, Matrix, composition_matrix
from microspeed.plugins import PluginManager

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "compositions.md"


def readmes(pm: PluginManager, matrix: Matrix) -> dict[Path, list[str]]:
    """``README path -> names of its plugins``, for the repository's plugins that declare features."""
    declaring = {f.plugin for f in matrix.features}
    out: dict[Path, list[str]] = {}
    for name, info in pm.infos.items():
        if info.source.startswith("builtin") or name not in declaring:
            continue
        package = Path(inspect.getfile(type(info.plugin))).resolve().parent
        readme = package.parent / "README.md"
        if readme.is_file() and ROOT in readme.parents:
            out.setdefault(readme, []).append(name)
    return out


def with_block(text: str, block: str) -> str:
    """``text`` with its generated block replaced by ``block`` (appended under "## Compositions" when absent)."""
    if README_BEGIN in text and README_END in text:
        head, rest = text.split(README_BEGIN, 1)
        return head + block.rstrip("\n") + rest.split(README_END, 1)[1]
    return text.rstrip("\n") + "\n\n## Compositions\n\n" + block


def expected(pm: PluginManager | None = None) -> dict[Path, str]:
    """Every generated file's expected content."""
    if pm is None:
        pm = PluginManager()
        pm.load_all()
    matrix: Matrix = composition_matrix(pm)
    files = {DOC: matrix.markdown()}
    for readme, plugins in readmes(pm, matrix).items():
        files[readme] = with_block(readme.read_text(), matrix.readme_section(plugins))
    return files


def main(argv: list[str]) -> int:
    """Rewrite the stale files, or with ``--check`` name them and return 1."""
    stale = [path for path, text in expected().items() if not path.is_file() or path.read_text() != text]
    if "--check" in argv:
        for path in stale:
            print(f"stale: {path.relative_to(ROOT)} (run python scripts/update_compositions.py)")
        return 1 if stale else 0
    for path, text in expected().items():
        if path in stale:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
