"""The ``microspeed`` command: ``run`` (torchrun), ``plugins`` (what loaded), ``demo`` (train a GPT), and more.

Start-up stays light: this module and ``microspeed``'s top level import neither torch nor the plugins, and each
sub-command parses its arguments (so ``--help`` answers) before it imports what it needs.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Callable, Sequence

from microspeed.plugins import PluginManager, all_hook_names


def _take_flag(args: list[str], flag: str) -> bool:
    """Remove ``flag`` from the launcher options (before the script or ``-m``); return whether it was there."""
    for i, arg in enumerate(args):
        if arg.endswith(".py") or arg in ("-m", "--module", "--no-python", "--no_python"):
            return False
        if arg == flag:
            del args[i]
            return True
    return False


def cmd_run(argv: Sequence[str]) -> int:
    """``microspeed run [--as-deepspeed] [torchrun options] script.py [args]``: see :mod:`microspeed.cli.run`."""
    from microspeed.cli.run import main as run_main

    return run_main(argv)


def cmd_plugins(argv: Sequence[str]) -> int:
    """List the plugins that load, with versions, and each hook's implementers in call order; or (``--matrix``) the
    composition matrix of their features."""
    parser = argparse.ArgumentParser(
        prog="microspeed plugins",
        description="List the plugins that load (built-ins, then entry points of group 'microspeed.plugins'), with "
                    "version, source and hooks, then every hook's implementers in call order.")
    parser.add_argument("--disable", action="append", default=[], metavar="NAME", help="plugin name not to load")
    parser.add_argument("--hooks", action="store_true", help="only the hooks and their implementers in call order")
    parser.add_argument("--matrix", action="store_true",
                        help="the composition matrix instead: which feature pairs the installed plugins support, "
                             "which they refuse and why (from their microspeed_features/microspeed_refusals)")
    parser.add_argument("--markdown", action="store_true",
                        help="with --matrix: print it as Markdown (`microspeed plugins --matrix --markdown > "
                             "docs/compositions.md` regenerates the repository's page)")
    opts = parser.parse_args(argv)
    if opts.markdown and not opts.matrix:
        parser.error("--markdown goes with --matrix")
    pm = PluginManager()
    pm.load_all(disabled=opts.disable)
    if opts.matrix:
        from microspeed.compositions import composition_matrix

        matrix = composition_matrix(pm, strict=False)  # a refusal about a plugin not installed here is shown apart
        sys.stdout.write(matrix.markdown() if opts.markdown else matrix.text())
        return 0
    if not opts.hooks:
        print("plugins (registration order):")
        for info in pm.infos.values():
            print(f"  {info.name:24s} {info.version or '-':10s} {info.source}")
            print(f"      hooks: {', '.join(h.removeprefix('microspeed_') for h in pm.hooks_of(info.name))}")
        print()
    print("hooks (implementers in call order):")
    for hook in all_hook_names():
        names = pm.implementers(hook)
        print(f"  {hook.removeprefix('microspeed_'):24s} {' -> '.join(names) if names else '(none)'}")
    return 0


def cmd_demo(argv: Sequence[str]) -> int:
    """Train the demo GPT on 2 local processes (or ``--nproc``), via torchrun."""
    parser = argparse.ArgumentParser(
        prog="microspeed demo",
        description="Train the demo GPT on local CPU processes through torchrun; other arguments go to the "
                    "training script (microspeed.demo.train).")
    parser.add_argument("--nproc", type=int, default=2, help="local processes (default 2)")
    parser.add_argument("--config", default=None, help="ds_config JSON (default examples/ds_config_demo.json)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps")
    parser.add_argument("--out", default="runs/demo", help="checkpoint directory")
    opts, rest = parser.parse_known_args(argv)
    from microspeed.demo import train as demo_train

    script = os.path.abspath(demo_train.__file__)
    args = [f"--nproc-per-node={opts.nproc}", "--standalone", script, "--out", opts.out]
    if opts.config:
        args += ["--config", opts.config]
    if opts.steps:
        args += ["--steps", str(opts.steps)]
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // opts.nproc)))
    from microspeed.cli.run import launch

    return launch(args + list(rest))  # as `microspeed run`: a failure prints the failing rank's error once


def cmd_deepspeed_path(argv: Sequence[str]) -> int:
    """Print the folder that makes ``import deepspeed`` resolve to microspeed's stand-in when first on ``PYTHONPATH``.

    For launchers other than ``microspeed run``:
    ``PYTHONPATH=$(microspeed deepspeed-path):$PYTHONPATH accelerate launch train.py``.
    """
    parser = argparse.ArgumentParser(prog="microspeed deepspeed-path", description=cmd_deepspeed_path.__doc__)
    parser.parse_args(argv)
    from microspeed.compat import standin

    try:
        print(standin.source_folder())
    except FileNotFoundError as exc:
        if standin.installed_standin():
            import importlib.machinery

            spec = importlib.machinery.PathFinder.find_spec("deepspeed")
            print(os.path.dirname(os.path.dirname(spec.origin)))
            return 0
        print(f"microspeed deepspeed-path: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_config_keys(argv: Sequence[str]) -> int:
    """Print the ds_config keys the loaded plugins accept, as the README's Markdown table."""
    parser = argparse.ArgumentParser(
        prog="microspeed config-keys",
        description="Print the ds_config keys the installed plugins accept (key, type, default, owning plugin, "
                    "description) as the README's Markdown table.")
    parser.add_argument("disabled", nargs="*", metavar="NAME", help="plugin names not to load")
    parser.add_argument("--disable", action="append", default=[], metavar="NAME",
                        help="plugin name not to load (same as a positional NAME)")
    opts = parser.parse_args(argv)
    from microspeed.config import markdown_table, merge_schema

    pm = PluginManager()
    pm.load_all(disabled=[*opts.disabled, *opts.disable])
    owners: dict[str, str] = {}
    claims = []
    for name, answers in pm.call_each("microspeed_config_sections"):
        for claim in answers:
            claims.append(claim or {})
            owners.update(dict.fromkeys(claim or {}, name))
    order = list(pm.infos)
    schema = merge_schema(sorted(claims, key=lambda c: min((order.index(owners[k]) for k in c), default=0)))
    print(markdown_table(schema, owners))
    return 0


