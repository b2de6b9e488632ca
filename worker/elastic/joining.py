"""Joining: a worker registers with the coordinator, waits for a rank, forms the
generation's group and builds its engine: from the module's values in a new job,
from the members' shards when it joins a running one ([Note: a newcomer builds
ahead]), or with the survivors' restore when its generation replaces a lost rank."""

from __future__ import annotations

import logging
import signal
import threading
from typing import NoReturn

from coordinator.core.messages import Generation
from worker import live
from worker.collectives import Collectives
from worker.elastic.change import after_loss, take_shards
from worker.elastic.phases import Phase, Session
from worker.elastic.recovery import restore
from worker.engine import (
    ZeroEngine,
)
from worker.factory import build_engine
from worker.flat import Reserve
from worker.inventory import Inventory
from worker.metrics import MetricsServer, SnapshotBoard, start_metrics
from worker.rendezvous import ControlPlane, JobFinished, LeftBeforeAdmission
from worker.reporting import report
from worker.spec import EngineSpec

__all__ = ["join", "left_before_admission", "prepare"]

logger = logging.getLogger(__name__)


def prepare(session: Session, spec: EngineSpec) -> tuple[Inventory, MetricsServer | None]:
    """Before registering, in every layout: the optimizer built and the inventory
    to register, the metrics endpoint, and SIGTERM taken as a leave (a pod deleted
    as it starts is then a graceful leave at the first step boundary)."""
    inventory = spec.resolve()
    metrics = start_metrics(spec.config, SnapshotBoard())
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, session._on_sigterm)
    return inventory, metrics


def left_before_admission(
    session: Session, metrics: MetricsServer | None, exc: LeftBeforeAdmission
) -> NoReturn:
    """The job finished, or SIGTERM came, before this worker was given a rank."""
    if isinstance(exc, JobFinished):
        logger.info("the job finished before this worker joined it: nothing to do")
    else:
        logger.info("SIGTERM before this worker was given a rank: left the job")
    if metrics is not None:
        metrics.close()
    session._to(Phase.LEFT)
    raise SystemExit(0) from None


def join(session: Session, spec: EngineSpec) -> ZeroEngine:
    """Register ``session`` at ``spec``'s coordinator, wait for a rank, form the
    generation's group and build the engine for it: from the module's values in a
    new job, from the members' shards when joining a running one."""
    inventory, metrics = prepare(session, spec)
    config, device = spec.config, spec.device
    assert device is not None and spec.coordinator is not None

    def build(gen: Generation, rank: int, comm: Collectives | None) -> ZeroEngine:
        return build_engine(
            spec,
            generation=gen,
            rank=rank,
            metrics=metrics,
            # after the job's first generation a new process holds nothing
            initial_state="peers" if gen.reshard is not None else "module",
            build_for=comm,
        )

    engine: ZeroEngine | None = None
    warming: threading.Thread | None = None
    wire: list[live.ExchangeBuffers] = []  # what the warm thread writes to receive into
    try:
        control = ControlPlane.join(
            spec.coordinator,
            inventory,
            device=device,
            metrics_port=None if metrics is None else metrics.port,
            stop=lambda: session.leave_requested,
            stage=config.stage,
            experts=spec.experts_request(),
            context_parallel=spec.context_parallel if spec.context_parallel > 1 else None,
        )
        session.control = control
        planned = control.generation
        # an expert- or context-parallel engine forms its groups as it builds, once the
        # group has formed ([Note: elastic blocks] in worker/elastic/blocks.py)
        if planned.reshard is not None and spec.expert_parallel * spec.context_parallel == 1:
            # [Note: a newcomer builds ahead]
            # A newcomer to a running job builds its (empty) buffers for its rank
            # before the group forms: the members reach the step boundary a step
            # after the coordinator formed the generation, and every second the
            # newcomer spends building after they arrive is a second they wait
            # in the exchange. The group that forms may be a newer generation
            # (a superseded rendezvous): with another rank or size, it rebuilds.
            # It also writes once the transient buffers of its first backward
            # (ShardState.warm), while it meets the members: in bench/elastic.py
            # that backward, which every member waits for, took 0.5-1.0 s against
            # 0.15-0.2 s for the next. Written before meeting, they delayed its
            # arrival on a new machine by more than that; while meeting, the
            # writes ran 0.15-0.4 s past the group's forming there (fresh pages
            # are slow on that machine), and its first backward took no longer
            # than the next.
            engine = build(
                planned,
                control.rank,
                Collectives.ahead(control.rank, planned.world_size, control.backend),
            )
            warming = threading.Thread(
                target=_warm, args=(engine, wire), name="zeroplane-warm", daemon=True
            )
            warming.start()
        try:
            # the generation formed may be newer; the members switch once this
            # rank's buffers are written ([Note: meeting ahead] in worker/rendezvous.py)
            control.init_process_group(ready=lambda: warming is None or not warming.is_alive())
        finally:
            if warming is not None:
                warming.join()  # before anything else touches the state
    except LeftBeforeAdmission as exc:
        left_before_admission(session, metrics, exc)
    gen = control.generation
    newcomer = gen.reshard is not None
    if engine is None:
        engine = build(gen, control.rank, None)
    elif (engine.rank, engine.world_size) == (control.rank, gen.world_size):
        engine.state.rebind(Collectives(None))
    else:
        engine.state.build(Collectives(None), from_module=False)
    engine.membership = session
    session.report_at_exit(engine)
    if engine.layout != gen.layout:
        raise RuntimeError(
            "the coordinator's bucket layout differs from this worker's: "
            "are all workers running the same model and zeroplane version?"
        )
    if newcomer and after_loss(gen):
        # joining in a generation that replaces a lost rank (e.g. a restarted pod
        # under its old name): restore with the survivors, holding nothing
        session._to(Phase.RECOVERING)
        restore(session, engine, gen, holds_state=False)
    elif newcomer:
        take_shards(session, engine, gen, comm=None, wire=wire[0] if wire else None)
    session.held.generation = gen.id
    engine.state.drop_module_values()
    if engine.experts is not None:
        engine.experts.state.drop_module_values()
    session._to(Phase.MEMBER)
    session.clock.start()  # its first step is timed from here
    report(control, engine)
    return engine


def _warm(engine: ZeroEngine, wire: list[live.ExchangeBuffers]) -> None:
    """A newcomer built ahead, while it meets the members: the transient buffers
    of its first backward (ShardState.warm), the optimizer state its import
    makes and a buffer to receive its shards into (worker/build_ahead.py [Note: a
    build from buffers written ahead]); appended to ``wire``."""
    state = engine.state
    state.warm()
    try:
        fields = state.state_fields()  # a probe: found once for both
        plan = state.reserve_plan(state.rank, state.world_size, buffers=False, fields=fields)
        state.reserve = Reserve.make(plan)
        recv = live.packed_bound(state, state.rank, state.world_size, fields)
        wire.append(live.ExchangeBuffers.make(0, recv, live.wire_device(state.comm)))
    except Exception as exc:  # out of memory, say: the import allocates as before
        logger.warning("writing the newcomer's buffers ahead failed: %s", exc)
