"""The coordinator's state file: the current generation and its members, as protobuf JSON.

Written atomically (write aside, fsync, rename, fsync the directory) each time
a generation forms, so a crash leaves either the old file or the new one. A
file that exists but cannot be read is an error, not a fresh start: starting
over would hand out generation ids the running workers already hold.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from google.protobuf import json_format

from coordinator._proto.zeroplane.coordinator.v1 import coordinator_pb2 as pb
from coordinator.membership import Snapshot
from coordinator.messages import (
    generation_from_proto,
    generation_to_proto,
    param_from_proto,
    param_to_proto,
    worker_from_proto,
    worker_to_proto,
)

__all__ = ["FORMAT_VERSION", "load_snapshot", "save_snapshot"]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1


def save_snapshot(path: str | os.PathLike[str], snapshot: Snapshot) -> None:
    path = Path(path)
    msg = pb.PersistedState(
        format_version=FORMAT_VERSION,
        inventory=[param_to_proto(p) for p in snapshot.inventory],
        members=[worker_to_proto(w) for w in snapshot.members],
        epoch=snapshot.epoch,
    )
    if snapshot.generation is not None:
        msg.generation.CopyFrom(generation_to_proto(snapshot.generation))
    data = json_format.MessageToJson(msg, preserving_proto_field_name=True, indent=1)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    # The rename itself is durable only once the directory is.
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_snapshot(path: str | os.PathLike[str]) -> Snapshot | None:
    """The snapshot in ``path``; None if there is no such file."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        msg = json_format.Parse(text, pb.PersistedState())
        if msg.format_version != FORMAT_VERSION:
            raise ValueError(f"format_version {msg.format_version}, expected {FORMAT_VERSION}")
        generation = None
        if msg.HasField("generation"):
            generation = generation_from_proto(msg.generation)
        return Snapshot(
            inventory=tuple(param_from_proto(p) for p in msg.inventory),
            generation=generation,
            members=tuple(worker_from_proto(w) for w in msg.members),
            epoch=msg.epoch,
        )
    except (json_format.ParseError, ValueError) as exc:
        raise ValueError(f"state file {str(path)!r} is unreadable: {exc}") from exc
