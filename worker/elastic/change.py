"""A member's membership changes: the prepared scale-up (``ready_for``,
``grow_to``), the prepared leave (``prepare_leave``, ``hand_over``, [Note: a leave
prepared ahead]), and a leave with nobody to take the shards
(``leave_holding_state``). worker/elastic/session.py decides at each step boundary
which applies ([Note: membership changes]); worker/elastic/prepared.py holds what a
member wrote ahead for one.

[Note: leaving with nobody to hand over to]
A hand-over needs someone to take the shards. When every member was asked to
leave at the same boundary (a launcher or an operator stopping the whole
job: its SIGTERM reaches every worker), or a member asked to leave is
waiting for a generation while the coordinator says the job is over (its
launcher is stopping it), the members leave without one, saying which
checkpoint the job's state goes back to, and exit 0 with the leave reason
"stopped"; the coordinator then forms no generation and tells everyone
still waiting that the job is over, as after a finish. A member asked to
leave while the job goes on keeps waiting (a replacement may be starting)
and hands over in the generation that forms. Before, the members handed
the state to each other one boundary after another until the last one had
nobody to give it to and crashed (or waited for a generation that never
formed until it was killed).

Every member asked to leave is not always a job being stopped: SIGTERMs from
outside reach the members one after another (a node drained, pods evicted),
and a launcher keeping the job's minimum starts a replacement for each
leaver while others still stay (coordinator/commands/keeping.py
``keep_minimum``). A leave that had to wait for a newcomer (the leaver's ep
or cp group is the whole job, or the world is one rank) then meets the next
SIGTERM, and every member is leaving while the replacements are seconds from
registering. So at such a boundary each member asks the coordinator whether
workers are on their way (``StatusReport.newcomers``: started by a launcher
and not registered yet, or registered and waiting for a generation; none
once the launcher says it stops the job; or a newer generation has formed
with them), and the members agree on the answer (a MAX all-reduce, since
they may hear it at different moments). Yes: they train on, announcing no
leave that would hold back the newcomers' generation, grow into it, and the
leavers then hand over to the newcomers as in any leave. No, or no newcomer
joined within ``$ZEROPLANE_MEMBERSHIP_WAIT_S``: they leave holding the
state, as above.
"""

from __future__ import annotations

import logging
import time
from typing import NoReturn

import torch
import torch.distributed as dist

from coordinator.control.client import CoordinatorError
from coordinator.core.messages import STOPPED, Generation
from coordinator.core.settings import env_seconds
from worker import live
from worker.collectives import Collectives
from worker.compat import abort_default_group
from worker.elastic import blocks
from worker.elastic.phases import Handed, PeerLost, Phase, Session, admitted
from worker.elastic.prepared import PreparedLeave, PreparedScaleUp
from worker.engine import ZeroEngine
from worker.rendezvous import MEMBERSHIP_WAIT_ENV

__all__ = [
    "NO_GENERATION",
    "after_loss",
    "grow_to",
    "grows",
    "hand_over",
    "join_ahead",
    "leave_holding_state",
    "newcomers_awaited",
    "prepare_leave",
    "ready_for",
]

logger = logging.getLogger(__name__)

# how long members train on waiting for a scale-up's ranks to be ready before
# switching anyway ([Note: meeting ahead] in worker/rendezvous.py)
_AHEAD_PATIENCE_S = 30.0
NO_GENERATION = "asked to leave while waiting for a generation, and the job is over"


def grows(old: Generation, gen: Generation) -> bool:
    """Whether ``gen`` only adds ranks to ``old``: its first ranks are ``old``'s
    members, in order, and nobody left or was lost."""
    old_ids = [m.worker_id for m in old.members]
    lost = gen.reshard is not None and (gen.reshard.lost_ranks or gen.reshard.left_ranks)
    return not lost and [m.worker_id for m in gen.members[: len(old_ids)]] == old_ids


def after_loss(gen: Generation) -> bool:
    """Whether ``gen`` replaces lost ranks: its members restore together, newcomers
    included, rather than exchange."""
    return gen.reshard is not None and bool(gen.reshard.lost_ranks)


# ------------------------------------------------------------ preparing


