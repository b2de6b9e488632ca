"""Reshard schedules: each element of each trainable parameter has one old and one new owner."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.layout import Layout, ParamSpec, compute_layout
from coordinator.core.reshard import moves_for_rank, reshard_schedule

pytestmark = pytest.mark.timeout(120)


@st.composite
def inventories(draw: st.DrawFn) -> list[ParamSpec]:
    n = draw(st.integers(1, 12))
    specs = []
    for i in range(n):
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
        specs.append(
            ParamSpec(
                name=f"p{i}",
                shape=shape,
                dtype=draw(st.sampled_from(["float32", "bfloat16"])),
                requires_grad=draw(st.booleans()) or i == 0,
                group=draw(st.integers(0, 1)),
                unit=draw(st.integers(0, 3)),
            )
        )
    return specs


@st.composite
def layouts(draw: st.DrawFn, specs: list[ParamSpec]) -> Layout:
    return compute_layout(
        specs,
        draw(st.integers(1, 9)),
        bucket_numel=draw(st.integers(1, 64)),
        align=draw(st.integers(1, 4)),
        by_unit=draw(st.booleans()),
    )


def _owner_by_element(layout: Layout) -> dict[tuple[str, int], int]:
    # Independent of slot_owners: walk each rank's slot shards (the worker's view).
    owner: dict[tuple[str, int], int] = {}
    for rank in range(layout.world_size):
        for _, piece in layout.owned(rank):
            for i in range(piece.param_start, piece.param_start + piece.numel):
                assert (piece.slot.name, i) not in owner
                owner[(piece.slot.name, i)] = rank
    return owner


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_every_element_moves_exactly_once_from_its_old_to_its_new_owner(data: st.DataObject):
    specs = data.draw(inventories())
    old = data.draw(layouts(specs))
    new = data.draw(layouts(specs))
    moves = reshard_schedule(old, new)

    old_owner, new_owner = _owner_by_element(old), _owner_by_element(new)
    trainable = {(p.name, i) for p in specs if p.requires_grad for i in range(p.numel)}
    assert set(old_owner) == set(new_owner) == trainable  # frozen parameters never appear

    covered: dict[tuple[str, int], tuple[int, int]] = {}
    for move in moves:
        assert move.start < move.stop
        for i in range(move.start, move.stop):
            key = (move.name, i)
            assert key not in covered, f"{key} is in two moves"
            covered[key] = (move.old_owner, move.new_owner)
    assert set(covered) == trainable  # nothing dropped
    for key, (was, becomes) in covered.items():
        assert was == old_owner[key] and becomes == new_owner[key]

    # Per rank, keep + send is what it owned and keep + receive what it will own.
    for rank in range(max(old.world_size, new.world_size)):
        old_rank = rank if rank < old.world_size else None
        new_rank = rank if rank < new.world_size else None
        mine = moves_for_rank(moves, old_rank=old_rank, new_rank=new_rank)
        owned = sum(n for k, n in _count(old_owner).items() if k == old_rank)
        owns = sum(n for k, n in _count(new_owner).items() if k == new_rank)
        assert sum(m.numel for m in mine.keep + mine.send) == owned
        assert sum(m.numel for m in mine.keep + mine.receive) == owns


def _count(owner: dict[tuple[str, int], int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for rank in owner.values():
        out[rank] = out.get(rank, 0) + 1
    return out


def test_same_layout_keeps_everything_in_place() -> None:
    specs = [ParamSpec(name="w", shape=(10, 10), dtype="float32")]
    layout = compute_layout(specs, 4, bucket_numel=1000)
    moves = reshard_schedule(layout, layout)
    assert all(m.old_owner == m.new_owner for m in moves)
    assert sum(m.numel for m in moves) == 100


def test_four_to_two_ranks() -> None:
    specs = [ParamSpec(name="w", shape=(8,), dtype="float32")]
    old = compute_layout(specs, 4, bucket_numel=1000)
    new = compute_layout(specs, 2, bucket_numel=1000)
    got = [(m.start, m.stop, m.old_owner, m.new_owner) for m in reshard_schedule(old, new)]
    assert got == [(0, 2, 0, 0), (2, 4, 1, 0), (4, 6, 2, 1), (6, 8, 3, 1)]


def test_different_inventories_are_rejected() -> None:
    a = compute_layout([ParamSpec(name="w", shape=(4,), dtype="float32")], 2, bucket_numel=8)
    b = compute_layout([ParamSpec(name="v", shape=(4,), dtype="float32")], 2, bucket_numel=8)
    with pytest.raises(ValueError, match="'w' is only in the old layout"):
        reshard_schedule(a, b)
    c = compute_layout([ParamSpec(name="w", shape=(5,), dtype="float32")], 2, bucket_numel=8)
    with pytest.raises(ValueError, match="4 elements in the old layout, 5 in the new"):
        reshard_schedule(a, c)
