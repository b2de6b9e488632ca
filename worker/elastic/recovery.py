"""Recovery: a peer was lost mid-step (a collective failed). The session forms the
coordinator's next generation without it, the ranks share what each holds, and
every rank restores one consistent state from the source the plan picks
(worker/elastic/restore_plan.py [Note: recovery sources]): one function per
:class:`RestoreSource`. Then :class:`StepAborted` tells the training loop to carry on
from ``engine.global_steps``."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from coordinator.core.messages import Generation
from worker import live
from worker.collectives import CollectiveError, Collectives, StepAborted
from worker.compat import abort_default_group
from worker.elastic import blocks
from worker.elastic.change import (
    NO_GENERATION,
    after_loss,
    exit_job,
    join_ahead,
    leave_holding_state,
    take_shards,
)
from worker.elastic.phases import Phase, RecoveryTiming, Session, admitted
from worker.engine import ZeroEngine
from worker.entries import Entries
from worker.live.restore_plan import current_rings
from worker.rendezvous import JobFinished
from worker.reporting import report
from worker.state import Counters

__all__ = ["Restoring", "recover", "recover_in_formed", "restore", "restore_from"]

logger = logging.getLogger(__name__)


def recover(session: Session, engine: ZeroEngine, exc: CollectiveError) -> NoReturn:
    """A peer is gone: form the coordinator's next generation and restore."""
    control = admitted(session)
    session._to(Phase.RECOVERING)
    join_ahead(session, drop=True)
    session.keeper.drop_refresh(wait=False)  # its group is broken
    if engine.state.whole:
        # the gradients from the left of the last step, or of the step whose go
        # failed, if they arrived before the loss
        session.keeper.log.commit(engine.global_steps)
    logger.warning("step abandoned (%s); waiting for the coordinator's next generation", exc)
    if blocks.size(engine) > 1:
        # this rank may stand by (its block broken) for as long as the others train
        # on: whoever still waits on it in the broken group must not wait that long
        abort_default_group(control.timeout)
    start = time.perf_counter()
    # (a rank that stands by waits while the others train on, and may see them finish)
    finished = lambda: control.client.job_finished  # noqa: E731
    gen = control.wait_to_re_form(stop=lambda: session.leave_requested, give_up=finished)
    if gen is None and finished():
        exit_job(session, "the job ended while this rank waited to re-form")
    if gen is None:
        leave_holding_state(session, engine, NO_GENERATION, broken=True)
    heard = time.perf_counter()
    try:
        # ready at once: a rank that stood by joins a scale-up of the others, who
        # wait for its ranks to be ready ([Note: meeting ahead] in worker/rendezvous.py)
        control.move_to(gen, broken=True, ready=lambda: True)
    except JobFinished:  # (the others ended training while this rank stood by)
        exit_job(session, "the job ended while this rank waited to re-form")
    timing = RecoveryTiming(heard - start, time.perf_counter() - heard)
    if _stood_by(engine, control.generation, control.rank):
        _rejoin(session, engine, control.generation)
    else:
        restore(session, engine, control.generation, holds_state=True, timing=timing)
    engine.stats.record_pause("crash", time.perf_counter() - start)
    session._to(Phase.MEMBER)
    engine.publish_snapshot()
    raise StepAborted(
        f"step abandoned after a lost peer; resume at step {engine.global_steps}"
    ) from exc


def _stood_by(engine: ZeroEngine, gen: Generation, rank: int) -> bool:
    """Whether this rank of a job of blocks was left out of the generations since the
    one it held state in: it waited while its block was broken (worker/elastic/blocks.py
    [Note: a lost block]), and what it holds is not the job's any more."""
    return (
        blocks.size(engine) > 1
        and gen.reshard is not None
        and gen.members[rank].previous_rank is None
    )


def _rejoin(session: Session, engine: ZeroEngine, gen: Generation) -> None:
    """A rank that stood by joins ``gen`` as a newcomer does: holding nothing, its
    block's groups formed again, it restores with the others where ``gen`` replaces
    lost ranks, else takes its shards from the members (who grow to ``gen``)."""
    keeper = session.keeper
    keeper.retire(keeper.replicas)  # of the job as it was before it stood by
    keeper.replicas = []
    blocks.regroup(engine)
    if after_loss(gen):
        restore(session, engine, gen, holds_state=False)
        return
    take_shards(session, engine, gen, comm=Collectives(None))
    session.held.generation = gen.id
    report(admitted(session), engine)
    logger.warning("rejoined as rank %d of %d after standing by", engine.rank, engine.world_size)


def recover_in_formed(session: Session, engine: ZeroEngine, intended: Generation) -> NoReturn:
    """The rendezvous of ``intended`` was superseded by a generation that lost
    ranks: restore in the one formed, as every rank of it does
    ([Note: superseded rendezvous])."""
    control = admitted(session)
    session._to(Phase.RECOVERING)
    formed = control.generation
    logger.warning(
        "generation %d was superseded by %d, which lost members: restoring",
        intended.id,
        formed.id,
    )
    restore(session, engine, formed, holds_state=True)
    session._to(Phase.MEMBER)
    engine.publish_snapshot()
    raise StepAborted(
        f"a membership change overlapped a loss; resume at step {engine.global_steps}"
    )


