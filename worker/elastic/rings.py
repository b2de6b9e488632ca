"""An elastic job on a mesh (tensor and pipeline parallel), re-formed ring by ring:
what :class:`~worker.live.session.ElasticSession` does at a step boundary and
after a loss when its engine is a :class:`~worker.mesh_engine.MeshEngine`
(joining, the world's vote, a leave, a switch to the next generation, standing
by, the restore of every ring through the one restore table of
worker/elastic/recovery.py).

[Note: elastic by whole groups]
A mesh job's state is one ring of dp ranks per (pp, tp) position: the ranks at
position (p, t) hold the same local shards (their pipeline stage's parameters,
their slice of each planned one, the replicated ones whole) and shard those
across dp with ZeRO. A membership change keeps tp and pp and moves dp by whole
model-parallel groups (the ``tp * pp`` ranks of one dp index;
coordinator/core/meshplan.py ``arrange_groups``): the coordinator keeps each
survivor's position, so its shards stay its own ring's, and places a newcomer
wherever a group needs one. At the change every rank of the new generation,
in its new process group:

1. builds the new DeviceMesh, moves its tensor-parallel hooks to its tp
   group (:meth:`worker.tp.TensorParallel.rebind`: the local parameters, the
   optimizer and the engine's hooks stay what they are) and rebuilds its
   pipeline stage and schedule over its pp group; a newcomer builds its
   engine empty (``initial_state="peers"``);
2. shares what it holds for its ring (one small all-reduce over the world:
   its live state's id and step, its replicas'), and every rank picks the
   same source (worker/live/restore_plan.py ``plan_rings``): the
   live state when every ring's ranks are all here and whole at one step (a
   scale-up), else the newest replica step that covers every ring (a lost
   rank: its shards come from its right dp neighbour's copy; a leave: every
   rank refreshed its replica at the boundary it left at, so nothing rolls
   back), else the last checkpoint;
3. re-shards each ring from its old dp width to its new one over the new dp
   group (worker/live/exchange.py ``exchange``, as a data-parallel
   job does over the world) and refreshes its replicas.

A rank whose group cannot be completed (its group peers lost, nobody to take
their place) stands by: it drops its state and joins again, holding nothing,
when the coordinator places it in a later generation.

Changes are voted at step boundaries over the whole world (one small MAX
all-reduce after each step: the newest generation any rank has heard of,
whether any rank was asked to leave). A lost peer fails a collective
mid-step: a dp one (the engine's), a tp one inside torch's DTensor or a send
inside torch's pipeline schedule; the last two raise a plain RuntimeError
from torch.distributed, which the engine (worker/mesh_engine.py
``MeshEngine._peer_loss``) takes for a lost peer only once the coordinator
has formed a newer generation (:meth:`peer_lost`). Replicas need
``ZeroConfig.replica_interval`` (1: every step); without them a lost rank's
shards come from the last checkpoint, and without one the job ends.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn, cast

import torch
import torch.distributed as dist

from coordinator.core.meshplan import MeshCoords, MeshShape
from coordinator.core.messages import Generation
from worker import live
from worker.collectives import CollectiveError, Collectives, StepAborted
from worker.compat import abort_default_group
from worker.elastic.change import exit_job
from worker.elastic.joining import left_before_admission, prepare
from worker.elastic.phases import Phase, Session
from worker.elastic.recovery import Restoring, restore_from
from worker.engine import ZeroEngine
from worker.entries import Entries
from worker.factory import build_engine
from worker.live.restore_plan import (
    RestoreSource,
    current_rings,
    plan_rings,
    ring_lost,
)
from worker.parallel import build_mesh
from worker.rendezvous import ControlPlane, LeftBeforeAdmission, env_seconds
from worker.reporting import report
from worker.spec import EngineSpec
from worker.state import Counters

if TYPE_CHECKING:  # (loaded with the mesh: worker/factory.py)
    from worker.mesh_engine import MeshEngine

__all__ = ["PEER_LOSS_WAIT_ENV", "Carried", "boundary", "join", "peer_lost", "recover"]

logger = logging.getLogger(__name__)

# this rank was asked to leave but holds the last copy of its ring ([Note: the last
# copy of a ring])
_deferred = False

# how long a tensor-parallel error waits for the coordinator to confirm a lost
# peer (a newer generation) before it is taken for the script's own error
PEER_LOSS_WAIT_ENV = "ZEROPLANE_PEER_LOSS_WAIT_S"


@dataclass
class Carried:
    """What a rank holds for its ring when it leaves a generation: its live state
    (None unless whole at a step boundary), its counters and its replicas."""

    generation: int
    pp: int
    tp: int
    dp: int
    dp_size: int
    step: int
    live: Entries | None
    counters: Counters
    replicas: list[live.Replica]


def join(session: Session, spec: EngineSpec) -> MeshEngine:
    """Register at ``spec``'s coordinator asking for its tp and pp, wait for a place
    in a generation, form its group and mesh, and build the engine (a
    :class:`MeshEngine`, or a pipeline's stage): from the module in the job's first
    generation, from the members' shards after."""
    # the whole model's inventory: the coordinator plans for the model as it is
    inventory, metrics = prepare(session, spec)
    device = spec.device
    assert device is not None and spec.coordinator is not None
    asked = spec.asked_degrees()
    try:
        control = ControlPlane.join(
            spec.coordinator,
            inventory,
            device=device,
            metrics_port=None if metrics is None else metrics.port,
            stop=lambda: session.leave_requested,
            stage=spec.config.stage,
            mesh=asked,
        )
    except LeftBeforeAdmission as exc:
        left_before_admission(session, metrics, exc)
    session.control = control
    if session.leave_requested:  # asked while it registered: a launcher stops counting it
        control.client.announce_leaving()
    control.init_process_group()
    gen = control.generation
    shape = gen.mesh
    if shape is None or (shape.tp, shape.pp) != asked:
        control.close(leave=True)
        raise RuntimeError(
            f"generation {gen.id} has the mesh {shape} ({gen.mesh_reason or 'none'}), "
            f"not tp={asked[0]}, pp={asked[1]}: is another job registered with this "
            "coordinator?"
        )
    born = "peers" if gen.reshard is not None else "module"
    engine = build_engine(
        spec,
        generation=gen,
        rank=control.rank,
        shape=shape,
        mesh=build_mesh(shape, device.type),
        coords=shape.coords(control.rank),
        metrics=metrics,
        initial_state=born,
    )
    engine = cast("MeshEngine", engine)  # the engine of a mesh job (worker/factory.py)
    engine.membership = session
    session.rings = True
    control.client.hold_position(engine.coords)
    session.report_at_exit(engine)
    if born == "peers":
        # joining a running job: the members hand this rank its shards
        _restore(session, engine, gen, carried=None, joining=True)
    else:
        session._refresh_replica(engine)
    engine.state.drop_module_values()
    session._to(Phase.MEMBER)
    logger.info(
        "mesh %s from generation %d: this rank is %s, at step %d",
        _words(shape), gen.id, _words(engine.coords), engine.global_steps,
    )  # fmt: skip
    report(control, engine)
    return engine


def boundary(session: Session, engine: ZeroEngine, stepped: bool) -> None:
    """After a step: the world votes (one small MAX all-reduce: the newest
    generation any rank heard of, whether any rank was asked to leave), and every
    rank acts on the same answer."""
    control = session.control
    assert control is not None
    session.keeper.confirm()  # the refresh started at the last boundary
    if stepped and control.report_due():
        report(control, engine)
    vote = torch.tensor(
        [control.latest_id, int(session.leave_requested)], dtype=torch.int64, device=engine.device
    )
    Collectives(None).all_reduce(vote, op="max", control=True)
    newest, leaving = (int(v) for v in vote.tolist())
    start = time.perf_counter()
    gen = None
    if newest > control.generation.id:  # (every rank waits for it: one answer below)
        gen = control.client.generation
        while gen is None or gen.id < newest:
            gen = control.wait_newer(member=False)
    # a scale-up that keeps every member goes first: the leavers leave at the next
    # boundary, from the wider world (whose replicas may cover what they held)
    grows = gen is not None and all(
        gen.rank_of(m.worker_id) is not None for m in control.generation.members
    )
    if leaving and not grows and _leave_step(session, engine):
        return
    if gen is not None:
        _switch(session, engine, gen, broken=False)
        engine.stats.record_pause("scale_up", time.perf_counter() - start)
    elif stepped:
        interval = engine.config.replica_interval
        if interval and engine.global_steps % interval == 0:
            session._refresh_replica(engine)


def recover(session: Session, engine: ZeroEngine, exc: CollectiveError) -> NoReturn:
    """A peer is gone: form the coordinator's next generation, restore, and have the
    training loop carry on from ``engine.global_steps``."""
    start = time.perf_counter()
    session._to(Phase.RECOVERING)
    session.keeper.drop_refresh(wait=False)  # its group is broken
    logger.warning("step abandoned (%s); waiting for the coordinator's next generation", exc)
    gen = _next_generation(session)
    if gen is None:
        exit_job(session, "the job ended while this rank waited to re-form")
    reached = engine.global_steps
    _switch(session, engine, gen, broken=True)
    engine.stats.record_pause("crash", time.perf_counter() - start)
    session._to(Phase.MEMBER)
    engine = cast("MeshEngine", engine)  # the engine of a mesh job (worker/factory.py)
    logger.warning(
        "recovered as %s of %s at step %d (this rank had reached step %d)",
        _words(engine.coords), _words(engine.shape), engine.global_steps, reached,
    )  # fmt: skip
    raise StepAborted(
        f"step abandoned after a lost peer; resume at step {engine.global_steps}"
    ) from exc


def peer_lost(session: Session) -> bool:
    """Whether the coordinator formed a newer generation (a peer was lost), waiting
    up to ``$ZEROPLANE_PEER_LOSS_WAIT_S`` (default 30 s) for it."""
    control = session.control
    if control is None:
        return False
    deadline = time.monotonic() + env_seconds(PEER_LOSS_WAIT_ENV, 30.0)
    while control.latest_id <= control.generation.id:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _leave_step(session: Session, engine: ZeroEngine) -> bool:
    """Some rank was asked to leave: every rank's replica is made current (one
    refresh, confirmed at once), the leavers go, and the rest re-form in the
    generation the coordinator forms without them, restoring from the replicas of
    this very step (nothing is trained again). False where every leaver stays for
    now: each holds the last copy of its ring (:func:`_leavers_now`)."""
    control = session.control
    assert control is not None
    engine = cast("MeshEngine", engine)  # the engine of a mesh job (worker/factory.py)
    ring = engine.coords.pp * engine.shape.tp + engine.coords.tp
    now = _leavers_now(engine, ring, session.leave_requested)
    if not now:
        return False
    session.keeper.refresh(engine.state, control.generation.id)
    session.keeper.confirm()
    if dist.get_rank() in now:
        session._to(Phase.LEAVING)
        report(control, engine)
        exit_job(session, "asked to leave")
    start = time.perf_counter()
    gen = _next_generation(session)
    if gen is None:
        exit_job(session, "the job ended while this rank waited to re-form")
    _switch(session, engine, gen, broken=True)
    engine.stats.record_pause("scale_down", time.perf_counter() - start)
    return True


def _leavers_now(engine: MeshEngine, ring: int, asked: bool) -> set[int]:
    """The ranks that leave at this boundary: those asked to, but one of a ring whose
    ranks were all asked while others stay.

    [Note: the last copy of a ring]
    A leave restores the leavers' shards from their ring's replicas, kept by their
    right dp neighbours at the same (pp, tp) position. When every rank of one ring
    is asked to leave at once (two SIGTERMs that hit both tp-0 ranks of a tp = 2,
    dp = 2 job) and the job goes on, nobody would hold that ring's state: the job
    would fall back to its last checkpoint, or start again. So the ring's first
    rank stays, its leave deferred (it still says it is leaving, so a launcher
    replaces it below its minimum), until a generation places a newcomer at its
    position; it leaves at the first boundary after that, its ring then restored
    from the newcomer's replica like any leave. The launcher replaces the other
    leavers (no whole group remains without the deferred rank: coordinator/commands/
    keeping.py ``keep_minimum``), and a newcomer completes a group with a standby of the
    broken ones. A job whose every rank was asked (a launcher stopping it) leaves at
    once, as before; so does the only rank of a ring at dp = 1 asked alone: a
    newcomer could take its position only with a whole group, which nobody starts
    for it, so it goes and its ring is restored from the last checkpoint
    (docs/guides/mesh.md)."""
    global _deferred
    world, me = dist.get_world_size(), dist.get_rank()
    # per rank: its ring, and 0 (stays), 1 (asked to leave) or 2 (asked, and deferred
    # at an earlier boundary: it keeps the last copy whatever the ring's width now)
    table = torch.zeros(world, 2, dtype=torch.int64, device=engine.device)
    table[me, 0] = ring
    table[me, 1] = 2 if asked and _deferred else int(asked)
    Collectives(None).all_reduce(table, op="sum", control=True)
    rows = [(int(r), int(a)) for r, a in table.tolist()]
    asked_ranks = {rank for rank, (_, a) in enumerate(rows) if a}
    if len(asked_ranks) == world:
        return asked_ranks
    now = set(asked_ranks)
    for r in {ring_of for ring_of, _ in rows}:
        held_by = [rank for rank, (ring_of, _) in enumerate(rows) if ring_of == r]
        if not all(rank in asked_ranks for rank in held_by):
            continue
        kept = [rank for rank in held_by if rows[rank][1] == 2]
        if len(held_by) == 1 and not kept:
            continue  # dp = 1, asked alone
        keeper = (kept or held_by)[0]
        now.discard(keeper)
        if keeper == me and not _deferred:
            _deferred = True
            logger.warning(
                "asked to leave, but this rank holds the last copy of its ring "
                "(pp %d, tp %d): it stays until a newcomer takes its position",
                engine.coords.pp, engine.coords.tp,
            )  # fmt: skip
    return now


def _next_generation(session: Session) -> Generation | None:
    """The coordinator's next generation, whether it places this rank or not (a rank
    it leaves out stands by: :func:`_switch`); None once the job is over. Below the
    job's minimum that may take a while: up to ``$ZEROPLANE_MEMBERSHIP_WAIT_S``."""
    control = session.control
    assert control is not None
    deadline = time.monotonic() + control.patience_s
    while True:
        try:
            return control.wait_newer(member=False, timeout=1.0)
        except TimeoutError:
            pass
        if control.client.job_finished:
            return None
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"the coordinator formed no generation after {control.generation.id} "
                f"within {control.patience_s:g}s"
            )


