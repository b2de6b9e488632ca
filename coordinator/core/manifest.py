"""What a checkpoint directory looks like, readable without torch.

The format itself is described in worker/checkpoint.py [Note: checkpoint
format]; this module holds the parts the torch-free CLI needs too: finding
the step folder a path means, reading its manifest and checking that the
manifest is whole and consistent before anything relies on it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from coordinator.core.ranges import Range, RangeIndex

__all__ = [
    "DTYPES",
    "FORMAT",
    "CheckpointError",
    "index_ranges",
    "manifest_checksum",
    "rank_file",
    "read_manifest",
    "resolve",
    "validate_manifest",
]

FORMAT = "zeroplane-checkpoint/1"

# dtype names (torch's, without ``torch.``) a manifest may give a parameter
DTYPES = frozenset(
    {
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "complex64",
        "complex128",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint64",
        "uint32",
        "uint16",
        "uint8",
        "bool",
    }
)

_STEP_DIR = re.compile(r"step-(\d+)")
_RANK_FILE = re.compile(r"rank(\d{5})\.pt")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHECKSUM = re.compile(r"sha256:[0-9a-f]{64}")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incompatible or damaged; the engine is unchanged."""


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def resolve(path: str | os.PathLike) -> Path:
    """The step folder ``path`` means: itself if it has a manifest, else its ``latest``."""
    p = Path(path)
    if (p / "manifest.json").is_file():
        return p
    latest = p / "latest"
    if not latest.is_file():
        raise CheckpointError(f"{p} is not a checkpoint: no manifest.json and no 'latest' file")
    try:
        name = latest.read_bytes().decode().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{latest} is unreadable: {exc}") from None
    if not _STEP_DIR.fullmatch(name):
        raise CheckpointError(f"{latest} should name a step-N folder, not {_show(name)}")
    step_dir = p / name
    if not (step_dir / "manifest.json").is_file():
        raise CheckpointError(f"{latest} names {name}, which has no manifest.json")
    return step_dir


