"""The shard layout: the one place that does offset arithmetic.

[Note: shard layout]
Trainable parameters are packed into flat buckets keyed by (gather unit, param
group, dtype). Parameters are walked in reverse registration order, which is
roughly the order autograd produces their gradients, so a bucket fills up in
backward order and buckets are numbered by when their last parameter arrives.
Each bucket is padded to a multiple of ``world_size * align`` and split into
``world_size`` equal contiguous ranges; rank ``r`` owns range ``r`` of every
bucket. A parameter may straddle two or more ranks.

State is addressed by (parameter name, element range), never by rank, so a
layout for one world size can be translated into a layout for another (see
``reshard``). The worker engine and the coordinator's planner call the same
``compute_layout`` on the same inventory and get the identical plan.

This module is torch-free: dtypes are strings such as ``"float32"``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from coordinator.core.steps import STEP, Steps, finish

__all__ = [
    "Bucket",
    "Layout",
    "ParamSpec",
    "Slot",
    "SlotShard",
    "compute_layout",
    "layout_steps",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamSpec:
    """One parameter of the model's inventory, as a worker reports it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool = True
    group: int = 0
    unit: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("ParamSpec.name must be a non-empty string")
        if self.shape and min(self.shape) < 0:
            raise ValueError(f"ParamSpec.shape of {self.name!r} has a negative dim: {self.shape}")
        if self.group < 0:
            raise ValueError(f"ParamSpec.group of {self.name!r} must be >= 0, got {self.group}")
        if self.unit < 0:
            raise ValueError(f"ParamSpec.unit of {self.name!r} must be >= 0, got {self.unit}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class Slot:
    """A parameter's place in a bucket: elements ``[offset, offset + numel)``."""

    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SlotShard:
    """The part of one slot that falls in one rank's range.

    ``param_start`` indexes the parameter's flattened elements; ``shard_start``
    indexes the rank's shard of the bucket.
    """

    slot: Slot
    param_start: int
    shard_start: int
    numel: int


@dataclass(frozen=True, slots=True)
class Bucket:
    index: int
    group: int
    dtype: str
    unit: int
    slots: tuple[Slot, ...]
    numel: int
    padded_numel: int
    world_size: int

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def slot_shards(self, rank: int) -> list[SlotShard]:
        """Every slot's intersection with ``rank``'s range, in bucket order."""
        return self.pieces(*self.shard_range(rank))

    def pieces(self, lo: int, hi: int) -> list[SlotShard]:
        """Every slot's intersection with bucket elements ``[lo, hi)``; offsets relative to lo."""
        return _intersect(self.slots, lo, hi)

    def owned_numel(self, rank: int) -> int:
        """Real (non-padding) elements in ``rank``'s range."""
        lo, hi = self.shard_range(rank)
        return max(0, min(hi, self.numel) - lo)

    def slot_owners(self, slot: Slot) -> list[tuple[int, int, int]]:
        """``(rank, param_start, param_stop)`` for each rank's part of ``slot``, in order.

        The inverse of ``slot_shards``: O(ranks the slot spans), not O(world size).
        """
        shard = self.shard_numel
        out = []
        pos, end = slot.offset, slot.offset + slot.numel
        while pos < end:
            rank = pos // shard
            stop = min(end, (rank + 1) * shard)
            out.append((rank, pos - slot.offset, stop - slot.offset))
            pos = stop
        return out


def _intersect(slots: Sequence[Slot], lo: int, hi: int) -> list[SlotShard]:
    out = []
    for slot in slots:
        start = max(lo, slot.offset)
        stop = min(hi, slot.offset + slot.numel)
        if start < stop:
            out.append(SlotShard(slot, start - slot.offset, start - lo, stop - start))
    return out


@dataclass(frozen=True)
class Layout:
    world_size: int
    buckets: tuple[Bucket, ...]
    _where: dict[str, tuple[int, Slot]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self._where:
            return  # given (layout_steps builds it as it goes)
        for bucket in self.buckets:
            for slot in bucket.slots:
                self._where[slot.name] = (bucket.index, slot)

    def locate(self, name: str) -> tuple[Bucket, Slot]:
        """The bucket and slot of a trainable parameter; KeyError names it if absent."""
        try:
            index, slot = self._where[name]
        except KeyError:
            raise KeyError(f"parameter {name!r} is not in any bucket (frozen or unknown)") from None
        return self.buckets[index], slot

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.buckets)

    @property
    def padded_numel(self) -> int:
        return sum(b.padded_numel for b in self.buckets)

    def param_owners(self, name: str) -> list[tuple[int, int, int]]:
        """``(rank, param_start, param_stop)`` covering trainable parameter ``name``."""
        bucket, slot = self.locate(name)
        return bucket.slot_owners(slot)

    def param_names(self) -> list[str]:
        """Trainable parameters in bucket order."""
        return [slot.name for bucket in self.buckets for slot in bucket.slots]

    def units(self) -> dict[int, list[Bucket]]:
        out: dict[int, list[Bucket]] = {}
        for bucket in self.buckets:
            out.setdefault(bucket.unit, []).append(bucket)
        return out

    def owned(self, rank: int) -> Iterator[tuple[Bucket, SlotShard]]:
        """Every (bucket, slot shard) that ``rank`` owns."""
        for bucket in self.buckets:
            for piece in bucket.slot_shards(rank):
                yield bucket, piece


def compute_layout(
    inventory: Sequence[ParamSpec],
    world_size: int,
    *,
    bucket_numel: int,
    align: int = 1,
    by_unit: bool = False,
) -> Layout:
    """Pack the trainable parameters of ``inventory`` into buckets for ``world_size`` ranks.

    ``bucket_numel`` caps a bucket's real elements (a larger parameter gets a
    bucket of its own). With ``by_unit`` (ZeRO stage 3) a bucket never crosses a
    gather unit and a unit's parameters of one (group, dtype) form one bucket,
    since a unit is gathered as a whole.
    """
    return finish(
        layout_steps(inventory, world_size, bucket_numel=bucket_numel, align=align, by_unit=by_unit)
    )


def layout_steps(
    inventory: Sequence[ParamSpec],
    world_size: int,
    *,
    bucket_numel: int,
    align: int = 1,
    by_unit: bool = False,
) -> Steps[Layout]:
    """``compute_layout`` in steps (coordinator/core/steps.py [Note: steps])."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    names = {p.name for p in inventory}
    if len(names) != len(inventory):
        seen: set[str] = set()
        dup = next(p.name for p in inventory if p.name in seen or seen.add(p.name))
        raise ValueError(f"parameter {dup!r} appears twice in the inventory")
    yield

    cap = math.inf if by_unit else bucket_numel
    # key -> (slots, filled numel, position of its last parameter so far)
    open_: dict[tuple[int, int, str], tuple[list[Slot], int, int]] = {}
    # Buckets are numbered by the position of their last parameter, and positions are
    # distinct: a closed bucket goes to its position's place here (no sort needed).
    closed: list[tuple[tuple[int, int, str], list[Slot], int] | None] = []
    trainable = [p for p in inventory if p.requires_grad]
    for pos, spec in enumerate(reversed(trainable)):
        if pos % STEP == 0:
            yield
        closed.append(None)
        key = (spec.unit if by_unit else 0, spec.group, spec.dtype)
        slots, filled, last = open_.get(key, (None, 0, 0))
        numel = spec.numel
        if slots is None or filled + numel > cap:
            if slots is not None:
                closed[last] = (key, slots, filled)
            slots, filled = [], 0
        slots.append(Slot(spec.name, filled, numel, tuple(spec.shape)))
        open_[key] = (slots, filled + numel, pos)
    while open_:
        if len(open_) % STEP == 0:
            yield
        key, (slots, filled, last) = open_.popitem()
        closed[last] = (key, slots, filled)

    # Temporaries are dropped as they are used, so none is freed all at once.
    quantum = world_size * align
    buckets: list[Bucket] = []
    where: dict[str, tuple[int, Slot]] = {}
    done = 0
    for pos in range(len(closed)):
        item, closed[pos] = closed[pos], None
        done += 1 if item is None else len(item[1])
        if done >= STEP:
            done = 0
            yield
        if item is None:
            continue
        key, slots, numel = item
        index = len(buckets)
        for slot in slots:
            where[slot.name] = (index, slot)
        buckets.append(
            Bucket(
                index=index,
                group=key[1],
                dtype=key[2],
                unit=key[0],
                slots=tuple(slots),
                numel=numel,
                padded_numel=max(quantum, -(-numel // quantum) * quantum),
                world_size=world_size,
            )
        )
    yield
    return Layout(world_size=world_size, buckets=tuple(buckets), _where=where)
