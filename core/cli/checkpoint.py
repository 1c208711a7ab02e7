"""``microspeed checkpoint``: ``consolidate``, ``import-deepspeed``, ``export-deepspeed`` and ``info``.

::

    microspeed checkpoint consolidate CKPT_DIR OUT [--tag TAG] [--no-verify]  # one full fp32 state dict
    microspeed checkpoint import-deepspeed DS_DIR OUT_DIR [--tag TAG]
    microspeed checkpoint export-deepspeed CKPT_DIR DST [--tag TAG] [--zero-stage S] [--world-size N] [--no-verify]
    microspeed checkpoint info CKPT_DIR [--tag TAG]              # what a checkpoint holds

None of them needs a process group or the world size the checkpoint was written with. The commands that read
tensors refuse a checkpoint without checksums unless given ``--no-verify``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _consolidate(opts: argparse.Namespace) -> int:
    from microspeed.checkpoint import get_fp32_state_dict, save_state_dict_file

    state = get_fp32_state_dict(opts.ckpt_dir, tag=opts.tag, verify=opts.verify)
    save_state_dict_file(state, opts.out)
    total = sum(t.numel() for k, t in state.items())
    print(f"wrote {opts.out}: {len(state)} tensors, {total:,} elements (fp32)")
    return 0


def _import_deepspeed(opts: argparse.Namespace) -> int:
    from microspeed.checkpoint.deepspeed_format import import_deepspeed

    report = import_deepspeed(opts.ds_dir, opts.out_dir, tag=opts.tag)
    print(report)
    return 0


def _export_deepspeed(opts: argparse.Namespace) -> int:
    from microspeed.checkpoint.export import export_deepspeed

    print(export_deepspeed(opts.ckpt_dir, opts.out_dir, tag=opts.tag, zero_stage=opts.zero_stage,
                           world_size=opts.world_size, verify=opts.verify))
    return 0


def _info(opts: argparse.Namespace) -> int:
    from microspeed.checkpoint import read_manifest, read_tensor_index, resolve_tag_dir

    tag_dir = resolve_tag_dir(opts.ckpt_dir, opts.tag)
    manifest = read_manifest(tag_dir)
    index = read_tensor_index(tag_dir)
    print(f"{tag_dir}")
    print(f"  written by microspeed {manifest.get('microspeed_version')} / torch {manifest.get('torch_version')} "
          f"on {manifest.get('world_size')} rank(s)")
    if manifest.get("source"):
        print(f"  imported from: {manifest['source'].get('kind')} {manifest['source'].get('version', '')}")
    print(f"  counters: {manifest.get('counters')}")
    groups: dict[str, int] = {}
    for key in index.state_dict_metadata:
        groups[key.split("/", 1)[0]] = groups.get(key.split("/", 1)[0], 0) + 1
    print(f"  tensors: {', '.join(f'{k} {v}' for k, v in sorted(groups.items()))}")
    print(f"  plugins with state: {', '.join(sorted(manifest.get('plugin_states') or {})) or '-'}")
    return 0


def _no_verify(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="read a checkpoint whose manifest carries no checksums (older layout); trust its files")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``microspeed checkpoint``; returns the exit code (1 on a checkpoint error)."""
    parser = argparse.ArgumentParser(prog="microspeed checkpoint", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("consolidate", help="write one full fp32 state dict (.pt, or .safetensors)")
    p.add_argument("ckpt_dir", help="a save folder (uses 'latest' or --tag) or a tag folder")
    p.add_argument("out", help="output file; .safetensors needs the safetensors package")
    p.add_argument("--tag", default=None)
    _no_verify(p)
    p.set_defaults(run=_consolidate)
    p = sub.add_parser("import-deepspeed", help="convert a DeepSpeed checkpoint (ZeRO stage 0-3) into ours")
    p.add_argument("ds_dir", help="DeepSpeed's save folder (with 'latest') or one of its tag folders")
    p.add_argument("out_dir", help="save folder to write (the tag is kept; 'latest' is written)")
    p.add_argument("--tag", default=None)
    p.set_defaults(run=_import_deepspeed)
    p = sub.add_parser("export-deepspeed", help="write a checkpoint in DeepSpeed's layout (ZeRO stage 0-2)")
    p.add_argument("ckpt_dir", help="a microspeed save folder (uses 'latest' or --tag) or a tag folder")
    p.add_argument("out_dir", help="DeepSpeed save folder to write (<tag>/ and 'latest')")
    p.add_argument("--tag", default=None)
    p.add_argument("--zero-stage", type=int, default=None, choices=(0, 1, 2),
                   help="layout to write (default: the run's stage; a stage-3 run is written as stage 2)")
    p.add_argument("--world-size", type=int, default=None,
                   help="ZeRO partitions to write (default: the number of ranks that saved it)")
    _no_verify(p)
    p.set_defaults(run=_export_deepspeed)
    p = sub.add_parser("info", help="print what a checkpoint holds")
    p.add_argument("ckpt_dir")
    p.add_argument("--tag", default=None)
    p.set_defaults(run=_info)
    opts = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    from microspeed.checkpoint import CheckpointError  # imports torch: only once the arguments are parsed

    try:
        return opts.run(opts)
    except (CheckpointError, FileNotFoundError) as exc:
        print(f"microspeed checkpoint {opts.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
