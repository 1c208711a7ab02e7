"""Build of the core distribution ``microspeed`` (the metadata is in pyproject.toml; this file adds what TOML cannot).

* The packages are discovered: every folder under ``core/`` holding an ``__init__.py`` is ``microspeed.<folder>``
  (setuptools' ``packages.find`` cannot add the ``microspeed`` prefix of the ``core`` -> ``microspeed`` mapping,
  and a hand-written list once left out ``microspeed.elasticity``).
* The wheel carries two things from outside ``core/`` that microspeed reads at run time:
  ``microspeed/deepspeed_standin/`` is ``compat/deepspeed/src`` (the ``deepspeed`` stand-in package and its
  ``deepspeed-0.19.8+microspeed.dist-info``), the folder ``microspeed deepspeed-path`` prints and
  ``microspeed run --as-deepspeed`` puts first on ``PYTHONPATH`` where no checkout is at hand; and
  ``microspeed/demo/ds_config_demo.json`` is ``examples/ds_config_demo.json``, ``microspeed demo``'s default
  config.
"""

from __future__ import annotations

import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))

#: Files of the checkout copied into the built package: source (relative to the checkout) -> target (relative
#: to the built ``microspeed`` package).
CARRIED = {
    os.path.join("compat", "deepspeed", "src"): "deepspeed_standin",
    os.path.join("examples", "ds_config_demo.json"): os.path.join("demo", "ds_config_demo.json"),
}


def core_packages() -> list[str]:
    """``microspeed`` and ``microspeed.<sub>`` for every package folder under ``core/``."""
    return ["microspeed", *(f"microspeed.{name}" for name in find_packages(os.path.join(HERE, "core")))]


class BuildWithCarried(build_py):
    """``build_py`` that also copies :data:`CARRIED` into the built package (not in editable installs: there the
    checkout's own files are found)."""

    def run(self) -> None:
        """Build the packages, then copy the carried files beside them."""
        super().run()
        if getattr(self, "editable_mode", False):
            return
        package = os.path.join(self.build_lib, "microspeed")
        for source, target in CARRIED.items():
            src, dst = os.path.join(HERE, source), os.path.join(package, target)
            if os.path.isdir(src):
                shutil.rmtree(dst, ignore_errors=True)
                shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
            else:
                shutil.copyfile(src, dst)


if __name__ == "__main__":  # as setuptools' build backend runs it (tests import core_packages without building)
    setup(packages=core_packages(), cmdclass={"build_py": BuildWithCarried})
