"""A generation's protobuf form: whole, in steps, and incremental (its members as a
``MembersDelta`` from the generation before, its reshard schedule left for the worker
to derive from the two layouts: coordinator/core/reshard.py [Note: incremental
schedule]); serialized in pieces so that a large one never holds the server's loop.
"""

from __future__ import annotations

from collections.abc import Sequence

from google.protobuf.message import Message

from coordinator._proto.zeroplane.coordinator.v1 import coordinator_pb2 as pb
from coordinator.core.conversions import (
    coords_from_proto,
    coords_to_proto,
    mesh_from_proto,
    mesh_to_proto,
)
from coordinator.core.layout import Bucket, Layout, Slot
from coordinator.core.messages import Generation, Member
from coordinator.core.reshard import LazyMoves, Move, ReshardSchedule
from coordinator.core.steps import STEP, Steps, finish

__all__ = [
    "MissingPrevious",
    "generation_from_proto",
    "generation_steps",
    "generation_to_proto",
    "members_delta",
    "moves_to_proto",
    "serialize_steps",
]


def _layout_steps(
    msg: pb.Layout, layout: Layout, *, bucket_numel: int, align: int, by_unit: bool
) -> Steps[None]:
    msg.world_size, msg.bucket_numel, msg.align, msg.by_unit = (
        layout.world_size,
        bucket_numel,
        align,
        by_unit,
    )
    # Filled in place: a layout has a slot per parameter, and this is its hot loop.
    add_bucket = msg.buckets.add
    done = 0
    for b in layout.buckets:
        bucket = add_bucket(
            index=b.index,
            group=b.group,
            dtype=b.dtype,
            unit=b.unit,
            numel=b.numel,
            padded_numel=b.padded_numel,
        )
        add_slot = bucket.slots.add
        for s in b.slots:
            slot = add_slot()
            slot.name, slot.offset, slot.numel = s.name, s.offset, s.numel
            slot.shape.extend(s.shape)
        done += len(b.slots) + 1
        if done >= STEP:
            done = 0
            yield


def _layout_from_proto(msg: pb.Layout) -> Layout:
    world = msg.world_size
    if world < 1:
        raise ValueError(f"Layout.world_size must be >= 1, got {world}")
    buckets = []
    for i, b in enumerate(msg.buckets):
        if b.index != i or b.padded_numel % world or b.padded_numel < b.numel:
            raise ValueError(f"Layout bucket {i} is inconsistent with world size {world}")
        slots = tuple(Slot(s.name, s.offset, s.numel, tuple(s.shape)) for s in b.slots)
        buckets.append(
            Bucket(
                index=b.index,
                group=b.group,
                dtype=b.dtype,
                unit=b.unit,
                slots=slots,
                numel=b.numel,
                padded_numel=b.padded_numel,
                world_size=world,
            )
        )
    return Layout(world_size=world, buckets=tuple(buckets))


def generation_to_proto(gen: Generation) -> pb.Generation:
    return finish(generation_steps(gen))


def generation_steps(gen: Generation) -> Steps[pb.Generation]:
    """``generation_to_proto`` in steps (coordinator/core/steps.py [Note: steps])."""
    msg = pb.Generation(
        id=gen.id,
        members=[
            pb.Member(
                worker_id=m.worker_id,
                rank=m.rank,
                host=m.host,
                previous_rank=-1 if m.previous_rank is None else m.previous_rank,
                device_memory_bytes=m.device_memory_bytes,
                mesh=coords_to_proto(gen.coords(m.rank)),
            )
            for m in gen.members
        ],
        world_size=gen.world_size,
        rendezvous_endpoint=gen.rendezvous_endpoint,
        stage=gen.stage,
        stage_reason=gen.stage_reason,
        inventory_digest=gen.inventory_digest,
        created_unix_s=gen.created_unix_s,
        epoch=gen.epoch,
        mesh_reason=gen.mesh_reason,
    )
    mesh_to_proto(gen.mesh, msg.mesh)
    yield from _layout_steps(
        msg.layout, gen.layout, bucket_numel=gen.bucket_numel, align=gen.align, by_unit=gen.by_unit
    )
    if gen.reshard is not None:
        r = gen.reshard
        reshard = msg.reshard
        reshard.from_generation_id = r.from_generation_id
        reshard.from_world_size = r.from_world_size
        reshard.from_stage = r.from_stage
        reshard.lost_ranks.extend(r.lost_ranks)
        reshard.left_ranks.extend(r.left_ranks)
        reshard.partial = r.partial
        add_move = reshard.moves.add
        for i, m in enumerate(r.moves):
            if i % STEP == 0:
                yield
            move = add_move()
            move.name, move.start, move.stop = m.name, m.start, m.stop
            move.old_owner, move.new_owner = m.old_owner, m.new_owner
    return msg


