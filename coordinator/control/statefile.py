"""The coordinator's state file: the current generation and its members.

Each time a generation forms and each time a member leaves, the state is made
durable before anyone hears of it, so a crash leaves a loadable state, either
the old one or the new one, and a restarted coordinator never hands out a
generation id the running workers already hold with other content. A file that
exists but cannot be read is an error naming the file, not a fresh start:
starting over would hand out generation ids the running workers already hold.

[Note: state file format]
Format 3 (written now) is binary: the magic line ``MAGIC``, then records, each
three little-endian uint32 (the payload's length, the CRC-32 of those four
length bytes, the CRC-32 of the payload) and the payload, a binary
``PersistedState`` with ``format_version`` 3. A generation in it is stored as
the server publishes it to watchers (``Snapshot.generation_wire``, bytes
already built) less what follows from the inventory: the layout without its
buckets, the reshard schedule without its moves.

- The first record is the base: the whole state (every member's
  ``WorkerInfo``, the generation, the epoch, the inventory's digest, the
  members that left, ``finished_by``, ``stopping``). It is written by
  replacing the file (write aside, fsync, rename, fsync the directory), so it
  is never torn.
- Every later record is a change to the state before it, appended and fsynced
  in place: ``generation`` is set only when a new generation formed (its
  members as a ``MembersDelta`` from the generation before, as the server sends
  it to watchers, or whole); ``members`` holds only the ``WorkerInfo`` that are
  new or changed; ``left`` the members that left since the previous record
  (since this record's generation formed, when it has one); ``finished_by``
  and ``stopping`` are whole. Epoch and inventory never change within a log:
  when they do, the file is rewritten with a new base.
- The file is compacted (rewritten as one base record) when a writer has not
  written it itself yet (so after every restart), when a change cannot be
  written as a delta, after ``MAX_GENERATION_RECORDS`` generations or
  ``MAX_RECORDS`` records, and when the records after the base outgrow it.

So forming a generation of 100,000 ranks costs a base record once (the
generation's bytes as published, reused, and the members' ``WorkerInfo``), and
re-forming after a host loss a few kilobytes appended.

A crash in the middle of an append leaves an incomplete last record: loading
ignores a last record that is cut short, that is all zeros, or whose payload
fails its checksum while ending exactly at the end of the file (what a crash
leaves when the file grew before its data reached the disk), logs a warning
naming the file, and returns the state before it. The append had not
returned, so that generation was never announced and its id is in no one's
hands. Any other damage (no magic line and no JSON, a base record cut short or
failing its checksum, a damaged record that is not the last, a record that
does not decode or does not follow from the state before it) is an error
naming the file. A server writes through ``StateStore``: in a thread, off its
event loop, one save at a time.

As in format 2, the parameter inventory is stored once, in a binary
``PersistedInventory`` file beside the state file named after the
inventory's digest (``STATE.inventory-DIGEST.binpb``), written when the job's
inventory is first saved; what follows from that inventory (the layout's
buckets, the reshard schedule's moves) is computed again on load with
``compute_layout`` and ``reshard_schedule`` (the moves lazily, as
``LazyMoves``), which are deterministic.

Formats 1 and 2 (protobuf JSON, which never starts with ``MAGIC``) still load:
format 2 with the inventory beside it as above, format 1 with the inventory and
the generation inline. The next write replaces them with format 3.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import struct
import threading
import zlib
from pathlib import Path

from google.protobuf import json_format
from google.protobuf.message import DecodeError

from coordinator._proto.zeroplane.coordinator.v1 import coordinator_pb2 as pb
from coordinator.control.membership import Snapshot
from coordinator.core.conversions import (
    inventory_digest,
    inventory_wire,
    param_from_proto,
    param_to_proto,
    worker_from_proto,
    worker_to_proto,
)
from coordinator.core.generation_codec import generation_from_proto, generation_to_proto
from coordinator.core.layout import Layout, ParamSpec, compute_layout
from coordinator.core.messages import Generation, WorkerInfo
from coordinator.core.reshard import LazyMoves

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "StateLog",
    "StateStore",
    "inventory_path",
    "length_delimited",
    "load_snapshot",
    "save_snapshot",
]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 3
MAGIC = b"\x89zeroplane state 3\n"
# Compaction (see [Note: state file format]): generations and records after the
# base, and the bytes after the base beyond which the file is rewritten (at
# least this many, else as many as the base has).
MAX_GENERATION_RECORDS = 16
MAX_RECORDS = 1024
MIN_LOG_BYTES = 1 << 20

# payload length, CRC-32 of those 4 length bytes, CRC-32 of the payload
_HEADER = struct.Struct("<III")
GENERATION_FIELD = pb.PersistedState.DESCRIPTOR.fields_by_name["generation"].number


def inventory_path(path: str | os.PathLike[str], digest: str) -> Path:
    """Where the inventory of digest ``digest`` lives beside state file ``path``."""
    path = Path(path)
    return path.with_name(f"{path.name}.inventory-{digest[:16]}.binpb")


def save_snapshot(path: str | os.PathLike[str], snapshot: Snapshot) -> None:
    """Write ``snapshot`` to ``path``, replacing the file (format 3, one base record;
    see [Note: state file format])."""
    StateLog(Path(path)).save(snapshot)


class StateLog:
    """One writer of a state file: the first save rewrites it, later ones append what
    changed, compacting now and then ([Note: state file format]). Thread-safe; each
    save is durable when it returns."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        # what the file holds, once this writer has written it (_end None: not yet)
        self._end: int | None = None
        self._ino = 0
        self._base_bytes = 0
        self._log_bytes = 0
        self._records = 0
        self._generation_records = 0
        self._digest = ""
        self._epoch = ""
        self._generation: Generation | None = None
        self._infos: dict[str, WorkerInfo] = {}
        self._left: frozenset[str] = frozenset()
        # how the last save was written: "base" or "delta" (for tests and the bench)
        self.last_write = ""

    def save(self, snapshot: Snapshot) -> None:
        with self._lock:
            digest, wire = _inventory(snapshot)
            try:
                delta = None if self._end is None else self._delta(snapshot, digest)
                if delta is None or not self._append(*delta):
                    self._rewrite(snapshot, digest, wire)
            except BaseException:
                self._end = None  # the file's state is unknown: rewrite it next time
                raise
            self._generation = snapshot.generation
            self._infos = {info.worker_id: info for info in snapshot.members}
            self._left = frozenset(snapshot.left)

    def _rewrite(self, snapshot: Snapshot, digest: str, wire: bytes) -> None:
        path = self.path
        if digest:
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
        payload = msg.SerializeToString()
        if snapshot.generation is not None:
            payload += _generation_field(_generation_bytes(snapshot))
        _write_atomically(path, MAGIC + _record(payload))
        st = path.stat()
        self._end, self._ino = st.st_size, st.st_ino
        self._base_bytes, self._log_bytes = len(payload), 0
        self._records = self._generation_records = 0
        self._digest, self._epoch = digest, snapshot.epoch
        self.last_write = "base"
        # Inventories of earlier jobs that used this state file are no longer referred to.
        for old in path.parent.glob(f"{path.name}.inventory-*.binpb"):
            if digest == "" or old != inventory_path(path, digest):
                old.unlink(missing_ok=True)

    def _delta(self, snapshot: Snapshot, digest: str) -> tuple[bytes, bool] | None:
        """``snapshot`` as a change to what the file holds, and whether it holds a new
        generation; None when the file must be rewritten instead."""
        if (digest, snapshot.epoch) != (self._digest, self._epoch):
            return None
        if self._records + 1 > MAX_RECORDS:
            return None
        gen, before = snapshot.generation, self._generation
        if gen is None or before is None:
            return None
        left = set(snapshot.left)
        msg = pb.PersistedState(
            format_version=FORMAT_VERSION,
            finished_by=snapshot.finished_by,
            stopping=snapshot.stopping,
        )
        generation = b""
        if gen is before:
            if not self._left <= left:
                return None
            msg.left.extend(w for w in snapshot.left if w not in self._left)
        elif gen.id > before.id:
            if self._generation_records + 1 > MAX_GENERATION_RECORDS:
                return None
            generation = _delta_bytes(snapshot, before) or _generation_bytes(snapshot)
            msg.left.extend(snapshot.left)
        else:
            return None
        infos = self._infos
        msg.members.extend(
            worker_to_proto(info)
            for info in snapshot.members
            if (known := infos.get(info.worker_id)) is not info and known != info
        )
        payload = msg.SerializeToString()
        if generation:
            payload += _generation_field(generation)
        if self._log_bytes + len(payload) > max(self._base_bytes, MIN_LOG_BYTES):
            return None
        return payload, bool(generation)

    def _append(self, payload: bytes, generation: bool) -> bool:
        """Append a record; False (nothing written) if the file is not the one this
        writer left (replaced or changed by someone else)."""
        assert self._end is not None
        data = _record(payload)
        fd = os.open(self.path, os.O_WRONLY)
        try:
            st = os.fstat(fd)
            if st.st_ino != self._ino or st.st_size != self._end:
                return False
            at, view = self._end, memoryview(data)
            while view:
                n = os.pwrite(fd, view, at)
                at, view = at + n, view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        self._end += len(data)
        self._log_bytes += len(payload)
        self._records += 1
        self._generation_records += generation
        self.last_write = "delta"
        return True


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
        load = _load_log if data.startswith(MAGIC) else _load_json
        snapshot = load(path, data)
        problem = snapshot.inconsistency()
        if problem is not None:
            raise ValueError(problem)
        return snapshot
    except (json_format.ParseError, DecodeError, ValueError) as exc:
        # UnicodeDecodeError and MissingPrevious are ValueErrors
        raise ValueError(f"state file {str(path)!r} is unreadable: {exc}") from exc


