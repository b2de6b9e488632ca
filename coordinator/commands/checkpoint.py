"""``zeroplane checkpoint inspect|export``: look inside a checkpoint, or consolidate it."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from coordinator.checkpoints import CheckpointError, read_manifest, resolve

__all__ = ["add_parser"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("checkpoint", help="inspect or export a checkpoint")
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    inspect = sub.add_parser("inspect", help="what a checkpoint holds (reads only its manifest)")
    inspect.add_argument("path", type=Path, help="checkpoint directory (or one of its step-N)")
    inspect.add_argument("--json", action="store_true", help="print the manifest as JSON")
    inspect.set_defaults(func=_inspect)
    export = sub.add_parser(
        "export",
        help="write the full parameters as one safetensors file, for inference",
        description="Streams tensor by tensor: memory stays bounded by the largest tensor.",
    )
    export.add_argument("path", type=Path, help="checkpoint directory (or one of its step-N)")
    export.add_argument("out", type=Path, help="output file, e.g. model.safetensors")
    export.set_defaults(func=_export)
    return parser


def _inspect(args: argparse.Namespace) -> int:
    try:
        step_dir = resolve(args.path)
        manifest = read_manifest(step_dir)  # validated: every field below is there
    except CheckpointError as exc:
        print(f"zeroplane checkpoint inspect: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(manifest, indent=1))
        return 0
    params = manifest["params"]
    trainable = sum(math.prod(p["shape"]) for p in params.values() if p["requires_grad"])
    frozen = sum(math.prod(p["shape"]) for p in params.values() if not p["requires_grad"])
    size = sum(f["bytes"] for f in manifest["files"].values())
    checksum = manifest.get("checksum", "none (written before manifests carried one)")
    print(f"checkpoint   {step_dir}")
    print(f"format       {manifest['format']}")
    print(f"checksum     {checksum}")
    print(f"step         {manifest['global_steps']}")
    print(
        f"saved by     {manifest['world_size']} rank(s), stage {manifest['stage']}, "
        f"{manifest['dtype']}, {manifest['optimizer']}"
    )
    print(f"parameters   {len(params)} tensors: {trainable:,} trainable, {frozen:,} frozen")
    print(f"files        {len(manifest['files'])}, {size / 2**20:.2f} MiB")
    for name, info in sorted(manifest["files"].items()):
        ranges, digest = len(info["ranges"]), info["sha256"][:16]
        print(f"  {name}  {info['bytes']:>12,} B  {ranges} ranges  sha256 {digest}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from worker.checkpoint import export_consolidated  # torch: only here

    try:
        count = export_consolidated(args.path, args.out)
    except (CheckpointError, OSError) as exc:
        print(f"zeroplane checkpoint export: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {count} tensors to {args.out}")
    return 0