COMMANDS: dict[str, Callable[[Sequence[str]], int] | str] = {
    "run": cmd_run,
    "plugins": cmd_plugins,
    "demo": cmd_demo,
    "config-keys": cmd_config_keys,
    "deepspeed-path": cmd_deepspeed_path,
    "checkpoint": "microspeed.cli.checkpoint:main",
    "trace": "microspeed.cli.trace:main",
    "plot": "microspeed.cli.plot:main",
    "lr-find": "microspeed.cli.lr_find:main",
}
"""Sub-commands: name -> function taking the remaining arguments and returning an exit code.

Sub-commands that live in their own modules register as ``"module:function"`` strings, imported
only when used, so ``microspeed --help`` stays fast.
"""

SUMMARIES: dict[str, str] = {
    "run": "launch a training script on N processes (wraps torchrun; --as-deepspeed for DeepSpeed scripts)",
    "plugins": "list loaded plugins, their versions and hooks",
    "demo": "train a small GPT on 2 local CPU processes",
    "config-keys": "print the ds_config keys the installed plugins accept (Markdown)",
    "deepspeed-path": "folder to put first on PYTHONPATH so `import deepspeed` gets microspeed",
    "checkpoint": "consolidate / import-deepspeed / export-deepspeed / info of checkpoints",
    "trace": "summary / export of hook-level traces",
    "plot": "draw loss and lr curves from a csv_monitor folder",
    "lr-find": "LR range test on a training script: loss-vs-lr plot and a suggested lr",
}
"""One line per built-in sub-command, for ``microspeed --help``."""


COMMAND_ENTRY_POINT_GROUP = "microspeed.commands"
"""Entry-point group through which plugin distributions add sub-commands (``name = "module:function"``)."""


def _commands() -> dict[str, Callable[[Sequence[str]], int] | str]:
    from importlib import metadata

    found = dict(COMMANDS)
    for ep in metadata.entry_points(group=COMMAND_ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep.value)
    return found


def _command(name: str) -> Callable[[Sequence[str]], int]:
    target = _commands()[name]
    if isinstance(target, str):
        import importlib

        module, _, func = target.partition(":")
        return getattr(importlib.import_module(module), func)
    return target


def usage(commands: Sequence[str] | None = None) -> str:
    """The text of ``microspeed --help``: every sub-command with one line on what it does."""
    commands = list(_commands() if commands is None else commands)
    width = max(len(n) for n in commands) + 2
    lines = [f"usage: microspeed [--version] [--help] {{{','.join(commands)}}} ...", "",
             "DeepSpeed's training runtime as a microkernel with plugins.", "", "commands:"]
    for name in commands:
        text = SUMMARIES.get(name) or f"(from a plugin: {_commands()[name]})"
        lines.append(f"  {name:{width}s}{text}")
    lines += ["", "`microspeed COMMAND --help` explains a command; `microspeed --version` lists versions."]
    return "\n".join(lines)


def version_text() -> str:
    """microspeed's version, then each installed plugin distribution's, then torch's and Python's (metadata only)."""
    import platform
    from importlib import metadata

    from microspeed import __version__
    from microspeed.plugins import ENTRY_POINT_GROUP

    lines = [f"microspeed {__version__}"]
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = ep.dist
        lines.append(f"  plugin {ep.name} {dist.version if dist else '?'} ({dist.name if dist else ep.value})")
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    lines.append(f"torch {torch_version}, python {platform.python_version()}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``microspeed`` command: 0 on success, 2 on a usage error, else the command's code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        print(version_text())
        return 0
    commands = _commands()
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(commands))
        return 0 if argv else 2
    if argv[0] not in commands:
        close = difflib.get_close_matches(argv[0], list(commands), n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        print(f"usage: microspeed [--version] [--help] {{{','.join(commands)}}} ...\n"
              f"microspeed: error: unknown command {argv[0]!r}{hint} (`microspeed --help` lists the commands)",
              file=sys.stderr)
        return 2
    try:
        return _command(argv[0])(argv[1:])
    except SystemExit as exc:  # argparse's --help (0) and usage errors (2): an exit status, as a return value
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        raise


if __name__ == "__main__":
    sys.exit(main())
