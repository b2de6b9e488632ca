"""The membership changes of a job of blocks (expert- or context-parallel groups of
consecutive ranks), by whole blocks: the groups formed again, and the experts' side of
a scale-up, a leave and a newcomer's join (worker/elastic/change.py and joining.py
call these beside the exchange of the engine's own state).

[Note: elastic blocks]
Expert and context parallelism group ranks in blocks of consecutive ranks within
data parallelism (worker/moe/dispatch.py ``ExpertGroups``, worker/context/parallel.py
``ContextParallel``). Their jobs change membership by whole blocks: the coordinator
arranges them as a mesh whose group is a block (coordinator/control/arrangement.py
``BlockArrangement``), and a rank asked to leave takes its block with it. After the
new group forms, every rank forms the blocks' groups again (every rank creates every
group, in the same order: members right after the new group forms, a newcomer as it
builds its engine). A context-parallel rank holds nothing of its own beyond the
engine's state (every rank holds the whole model), so that is all it needs; an
expert-parallel one holds its place's experts, which follow below.

[Note: elastic expert parallelism]
Under expert parallelism (worker/moe/dispatch.py [Note: expert parallelism]) an
ep group is ``ep`` consecutive ranks, and the rank at place ``j`` of every group
holds the same experts, sharded over those ranks (the expert-data-parallel ring
of place ``j``; worker/moe/shards.py [Note: two shard states]). A membership
change keeps ``ep`` and moves the world by whole ep groups, each survivor at its
place (``BlockArrangement``), so a survivor's experts stay its own and only their
sharding changes:

* the engine's own state (every parameter but the experts) re-shards over the
  world with the data-parallel exchange (worker/live/exchange.py), as in a
  data-parallel job;
* the experts re-shard ring by ring: one exchange per place over the same group,
  whose new members are the new ranks at that place; a rank sends only in its
  own place's (its ring's layout is the one it computes), and every rank takes
  part in every place's, since it is one collective of the whole group;
* the ep and expert-data-parallel groups are formed again over the new world
  (every rank creates every group, in the same order: members right after the
  new group forms, a newcomer as it builds its engine), and each experts module
  exchanges its tokens over its new ep group.

A rank asked to leave takes its whole ep group with it: its peers' experts are
one group's share of every layer, which nobody else holds. The group's ranks
hand their shards over to the survivors over the old group, as a leaver does in
a data-parallel job, and exit 0.

[Note: a lost block]
A rank lost (a crash) breaks its block: the coordinator forms the next
generation from whole blocks (``BlockArrangement``, as a mesh's whole groups), so
unless a replacement completes the block at once (a job at its minimum waits for
one), the lost rank's block peers stand by, alive, holding shards nobody can ask
them for. The survivors restore without the whole block from the in-memory
replicas (worker/live/replicas.py [Note: in-memory replicas]), which is why a
rank of a job of blocks keeps the replica of the rank one block to its left
(``stride`` = the block's size) rather than of its left neighbour, who is in its
own block and lost with it: every rank of the lost block has its copy in another
block, and, the holder being at the same place, an expert-parallel rank's copy
holds the same experts' shards, kept in the same replica beside the engine's own
(``ReplicaKeeper.refresh(also=...)``). The restore re-shards the engine's state
over the world and the experts' ring by ring (:func:`exchange`), as a membership
change does, rolled back to the replicas' step (a block job keeps no gradient
log: [Note: rolling a lost rank forward] brings one rank forward, not a block).

A rank that stands by aborts its broken group at once (a peer may still wait on
it there), waits for a generation that places it, and joins as a newcomer does,
holding nothing: where that generation only grows the job, the members hand it
its shards; where it replaces lost ranks too, it restores with them
(worker/elastic/recovery.py ``_rejoin``). So that the members of a recovery restore
in its generation before a newcomer joins, the coordinator admits newcomers (a
standby among them) to a block job only once every member has applied it, as in a
data-parallel job (``BlockArrangement.sizes``). Two blocks lost together, one a
block to the left of the other, leave a gap: the job falls back to its last
checkpoint, which loads at any ep, cp and world size. A loss in the step right
after a membership change, before the new membership's replicas are confirmed at
its first step boundary, rolls back to the replicas from before the change where
they cover every rank it had (worker/live/restore_plan.py ``_replica_candidates``:
after a scale-up they do; after a leave, unless the rank lost held a leaver's
copy), else to the checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from worker import live
from worker.collectives import Collectives
from worker.engine import ZeroEngine
from worker.entries import Entries
from worker.moe.dispatch import ExpertGroups
from worker.moe.shards import ExpertShards
from worker.state import Counters

__all__ = ["adopt", "exchange", "leaving_group", "regroup", "size"]


def size(engine: ZeroEngine) -> int:
    """Ranks per block: the ep or cp degree, or the least multiple of both (1: a
    data-parallel job)."""
    ep = 1 if engine.experts is None else engine.experts.groups.size
    cp = 1 if engine.context is None else engine.context.size
    return math.lcm(ep, cp)


def leaving_group(engine: ZeroEngine, leaving: int) -> list[int]:
    """The ranks that leave with rank ``leaving``: its block ([Note: elastic blocks])."""
    n = size(engine)
    first = leaving - leaving % n
    return list(range(first, first + n))


def regroup(engine: ZeroEngine) -> None:
    """Form the blocks' groups over the new default group (a collective of every rank
    of it): the experts modules and the context move onto theirs."""
    if engine.experts is not None:
        ep = engine.experts.groups.size
        engine.experts.regroup(ExpertGroups.form(Collectives(None), ep))
    if engine.context is not None:
        engine.context.regroup(Collectives(None))


def exchange(
    experts: ExpertShards,
    *,
    holds_state: bool,
    new_members: Sequence[int],
    entries: Entries | None = None,
    counters: Counters | None = None,
) -> live.Handover:
    """Send this rank's experts' shards to their new owners and receive its own,
    one ring (place) after another over the default group ([Note: elastic expert
    parallelism]). ``new_members``: the ranks of the default group that form the
    new world, in new-rank order (the new rank ``i`` is at place ``i % ep``; a
    member keeps its place); ``entries``/``counters``: send these (what it was
    handed) instead of its live state."""
    ep, place = experts.groups.size, experts.groups.place
    mine: live.Handover | None = None
    for p in range(ep):
        ring = [rank for i, rank in enumerate(new_members) if i % ep == p]
        handover = live.exchange(
            experts.state,
            holds_state=holds_state and p == place,
            via=None,
            new_members=ring,
            entries=entries if p == place else {},
            counters=counters,
        )
        if p == place:
            mine = handover
    assert mine is not None
    return mine


def adopt(experts: ExpertShards, handover: live.Handover | None) -> None:
    """Fill the experts' state from ``handover`` (None: nothing arrived, a rank
    that leaves), rebuilt over its new expert-data-parallel group."""
    if handover is not None:
        live.adopt(experts.state, handover, experts.groups.edp)
        experts.ballot.clear()
