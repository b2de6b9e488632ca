"""The reshard schedule: which element ranges move between two layouts.

[Note: reshard schedule]
State is addressed by (parameter name, element range), never by rank, so a
change of world size is a change of owner per range. For every trainable
parameter, the old layout splits its flattened elements into runs owned by
old ranks and the new layout into runs owned by new ranks; intersecting the
two run lists gives the moves. Each element of each trainable parameter lies
in exactly one move, whose ``old_owner`` owns it in the old layout and whose
``new_owner`` owns it in the new one. Ranges whose owner does not change are
moves with ``old_owner == new_owner`` (rank numbers; whether it is the same
*worker* is the generation's business, see ``Member.previous_rank``). Padding
never moves: it is not part of any parameter.

At stage 0 nothing is partitioned, so the owners are nominal: every rank
holds every element and any survivor can serve any range.

All offsets come from ``coordinator.core.layout``; this module only intersects
runs (with ``coordinator.core.ranges``, see [Note: element ranges]).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from coordinator.core.layout import Bucket, Layout, Slot
from coordinator.core.steps import STEP, Steps, finish

__all__ = [
    "LazyMoves",
    "Move",
    "RankMoves",
    "RankSchedules",
    "ReshardSchedule",
    "check_reshardable",
    "moves_for_rank",
    "reshard_schedule",
    "reshard_steps",
]


class Move(NamedTuple):
    """Elements ``[start, stop)`` of flattened parameter ``name`` go from old to new owner.

    A named tuple, not a dataclass: a one-host change in a 100,000-rank job has
    about 700,000 moves, and a tuple is built in a third of the time."""

    name: str
    start: int
    stop: int
    old_owner: int
    new_owner: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, kw_only=True)
class ReshardSchedule:
    """The moves from generation ``from_generation_id`` to the one that carries this."""

    from_generation_id: int
    from_world_size: int
    from_stage: int
    # A tuple, or a LazyMoves that builds it on first use.
    moves: Sequence[Move]
    # Old ranks whose worker is gone without a word: the members restore their
    # state from what the survivors hold (worker/live/restore_plan.py [Note: recovery sources]).
    lost_ranks: tuple[int, ...] = ()
    # Old ranks whose worker asked to leave (after handing its shards over).
    left_ranks: tuple[int, ...] = ()
    # Only the moves that concern the worker that received it (sent incrementally).
    partial: bool = False


@dataclass(frozen=True)
class RankMoves:
    """One worker's view of a schedule: what it keeps, sends and receives."""

    keep: tuple[Move, ...]
    send: tuple[Move, ...]
    receive: tuple[Move, ...]


def reshard_schedule(old: Layout, new: Layout) -> list[Move]:
    """Moves covering every element of every trainable parameter, in ``new``'s bucket order.

    Both layouts must hold the same trainable parameters with the same sizes.
    """
    return finish(reshard_steps(old, new))


def reshard_steps(old: Layout, new: Layout) -> Steps[list[Move]]:
    """``reshard_schedule`` in steps (coordinator/core/steps.py [Note: steps])."""
    old_names = yield from _names_steps(old)
    new_names = yield from _names_steps(new)
    if set(old_names) != set(new_names):
        only_old = sorted(set(old_names) - set(new_names))
        only_new = sorted(set(new_names) - set(old_names))
        first = (only_old or only_new)[0]
        side = "old" if only_old else "new"
        raise ValueError(f"parameter {first!r} is only in the {side} layout")
    yield
    moves: list[Move] = []
    for i, name in enumerate(new_names):
        if i % STEP == 0:
            yield
        a_bucket, a_slot = old.locate(name)
        b_bucket, b_slot = new.locate(name)
        if a_slot.numel != b_slot.numel:
            raise ValueError(
                f"parameter {name!r} has {a_slot.numel} elements in the old layout, "
                f"{b_slot.numel} in the new"
            )
        _intersect_owners(moves, name, a_bucket, a_slot, b_bucket, b_slot)
    return moves


