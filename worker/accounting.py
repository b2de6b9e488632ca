"""What a rank holds and moves, counted: the engine's memory and collective reports
and the snapshot its metrics show (worker/metrics.py), from the shard state's public
methods and the step's statistics (worker/stats.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from worker.collectives import Collectives
from worker.config import ZeroConfig
from worker.metrics import Snapshot
from worker.state import ShardState
from worker.stats import StepStats

if TYPE_CHECKING:
    from worker.moe.shards import ExpertShards

__all__ = [
    "MemoryReadings",
    "comm_report",
    "memory_by_location",
    "memory_report",
    "op_totals",
    "snapshot",
]


def memory_report(
    state: ShardState, *, replica: int, activations: int, also: Sequence[ShardState] = ()
) -> dict[str, int]:
    """``state``'s model-state bytes by kind (with those of the states ``also``: an
    expert-parallel model's experts), ``replica`` bytes of in-memory replicas and
    their ``total``; beside them, not in the total, the ``activations`` the last
    measured forward kept for backward (worker/activations.py [Note: saved-activation
    bytes])."""
    report = state.memory_report()
    for other in also:
        for kind, nbytes in other.memory_report().items():
            report[kind] = report.get(kind, 0) + nbytes
    report["replica"] = replica
    report["total"] = sum(report.values())
    report["activations"] = activations
    return report


def memory_by_location(
    state: ShardState, *, replica: int, also: Sequence[ShardState] = ()
) -> dict[str, dict[str, int]]:
    """:func:`memory_report`'s model-state bytes split by where they live, each side
    with its ``total`` (the states ``also`` included, as :func:`memory_report`'s)."""
    split: dict[str, dict[str, int]] = {
        where: dict(kinds) for where, kinds in state.memory_by_location().items()
    }
    for other in also:
        for where, kinds in other.memory_by_location().items():
            into = split.setdefault(where, {})
            for kind, nbytes in kinds.items():
                into[kind] = into.get(kind, 0) + nbytes
    # replicas are copies of the master partition and optimizer state: they
    # live where those do
    where = state.placement.master_location
    for location, kinds in split.items():
        kinds["replica"] = replica if location == where else 0
        kinds["total"] = sum(kinds.values())
    return split


def comm_report(
    state: ShardState, *, by_group: bool = False, experts: ExpertShards | None = None
) -> dict[str, dict[str, Any]]:
    """Collective calls and logical bytes by op over every group of ``state``
    (``ShardState.comm_groups``) and of an expert-parallel engine's ``experts``
    (scopes ``experts``, their expert-data-parallel group, and ``ep``, the token
    exchange's, where it is not the world), summed; ``by_group``: by scope instead."""
    groups = dict(state.comm_groups())
    if experts is not None:
        groups["experts"] = experts.groups.edp
        if experts.groups.ep is not state.comm:
            groups["ep"] = experts.groups.ep
    reports = {scope: c.report() for scope, c in groups.items()}
    if by_group:
        return reports
    merged: dict[str, dict[str, Any]] = {}
    for report in reports.values():
        for op, stats in report.items():
            into = merged.setdefault(op, dict.fromkeys(stats, 0))
            for key, value in stats.items():
                into[key] += value
    return dict(sorted(merged.items()))


def op_totals(comms: Iterable[Collectives]) -> dict[str, tuple[int, int, int, float]]:
    """(calls, bytes, wire bytes, seconds) by op, summed over ``comms``."""
    totals: dict[str, tuple[int, int, int, float]] = {}
    for comm in comms:
        for op, s in list(comm.stats.items()):
            c, b, w, t = totals.get(op, (0, 0, 0, 0.0))
            totals[op] = (c + s.calls, b + s.bytes, w + s.wire_bytes, t + s.seconds)
    return totals


class MemoryReadings:
    """The memory report walks every bucket: read at most four times a second, and
    again whenever the buffers were rebuilt."""

    def __init__(self) -> None:
        self._cache: tuple[int, float, dict[str, int], dict[str, int]] | None = None

    def read(
        self, builds: int, take: Callable[[], tuple[dict[str, int], dict[str, int]]]
    ) -> tuple[dict[str, int], dict[str, int]]:
        """The (memory report, its host part) as of the buffers' ``builds``-th build,
        from ``take()`` when the last reading is older."""
        now = time.monotonic()
        cache = self._cache
        if cache is None or cache[0] != builds or now - cache[1] > 0.25:
            memory, host = take()
            cache = self._cache = (builds, now, memory, host)
        return dict(cache[2]), dict(cache[3])


def snapshot(
    state: ShardState,
    stats: StepStats,
    *,
    memory: dict[str, int],
    memory_host: dict[str, int],
    generation: int,
    device: torch.device,
    config: ZeroConfig,
    mesh: dict[str, str],
    experts: ExpertShards | None = None,
) -> Snapshot:
    """What a rank's metrics show now: ``state`` and ``stats``, its ``memory``
    report and the report's ``memory_host`` part, its ``generation`` and ``mesh``
    labels; an expert-parallel engine's ``experts``: their state (which the
    ``memory`` report counts), groups and load."""
    assert state.layout is not None
    states = [state] if experts is None else [state, experts.state]
    groups = [c for st in states for c in st.comm_groups().values()]
    if experts is not None and experts.groups.ep is not state.comm:
        groups.append(experts.groups.ep)
    return Snapshot(
        rank=state.rank,
        stage=state.stage.number,
        world_size=state.world_size,
        generation=generation,
        backend=state.comm.backend,
        device=device,
        dtype=config.dtype,
        compression=config.compression,
        trainable_numel=state.layout.numel + (0 if experts is None else experts.full_numel),
        master_numel=sum(b.master.numel() for st in states for b in st.buckets),
        frozen_bytes=state.frozen_bytes(),
        memory=memory,
        memory_host=memory_host,
        collectives=op_totals(groups),
        step_histogram=stats.histogram(),
        global_steps=state.global_steps,
        skipped_steps=state.skipped_steps,
        changes=dict(stats.changes),
        pause_seconds=dict(stats.pause_seconds),
        samples=stats.samples,
        tokens=stats.tokens,
        loss=stats.loss,
        mesh=dict(mesh),
        experts=() if experts is None else experts.loads(),
    )