def ready_for(session: Session, engine: ZeroEngine, gen: Generation) -> bool:
    """Whether every rank of ``gen``, a scale-up of this one, is ready to switch
    ([Note: meeting ahead] in worker/rendezvous.py): polled at each step boundary
    while the members train on, for at most ``_AHEAD_PATIENCE_S``; after that the
    switch goes ahead, and the meeting handles a newcomer that never came. This
    rank is ready once it has written its buffers for ``gen`` (worker/build_ahead.py
    [Note: a build from buffers written ahead]), in a thread started here."""
    control = admitted(session)
    ahead = session.ahead
    if not isinstance(ahead, PreparedScaleUp) or ahead.generation != gen.id:
        join_ahead(session)
        rank = gen.rank_of(control.client.worker_id)
        assert rank is not None
        session.ahead = ahead = PreparedScaleUp(gen.id, time.monotonic(), rank, gen.world_size)
        ahead.start(engine.state)
    if time.monotonic() - ahead.since > _AHEAD_PATIENCE_S:
        return True
    return control.prepare(gen, ready=ahead.written)


def join_ahead(session: Session, *, drop: bool = False) -> None:
    """Before anything builds: the thread writing buffers ahead is done;
    ``drop``: the change it prepared for will not come (what the build does
    not take of them goes with the build)."""
    if session.ahead is not None and session.ahead.thread is not None:
        session.ahead.thread.join()
    if drop:
        session.ahead = None


def prepare_leave(session: Session, engine: ZeroEngine, leaving: int) -> None:
    """Rank ``leaving`` announced its leave ([Note: a leave prepared ahead]):
    write the buffers of the generation without it, in a thread."""
    current = admitted(session).generation.id
    ahead = session.ahead
    if isinstance(ahead, PreparedLeave) and ahead.prepares_leave(current, leaving):
        return
    join_ahead(session, drop=True)  # a scale-up's preparation gives way
    going = blocks.leaving_group(engine, leaving)
    survivors = [r for r in range(engine.world_size) if r not in going]
    rank = None if engine.rank in going else survivors.index(engine.rank)
    session.ahead = PreparedLeave(current, time.monotonic(), rank, len(survivors), leaver=leaving)
    session.ahead.start(engine.state)


# ------------------------------------------------------------ changing


