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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from coordinator.core.layout import Layout
from coordinator.core.ranges import overlap
from coordinator.core.steps import STEP, Steps, finish

__all__ = [
    "Move",
    "RankMoves",
    "ReshardSchedule",
    "moves_for_rank",
    "reshard_schedule",
    "reshard_steps",
]


@dataclass(frozen=True, slots=True)
class Move:
    """Elements ``[start, stop)`` of flattened parameter ``name`` go from old to new owner."""

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
    moves: tuple[Move, ...]
    # Old ranks whose worker is gone without a word: the members restore their
    # state from what the survivors hold (worker/elastic/restore_plan.py [Note: recovery sources]).
    lost_ranks: tuple[int, ...] = ()
    # Old ranks whose worker asked to leave (after handing its shards over).
    left_ranks: tuple[int, ...] = ()


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
        a = old.param_owners(name)
        b = new.param_owners(name)
        a_numel = a[-1][2] if a else 0
        b_numel = b[-1][2] if b else 0
        if a_numel != b_numel:
            raise ValueError(
                f"parameter {name!r} has {a_numel} elements in the old layout, {b_numel} in the new"
            )
        moves.extend(_intersect_runs(name, a, b))
    return moves


def _names_steps(layout: Layout) -> Steps[list[str]]:
    names: list[str] = []
    for bucket in layout.buckets:
        names.extend(slot.name for slot in bucket.slots)
        if len(names) % STEP < len(bucket.slots) + 1:
            yield
    return names


def _intersect_runs(
    name: str, old: Sequence[tuple[int, int, int]], new: Sequence[tuple[int, int, int]]
) -> Iterable[Move]:
    # Both run lists are sorted and tile [0, numel): a two-pointer sweep.
    i = j = 0
    while i < len(old) and j < len(new):
        old_rank, old_start, old_stop = old[i]
        new_rank, new_start, new_stop = new[j]
        hit = overlap(old_start, old_stop, new_start, new_stop)
        if hit is not None:
            yield Move(name, *hit, old_rank, new_rank)
        if old_stop <= new_stop:
            i += 1
        if new_stop <= old_stop:
            j += 1


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