def _switch(session: Session, engine: ZeroEngine, gen: Generation, *, broken: bool) -> None:
    """Move to ``gen``: re-form there, or stand by until a generation places this rank."""
    engine = cast("MeshEngine", engine)  # the engine of a mesh job (worker/factory.py)
    control = session.control
    assert control is not None
    me = control.client.worker_id
    carried = session.carried if session.carried is not None else _hold(session, engine)
    session.carried = carried
    engine.state.release()
    if gen.rank_of(me) is None:
        logger.warning(
            "generation %d has no place for this rank (its group was not whole): "
            "standing by", gen.id,
        )  # fmt: skip
        abort_default_group(control.timeout)
        session.carried = None
        # it holds nothing now: asked to leave, it goes at once
        placed = control.wait_to_re_form(stop=lambda: True, give_up=lambda: session.leave_requested)
        if placed is None:
            exit_job(
                session,
                "asked to leave while it stood by"
                if session.leave_requested
                else "the job ended while this rank stood by",
            )
        gen, broken = placed, False
    control.move_to(gen, broken=broken)
    gen = control.generation
    shape = gen.mesh
    if shape is None or (shape.tp, shape.pp) != (engine.shape.tp, engine.shape.pp):
        raise RuntimeError(
            f"generation {gen.id} changed the mesh to {shape}: an elastic mesh job keeps "
            f"tp={engine.shape.tp}, pp={engine.shape.pp}"
        )
    engine.rebind_mesh(build_mesh(shape, engine.device.type), shape, shape.coords(control.rank))
    # a registration again places this rank only at its (pp, tp) position
    control.client.hold_position(engine.coords)
    _restore(session, engine, gen, carried=session.carried)
    session.carried = None


