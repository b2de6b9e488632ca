"""How a proposal arranges a job's workers into the next generation: one arrangement per
job, chosen by the first worker that registers.

[Note: arrangements]
zeroplane runs three kinds of job, and only the arrangement of the next generation's
ranks tells them apart; the membership's states, leases and propose → build → commit
are the same for all (coordinator/control/membership.py [Note: atomic formation]):

* ``ElasticArrangement``, a data-parallel elastic job: the survivors keep their
  relative order and joiners are appended, grouped by host, up to
  ``MembershipConfig.max_workers`` (none while a recovery is under way);
* ``FixedArrangement``, a group its workers' script formed itself (an attached job,
  ``WorkerInfo.fixed_rank``): the first generation forms once every rank of the group
  has registered, each at the rank the script gave it;
* ``MeshArrangement``, an elastic job on a mesh of fixed tp and pp degrees: whole
  model-parallel groups, each survivor at its position, newcomers filling the gaps,
  a survivor without a whole group standing by (coordinator/core/meshplan.py [Note:
  arranging whole groups]);
* ``BlockArrangement``, an elastic expert- or context-parallel job: the same, its
  groups the ep (or cp) groups of consecutive ranks, each survivor at its place in
  its group (worker/elastic/blocks.py [Note: elastic expert parallelism]).

A mesh job whose degrees are left to the coordinator (``--mesh auto``) is arranged as a
data-parallel one; its mesh is chosen when the generation is planned.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Protocol

from coordinator.control.roster import Roster
from coordinator.core.meshplan import GroupArrangement, MeshCoords, arrange_groups
from coordinator.core.messages import Generation, WorkerInfo
from coordinator.core.settings import MembershipConfig

__all__ = [
    "Arrangement",
    "BlockArrangement",
    "ElasticArrangement",
    "FixedArrangement",
    "MembershipView",
    "MeshArrangement",
    "arrangement_for",
]


class MembershipView(Protocol):
    """What an arrangement reads of the membership (coordinator/control/membership.py)."""

    generation: Generation | None
    roster: Roster
    config: MembershipConfig
    # the workers the current generation admitted (none for a job's first: every
    # member of it holds its state from the start)
    admitted_last: frozenset[str]

    def recovering(self) -> bool:
        """A recovery is under way: newcomers wait for it."""
        ...

    def survivors(self) -> list[str]:
        """The current generation's members still here, in rank order."""
        ...


class Arrangement:
    """How the next generation's workers are chosen and ordered ([Note: arrangements])."""

    def sizes(self, ms: MembershipView) -> tuple[int, int]:
        """(the survivors, the waiting workers admitted) of the next generation."""
        survivors = 0 if ms.generation is None else ms.generation.world_size - len(ms.roster.gone)
        admitted = min(ms.roster.waiting_count, ms.config.max_workers - survivors)
        if survivors >= ms.config.min_workers and ms.recovering():
            admitted = 0
        return survivors, admitted

    def ready(self, ms: MembershipView) -> bool | None:
        """Whether a generation is due, where this arrangement alone decides it; None
        where the membership's rules do (MembershipConfig)."""
        return None

    def arrange(self, ms: MembershipView) -> GroupArrangement:
        """The next generation's workers in rank order, those of them admitted now, and
        the survivors left out."""
        raise NotImplementedError

    def placeable(self, ms: MembershipView, workers: Collection[str]) -> int:
        """How many of ``workers`` (members, standbys, workers not registered yet) a
        generation of them alone could hold: what a launcher counts against its
        minimum (coordinator/commands/keeping.py ``keep_minimum``)."""
        return len(workers)


class ElasticArrangement(Arrangement):
    """Survivors in order, then joiners grouped by host ([Note: arrangements])."""

    def arrange(self, ms: MembershipView) -> GroupArrangement:
        _, count = self.sizes(ms)
        admitted = list(ms.roster.waiting())[:count]
        # Joiners grouped by host, so that ranks on one machine are neighbours.
        admitted.sort(key=lambda wid: (ms.roster.live[wid].info.host, wid))
        return GroupArrangement(
            order=(*ms.survivors(), *admitted), admitted=tuple(admitted), standby=()
        )


class FixedArrangement(Arrangement):
    """The ranks the workers' script gave them ([Note: arrangements])."""

    def ready(self, ms: MembershipView) -> bool | None:
        return self._group(ms) is not None if ms.generation is None else None

    def arrange(self, ms: MembershipView) -> GroupArrangement:
        group = self._group(ms) or []
        admitted = sorted(group, key=lambda wid: ms.roster.live[wid].info.fixed_rank or 0)
        return GroupArrangement(
            order=(*ms.survivors(), *admitted), admitted=tuple(admitted), standby=()
        )

    @staticmethod
    def _group(ms: MembershipView) -> list[str] | None:
        """The waiting workers of the group, once all of its ranks have registered
        (None: it is not complete)."""
        waiting = [ms.roster.live[wid].info for wid in ms.roster.waiting()]
        if not waiting:
            return None
        size = waiting[0].fixed_world_size
        ranks = {info.fixed_rank for info in waiting}
        complete = len(waiting) == size and ranks == set(range(size or 0))
        return [info.worker_id for info in waiting] if complete else None