def _load_json(path: Path, data: bytes) -> Snapshot:
    """Formats 1 and 2."""
    msg = json_format.Parse(data.decode("utf-8"), pb.PersistedState())
    if msg.format_version == 1:
        inventory = tuple(param_from_proto(p) for p in msg.inventory)
        generation = None
        if msg.HasField("generation"):
            generation = generation_from_proto(msg.generation)
        digest = inventory_digest(inventory) if inventory else ""
        wire = b""
    elif msg.format_version == 2:
        inventory, digest, wire = _inventory_beside(path, msg.inventory_digest)
        generation = None
        if msg.HasField("generation"):
            generation = _with_derived(generation_from_proto(msg.generation), inventory)
    else:
        raise ValueError(f"format_version {msg.format_version} in JSON, expected 1 or 2")
    return Snapshot(
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


def _load_log(path: Path, data: bytes) -> Snapshot:
    """Format 3: the base record and the changes after it."""
    records = _records(path, data)
    base = records[0]
    inventory, digest, wire = _inventory_beside(path, base.inventory_digest)
    generation = None
    if base.HasField("generation"):
        generation = generation_from_proto(base.generation)
    members = tuple(worker_from_proto(w) for w in base.members)
    infos = {info.worker_id: info for info in members}
    left = tuple(base.left)
    finished_by, stopping = base.finished_by, base.stopping
    for i, rec in enumerate(records[1:], 1):
        if generation is None:
            raise ValueError(f"record {i} follows a base record without a generation")
        if rec.epoch or rec.inventory_digest or rec.inventory:
            raise ValueError(f"record {i} changes the epoch or the inventory")
        for w in rec.members:
            infos[w.worker_id] = worker_from_proto(w)
        if rec.HasField("generation"):
            following = generation_from_proto(rec.generation, generation)
            if following.id <= generation.id:
                raise ValueError(f"record {i}: generation {following.id} after {generation.id}")
            generation, left = following, tuple(rec.left)
        else:
            left += tuple(rec.left)
        finished_by, stopping = rec.finished_by, rec.stopping
    if len(records) > 1:
        assert generation is not None
        # an info is kept while its worker is a member; inconsistency() names one missing
        members = tuple(infos[m.worker_id] for m in generation.members if m.worker_id in infos)
    if generation is not None:
        generation = _with_derived(generation, inventory)
    return Snapshot(
        inventory=inventory,
        generation=generation,
        members=members,
        epoch=base.epoch,
        inventory_digest=digest,
        inventory_wire=wire,
        left=left,
        finished_by=finished_by,
        stopping=stopping,
    )


def _records(path: Path, data: bytes) -> list[pb.PersistedState]:
    """The records of a format-3 file, less a torn last one (see [Note: state file format])."""
    out: list[pb.PersistedState] = []
    at, end = len(MAGIC), len(data)
    while at < end:
        where = f"record {len(out)} at byte {at}"
        torn = ""
        if end - at < _HEADER.size:
            torn = f"{where} is cut short ({end - at} bytes)"
        else:
            size, size_crc, crc = _HEADER.unpack_from(data, at)
            stop = at + _HEADER.size + size
            if zlib.crc32(data[at : at + 4]) != size_crc:
                if any(memoryview(data)[at:]):
                    raise ValueError(f"{where} is damaged (its length fails its checksum)")
                torn = f"{where} is zeros"
            elif stop > end:
                torn = f"{where} is cut short ({end - at - _HEADER.size} of {size} bytes)"
            else:
                payload = data[at + _HEADER.size : stop]
                if zlib.crc32(payload) != crc:
                    if stop != end and any(memoryview(data)[at:]):
                        raise ValueError(f"{where} is damaged (it fails its checksum)")
                    torn = f"{where} fails its checksum"
        if torn:
            if not out:
                raise ValueError(torn)
            logger.warning(
                "state file %r: %s; it is the last, being written when the coordinator "
                "stopped, and is ignored",
                str(path),
                torn,
            )
            break
        msg = pb.PersistedState.FromString(payload)
        if msg.format_version != FORMAT_VERSION:
            raise ValueError(f"{where} has format_version {msg.format_version}, expected 3")
        out.append(msg)
        at = stop
    if not out:
        raise ValueError("it holds no record")
    return out


def _inventory(snapshot: Snapshot) -> tuple[str, bytes]:
    if not snapshot.inventory:
        return "", b""
    wire = snapshot.inventory_wire or inventory_wire(
        [param_to_proto(p) for p in snapshot.inventory]
    )
    return inventory_digest(wire), wire


def _inventory_beside(path: Path, digest: str) -> tuple[tuple[ParamSpec, ...], str, bytes]:
    if not digest:
        return (), "", b""
    inventory, wire = _load_inventory(inventory_path(path, digest), digest)
    return inventory, digest, wire


def _generation_bytes(snapshot: Snapshot) -> bytes:
    """The snapshot's generation, members whole, as stored."""
    assert snapshot.generation is not None
    if snapshot.generation_wire:
        return snapshot.generation_wire
    return generation_to_proto(_without_derived(snapshot.generation)).SerializeToString()


def _delta_bytes(snapshot: Snapshot, before: Generation) -> bytes | None:
    """The snapshot's generation with its members as a delta from ``before``, if the
    server gave it that way and from that generation."""
    if not snapshot.generation_delta_wire:
        return None
    assert snapshot.generation is not None
    try:
        head = pb.Generation.FromString(snapshot.generation_delta_wire)
    except DecodeError:
        return None
    if head.id != snapshot.generation.id or not head.HasField("members_delta"):
        return None
    if head.members_delta.from_generation_id != before.id:
        return None
    return snapshot.generation_delta_wire


def _generation_field(generation: bytes) -> bytes:
    """``generation`` as field 3 of a serialized PersistedState (fields may come in any
    order, so it is appended to the rest)."""
    return length_delimited(GENERATION_FIELD, generation)


def length_delimited(number: int, data: bytes) -> bytes:
    """Field ``number`` holding ``data`` (a string, bytes or a message), serialized. Appended
    to a serialized message it sets the field, or for a message field merges into it."""
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _record(payload: bytes) -> bytes:
    size = len(payload)
    return _HEADER.pack(size, zlib.crc32(size.to_bytes(4, "little")), zlib.crc32(payload)) + payload


class StateStore:
    """Where a server saves its snapshots: off the event loop, or nowhere (``path`` None)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.log = None if path is None else StateLog(path)

    async def save(self, snapshot: Snapshot) -> None:
        if self.log is None:
            return
        try:
            await asyncio.to_thread(self.log.save, snapshot)
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
        # built on first use, and a restored server cuts each worker's part from it
        reshard = dataclasses.replace(reshard, moves=LazyMoves(before, layout), partial=False)
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