def _live(session: Session, engine: ZeroEngine) -> live.StateId | None:
    """Whose state this rank's shards are, while whole ([Note: recovery sources])."""
    held = session.held
    if held.handed is not None:
        return held.handed.ident
    if held.generation is None or not engine.state.whole:
        return None
    return (held.generation, engine.rank, engine.world_size)


def restore(
    session: Session,
    engine: ZeroEngine,
    gen: Generation,
    *,
    holds_state: bool,
    timing: RecoveryTiming | None = None,
) -> None:
    """Bring every rank of ``gen`` to one consistent state after a loss, from the
    best source the group holds (worker/elastic/restore_plan.py [Note: recovery
    sources]). A collective of the new group; a worker that joins in the same
    generation (a restarted pod under its old name) takes part holding nothing
    (``holds_state=False``)."""
    control = admitted(session)
    keeper = session.keeper
    started = time.perf_counter()
    reached = engine.global_steps
    if holds_state:  # (a newcomer formed its blocks' groups as it built its engine)
        blocks.regroup(engine)
    replicas, keeper.replicas = (keeper.replicas if holds_state else []), []
    log, keeper.log = keeper.log, live.GradientLog()
    live_id = _live(session, engine) if holds_state else None
    mine = live.Holding(
        live=live_id,
        replicas=tuple(r.ident for r in replicas),
        holds_state=holds_state,
        checkpoint=None if engine.last_checkpoint is None else str(engine.last_checkpoint),
        live_step=engine.global_steps if live_id is not None else -1,
        log=log.coverage() if holds_state else None,
    )
    table = torch.zeros(gen.world_size, mine.WIDTH, dtype=torch.int64, device=engine.device)
    table[control.rank] = mine.encode()
    comm = Collectives(None)
    comm.all_reduce(table, op="sum", control=True)
    holdings = [live.Holding.decode(row) for row in table.cpu()]
    stride = blocks.size(engine)
    if stride > 1:  # a rank that stood by holds an older generation's state: not the job's
        (holdings,) = current_rings([holdings])
    plan = live.plan_restore(holdings, stride=stride)
    logger.info(
        "recovery plan %s (generation %s, step %s, lost %s) from %s",
        plan.source, plan.generation, plan.step, sorted(plan.lost),
        "; ".join(f"live {h.live} at {h.live_step}, log {h.log}, replicas {h.replicas}"
                  for h in holdings),
    )  # fmt: skip
    restoring = Restoring(
        session=session,
        engine=engine,
        plan=plan,
        live=live_id,
        replicas=replicas,
        log=log,
        members=list(range(gen.world_size)),
        comm=comm,
        holds_state=holds_state,
        lost=plan.lost,
    )
    source = restore_from(restoring)
    engine.mark_restored()
    session.held.generation = gen.id
    keeper.retire(replicas)  # adopted: nothing reads them now
    # a second loss before the next interval must find this generation's replicas
    session._refresh_replica(engine)
    report(control, engine)  # the coordinator admits newcomers once all applied it
    took = "" if timing is None else f"; {timing.describe(time.perf_counter() - started)}"
    logger.warning(
        "recovered as rank %d of %d at step %d (from %s; this rank had reached step %d%s)",
        engine.rank,
        engine.world_size,
        engine.global_steps,
        source,
        reached,
        took,
    )


# ------------------------------------------------------------ one function per source


@dataclasses.dataclass(frozen=True, kw_only=True)
class Restoring:
    """What a restore source's function works from, in every layout: the plan every
    rank agreed on, what this rank holds (``live``, ``replicas``, ``log``), the new
    group's ``members`` and collectives (``comm``; ``via``: the group the exchange
    runs over, None for the world) and ``lost``, the ranks of this rank's ring that
    nobody is now (their state comes from their right neighbour's replica).

    A data-parallel rank's live state is its engine's own. A mesh rank's left the
    engine when its ring re-formed (worker/elastic/rings.py): ``carried`` holds it
    (the entries and counters of ``live``)."""

    session: Session
    engine: ZeroEngine
    plan: live.RestorePlan
    live: live.StateId | None
    replicas: list[live.Replica]
    log: live.GradientLog
    members: list[int]
    comm: Collectives
    holds_state: bool
    lost: frozenset[int] = frozenset()
    carried: tuple[Entries, Counters] | None = None
    via: dist.ProcessGroup | None = None


def restore_from(ctx: Restoring) -> str:
    """Restore from the plan's source (one function per :class:`RestoreSource`);
    what the log says it was."""
    return _RESTORE_FROM[ctx.plan.source](ctx)