def hand_over(session: Session, engine: ZeroEngine, leaving: int) -> None:
    """[Note: a leave prepared ahead]
    A leave used to be heard at the boundary it handed over at: the survivors
    then built the new layout's buffers, the optimizer state and the
    hand-over's buffers while everyone waited, and faulted the rest in during
    their first step at the new size (bench/elastic.py, 3→2: 0.41 s of pause,
    0.15 s of it in that step). Now a rank asked to leave votes "waiting" at
    its first boundary, which announces the leave without making it; every
    rank then writes what it will need in a thread (a ``PreparedLeave``: the
    survivors their buffers for the generation without it, the leaver its
    send buffer) and votes "waiting" until written, at most
    ``_LEAVE_PATIENCE_S`` (worker/elastic/session.py); the hand-over is made at
    the first boundary nobody waits at. The announcement costs the leaver one
    step, so a rank whose steps take longer than ``_ANNOUNCE_MAX_STEP_S`` (the
    median of its last five) hands over unannounced, as before: its grace
    period is finite. A scale-up pending meanwhile waits for the leave; the
    generation it formed still holds the leaver, so the survivors wait for the
    next one (before, they took it for a lost member and recovered, or hung).
    The send buffer is sized to what a rank sends (``live.sent_bound``): a
    scale-down's first survivor keeps all it owns and writes none."""
    control = admitted(session)
    ahead, session.ahead = session.ahead, None
    current = control.generation.id
    prepared = isinstance(ahead, PreparedLeave) and ahead.prepares_leave(current, leaving)
    wire = ahead.wire if prepared else None
    # under expert or context parallelism its group leaves with it (worker/elastic/blocks.py)
    going = blocks.leaving_group(engine, leaving)
    survivors = [r for r in range(engine.world_size) if r not in going]
    if engine.rank in going:
        session._to(Phase.LEAVING)
    handover, handed = _exchange(engine, holds_state=True, new_members=survivors, wire=wire)
    if engine.rank in going:
        engine.state.release()
        dist.destroy_process_group()
        session._forget_exit()
        control.close(leave=True)
        session._to(Phase.LEFT)
        with_it = "" if engine.rank == leaving else f" with rank {leaving} of its group"
        logger.info("handed over at step %d; leaving%s", handover.counters.global_steps, with_it)
        raise SystemExit(0)
    old = control.generation
    gen = control.wait_to_re_form(stop=lambda: session.leave_requested)
    while gen is not None and grows(old, gen):
        # a scale-up formed before the leave (the leaver is in it, and its
        # newcomers wait for it): the coordinator forms the next without the leaver
        control.generation = gen
        gen = control.wait_to_re_form(stop=lambda: session.leave_requested)
    if gen is None:
        leave_holding_state(session, engine, NO_GENERATION)
    survivor_ids = [m.worker_id for m in old.members if m.rank not in going]
    others_lost = gen.reshard is not None and set(gen.reshard.lost_ranks) - set(going)
    if others_lost or [m.worker_id for m in gen.members[: len(survivor_ids)]] != survivor_ids:
        # another member vanished meanwhile: recover like a crash
        raise PeerLost(f"generation {gen.id} lost more of generation {old.id} than rank {leaving}")
    control.move_to(gen)
    if control.generation.id != gen.id:
        session._recover_in_formed(engine, gen)
    blocks.regroup(engine)
    if gen.world_size > len(survivor_ids):
        # workers admitted in the same generation: pass them their shards of what
        # the survivors were just handed (they run the join exchange). Should a
        # newcomer die meanwhile, that hand-over is whole: recovery starts from it.
        me = survivors.index(engine.rank)
        session.held.handed = Handed((gen.id, me, len(survivors)), handover, handed)
        everyone = list(range(gen.world_size))
        handover = live.exchange(
            engine.state,
            holds_state=True,
            via=None,
            new_members=everyone,
            entries=handover.entries,
            counters=handover.counters,
        )
        if engine.experts is not None and handed is not None:
            handed = blocks.exchange(
                engine.experts,
                holds_state=True,
                new_members=everyone,
                entries=handed.entries,
                counters=handed.counters,
            )
    session._adopt(engine, handover, Collectives(None))
    if engine.experts is not None:
        blocks.adopt(engine.experts, handed)
    if gen.world_size > len(survivor_ids):
        engine.saved_at = engine.global_steps  # newcomers too: [Note: no save at a join]
    session.held.generation, session.held.handed = gen.id, None
    session._refresh_replica(engine)  # newcomers, at the end of their join, too
    logger.info(
        "rank %s left; now rank %d of %d%s",
        leaving if len(going) == 1 else f"{leaving} (with its group, ranks {going})",
        engine.rank,
        engine.world_size,
        "" if wire is None else " (prepared ahead)",
    )


def take_shards(
    session: Session,
    engine: ZeroEngine,
    gen: Generation,
    *,
    comm: Collectives | None,
    wire: live.ExchangeBuffers | None = None,
) -> None:
    """A rank that holds nothing joins the running job ``gen`` (the members grow to it,
    :func:`grow_to`): they hand it its shards, its experts' too, over ``gen``'s group.
    ``comm``: the group to rebuild its state for (None: built for it already);
    ``wire``: buffers written ahead to receive into."""
    everyone = list(range(gen.world_size))
    handover, held = _exchange(engine, holds_state=False, new_members=everyone, wire=wire)
    if handover.nobody_held:
        # the generation this worker was admitted to superseded the job's first
        # before it formed: nobody trained yet, every rank starts from the module
        engine.state.build_from_kept_module(Collectives(None))
        if engine.experts is not None:
            engine.experts.state.build_from_kept_module(engine.experts.groups.edp)
        engine.publish_snapshot()
        logger.info("the job starts in generation %d as rank %d", gen.id, engine.rank)
    else:
        session._adopt(engine, handover, comm)
        if engine.experts is not None:
            blocks.adopt(engine.experts, held)
        engine.saved_at = engine.global_steps  # [Note: no save at a join]
        logger.info("joined at step %d as rank %d", engine.global_steps, engine.rank)
    session._refresh_replica(engine)  # as the members do after the exchange


