"""The newest generation as the server hands it out: its wire forms, built once
however many workers watch, and the state file's copy of them.

A generation is built from a proposal and encoded here, in steps (coordinator/core/
steps.py [Note: steps]), before the server commits it (coordinator/control/
membership.py [Note: atomic formation]); one that does not encode is never published.
"""

from __future__ import annotations

import asyncio
import dataclasses

from coordinator._proto.zeroplane.coordinator.v1 import coordinator_pb2 as pb
from coordinator.control.membership import Proposal, Snapshot, build_steps
from coordinator.control.statefile import length_delimited
from coordinator.core.generation_codec import (
    generation_steps,
    members_delta,
    moves_to_proto,
    serialize_steps,
)
from coordinator.core.messages import Generation
from coordinator.core.reshard import LazyMoves, RankSchedules
from coordinator.core.steps import Steps, finish, finish_async

__all__ = ["Published", "publish_steps"]

LAYOUT_FIELD = pb.Generation.DESCRIPTOR.fields_by_name["layout"].number


def publish_steps(proposal: Proposal) -> Steps[tuple[Generation, Published]]:
    """A proposal's generation and its wire forms (see coordinator/control/membership.py
    [Note: atomic formation])."""
    generation = yield from build_steps(proposal)
    published = yield from Published.steps(generation, proposal.previous)
    return generation, published


class Published:
    """A generation as watchers get it (coordinator/core/reshard.py [Note: incremental
    schedule]): whole, built on first demand, or per worker, a head shared by all
    (members whole, or as a delta from the previous generation; the schedule without
    its moves) and the worker's own moves appended."""

    def __init__(
        self,
        generation: Generation,
        head: bytes,
        delta_head: bytes | None,
        layout: bytes = b"",
    ) -> None:
        self.id = generation.id
        self.generation = generation
        # the heads without the layout's buckets (what the state file stores), and the
        # layout whole appended (a Generation's field 7, merged into the one before)
        self._stored, self._delta_stored = head, delta_head
        self._head = head + layout
        self._delta_head = None if delta_head is None else delta_head + layout
        self._whole: asyncio.Future[bytes] | None = None
        reshard = generation.reshard
        self._schedules: RankSchedules | None = None
        self._ranks: dict[str, tuple[int | None, int | None]] | None = None
        if reshard is not None and isinstance(reshard.moves, LazyMoves):
            self._schedules = reshard.moves.schedules

    @classmethod
    def of(cls, generation: Generation, previous: Generation | None) -> Published:
        return finish(cls.steps(generation, previous))

    @classmethod
    def steps(cls, generation: Generation, previous: Generation | None) -> Steps[Published]:
        reshard = generation.reshard
        if reshard is not None:  # the moves go to each worker apart
            reshard = dataclasses.replace(reshard, moves=(), partial=True)
        msg = yield from generation_steps(dataclasses.replace(generation, reshard=reshard))
        # The layout's buckets apart: the state file leaves them out (they follow from
        # the inventory), a watcher gets them appended (a message field given twice is
        # merged, as for the moves appended in incremental()).
        layout = length_delimited(LAYOUT_FIELD, msg.layout.SerializeToString())
        yield
        del msg.layout.buckets[:]
        head = msg.SerializeToString()
        yield
        delta = None if previous is None else members_delta(previous, generation)
        delta_head = None
        if delta is not None:
            yield
            del msg.members[:]
            msg.members_delta.CopyFrom(delta)
            delta_head = msg.SerializeToString()
        return cls(generation, head, delta_head, layout)

    def for_state_file(self, snapshot: Snapshot) -> Snapshot:
        """``snapshot`` (of this generation) with the wire forms the state file stores
        (coordinator/control/statefile.py [Note: state file format])."""
        if snapshot.generation is not self.generation:
            return snapshot
        return dataclasses.replace(
            snapshot,
            generation_wire=self._stored,
            generation_delta_wire=self._delta_stored or b"",
        )

    async def whole(self) -> bytes:
        """The generation with every member and every move (one build, however many ask)."""
        if self._whole is None:
            self._whole = asyncio.ensure_future(finish_async(whole_steps(self.generation)))
        return await asyncio.shield(self._whole)

    def incremental(self, worker_id: str, after: int) -> bytes:
        reshard = self.generation.reshard
        delta = self._delta_head is not None and reshard is not None
        head = self._delta_head if delta and after == reshard.from_generation_id else self._head
        if reshard is None:
            return head
        old_rank, new_rank = self._ranks_of(worker_id)
        if old_rank is None and new_rank is None:
            return head
        if self._schedules is not None:
            moves = self._schedules.for_rank(old_rank, new_rank)
        else:  # restored from a state file, whole: this worker's part of it
            moves = [m for m in reshard.moves if m.old_owner == old_rank or m.new_owner == new_rank]
        return head + moves_to_proto(moves)

    def _ranks_of(self, worker_id: str) -> tuple[int | None, int | None]:
        if self._ranks is None:
            self._ranks = {m.worker_id: (m.previous_rank, m.rank) for m in self.generation.members}
        return self._ranks.get(worker_id, (None, None))


def whole_steps(generation: Generation) -> Steps[bytes]:
    reshard = generation.reshard
    if reshard is not None and isinstance(reshard.moves, LazyMoves):
        yield from reshard.moves.steps()
    msg = yield from generation_steps(generation)
    data = yield from serialize_steps(msg)
    return data