def _from_live(ctx: Restoring) -> str:
    engine, plan, live_id, held = ctx.engine, ctx.plan, ctx.live, ctx.session.held
    sends = live_id is not None and live_id[0] == plan.generation
    handed, held.handed = held.handed, None
    entries: Entries | None = None if sends else {}
    counters = None if handed is None else handed.handover.counters
    if sends and handed is not None:  # a hand-over this rank had not adopted yet
        entries = handed.handover.entries
    if ctx.carried is not None:  # a ring re-formed: the state left the engine
        entries, counters = ctx.carried if sends else ({}, None)
    handover = live.exchange(
        engine.state,
        holds_state=sends,
        via=ctx.via,
        new_members=ctx.members,
        entries=entries,
        counters=counters,
    )
    ctx.session._adopt(engine, handover, ctx.comm)
    experts = None if not sends or handed is None else handed.experts
    _experts_from(
        ctx,
        holds_state=sends,
        entries=None if experts is None else experts.entries,
        counters=None if experts is None else experts.counters,
    )
    return "live state, nothing rolled back"


def _from_forward(ctx: Restoring) -> str:
    engine, plan, live_id, log = ctx.engine, ctx.plan, ctx.live, ctx.log
    # survivors keep their state; each lost rank's comes from its right neighbour
    entries = engine.state.export_ranges(copy=False) if live_id is not None else {}
    left = (engine.rank - 1) % engine.world_size
    replayed = 0
    if live_id is not None and left in plan.lost:
        replica = max(
            (
                r
                for r in ctx.replicas
                if r.generation == plan.generation
                and log.after <= r.counters.global_steps <= (plan.step or 0)
            ),
            key=lambda r: r.counters.global_steps,
        )
        steps = log.between(replica.counters.global_steps, plan.step or 0)
        entries.update(live.roll_forward(engine.state, left, replica.neighbour, steps))
        replayed = len(steps)
    handover = live.exchange(
        engine.state,
        holds_state=live_id is not None,
        via=ctx.via,
        new_members=ctx.members,
        entries=entries,
    )
    ctx.session._adopt(engine, handover, ctx.comm)
    return (
        f"live state; lost rank(s) {sorted(plan.lost)} brought forward from their "
        f"replicas and logged gradients ({replayed} step(s) here), nothing rolled back"
    )


def _from_replica(ctx: Restoring) -> str:
    engine, plan = ctx.engine, ctx.plan
    entries: Entries = {}
    wanted = (plan.generation, plan.step)
    replica = next((r for r in ctx.replicas if r.ident[:2] == wanted), None)
    if replica is not None:  # (a rank that stood by holds an older state: none)
        entries = dict(replica.own)
        if replica.neighbour_rank in ctx.lost:
            entries.update(replica.neighbour)
    holds = ctx.holds_state and replica is not None
    counters = None if replica is None else replica.counters
    handover = live.exchange(
        engine.state,
        holds_state=holds,
        via=ctx.via,
        new_members=ctx.members,
        entries=entries,
        counters=counters,
    )
    ctx.session._adopt(engine, handover, ctx.comm)
    # an expert-parallel rank's replica holds its experts' entries too
    _experts_from(ctx, holds_state=holds, entries=entries, counters=counters)
    return "in-memory replicas"


def _experts_from(
    ctx: Restoring, *, holds_state: bool, entries: Entries | None, counters: Counters | None
) -> None:
    """The experts' state of an expert-parallel engine, restored as the engine's own
    just was: its entries (None: its live state) re-sharded place by place over the
    new group (worker/elastic/blocks.py [Note: a lost block])."""
    experts = ctx.engine.experts
    if experts is None:
        return
    handover = blocks.exchange(
        experts,
        holds_state=holds_state,
        new_members=ctx.members,
        entries=entries if holds_state else {},
        counters=counters,
    )
    blocks.adopt(experts, handover)


def _from_module(ctx: Restoring) -> str:
    ctx.engine.state.build_from_kept_module(ctx.comm)
    if (experts := ctx.engine.experts) is not None:
        experts.state.build_from_kept_module(experts.groups.edp)
    ctx.engine.publish_snapshot()
    return "nothing: every holder of the job's state was lost, it starts again"


def _from_checkpoint(ctx: Restoring) -> str:
    engine = ctx.engine
    checkpoint_dir = Path(ctx.plan.checkpoint or "")
    engine.state.build(ctx.comm, from_module=False)  # torn until the checkpoint is in
    if (experts := engine.experts) is not None:
        experts.state.build(experts.groups.edp, from_module=False)
    engine.load_checkpoint(checkpoint_dir)
    engine.last_checkpoint = checkpoint_dir
    return str(checkpoint_dir)


# what each source restores from, and what the log says it was
_RESTORE_FROM: dict[live.RestoreSource, Callable[[Restoring], str]] = {
    live.RestoreSource.LIVE: _from_live,
    live.RestoreSource.FORWARD: _from_forward,
    live.RestoreSource.REPLICA: _from_replica,
    live.RestoreSource.MODULE: _from_module,
    live.RestoreSource.CHECKPOINT: _from_checkpoint,
}
