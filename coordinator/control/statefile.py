"""The coordinator's state file: the current generation and its members, as protobuf JSON.

Written atomically (write aside, fsync, rename, fsync the directory) each time
a generation forms and each time a member leaves, so a crash leaves either the
old file or the new one. A
file that exists but cannot be read is an error naming the file, not a fresh
start: starting over would hand out generation ids the running workers
already hold.

[Note: state file format]
Format 2 (written now) stores the parameter inventory once, in a binary
``PersistedInventory`` file beside the state file named after the
inventory's digest (``STATE.inventory-DIGEST.binpb``), written when the job's
inventory is first saved. The state file itself holds the generation without
what follows from that inventory (its layout's buckets, its reshard
schedule's moves): ``load_snapshot`` computes them again with
``compute_layout`` and ``reshard_schedule``, which are deterministic. So a
generation of a 100k-parameter model costs a few kilobytes to save, not tens
of megabytes. Format 1 files (inventory and generation inline) still load.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from pathlib import Path

from google.protobuf import json_format
from google.protobuf.message import DecodeError

from coordinator._proto.zeroplane.coordinator.v1 import coordinator_pb2 as pb
from coordinator.control.membership import Snapshot
from coordinator.core.layout import Layout, ParamSpec, compute_layout
from coordinator.core.messages import (
    Generation,
    generation_from_proto,
    generation_to_proto,
    inventory_digest,
    inventory_wire,
    param_from_proto,
    param_to_proto,
    worker_from_proto,
    worker_to_proto,
)
from coordinator.core.reshard import reshard_schedule

__all__ = ["FORMAT_VERSION", "StateStore", "inventory_path", "load_snapshot", "save_snapshot"]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2


def inventory_path(path: str | os.PathLike[str], digest: str) -> Path:
    """Where the inventory of digest ``digest`` lives beside state file ``path``."""
    path = Path(path)
    return path.with_name(f"{path.name}.inventory-{digest[:16]}.binpb")


def save_snapshot(path: str | os.PathLike[str], snapshot: Snapshot) -> None:
    """Write ``snapshot`` to ``path`` (format 2, see [Note: state file format])."""
    path = Path(path)
    digest = ""
    if snapshot.inventory:
        wire = snapshot.inventory_wire or inventory_wire(
            [param_to_proto(p) for p in snapshot.inventory]
        )
        digest = inventory_digest(wire)
        side = inventory_path(path, digest)
        if not side.exists():
            _write_atomically(side, wire)
    msg = pb.PersistedState(
        format_version=FORMAT_VERSION,
        members=[worker_to_proto(w) for w in snapshot.members],
        epoch=snapshot.epoch,
        inventory_digest=digest,
        left=snapshot.left,
        finished_by=snapshot.finished_by,
        stopping=snapshot.stopping,
    )
    if snapshot.generation is not None:
        msg.generation.CopyFrom(generation_to_proto(_without_derived(snapshot.generation)))
    data = json_format.MessageToJson(msg, preserving_proto_field_name=True, indent=1)
    _write_atomically(path, data.encode())
    # Inventories of earlier jobs that used this state file are no longer referred to.
    for old in path.parent.glob(f"{path.name}.inventory-*.binpb"):
        if digest == "" or old != inventory_path(path, digest):
            old.unlink(missing_ok=True)


def load_snapshot(path: str | os.PathLike[str]) -> Snapshot | None:
    """The snapshot in ``path``; None if there is no such file. ValueError naming the
    file when it cannot be read, or does not hold a consistent snapshot."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"state file {str(path)!r} cannot be read: {exc.strerror}") from exc
    try:
        msg = json_format.Parse(data.decode("utf-8"), pb.PersistedState())
        if msg.format_version == 1:
            inventory = tuple(param_from_proto(p) for p in msg.inventory)
            generation = None
            if msg.HasField("generation"):
                generation = generation_from_proto(msg.generation)
            digest = inventory_digest(inventory) if inventory else ""
            wire = b""
        elif msg.format_version == 2:
            digest, wire = msg.inventory_digest, b""
            if digest:
                inventory, wire = _load_inventory(inventory_path(path, digest), digest)
            else:
                inventory = ()
            generation = None
            if msg.HasField("generation"):
                generation = _with_derived(generation_from_proto(msg.generation), inventory)
        else:
            raise ValueError(f"format_version {msg.format_version}, expected 1 or 2")
        snapshot = Snapshot(
            inventory=inventory,
            generation=generation,
            members=tuple(worker_from_proto(w) for w in msg.members),
            epoch=msg.epoch,
            inventory_digest=digest,
            inventory_wire=wire,
            left=tuple(msg.left),
            finished_by=msg.finished_by,
            stopping=msg.stopping,
        )
        problem = snapshot.inconsistency()
        if problem is not None:
            raise ValueError(problem)
        return snapshot
    except (json_format.ParseError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"state file {str(path)!r} is unreadable: {exc}") from exc


class StateStore:
    """Where a server saves its snapshots: off the event loop, or nowhere (``path`` None)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    async def save(self, snapshot: Snapshot) -> None:
        if self.path is None:
            return
        try:
            await asyncio.to_thread(save_snapshot, self.path, snapshot)
        except OSError:
            logger.exception("cannot write the state file %s", self.path)


def _without_derived(gen: Generation) -> Generation:
    """``gen`` less what its inventory determines (see [Note: state file format])."""
    reshard = gen.reshard
    if reshard is not None:
        reshard = dataclasses.replace(reshard, moves=())
    layout = Layout(world_size=gen.layout.world_size, buckets=())
    return dataclasses.replace(gen, layout=layout, reshard=reshard)


def _with_derived(gen: Generation, inventory: tuple[ParamSpec, ...]) -> Generation:
    if not inventory:
        raise ValueError(f"generation {gen.id} has no parameter inventory")
    layout = compute_layout(
        inventory,
        gen.world_size,
        bucket_numel=gen.bucket_numel,
        align=gen.align,
        by_unit=gen.by_unit,
    )
    reshard = gen.reshard
    if reshard is not None:
        before = compute_layout(
            inventory,
            reshard.from_world_size,
            bucket_numel=gen.bucket_numel,
            align=gen.align,
            by_unit=reshard.from_stage == 3,
        )
        reshard = dataclasses.replace(reshard, moves=tuple(reshard_schedule(before, layout)))
    return dataclasses.replace(gen, layout=layout, reshard=reshard)


def _load_inventory(side: Path, digest: str) -> tuple[tuple[ParamSpec, ...], bytes]:
    try:
        wire = side.read_bytes()
    except OSError as exc:
        raise ValueError(
            f"its inventory file {str(side)!r} cannot be read: {exc.strerror}"
        ) from exc
    if inventory_digest(wire) != digest:
        raise ValueError(f"its inventory file {str(side)!r} does not hold inventory {digest[:16]}")
    try:
        msg = pb.PersistedInventory.FromString(wire)
    except DecodeError as exc:
        raise ValueError(f"its inventory file {str(side)!r} is not valid: {exc}") from exc
    return tuple(param_from_proto(p) for p in msg.params), wire


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
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