def serialize_steps(msg: pb.Generation) -> Steps[bytes]:
    """``msg.SerializeToString()`` in steps (coordinator/core/steps.py): its layout's buckets
    and its reshard moves go out in pieces, each a ``Generation`` holding a few of them.
    Parsing concatenated messages merges them (a message field merges, a repeated field
    appends), so the bytes parse to ``msg``; the pieces just never take long."""
    head = pb.Generation()
    for descriptor, value in msg.ListFields():
        name = descriptor.name
        if name in ("layout", "reshard"):
            continue
        if isinstance(value, Message):
            getattr(head, name).CopyFrom(value)
        elif hasattr(value, "extend"):  # a repeated field
            getattr(head, name).extend(value)
        else:
            setattr(head, name, value)
    layout, reshard = msg.layout, msg.reshard
    head.layout.world_size, head.layout.bucket_numel = layout.world_size, layout.bucket_numel
    head.layout.align, head.layout.by_unit = layout.align, layout.by_unit
    if msg.HasField("reshard"):
        head.reshard.from_generation_id = reshard.from_generation_id
        head.reshard.from_world_size = reshard.from_world_size
        head.reshard.from_stage = reshard.from_stage
        head.reshard.lost_ranks.extend(reshard.lost_ranks)
        head.reshard.left_ranks.extend(reshard.left_ranks)
    pieces = [head.SerializeToString()]
    buckets, moves = msg.layout.buckets, msg.reshard.moves
    start = slots = 0
    for i, bucket in enumerate(buckets):
        slots += len(bucket.slots) + 1
        if slots >= STEP or i == len(buckets) - 1:
            yield
            piece = pb.Generation(layout=pb.Layout(buckets=buckets[start : i + 1]))
            pieces.append(piece.SerializeToString())
            start, slots = i + 1, 0
    for i in range(0, len(moves), STEP):
        yield
        piece = pb.Generation(reshard=pb.ReshardSchedule(moves=moves[i : i + STEP]))
        pieces.append(piece.SerializeToString())
    return b"".join(pieces)


def moves_to_proto(moves: Sequence[Move]) -> bytes:
    """A ``Generation`` holding just ``moves`` in its schedule, serialized: appended to
    an incremental head, it completes a worker's generation (see serialize_steps)."""
    msg = pb.Generation()
    add_move = msg.reshard.moves.add
    for m in moves:
        move = add_move()
        move.name, move.start, move.stop = m.name, m.start, m.stop
        move.old_owner, move.new_owner = m.old_owner, m.new_owner
    return msg.SerializeToString()


def members_delta(previous: Generation, gen: Generation) -> pb.MembersDelta | None:
    """``gen``'s members as a change from ``previous`` (see the proto's MembersDelta);
    None when they are not survivors in order followed by newcomers."""
    survivors = [m for m in gen.members if m.previous_rank is not None]
    if gen.members[: len(survivors)] != tuple(survivors):
        return None
    kept: set[int] = set()
    last = -1
    for m in survivors:
        if m.previous_rank <= last or m.previous_rank >= previous.world_size:
            return None
        old = previous.members[m.previous_rank]
        if (old.worker_id, old.host, old.device_memory_bytes) != (
            m.worker_id,
            m.host,
            m.device_memory_bytes,
        ):
            return None
        kept.add(m.previous_rank)
        last = m.previous_rank
    delta = pb.MembersDelta(
        from_generation_id=previous.id,
        removed_ranks=[r for r in range(previous.world_size) if r not in kept],
    )
    for m in gen.members[len(survivors) :]:
        delta.added.add(
            worker_id=m.worker_id,
            rank=m.rank,
            host=m.host,
            previous_rank=-1,
            device_memory_bytes=m.device_memory_bytes,
        )
    return delta