def _exchange(
    engine: ZeroEngine,
    *,
    holds_state: bool,
    new_members: list[int],
    wire: live.ExchangeBuffers | None,
) -> tuple[live.Handover, live.Handover | None]:
    """The engine's state sent to its owners among ``new_members`` (ranks of the
    default group, in new-rank order) and this rank's received, then its experts'
    (None without experts: worker/elastic/blocks.py)."""
    handover = live.exchange(
        engine.state, holds_state=holds_state, via=None, new_members=new_members, buffers=wire
    )
    if engine.experts is None:
        return handover, None
    experts = blocks.exchange(engine.experts, holds_state=holds_state, new_members=new_members)
    return handover, experts


def exit_job(session: Session, why: str) -> NoReturn:
    """Leave the job and end this process with 0: what it held is the others' now
    (a rank that stood by, or waited to re-form while the job ended)."""
    control = admitted(session)
    session._forget_exit()  # not a finish: the job goes on without this rank
    control.final_report()
    control.close(leave=True)
    session.phase = Phase.LEFT
    logger.info("left the job: %s", why)
    raise SystemExit(0)


def leave_holding_state(
    session: Session, engine: ZeroEngine, why: str, *, broken: bool = False
) -> NoReturn:
    """Leave without a hand-over: nobody is left to take this rank's shards
    ([Note: leaving with nobody to hand over to])."""
    control = admitted(session)
    kept = engine.last_checkpoint
    logger.warning(
        "%s: leaving at step %d with nobody to hand the shards over to; the job "
        "stops, and what it trained after %s is not kept",
        why,
        engine.global_steps,
        f"the checkpoint {kept}" if kept is not None else "its start",
    )
    session._to(Phase.LEAVING)
    session.keeper.drop_refresh(wait=False)
    engine.state.release()
    if broken:
        abort_default_group(control.timeout)
    elif dist.is_initialized():
        dist.destroy_process_group()
    session._forget_exit()
    control.close(leave=True, reason=STOPPED)
    session._to(Phase.LEFT)
    raise SystemExit(0)


def newcomers_awaited(session: Session, since: float) -> bool:
    """Every member was asked to leave at this boundary: whether they all agree to
    train on for workers on their way, having waited since ``since`` (monotonic)
    ([Note: leaving with nobody to hand over to]). A collective of every member."""
    control = admitted(session)
    patience = env_seconds(MEMBERSHIP_WAIT_ENV, 600.0)
    coming = False
    if time.monotonic() - since < patience:
        try:
            status = control.client.status()
            # (a newer generation holds them: the members switch to it when all are ready)
            coming = status.newcomers > 0 or status.generation_id > control.generation.id
        except CoordinatorError as exc:  # (another member may hear it)
            logger.warning("could not ask the coordinator for newcomers: %s", exc)
    agreed = torch.tensor([int(coming)], dtype=torch.int32)
    Collectives(None).all_reduce(agreed, op="max", control=True)
    return bool(agreed.item())


def grow_to(session: Session, engine: ZeroEngine, gen: Generation) -> None:
    control = admitted(session)
    old = control.generation
    if not grows(old, gen):
        # a member vanished without a graceful hand-over: recover like a crash
        raise PeerLost(f"generation {gen.id} lost members of generation {old.id}")

    control.move_to(gen)
    if control.generation.id != gen.id and after_loss(control.generation):
        session._recover_in_formed(engine, gen)
    gen = control.generation
    ahead, session.ahead = session.ahead, None
    wire = ahead.wire if ahead is not None and ahead.generation == gen.id else None
    everyone = list(range(gen.world_size))
    blocks.regroup(engine)  # (before the exchange, as a newcomer forms them)
    # the exchange exports from the old layout and rank, which the state still holds
    handover, handed = _exchange(engine, holds_state=True, new_members=everyone, wire=wire)
    session._adopt(engine, handover, Collectives(None))
    if engine.experts is not None:
        blocks.adopt(engine.experts, handed)
    session.held.generation = gen.id
    engine.saved_at = engine.global_steps  # as the newcomers: [Note: no save at a join]
    session._refresh_replica(engine)  # the newcomers, at the end of their join, too
    logger.info("grew to %d ranks at step %d", engine.world_size, engine.global_steps)