def manifest_checksum(manifest: dict) -> str:
    """``sha256:`` and the SHA-256 of the canonical JSON (sorted keys, no spaces,
    ASCII) of every field but ``checksum`` itself."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def read_manifest(step_dir: Path) -> dict:
    """The manifest of ``step_dir``, checked whole by :func:`validate_manifest`."""
    path = step_dir / "manifest.json"
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{path} is unreadable: {exc.strerror or exc}") from None
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path} is not UTF-8 (byte {exc.start})") from None
    try:
        manifest = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_nan)
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    validate_manifest(manifest, path)
    return manifest


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {_show(key)}")
        out[key] = value
    return out


def _no_nan(token: str) -> float:
    raise ValueError(f"{token} is not a number JSON allows")


# ---------------------------------------------------------------------------- validation


def validate_manifest(manifest: Any, path: Path) -> None:
    """Raise :class:`CheckpointError` naming ``path`` unless the manifest is whole.

    In order: the format; the checksum, if the manifest has one (manifests
    written before checksums have none and get the structural checks only);
    every field's type and range; the files (exactly ``rank00000.pt`` to
    ``rank{world_size-1}.pt``) and their ranges, which must hold each element
    of every trainable parameter exactly once and nothing of anything else;
    the aliases; ``global_steps`` against the folder's name. Deterministic, so
    ranks reading the same manifest reach the same verdict.
    """

    def fail(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: {what}")

    if not isinstance(manifest, dict):
        raise fail(f"expected a JSON object, found {type(manifest).__name__}")
    if manifest.get("format") != FORMAT:
        raise fail(f"format {_show(manifest.get('format'))}, expected {FORMAT!r}")
    if "checksum" in manifest:
        given = manifest["checksum"]
        if not isinstance(given, str) or not _CHECKSUM.fullmatch(given):
            raise fail(f"checksum {_show(given)} is not 'sha256:' and 64 hex digits")
        if given != manifest_checksum(manifest):
            raise CheckpointError(f"{path} does not match its checksum (edited or corrupt)")

    def field(obj: dict, key: str, kind: type | tuple[type, ...], where: str = "") -> Any:
        if key not in obj:
            raise fail(f"{where}{key!r} is missing")
        value = obj[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise fail(f"{where}{key!r} is {_show(value)}, not {_kind_name(kind)}")
        return value

    def count(obj: dict, key: str, lo: int, hi: int | None = None, where: str = "") -> int:
        value = field(obj, key, int, where)
        if value < lo or (hi is not None and value > hi):
            bounds = f"at least {lo}" if hi is None else f"{lo} to {hi}"
            raise fail(f"{where}{key!r} is {value}, expected {bounds}")
        return value

    steps = count(manifest, "global_steps", 0)
    world = count(manifest, "world_size", 1)
    count(manifest, "stage", 0, 3)
    field(manifest, "dtype", str)
    field(manifest, "optimizer", str)
    scale = field(manifest, "loss_scale", (int, float))
    if not (math.isfinite(scale) and scale > 0):
        raise fail(f"'loss_scale' is {scale}, expected a positive number")

    params = field(manifest, "params", dict)
    numel: dict[str, int] = {}
    for name, info in params.items():
        where = f"parameter {_show(name)}: "
        if not isinstance(info, dict):
            raise fail(f"{where}expected an object, found {_show(info)}")
        shape = field(info, "shape", list, where)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise fail(f"{where}shape {_show(shape)} is not a list of sizes")
        dtype = field(info, "dtype", str, where)
        if dtype not in DTYPES:
            raise fail(f"{where}unknown dtype {_show(dtype)}")
        if field(info, "requires_grad", bool, where):
            numel[name] = math.prod(shape)
        count(info, "group", 0, where=where)

    files = field(manifest, "files", dict)
    expected = {rank_file(r) for r in range(world)} if len(files) == world else set()
    if set(files) != expected:
        raise fail(f"lists files {_show(sorted(files))}, not one per rank of world_size {world}")
    for file, info in sorted(files.items()):
        where = f"{file}: "
        if not isinstance(info, dict):
            raise fail(f"{where}expected an object, found {_show(info)}")
        count(info, "bytes", 0, where=where)
        if not _SHA256.fullmatch(field(info, "sha256", str, where)):
            raise fail(f"{where}'sha256' is not 64 hex digits")
        for rng in field(info, "ranges", list, where):
            if not (
                isinstance(rng, list)
                and len(rng) == 3
                and isinstance(rng[0], str)
                and all(isinstance(x, int) and not isinstance(x, bool) for x in rng[1:])
            ):
                raise fail(f"{where}range {_show(rng)} is not [name, start, stop]")
            name, start, stop = rng
            if name not in numel:
                what = "a frozen" if name in params else "an unknown"
                raise fail(f"{where}range {_show(rng)} is of {what} parameter")
            if not 0 <= start < stop <= numel[name]:
                raise fail(f"{where}range {_show(rng)} is not within {numel[name]} elements")
    index = index_ranges(manifest)
    for name, n in numel.items():
        flaw = index.cover_flaw(name, n)
        if flaw:
            raise fail(flaw)

    aliases = manifest.get("aliases", {})
    if not isinstance(aliases, dict):
        raise fail(f"'aliases' is {_show(aliases)}, not an object")
    for alias, name in aliases.items():
        if alias in params or name not in params:
            raise fail(f"alias {_show(alias)} -> {_show(name)} does not name one parameter")

    folder = _STEP_DIR.fullmatch(path.parent.name)
    if folder and int(folder[1]) != steps:
        raise fail(f"'global_steps' is {steps} but the folder is {path.parent.name}")


def index_ranges(manifest: dict) -> RangeIndex:
    """Every range of a validated manifest, with the file that holds it."""
    return RangeIndex(
        (Range(name, start, stop), file)
        for file, info in manifest["files"].items()
        for name, start, stop in info["ranges"]
    )


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    names |= {list: "a list", dict: "an object"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds:
        return names[float]
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _show(value: Any, limit: int = 60) -> str:
    """A bounded, one-line repr of a value taken from a file."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
