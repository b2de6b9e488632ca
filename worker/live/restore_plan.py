"""The pure restore plan: what each rank of a new group holds after a loss
(:class:`Holding`), and the one source every rank restores from
(:func:`plan_restore`, [Note: recovery sources]). No torch.distributed here, and
nothing of the session: worker/elastic/recovery.py shares the holdings and acts on
the plan."""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "Holding",
    "ReplicaId",
    "RestorePlan",
    "RestoreSource",
    "StateId",
    "current_rings",
    "plan_restore",
    "plan_rings",
    "ring_lost",
]

# (generation id, rank, world size): whose state a rank holds
StateId = tuple[int, int, int]
# (generation id, step, rank, world size): whose state a replica is, and of when
ReplicaId = tuple[int, int, int, int]

# room for the checkpoint directory in a Holding row (one int64 per byte)
_PATH_BYTES = 1024


@dataclass(frozen=True)
class Holding:
    """What one rank of the new group can restore from after a loss.

    [Note: recovery sources]
    After a peer is lost, every rank of the new group must restore the same
    consistent state, from the best source the group holds between them:
    1. live state: the engine's own shards, when they are intact at a step
       boundary (no optimizer update was under way) and every rank of the
       generation they belong to survived. This is the case when the rank
       lost was a newcomer that died while joining: the members still hold
       the whole job as of the last step, and nothing is rolled back.
    2. in-memory replicas of the generation the loss happened in, when they
       cover every one of its ranks (see :class:`Replica`);
    3. the last checkpoint;
    4. nothing, when no rank of the group holds any state: every holder of the
       job's state was lost (all members killed, or the last survivors gave up
       after a loss nothing covered, below). The group starts again from the
       module as the script built it, as a restart under torchrun would: a
       script that loads its checkpoint at start resumes there.
    A group in which some ranks hold state but nothing covers the rest cannot
    go on: those ranks raise, and the launcher's restarts bring fresh processes
    that take path 4.
    Ranks share their holdings (one small all-reduce) and each runs
    :func:`plan_restore` on the same table, so all take the same path.
    """

    live: StateId | None
    # the confirmed replica and, while a refresh is unconfirmed, the new one
    replicas: tuple[ReplicaId, ...]
    holds_state: bool
    checkpoint: str | None
    # the global step of the live state; the left neighbour's gradient log
    # (generation, after, last): steps after+1..last ([Note: rolling a lost rank forward])
    live_step: int = -1
    log: tuple[int, int, int] | None = None

    _REPLICAS = 2
    _LOG = 3 + 4 * _REPLICAS  # live_step, log
    _HEAD = _LOG + 4 + 2  # holds_state, path length
    WIDTH = _HEAD + _PATH_BYTES

    def encode(self) -> torch.Tensor:
        if len(self.replicas) > self._REPLICAS:
            raise ValueError(f"at most {self._REPLICAS} replicas, got {len(self.replicas)}")
        row = torch.full((self.WIDTH,), -1, dtype=torch.int64)
        if self.live is not None:
            row[0:3] = torch.tensor(self.live)
        for i, ident in enumerate(self.replicas):
            row[3 + 4 * i : 7 + 4 * i] = torch.tensor(ident)
        row[self._LOG] = self.live_step
        if self.log is not None:
            row[self._LOG + 1 : self._LOG + 4] = torch.tensor(self.log)
        head = self._HEAD
        row[head - 2] = int(self.holds_state)
        raw = (self.checkpoint or "").encode()
        if len(raw) > _PATH_BYTES:
            raise ValueError(f"checkpoint path longer than {_PATH_BYTES} bytes: {self.checkpoint}")
        row[head - 1] = len(raw)
        row[head : head + len(raw)] = torch.tensor(list(raw), dtype=torch.int64)
        return row

    @classmethod
    def decode(cls, row: torch.Tensor) -> Holding:
        v = row.tolist()
        head = cls._HEAD
        length = v[head - 1]
        path = bytes(v[head : head + length]).decode() if length > 0 else None
        slots = (tuple(v[3 + 4 * i : 7 + 4 * i]) for i in range(cls._REPLICAS))
        log = tuple(v[cls._LOG + 1 : cls._LOG + 4])
        return cls(
            live=tuple(v[0:3]) if v[0] >= 0 else None,  # type: ignore[arg-type]
            replicas=tuple(r for r in slots if r[0] >= 0),  # type: ignore[misc]
            holds_state=bool(v[head - 2]),
            checkpoint=path,
            live_step=v[cls._LOG],
            log=log if log[0] >= 0 else None,  # type: ignore[arg-type]
        )


