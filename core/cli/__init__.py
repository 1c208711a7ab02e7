"""The ``microspeed`` command: ``run`` (torchrun), ``plugins`` (what loaded), ``demo`` (train a GPT), and more."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

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
    """``microspeed run [--as-deepspeed] [torchrun options] script.py [args]``: hands everything to torchrun.

    ``--as-deepspeed`` makes ``import deepspeed`` in the launched processes resolve to microspeed's
    stand-in (its source folder goes first on their ``PYTHONPATH``), even where real DeepSpeed is
    installed; where the stand-in is pip-installed it changes nothing.
    """
    from torch.distributed import run as torchrun

    args = list(argv)
    if _take_flag(args, "--as-deepspeed"):
        from microspeed.compat import standin

        if not standin.installed_standin():
            try:
                folder = str(standin.source_folder())
            except FileNotFoundError as exc:
                print(f"microspeed run --as-deepspeed: {exc}", file=sys.stderr)
                return 2
            rest = os.environ.get("PYTHONPATH")
            os.environ["PYTHONPATH"] = folder + (os.pathsep + rest if rest else "")
    if not any(a.startswith("--nproc") for a in args):
        args = ["--nproc-per-node", "1", *args]
    torchrun.main(args)
    return 0


def cmd_plugins(argv: Sequence[str]) -> int:
    """List the plugins that load, with versions, and each hook's implementers in call order."""
    parser = argparse.ArgumentParser(prog="microspeed plugins")
    parser.add_argument("--disable", action="append", default=[], help="plugin name not to load")
    parser.add_argument("--hooks", action="store_true", help="only the hooks and their implementers in call order")
    opts = parser.parse_args(argv)
    pm = PluginManager()
    pm.load_all(disabled=opts.disable)
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
    parser = argparse.ArgumentParser(prog="microspeed demo")
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
    from torch.distributed import run as torchrun

    torchrun.main(args + list(rest))
    return 0


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
    from microspeed.config import markdown_table, merge_schema

    pm = PluginManager()
    pm.load_all(disabled=list(argv))
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


COMMANDS = {
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


COMMAND_ENTRY_POINT_GROUP = "microspeed.commands"
"""Entry-point group through which plugin distributions add sub-commands (``name = "module:function"``)."""


def _commands() -> dict:
    from importlib import metadata

    found = dict(COMMANDS)
    for ep in metadata.entry_points(group=COMMAND_ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep.value)
    return found


def _command(name: str):
    target = _commands()[name]
    if isinstance(target, str):
        import importlib

        module, _, func = target.partition(":")
        return getattr(importlib.import_module(module), func)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``microspeed`` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = _commands()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        extra = "".join(f"\n  {n:12s} (from a plugin: {commands[n]})" for n in commands if n not in COMMANDS)
        print(f"usage: microspeed {{{','.join(commands)}}} ...\n"
              "  run      launch a training script on N processes (wraps torchrun);\n"
              "           --as-deepspeed: `import deepspeed` gets microspeed's stand-in\n"
              "  plugins  list loaded plugins, their versions and hooks\n"
              "  demo     train a small GPT on 2 local CPU processes\n"
              "  config-keys  print the ds_config keys the installed plugins accept (Markdown)\n"
              "  deepspeed-path  folder to put first on PYTHONPATH so `import deepspeed` gets microspeed\n"
              "  checkpoint   consolidate / import-deepspeed checkpoints\n"
              "  trace        summary / export of hook-level traces\n"
              "  plot         draw loss and lr curves from a csv_monitor folder\n"
              "  lr-find      LR range test on a training script: loss-vs-lr plot and a suggested lr" + extra)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return _command(argv[0])(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