def _hold(session: Session, engine: MeshEngine) -> Carried:
    """What this rank brings to the next generation, taken before its buffers go."""
    assert session.control is not None
    whole = engine.state.whole and not engine.state.micro_in_step
    replicas, session.keeper.replicas = session.keeper.replicas, []
    return Carried(
        generation=session.control.generation.id,
        pp=engine.coords.pp,
        tp=engine.coords.tp,
        dp=engine.rank,
        dp_size=engine.world_size,
        step=engine.global_steps,
        live=engine.state.export_ranges(copy=True) if whole else None,
        counters=engine.state.counters(),
        replicas=replicas,
    )


def _restore(
    session: Session,
    engine: MeshEngine,
    gen: Generation,
    carried: Carried | None,
    *,
    joining: bool = False,
) -> None:
    """Every rank of ``gen``, in its new group: agree on the source and re-shard each
    ring over the new dp group ([Note: elastic by whole groups]), through the
    restore table every layout uses (worker/elastic/recovery.py)."""
    control = session.control
    assert control is not None
    coords, shape = engine.coords, engine.shape
    ring = coords.pp * shape.tp + coords.tp
    keep = carried is not None and (carried.pp, carried.tp) == (coords.pp, coords.tp)
    held = carried if keep else None
    live_id = (
        None if held is None or held.live is None else (held.generation, held.dp, held.dp_size)
    )
    mine = live.Holding(
        live=live_id,
        replicas=tuple(r.ident for r in held.replicas) if held is not None else (),
        holds_state=keep,
        checkpoint=None if engine.last_checkpoint is None else str(engine.last_checkpoint),
        live_step=held.step if held is not None and live_id is not None else -1,
    )
    # per rank: its ring, the step it had reached (-1: it holds nothing), the last
    # step it saved, whether it joins the job now (a newcomer), its holding
    table = torch.zeros(gen.world_size, 4 + mine.WIDTH, dtype=torch.int64, device=engine.device)
    table[control.rank, 0] = ring
    table[control.rank, 1] = held.step if held is not None else -1
    table[control.rank, 2] = engine.saved_at
    table[control.rank, 3] = int(joining)
    table[control.rank, 4:] = mine.encode()
    Collectives(None).all_reduce(table, op="sum", control=True)
    rings: list[list[live.Holding]] = [[] for _ in range(shape.group_size)]
    for row in table.cpu():
        rings[int(row[0])].append(live.Holding.decode(row[4:]))
    reached, saved = int(table[:, 1].max()), int(table[:, 2].max())
    held_words = "; ".join(
        f"ring {r} (pp {r // shape.tp}, tp {r % shape.tp}): "
        + ", ".join(f"live {h.live} at {h.live_step}, replicas {h.replicas}" for h in held_by)
        for r, held_by in enumerate(rings)
    )
    logger.info("generation %d: the ranks hold %s", gen.id, held_words)
    rings = current_rings(rings)
    plan = plan_rings(rings)
    lost: frozenset[int] = frozenset()
    if plan.source is RestoreSource.REPLICA:
        assert plan.generation is not None and plan.step is not None
        lost = ring_lost(rings[ring], plan.generation, plan.step)
    dp_comm = Collectives(engine.mesh["dp"].get_group())
    source = restore_from(
        Restoring(
            session=session,
            engine=engine,
            plan=plan,
            live=live_id,
            replicas=[] if held is None else held.replicas,
            log=live.GradientLog(),
            members=list(range(shape.dp)),
            comm=dp_comm,
            holds_state=keep,
            carried=None if held is None or held.live is None else (held.live, held.counters),
            via=dp_comm.group,
            lost=lost,
        )
    )
    if carried is not None:
        session.keeper.retire(carried.replicas)
    # checkpoint_due must give one answer on every rank of the generation, standbys
    # and newcomers included: each decides from the same table. After a rollback the
    # step it went back to is not saved again; nor the step newcomers join at
    # (engine_checkpoints.py [Note: no save at a join]); else (a leave, a restore of
    # the very step the job had reached) the last save any rank made stands
    if engine.global_steps < reached:
        engine.mark_restored()
    elif int(table[:, 3].max()):
        engine.saved_at = engine.global_steps
    else:
        engine.saved_at = saved
    logger.info(
        "generation %d: restored from %s (%s; step %d)",
        gen.id, plan.source, source, engine.global_steps,
    )  # fmt: skip
    session._refresh_replica(engine)
    report(control, engine)


def _words(mesh: MeshShape | MeshCoords) -> str:
    return f"pp={mesh.pp} dp={mesh.dp} tp={mesh.tp}"
