"""The shard layout: coverage, padding, ownership, determinism."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.layout import ParamSpec, compute_layout


def spec(name: str, *shape: int, group: int = 0, unit: int = 0, grad: bool = True) -> ParamSpec:
    return ParamSpec(
        name=name, shape=shape, dtype="float32", group=group, unit=unit, requires_grad=grad
    )


inventories = st.lists(
    st.tuples(st.integers(0, 40), st.integers(0, 2), st.integers(0, 3), st.booleans()),
    min_size=1,
    max_size=12,
).map(
    lambda rows: [
        spec(f"p{i}", n, group=g, unit=u, grad=t or i == 0) for i, (n, g, u, t) in enumerate(rows)
    ]
)


@settings(max_examples=200, deadline=None)
@given(
    inventories,
    st.integers(1, 5),
    st.integers(1, 64),
    st.booleans(),
    st.sampled_from([1, 2, 4]),
)
def test_every_trainable_element_has_exactly_one_owner(inv, world, cap, by_unit, align):
    layout = compute_layout(inv, world, bucket_numel=cap, align=align, by_unit=by_unit)
    owned: dict[str, list[tuple[int, int]]] = {}
    for bucket in layout.buckets:
        assert bucket.padded_numel % (world * align) == 0
        assert bucket.padded_numel - bucket.numel < world * align or bucket.numel == 0
        assert sum(s.numel for s in bucket.slots) == bucket.numel
        assert len(
            {s.unit for s in [p for p in inv if p.name in {x.name for x in bucket.slots}]}
        ) <= (1 if by_unit else len(inv))
        for rank in range(world):
            for piece in bucket.slot_shards(rank):
                owned.setdefault(piece.slot.name, []).append(
                    (piece.param_start, piece.param_start + piece.numel)
                )
        if not by_unit:
            assert bucket.numel <= cap or len(bucket.slots) == 1
    for p in inv:
        if not p.requires_grad:
            assert p.name not in owned and p.name not in layout._where
            continue
        ranges = sorted(owned.get(p.name, []))
        covered = 0
        for lo, hi in ranges:
            assert lo == covered, f"{p.name}: gap or overlap at {lo}"
            covered = hi
        assert covered == p.numel


def test_parameter_straddles_ranks_and_padding_is_at_the_end() -> None:
    layout = compute_layout([spec("a", 5), spec("b", 6)], 3, bucket_numel=100)
    (bucket,) = layout.buckets
    assert (bucket.numel, bucket.padded_numel, bucket.shard_numel) == (11, 12, 4)
    # reverse registration order: b first, then a
    assert [(s.name, s.offset) for s in bucket.slots] == [("b", 0), ("a", 6)]
    pieces = {
        r: [(p.slot.name, p.param_start, p.numel) for p in bucket.slot_shards(r)] for r in range(3)
    }
    assert pieces == {0: [("b", 0, 4)], 1: [("b", 4, 2), ("a", 0, 2)], 2: [("a", 2, 3)]}
    assert [bucket.owned_numel(r) for r in range(3)] == [4, 4, 3]


def test_groups_and_dtypes_never_share_a_bucket() -> None:
    inv = [spec("w1", 4, group=0), spec("b1", 2, group=1), spec("w2", 4, group=0)]
    layout = compute_layout(inv, 2, bucket_numel=100)
    assert sorted(sorted(s.name for s in b.slots) for b in layout.buckets) == [["b1"], ["w1", "w2"]]


def test_same_inventory_same_layout() -> None:
    inv = [spec(f"p{i}", i + 1, group=i % 2) for i in range(10)]
    assert compute_layout(inv, 3, bucket_numel=7) == compute_layout(inv, 3, bucket_numel=7)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size"),
        ({"bucket_numel": 0}, "bucket_numel"),
        ({"align": 0}, "align"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, message: str) -> None:
    args = {"world_size": 2, "bucket_numel": 10} | kwargs
    with pytest.raises(ValueError, match=message):
        compute_layout([spec("a", 3)], args.pop("world_size"), **args)


def test_duplicate_names_rejected() -> None:
    with pytest.raises(ValueError, match="'a' appears twice"):
        compute_layout([spec("a", 3), spec("a", 4)], 2, bucket_numel=10)
