"""Another system's checkpoint, found and converted for a load.

    with converted("ds_or_dcp_dir/", optimizer="AdamW", layout=layout) as step_dir:
        checkpoint.load_checkpoint(state, step_dir)     # what engine.load_checkpoint does

``foreign_kind`` tells a DeepSpeed ZeRO directory (worker/ds_checkpoint.py) and a
torch DCP one (worker/dcp_checkpoint.py) from a zeroplane checkpoint; ``converted``
reads it whole and writes it as a temporary zeroplane checkpoint (worker/foreign.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from coordinator.core.manifest import CheckpointError
from worker import dcp_checkpoint, ds_checkpoint
from worker.foreign import write_whole

__all__ = ["converted", "foreign_kind"]


def foreign_kind(path: str | os.PathLike) -> str | None:
    """``"deepspeed"`` or ``"dcp"`` for another system's checkpoint directory, else None."""
    if ds_checkpoint.is_deepspeed_checkpoint(path):
        return "deepspeed"
    if dcp_checkpoint.is_dcp_checkpoint(path):
        return "dcp"
    return None


@contextlib.contextmanager
def converted(path: str | os.PathLike, *, optimizer: str, layout: Any = None) -> Iterator[Path]:
    """Another system's checkpoint ``path`` as a temporary zeroplane checkpoint, removed
    after the block. ``layout``: the loading model's (worker/dcp_checkpoint.py
    ``ModelLayout``: what a DCP checkpoint, keyed by name, is matched against)."""
    kind = foreign_kind(path)
    if kind is None:
        raise CheckpointError(f"{path} is neither a DeepSpeed nor a torch DCP checkpoint")
    whole = (
        ds_checkpoint.read_deepspeed(path)
        if kind == "deepspeed"
        else dcp_checkpoint.read_dcp(path, layout=layout)
    )
    scratch = Path(tempfile.mkdtemp(prefix=f"zeroplane-from-{kind}-"))
    try:
        yield write_whole(whole, scratch, optimizer=optimizer)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