def _names_steps(layout: Layout) -> Steps[list[str]]:
    names: list[str] = []
    for bucket in layout.buckets:
        names.extend(slot.name for slot in bucket.slots)
        if len(names) % STEP < len(bucket.slots) + 1:
            yield
    return names


def _intersect_owners(
    out: list[Move],
    name: str,
    old: Bucket,
    old_slot: Slot,
    new: Bucket,
    new_slot: Slot,
    pos: int = 0,
    numel: int | None = None,
) -> None:
    """Append the moves of one parameter's elements ``[pos, numel)`` (all of them by
    default): the intersection of its runs of owners in the old bucket with those in
    the new (what ``Bucket.slot_owners`` lists), swept in one pass without listing
    the runs. The hot loop of a large re-formation."""
    old_shard, new_shard = old.shard_numel, new.shard_numel
    old_offset, new_offset = old_slot.offset, new_slot.offset
    if numel is None:
        numel = old_slot.numel
    # the owner of the element at ``pos``, and where (in the parameter) its run ends
    a = (old_offset + pos) // old_shard
    a_end = (a + 1) * old_shard - old_offset
    b = (new_offset + pos) // new_shard
    b_end = (b + 1) * new_shard - new_offset
    append = out.append
    while pos < numel:
        if a_end <= b_end:
            stop = a_end if a_end < numel else numel
            append(Move(name, pos, stop, a, b))
            if b_end == a_end:
                b += 1
                b_end += new_shard
            a += 1
            a_end += old_shard
        else:
            stop = b_end if b_end < numel else numel
            append(Move(name, pos, stop, a, b))
            b += 1
            b_end += new_shard
        pos = stop


def check_reshardable(old: Layout, new: Layout) -> None:
    """Raise ValueError unless ``old`` and ``new`` hold the same trainable parameters
    with the same sizes (what a schedule between them needs); O(parameters)."""
    old_names, new_names = old.param_names(), new.param_names()
    if set(old_names) != set(new_names):
        only_old = sorted(set(old_names) - set(new_names))
        only_new = sorted(set(new_names) - set(old_names))
        first = (only_old or only_new)[0]
        side = "old" if only_old else "new"
        raise ValueError(f"parameter {first!r} is only in the {side} layout")
    for name in new_names:
        a, b = old.locate(name)[1].numel, new.locate(name)[1].numel
        if a != b:
            raise ValueError(
                f"parameter {name!r} has {a} elements in the old layout, {b} in the new"
            )


# [Note: incremental schedule]
# A one-host change in a job of 100,000 ranks has about 700,000 moves (27 MB on the
# wire); sent whole to every member that is 2.7 TB, and building them all takes
# the coordinator seconds. But a worker only ever acts on the moves it is party
# to: those into its new range and out of its old one, a dozen or so. So the
# coordinator keeps the two layouts (``LazyMoves``) and cuts each worker its
# moves when its generation goes out (``RankSchedules.for_rank``): the moves of a
# rank lie inside its own ranges (a move is the intersection of one old and one
# new run), so sweeping just those ranges finds them, each exactly as the whole
# schedule has it. Every move has a new owner, so the members' pieces together
# are the whole schedule. The whole list is still built, once, when something
# asks for it (a client that did not ask for increments, the tests).


