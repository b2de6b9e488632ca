"""What a checkpoint directory looks like, readable without torch.

The format itself is described in worker/checkpoint.py [Note: checkpoint
format]; this module holds the parts the torch-free CLI needs too: finding
the step folder a path means and reading its manifest.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["FORMAT", "CheckpointError", "read_manifest", "resolve"]

FORMAT = "zeroplane-checkpoint/1"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incompatible or damaged; the engine is unchanged."""


def resolve(path: str | os.PathLike) -> Path:
    """The step folder ``path`` means: itself if it has a manifest, else its ``latest``."""
    p = Path(path)
    if (p / "manifest.json").is_file():
        return p
    latest = p / "latest"
    if not latest.is_file():
        raise CheckpointError(f"{p} is not a checkpoint: no manifest.json and no 'latest' file")
    step_dir = p / latest.read_text().strip()
    if not (step_dir / "manifest.json").is_file():
        raise CheckpointError(f"{latest} names {step_dir.name}, which has no manifest.json")
    return step_dir


def read_manifest(step_dir: Path) -> dict:
    try:
        manifest = json.loads((step_dir / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{step_dir / 'manifest.json'} is unreadable: {exc}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{step_dir / 'manifest.json'}: format {manifest.get('format')!r}, expected {FORMAT!r}"
        )
    return manifest