class RestoreSource(enum.StrEnum):
    """Where a recovery's state comes from ([Note: recovery sources]); the values
    are the names the recovery's log lines give."""

    LIVE = "live"
    FORWARD = "forward"
    REPLICA = "replica"
    CHECKPOINT = "checkpoint"
    MODULE = "module"


@dataclass(frozen=True)
class RestorePlan:
    """``source`` (a :class:`RestoreSource`, named by these values): "live"
    (ranks whose live state is of ``generation`` send it), "forward" (the same,
    and the state of each rank in ``lost`` is its replica brought forward to
    ``step`` by its right neighbour's gradient log), "replica" (the replicas of
    ``generation`` at ``step``; ``lost``: its ranks no member is, whose state
    comes from their right neighbour's copy), "checkpoint" (load ``checkpoint``)
    or "module" (nobody holds anything: start from the module)."""

    source: RestoreSource
    generation: int | None = None
    step: int | None = None
    checkpoint: str | None = None
    lost: frozenset[int] = frozenset()


def plan_restore(holdings: Sequence[Holding], *, stride: int = 1) -> RestorePlan:
    """Pick the recovery source every rank of a data-parallel job will use: its
    state is one ring (:func:`plan_rings`). ``stride``: how far each rank's replica
    holder is (a job of blocks keeps it a block away)."""
    return plan_rings([holdings], stride=stride)


def _complete_live(holdings: Sequence[Holding]) -> int | None:
    """The newest generation whose every rank's live state some holding is."""
    by_generation: dict[int, set[int]] = {}
    worlds: dict[int, int] = {}
    for h in holdings:
        if h.live is not None:
            gen, rank, world = h.live
            by_generation.setdefault(gen, set()).add(rank)
            worlds[gen] = world
    for gen in sorted(by_generation, reverse=True):
        if by_generation[gen] == set(range(worlds[gen])):
            return gen
    return None


def _replica_candidates(
    holdings: Sequence[Holding], stride: int = 1
) -> Iterator[tuple[int, int, frozenset[int]]]:
    """The (generation, step) replica sets that cover every rank of their
    generation, newest first, each with its ranks no member is (``lost``)."""
    # newest first; a member with replicas of that generation but not of that step
    # would restore ahead of (or behind) the others: replicas are all or nothing. A
    # member with none of that generation joined after it (the loss came before its
    # first replica was confirmed: [Note: a refresh overlaps a step]) and takes its
    # state from the others, as a rank holding nothing does
    for gen, step in sorted({r[:2] for h in holdings for r in h.replicas}, reverse=True):
        usable = all(
            any(r[:2] == (gen, step) for r in h.replicas)
            for h in holdings
            if h.holds_state and any(r[0] == gen for r in h.replicas)
        )
        ranks = [r[2:] for h in holdings for r in h.replicas if r[:2] == (gen, step)]
        world = ranks[0][1]
        present = {rank for rank, _ in ranks}
        lost = frozenset(set(range(world)) - present)
        # each rank keeps its own state and its left neighbour's (``stride`` ranks left)
        covered = present | {(r - stride) % world for r in present}
        if usable and covered == set(range(world)):
            yield gen, step, lost