class RankSchedules:
    """Each worker's part of the schedule between two layouts, computed on demand
    ([Note: incremental schedule])."""

    def __init__(self, old: Layout, new: Layout) -> None:
        self.old, self.new = old, new
        # per layout, each bucket's (shard size, real elements, slot offsets, slots)
        self._buckets = {
            id(layout): [
                (b.shard_numel, b.numel, [slot.offset for slot in b.slots], b.slots)
                for b in layout.buckets
            ]
            for layout in (old, new)
        }
        # per parameter: its order in the schedule, and where it is in each layout
        self._params = {
            name: (i, *old.locate(name), *new.locate(name))
            for i, name in enumerate(new.param_names())
        }

    def _pieces(self, layout: Layout, rank: int, out: list[tuple[int, str, int, int]]) -> None:
        """Append (order, parameter, start, stop) for every part of ``rank``'s ranges in
        ``layout``."""
        params = self._params
        for shard, numel, offsets, slots in self._buckets[id(layout)]:
            lo = rank * shard
            hi = min(lo + shard, numel)
            if lo >= hi:
                continue
            i = max(bisect_right(offsets, lo) - 1, 0)
            while i < len(slots) and offsets[i] < hi:
                slot = slots[i]
                begin, end = slot.offset, slot.offset + slot.numel
                start, stop = (lo if lo > begin else begin), (hi if hi < end else end)
                if start < stop:
                    out.append((params[slot.name][0], slot.name, start - begin, stop - begin))
                i += 1

    def for_rank(self, old_rank: int | None, new_rank: int | None) -> list[Move]:
        """The moves out of ``old_rank`` (of the old layout) or into ``new_rank`` (of
        the new), in the whole schedule's order; None: not in that layout."""
        pieces: list[tuple[int, str, int, int]] = []
        if new_rank is not None:
            self._pieces(self.new, new_rank, pieces)
        if old_rank is not None:
            self._pieces(self.old, old_rank, pieces)
        pieces.sort()
        moves: list[Move] = []
        k = 0
        while k < len(pieces):
            _, name, start, stop = pieces[k]
            k += 1
            # the old and the new range of one worker may overlap: sweep their union once
            while k < len(pieces) and pieces[k][1] == name and pieces[k][2] <= stop:
                stop = max(stop, pieces[k][3])
                k += 1
            _, a_bucket, a_slot, b_bucket, b_slot = self._params[name]
            _intersect_owners(moves, name, a_bucket, a_slot, b_bucket, b_slot, start, stop)
        return [m for m in moves if m.new_owner == new_rank or m.old_owner == old_rank]


class LazyMoves(Sequence[Move]):
    """The whole schedule between two layouts, built on first use ([Note: incremental
    schedule]); compares equal to the same moves as a tuple."""

    def __init__(self, old: Layout, new: Layout) -> None:
        self.schedules = RankSchedules(old, new)
        self._moves: tuple[Move, ...] | None = None

    def _all(self) -> tuple[Move, ...]:
        if self._moves is None:
            self._moves = tuple(reshard_schedule(self.schedules.old, self.schedules.new))
        return self._moves

    def steps(self) -> Steps[tuple[Move, ...]]:
        """Build the whole list in steps (coordinator/core/steps.py [Note: steps])."""
        if self._moves is None:
            moves = yield from reshard_steps(self.schedules.old, self.schedules.new)
            self._moves = tuple(moves)
        return self._moves

    def __getitem__(self, index):  # type: ignore[override]
        return self._all()[index]

    def __len__(self) -> int:
        return len(self._all())

    def __iter__(self) -> Iterator[Move]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return self._all() == tuple(other)

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        state = "built" if self._moves is not None else "not built"
        return f"LazyMoves({state})"


def moves_for_rank(
    moves: Iterable[Move], *, old_rank: int | None, new_rank: int | None
) -> RankMoves:
    """Split ``moves`` for a worker that was ``old_rank`` and becomes ``new_rank``.

    ``None`` means the worker was not in that generation (a joiner has no old
    rank, a leaver no new one).
    """
    keep, send, receive = [], [], []
    for move in moves:
        was_mine = old_rank is not None and move.old_owner == old_rank
        is_mine = new_rank is not None and move.new_owner == new_rank
        if was_mine and is_mine:
            keep.append(move)
        elif was_mine:
            send.append(move)
        elif is_mine:
            receive.append(move)
    return RankMoves(tuple(keep), tuple(send), tuple(receive))
