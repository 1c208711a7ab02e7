"""The ``deepspeed`` stand-in: where it is, what it shadows, and the check that it is never mixed with DeepSpeed.

Libraries such as Hugging Face transformers/accelerate and Lightning ``import deepspeed`` themselves.
The stand-in distribution (``compat/deepspeed`` in a microspeed checkout, distribution name
``deepspeed``, version ``0.19.8+microspeed``) provides that import name over microspeed. Its source
folder carries a static ``.dist-info`` (the ``microspeed`` wheel carries a copy of that folder as
``microspeed/deepspeed_standin``), so putting the folder first on ``PYTHONPATH`` makes both
``import deepspeed`` and ``importlib.metadata.version("deepspeed")`` resolve to it even where real
DeepSpeed is installed: that is what ``microspeed run --as-deepspeed`` and
``PYTHONPATH=$(microspeed deepspeed-path):$PYTHONPATH`` do.

Mixing both in one process would run half of a job on each, so :func:`check_not_mixed` refuses it,
naming both paths.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
from pathlib import Path

from microspeed.errors import PluginError

ENV_VAR = "MICROSPEED_DEEPSPEED_PATH"
"""Overrides where the stand-in's source folder (the one holding ``deepspeed/``) is looked for."""

STANDIN_VERSION = "0.19.8+microspeed"
"""The stand-in distribution's version: DeepSpeed's version it mirrors, marked as microspeed."""

#: Files only real DeepSpeed has: finding one beside the stand-in's ``__init__.py`` means two installs merged.
REAL_ONLY_FILES = ("git_version_info_installed.py", "ops/op_builder", "inference", "module_inject")


class StandinConflictError(PluginError, ImportError):
    """Real DeepSpeed and microspeed's ``deepspeed`` stand-in would both run in one process."""


def source_folder() -> Path:
    """The folder to put first on ``sys.path`` so that ``import deepspeed`` gets the stand-in.

    ``$MICROSPEED_DEEPSPEED_PATH`` when set; else the copy of the stand-in's folder an installed ``microspeed``
    wheel carries (``microspeed/deepspeed_standin``: a wheel never looks outside its own package); else
    ``compat/deepspeed/src`` of the microspeed checkout this package was installed from (an editable install).
    Raises :class:`FileNotFoundError` saying how to get it otherwise.
    """
    override = os.environ.get(ENV_VAR)
    if override:
        folder = Path(override).resolve()
        if not (folder / "deepspeed" / "__init__.py").is_file():
            raise FileNotFoundError(f"{ENV_VAR}={override}: no deepspeed/__init__.py there; point it at the folder "
                                    "that holds the stand-in package (compat/deepspeed/src of a microspeed checkout)")
        return folder
    package = Path(__file__).resolve().parents[1]  # core/compat/standin.py -> core (the microspeed package)
    checkout = package.parent / "compat" / "deepspeed" / "src"
    for folder in (package / "deepspeed_standin", checkout):
        if (folder / "deepspeed" / "__init__.py").is_file():
            return folder
    raise FileNotFoundError(
        f"the deepspeed stand-in was not found beside microspeed (neither {package / 'deepspeed_standin'} nor "
        f"{checkout} exists: microspeed is neither an installed wheel nor an editable install of a checkout). "
        f"Either pip install the stand-in (pip install ./compat/deepspeed from a checkout), which replaces real "
        f"DeepSpeed, or set {ENV_VAR} to its source folder.")


def installed_standin() -> bool:
    """Whether ``import deepspeed`` already resolves to the stand-in through the normal path (pip-installed)."""
    spec = importlib.machinery.PathFinder.find_spec("deepspeed")
    origin = spec.origin if spec is not None else None
    return origin is not None and is_standin_file(origin)


def is_standin_file(path: str) -> bool:
    """Whether ``path`` is the ``__init__.py`` of a stand-in package (it carries the marker file)."""
    return (Path(path).parent / "_microspeed_standin").is_file()


def shadowed_deepspeed(standin_dir: str) -> str | None:
    """The ``__init__.py`` of a real DeepSpeed that a later ``sys.path`` entry holds, or ``None``."""
    here = os.path.realpath(standin_dir)
    for entry in sys.path:
        folder = os.path.join(entry or os.getcwd(), "deepspeed")
        init = os.path.join(folder, "__init__.py")
        if os.path.realpath(folder) != here and os.path.isfile(init) and not is_standin_file(init):
            return init
    return None


def _real_module_file(name: str, module: object, standin_dir: str) -> str | None:
    """The file of ``module`` when it is real DeepSpeed's (not the stand-in's and not a microspeed alias)."""
    if not (name == "deepspeed" or name.startswith("deepspeed.")):
        return None
    own_name = getattr(module, "__name__", name)
    if own_name != name and not own_name.startswith("deepspeed"):
        return None  # a microspeed module aliased under a deepspeed name
    path = getattr(module, "__file__", None)
    if path is None:
        return None
    here = os.path.realpath(standin_dir) + os.sep
    return None if os.path.realpath(path).startswith(here) else path


def check_not_mixed(standin_dir: str) -> None:
    """Refuse (:class:`StandinConflictError`) when real DeepSpeed runs beside the stand-in in this process.

    Two cases, each message naming both paths: a module of real DeepSpeed is in ``sys.modules``
    (imported before the stand-in, or loaded later by file path), or the stand-in's own folder holds
    real DeepSpeed's files (two installs merged into one ``site-packages/deepspeed``).
    """
    init = os.path.join(standin_dir, "__init__.py")
    for name, module in list(sys.modules.items()):
        real = _real_module_file(name, module, standin_dir)
        if real is not None:
            raise StandinConflictError(
                f"real DeepSpeed and microspeed's deepspeed stand-in in one process: module {name!r} of real "
                f"DeepSpeed ({real}) is loaded beside the stand-in ({init}). Import only one: start the run with "
                f"`microspeed run --as-deepspeed` (or PYTHONPATH=$(microspeed deepspeed-path):$PYTHONPATH) and make "
                f"sure nothing imports real DeepSpeed first, or drop the stand-in to run real DeepSpeed.")
    for rel in REAL_ONLY_FILES:
        found = os.path.join(standin_dir, rel)
        if os.path.exists(found):
            raise StandinConflictError(
                f"real DeepSpeed and microspeed's deepspeed stand-in are installed into the same folder: {found} "
                f"belongs to real DeepSpeed, {init} to the stand-in. Reinstall one of them: "
                f"pip uninstall -y deepspeed && pip install ./compat/deepspeed (microspeed) or "
                f"pip install --force-reinstall deepspeed (real DeepSpeed).")


_announced = False


def announce(standin_dir: str, version: str) -> None:
    """Print once per process (rank 0 only) which ``deepspeed`` was imported and what it shadows."""
    global _announced
    if _announced or os.environ.get("RANK", "0") != "0":
        return
    _announced = True
    real = shadowed_deepspeed(standin_dir)
    tail = f"real DeepSpeed at {os.path.dirname(real)} is shadowed" if real else "no real DeepSpeed on the path"
    print(f"deepspeed -> microspeed {version} stand-in ({standin_dir}); {tail}", file=sys.stderr, flush=True)