def _expand_members(delta: pb.MembersDelta, previous: Generation | None) -> tuple[Member, ...]:
    if previous is None or previous.id != delta.from_generation_id:
        have = "none" if previous is None else previous.id
        raise MissingPrevious(
            f"members are a delta from generation {delta.from_generation_id}; this client "
            f"holds {have}"
        )
    removed = set(delta.removed_ranks)
    members = [
        Member(
            worker_id=m.worker_id,
            rank=rank,
            host=m.host,
            previous_rank=m.rank,
            device_memory_bytes=m.device_memory_bytes,
        )
        for rank, m in enumerate(m for m in previous.members if m.rank not in removed)
    ]
    members += [
        Member(
            worker_id=m.worker_id,
            rank=m.rank,
            host=m.host,
            previous_rank=None,
            device_memory_bytes=m.device_memory_bytes,
        )
        for m in delta.added
    ]
    return tuple(members)


class MissingPrevious(ValueError):
    """An incremental generation that needs a previous generation this side lacks."""


def generation_from_proto(msg: pb.Generation, previous: Generation | None = None) -> Generation:
    """``msg`` as a Generation. An incremental one (a MembersDelta, a partial schedule)
    is completed from ``previous``, the generation it follows: its members from the
    delta and its whole schedule from the two layouts (built on first use, see
    coordinator/core/reshard.py [Note: incremental schedule]); without ``previous``
    a MembersDelta raises MissingPrevious and a partial schedule stays partial."""
    if msg.HasField("members_delta"):
        members = _expand_members(msg.members_delta, previous)
    else:
        members = tuple(
            Member(
                worker_id=m.worker_id,
                rank=m.rank,
                host=m.host,
                previous_rank=None if m.previous_rank < 0 else m.previous_rank,
                device_memory_bytes=m.device_memory_bytes,
            )
            for m in msg.members
        )
    if [m.rank for m in members] != list(range(len(members))) or len(members) != msg.world_size:
        raise ValueError(f"generation {msg.id}: members are not ranks 0..{msg.world_size - 1}")
    mesh = mesh_from_proto(msg)
    if mesh is not None and mesh.world_size != len(members):
        raise ValueError(
            f"generation {msg.id}: a mesh of pp={mesh.pp} x dp={mesh.dp} x tp={mesh.tp} "
            f"for {len(members)} members"
        )
    for m in () if msg.HasField("members_delta") else msg.members:
        given = coords_from_proto(m, "mesh")
        if given != (None if mesh is None else mesh.coords(m.rank)):
            raise ValueError(
                f"generation {msg.id}: rank {m.rank}'s mesh coordinates {given} are not its "
                "place in the generation's mesh"
            )
    layout = _layout_from_proto(msg.layout)
    reshard = None
    if msg.HasField("reshard"):
        r = msg.reshard
        partial = r.partial
        moves: Sequence[Move]
        if partial and previous is not None and previous.id == r.from_generation_id:
            moves, partial = LazyMoves(previous.layout, layout), False
        else:
            moves = tuple(Move(m.name, m.start, m.stop, m.old_owner, m.new_owner) for m in r.moves)
        reshard = ReshardSchedule(
            from_generation_id=r.from_generation_id,
            from_world_size=r.from_world_size,
            from_stage=r.from_stage,
            moves=moves,
            lost_ranks=tuple(r.lost_ranks),
            left_ranks=tuple(r.left_ranks),
            partial=partial,
        )
    return Generation(
        id=msg.id,
        members=members,
        rendezvous_endpoint=msg.rendezvous_endpoint,
        stage=msg.stage,
        stage_reason=msg.stage_reason,
        layout=layout,
        bucket_numel=msg.layout.bucket_numel,
        align=msg.layout.align,
        reshard=reshard,
        inventory_digest=msg.inventory_digest,
        created_unix_s=msg.created_unix_s,
        epoch=msg.epoch,
        mesh=mesh,
        mesh_reason=msg.mesh_reason,
    )
