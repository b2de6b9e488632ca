"""Element ranges of flattened parameters: the one place that intersects them.

[Note: element ranges]
Training state is addressed by (parameter name, element range of the
flattened parameter), never by rank: a checkpoint file, a live hand-over
between world sizes and an in-memory replica all hold entries keyed
``name[start:stop]``. Moving state is then always the same question: which
of the ranges held somewhere overlap the ranges a rank now owns. The
coordinator's reshard schedule (``coordinator/core/reshard.py``), the workers'
live exchange (``worker/live/exchange.py``) and checkpoint loading
(``worker/checkpoint.py``) all answer it with this module. Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from coordinator.core.layout import Layout

__all__ = ["Range", "RangeIndex", "overlap", "owned_ranges"]


def overlap(start: int, stop: int, lo: int, hi: int) -> tuple[int, int] | None:
    """The intersection of ``[start, stop)`` and ``[lo, hi)``, or None if empty."""
    a, b = max(start, lo), min(stop, hi)
    return (a, b) if a < b else None


@dataclass(frozen=True, slots=True)
class Range:
    """Elements ``[start, stop)`` of the flattened parameter ``name``."""

    name: str
    start: int
    stop: int

    @property
    def key(self) -> str:
        return f"{self.name}[{self.start}:{self.stop}]"

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @classmethod
    def parse(cls, key: str) -> Range:
        """The inverse of ``key``; a name may itself hold brackets."""
        name, bracket, rng = key.rpartition("[")
        start, colon, stop = rng.rstrip("]").partition(":")
        if not bracket or not colon or not key.endswith("]"):
            raise ValueError(f"not an element-range key: {key!r}")
        return cls(name, int(start), int(stop))


def owned_ranges(layout: Layout, rank: int, *, partitioned: bool) -> list[Range]:
    """The ranges whose optimizer state ``rank`` owns under ``layout``: its range
    of every bucket, or every element when the optimizer is not partitioned
    (stage 0), in layout order."""
    out = []
    for bucket in layout.buckets:
        pieces = bucket.slot_shards(rank) if partitioned else bucket.pieces(0, bucket.padded_numel)
        out += [Range(p.slot.name, p.param_start, p.param_start + p.numel) for p in pieces]
    return out


class RangeIndex:
    """Where ranges are held: ``name -> [(start, stop, source)]``, for overlap queries."""

    def __init__(self, held: Iterable[tuple[Range, str]] = ()) -> None:
        self._by_name: dict[str, list[tuple[int, int, str]]] = {}
        for rng, source in held:
            self.add(rng, source)

    @classmethod
    def of_keys(cls, keys: Iterable[str], source: str = "") -> RangeIndex:
        return cls((Range.parse(k), source) for k in keys)

    def add(self, rng: Range, source: str) -> None:
        runs = self._by_name.setdefault(rng.name, [])
        runs.append((rng.start, rng.stop, source))
        runs.sort()

    def overlapping(self, want: Range) -> Iterator[tuple[Range, int, int, str]]:
        """``(held, a, b, source)`` for each held range that overlaps ``want`` in ``[a, b)``."""
        for lo, hi, source in self._by_name.get(want.name, ()):
            hit = overlap(want.start, want.stop, lo, hi)
            if hit is not None:
                yield Range(want.name, lo, hi), hit[0], hit[1], source

    def sources(self, wanted: Iterable[Range]) -> set[str]:
        """Every source holding part of a wanted range."""
        return {source for want in wanted for *_, source in self.overlapping(want)}

    def names(self) -> set[str]:
        return set(self._by_name)

    def cover_flaw(self, name: str, numel: int) -> str | None:
        """How the held ranges of ``name`` fail to hold each of its ``numel``
        elements exactly once (the first gap or overlap), or None if they do."""
        pos, last = 0, ""
        for lo, hi, source in self._by_name.get(name, ()):
            if lo > pos:
                return f"elements [{pos}, {lo}) of {name!r} are held by none"
            if lo < pos:
                return (
                    f"elements [{lo}, {min(pos, hi)}) of {name!r} are held twice "
                    f"({last} and {source})"
                )
            pos, last = hi, source
        if pos != numel:
            if pos > numel:
                return f"{name!r} has {numel} elements but {last} holds up to {pos}"
            return f"elements [{pos}, {numel}) of {name!r} are held by none"
        return None