class MeshArrangement(Arrangement):
    """Whole model-parallel groups of ``tp * pp`` ranks ([Note: arrangements])."""

    # at each position, staying members and those holding state first: a mesh's
    # leaver goes alone (its peers stand by). Not for blocks: an ep or cp group
    # leaves whole, with partners nobody flagged, so blocks keep their completeness
    # order (worker/elastic/blocks.py)
    keeps_holders = True

    def __init__(self, tp: int, pp: int) -> None:
        self.tp, self.pp = tp, pp

    def sizes(self, ms: MembershipView) -> tuple[int, int]:
        arranged = self.arrange(ms)
        return arranged.world_size - len(arranged.admitted), len(arranged.admitted)

    def arrange(self, ms: MembershipView) -> GroupArrangement:
        previous = ms.generation
        survivors: dict[str, MeshCoords] = {}
        if previous is not None:
            survivors = {
                m.worker_id: coords
                for m in previous.members
                if m.worker_id not in ms.roster.gone
                and (coords := self.coords(previous, m.rank)) is not None
            }
        # a standby keeps the position its engine was built for: queued with the
        # survivors there, admitted when a group takes it
        bound = ms.roster.standby()
        joiners = [wid for wid in ms.roster.waiting() if wid not in bound]
        joiners.sort(key=lambda wid: (ms.roster.live[wid].info.host, wid))  # a group on one host
        holders, leaving = None, set()
        if self.keeps_holders:
            # the newcomers of the current generation may hold nothing yet (that
            # generation may have been replaced before it formed); members before it do
            holders = set(survivors) - ms.admitted_last
            leaving = {w for w in survivors if (e := ms.roster.live.get(w)) and e.leaving}
        arranged = arrange_groups(
            tp=self.tp,
            pp=self.pp,
            survivors={**survivors, **bound},
            joiners=joiners,
            max_world=ms.config.max_workers,
            holders=holders,
            leaving=leaving,
        )
        placed = set(arranged.order)
        return GroupArrangement(
            order=arranged.order,
            admitted=arranged.admitted + tuple(w for w in bound if w in placed),
            standby=tuple(w for w in arranged.standby if w not in bound),
        )

    def coords(self, generation: Generation, rank: int) -> MeshCoords | None:
        """Where ``rank`` of ``generation`` sits (None: nowhere, a job without a mesh)."""
        return None if generation.mesh is None else generation.mesh.coords(rank)

    def placeable(self, ms: MembershipView, workers: Collection[str]) -> int:
        """Only whole groups count: a member or standby keeps its position, and two
        survivors at one position fill one group, not two; a worker with none (not
        registered yet, or new) fills any gap."""
        gen, held = ms.generation, ms.roster.standby()
        ranks = {} if gen is None else {m.worker_id: m.rank for m in gen.members}
        positions: dict[str, MeshCoords] = {}
        joiners: list[str] = []
        for wid in workers:
            at = held.get(wid)
            if at is None and gen is not None and wid in ranks:
                at = self.coords(gen, ranks[wid])
            if at is None:
                joiners.append(wid)
            else:
                positions[wid] = at
        whole = arrange_groups(
            tp=self.tp, pp=self.pp, survivors=positions, joiners=joiners, max_world=len(workers)
        )
        return whole.world_size


class BlockArrangement(MeshArrangement):
    """Whole blocks of ``size`` consecutive ranks (ep or cp groups), each survivor at
    its place ([Note: arrangements]): a mesh arrangement whose group is a block, the
    place standing for the tp index."""

    keeps_holders = False

    def __init__(self, size: int) -> None:
        super().__init__(tp=size, pp=1)

    def coords(self, generation: Generation, rank: int) -> MeshCoords | None:
        return MeshCoords(pp=0, dp=rank // self.tp, tp=rank % self.tp)

    def sizes(self, ms: MembershipView) -> tuple[int, int]:
        """As a mesh's, but newcomers (a standby among them) wait for a recovery under
        way, as in a data-parallel job: a block job's members restore in the
        generation that replaced a lost rank, and a newcomer joins the one after it
        (worker/elastic/blocks.py [Note: a lost block])."""
        survivors, admitted = super().sizes(ms)
        if admitted and survivors >= ms.config.min_workers and ms.recovering():
            return survivors, 0
        return survivors, admitted


def arrangement_for(info: WorkerInfo) -> Arrangement:
    """The arrangement of a job whose first worker registered with ``info``."""
    if info.fixed_rank is not None:
        return FixedArrangement()
    ep = 1 if info.experts is None else info.experts[0]
    cp = info.context_parallel or 1
    if ep * cp > 1:  # (both: blocks of the least multiple of the two)
        return BlockArrangement(math.lcm(ep, cp))
    if info.mesh is not None and 0 not in info.mesh:
        return MeshArrangement(*info.mesh)
    return ElasticArrangement()
