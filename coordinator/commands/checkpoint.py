"""``zeroplane checkpoint inspect|export|convert``: look inside a checkpoint, consolidate
it, or convert DeepSpeed's into one."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from coordinator.commands.args import PRECISIONS, add_alias
from coordinator.core.manifest import CheckpointError, read_manifest, resolve
from coordinator.core.planner import parse_bytes

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
        help="write the full parameters and persistent buffers as safetensors, for inference",
        description=(
            "Writes what the model's state_dict() holds (non-persistent buffers are not "
            "written), loadable with load_state_dict(strict=True) or from_pretrained. "
            "Memory stays bounded by one output file: a model larger than --max-shard-size "
            "is split into NAME-00001-of-0000N.safetensors files and NAME.safetensors"
            ".index.json, as transformers' save_pretrained splits it."
        ),
    )
    export.add_argument("path", type=Path, help="checkpoint directory (or one of its step-N)")
    export.add_argument("out", type=Path, help="output file, e.g. model.safetensors")
    precision = export.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="cast every floating tensor to this precision (default: fp32 master weights, "
        "frozen parameters and buffers as saved)",
    )
    add_alias(export, "--dtype", to=precision)
    export.add_argument(
        "--max-shard-size",
        type=_shard_size,
        default="5GB",
        metavar="SIZE",
        help="largest output file before splitting: 5GB, 500MB, 2GiB, ... (default 5GB)",
    )
    export.set_defaults(func=_export, needs="torch")
    convert = sub.add_parser(
        "convert",
        help="a DeepSpeed ZeRO checkpoint (stages 1-3, any world size) as a zeroplane one",
        description=(
            "Reads DeepSpeed's save_checkpoint directory (or one of its tags) whole: fp32 "
            "masters, optimizer state, frozen parameters, buffers, steps and client state; "
            "writes them as a zeroplane checkpoint that loads at any world size and stage. "
            "engine.load_checkpoint reads DeepSpeed's directory as it is too; converting "
            "once spares every rank reading it whole."
        ),
    )
    convert.add_argument("path", type=Path, help="DeepSpeed checkpoint directory (or its tag)")
    convert.add_argument("out", type=Path, help="the zeroplane checkpoint directory to write")
    convert.add_argument(
        "--optimizer",
        required=True,
        metavar="NAME",
        help="the class name of the optimizer that will load it (torch's: AdamW, Adam, SGD)",
    )
    convert.set_defaults(func=_convert, needs="torch")
    return parser


def _shard_size(text: str) -> int:
    try:
        size = parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"not a positive size: {text!r}")
    return size


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
    import torch  # only here: the CLI stays torch-free

    from worker.checkpoint import export_consolidated

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(
        args.precision
    )
    try:
        count, files = export_consolidated(
            args.path, args.out, dtype=dtype, max_shard_bytes=args.max_shard_size
        )
    except (CheckpointError, OSError) as exc:
        print(f"zeroplane checkpoint export: {exc}", file=sys.stderr)
        return 2
    where = args.out if len(files) == 1 else f"{len(files) - 1} files, index {files[-1]}"
    print(f"wrote {count} tensors to {where}")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from worker.ds_checkpoint import convert_deepspeed

    try:
        step_dir = convert_deepspeed(args.path, args.out, optimizer=args.optimizer)
    except (CheckpointError, OSError) as exc:
        print(f"zeroplane checkpoint convert: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {step_dir} (load it with engine.load_checkpoint({str(args.out)!r}))")
    return 0