def plan_rings(rings: Sequence[Sequence[Holding]], *, stride: int = 1) -> RestorePlan:
    """Pick the recovery source every rank will use ([Note: recovery sources]), for
    a job whose state is one ring of dp ranks per (pp, tp) position (a data-parallel
    job is one ring): ``rings`` holds, for each, the holdings of the new group's
    ranks that keep that position. Every ring must restore the same step, so one
    source serves them all: the live state where every ring has all of its ranks
    whole at one step; else, for one ring, its survivors' live state with each lost
    rank brought forward by its right neighbour's gradient log; else the newest
    replica step that covers every ring (each ring's own lost ranks are its
    business: :func:`ring_lost`); else a checkpoint, else (nobody holds anything)
    the module.

    Everything is read from the holdings themselves, not from the generation's
    reshard schedule: the group that restores may not be the one the coordinator
    formed right after the loss (a rendezvous superseded by a newer generation
    skips it), and the state ids say what each rank really holds.
    Raises when nothing the group holds covers the whole job.
    """
    lives = {_complete_live(ring) for ring in rings}
    if len(lives) == 1 and None not in lives:
        gen = lives.pop()
        # a rank that stood by may hold an older generation's state: it sends nothing
        steps = {h.live_step for ring in rings for h in ring if h.live and h.live[0] == gen}
        if len(steps) == 1:
            return RestorePlan(RestoreSource.LIVE, generation=gen)
    if len(rings) == 1:  # a mesh keeps no gradient log (its rings roll back instead)
        forward = _roll_forward_plan(rings[0])
        if forward is not None:
            return forward
    if all(any(h.holds_state for h in ring) for ring in rings):
        common: set[tuple[int, int]] | None = None
        for ring in rings:
            found = {(gen, step) for gen, step, _ in _replica_candidates(ring, stride)}
            common = found if common is None else common & found
        if common:
            gen, step = max(common)
            lost = ring_lost(rings[0], gen, step, stride) if len(rings) == 1 else frozenset()
            return RestorePlan(RestoreSource.REPLICA, generation=gen, step=step, lost=lost)
    everyone = [h for ring in rings for h in ring]
    return _last_resort(everyone)


def current_rings(rings: Sequence[Sequence[Holding]]) -> list[list[Holding]]:
    """``rings`` with a holding of an older generation than the newest any rank
    holds (a rank that stood by while the others went on) taken for holding
    nothing: its state is not the job's any more."""

    def newest(h: Holding) -> int:
        gens = [h.live[0]] if h.live is not None else []
        return max([*gens, *(r[0] for r in h.replicas)], default=-1)

    latest = max((newest(h) for ring in rings for h in ring if h.holds_state), default=-1)
    return [
        [
            h
            if not h.holds_state or newest(h) == latest
            else Holding(live=None, replicas=(), holds_state=False, checkpoint=h.checkpoint)
            for h in ring
        ]
        for ring in rings
    ]


def ring_lost(
    ring: Sequence[Holding], generation: int, step: int, stride: int = 1
) -> frozenset[int]:
    """The ranks of one ring that no member holds the replica of (generation, step) of."""
    for gen, at, lost in _replica_candidates(ring, stride):
        if (gen, at) == (generation, step):
            return lost
    raise ValueError(f"no replica of generation {generation} at step {step} covers this ring")


def _last_resort(holdings: Sequence[Holding]) -> RestorePlan:
    """A checkpoint, or the module where nobody holds anything; else nothing covers the job."""
    for h in holdings:
        if h.checkpoint is not None:
            return RestorePlan(RestoreSource.CHECKPOINT, checkpoint=h.checkpoint)
    if not any(h.holds_state for h in holdings):
        return RestorePlan(RestoreSource.MODULE)
    raise RuntimeError(
        "a worker was lost and neither in-memory replicas nor a checkpoint cover "
        "its state; set ZeroConfig.replica_interval or save checkpoints (under an "
        "elastic launcher the job restarts from its script's checkpoint or the start)"
    )


def _roll_forward_plan(holdings: Sequence[Holding]) -> RestorePlan | None:
    """Keep the survivors' live state when every holder is whole at one step of one
    generation and each lost rank's right neighbour can bring that rank's replica
    up to it ([Note: rolling a lost rank forward]). A log one step longer is the
    loss at a step's go: the gradients were delivered, no rank stepped."""
    holders = [h for h in holdings if h.holds_state]
    lives = {(h.live[0], h.live[2], h.live_step) if h.live else None for h in holders}
    if len(lives) != 1 or None in lives:
        return None
    ((gen, world, step),) = lives  # type: ignore[misc]
    by_rank = {h.live[1]: h for h in holders if h.live is not None}
    lost = set(range(world)) - set(by_rank)

    def brings_forward(lost_rank: int) -> bool:
        right = by_rank.get((lost_rank + 1) % world)
        if right is None or right.log is None:
            return False
        log_gen, after, last = right.log
        return (
            log_gen == gen
            and last >= step
            and any(r[0] == gen and r[3] == world and after <= r[1] <= step for r in right.replicas)
        )

    if not lost or not all(brings_forward(r) for r in lost):
        return None
    return RestorePlan(RestoreSource.FORWARD, generation=gen, step=step, lost=frozenset(lost))
