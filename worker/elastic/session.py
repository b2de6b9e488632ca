"""A worker's life in a coordinator's job: joining, following generations,
handing over, recovering. The engine (worker/engine.py) knows none of it:
it asks this session for its vote at each step boundary, tells it when a
step is done, and hands it any collective that failed.

:class:`ElasticSession` is those seams and what is decided at a step boundary;
the work is done below it, by the phase it moves to (worker/elastic/phases.py
[Note: session phases]): joining.py (JOINING), change.py (a scale-up, a leave:
MEMBER to MEMBER, LEAVING, LEFT), recovery.py (RECOVERING). It holds its replicas
in a :class:`ReplicaKeeper` (replicas.py).

[Note: membership changes]
Every rank must change membership at the same step boundary, so the
decision rides on the step-boundary ballot: the newest generation id any
rank has heard of and the rank of a worker that got SIGTERM. After the step:
* a leaving rank: all ranks hand its shards to the survivors over the
  current group (it is still alive), then it tells the coordinator it
  leaves and exits 0; the survivors form the generation without it;
* a newer generation with newcomers: the members form the new group at
  its rendezvous and move shards to the newcomers over it;
* a collective that fails (a peer died): the step is abandoned, the
  survivors wait for the coordinator's generation without the dead rank
  (its lease expires), form it, and restore (recovery).
"""

from __future__ import annotations

import logging
import time
from typing import Any, NoReturn

import torch

from coordinator.core.messages import FINISHED, Generation
from worker.ballot import BoundaryVote
from worker.collectives import CollectiveError, Collectives, Handle
from worker.elastic import blocks, change, joining, recovery, rings
from worker.elastic.phases import TRANSITIONS, Held, Phase, StepClock, admitted
from worker.elastic.prepared import PreparedLeave, PreparedScaleUp
from worker.engine import ZeroEngine
from worker.live import Handover, PendingRefresh, Replica, ReplicaKeeper
from worker.rendezvous import ControlPlane
from worker.reporting import FinalReport, report
from worker.spec import EngineSpec

__all__ = ["ElasticSession", "Phase"]

logger = logging.getLogger(__name__)

# [Note: a leave prepared ahead]: a rank asked to leave announces it first only
# when its steps are this short (the announcement costs it a step before it can
# hand over); the survivors hand over after preparing this long at most
_ANNOUNCE_MAX_STEP_S = 2.0
_LEAVE_PATIENCE_S = 4.0


class ElasticSession(FinalReport):
    """One worker's membership in a coordinator's job (see the module notes)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = Phase.JOINING
        self.leave_requested = False
        # the coordinator connection: None while joining, until admitted
        self.control: ControlPlane | None = None
        # the replicas, the refresh in flight, a spare buffer and the gradient log
        self.keeper = ReplicaKeeper()
        # the generation whose membership this rank's shards belong to, or what
        # it was handed between the two exchanges of a leave and a join
        self.held = Held()
        # the scale-up or leave this member prepares for ([Note: meeting ahead],
        # [Note: a leave prepared ahead])
        self.ahead: PreparedScaleUp | PreparedLeave | None = None
        # the last step boundary and the times between the last few
        self.clock = StepClock()
        # an engine on a mesh re-forms ring by ring (worker/elastic/rings.py), and
        # carries its state across a change it had to retry (a peer lost in it)
        self.rings = False
        self.carried: rings.Carried | None = None
        # a leave it could not make yet was said (_leave_deferred)
        self._told_deferred = False
        # since when every member, asked to leave, trains on for workers on their way
        # ([Note: leaving with nobody to hand over to] in worker/elastic/change.py)
        self._awaiting_since: float | None = None

    # what the keeper holds, read as the session's own
    @property
    def replicas(self) -> list[Replica]:
        return self.keeper.replicas

    @property
    def refreshing(self) -> PendingRefresh | None:
        return self.keeper.refreshing

    @property
    def spare(self) -> torch.Tensor | None:
        return self.keeper.spare

    def _to(self, phase: Phase) -> None:
        if phase not in TRANSITIONS[self.phase]:
            raise RuntimeError(f"worker session: no transition from {self.phase} to {phase}")
        self.phase = phase

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        logger.info("SIGTERM: handing this rank's shards over at the next step boundary")
        self.leave_requested = True
        if self.control is not None:
            self.control.client.announce_leaving()  # a launcher stops counting it now

    # ------------------------------------------------------------ joining

    @classmethod
    def join(cls, spec: EngineSpec) -> ZeroEngine:
        """Register at ``spec``'s coordinator, wait for a rank, form the generation's
        group (and mesh) and build the engine for it (worker/elastic/joining.py; on a
        mesh, worker/elastic/rings.py)."""
        if spec.model_parallel:
            return rings.join(cls(), spec)
        return joining.join(cls(), spec)

    # ------------------------------------------------------------ the engine's seams

    def vote(self, engine: ZeroEngine) -> BoundaryVote:
        control = admitted(self)
        if self.rings:  # the dp ballot carries no membership: the world votes after
            return BoundaryVote(generation=control.generation.id)
        generation, waiting = control.latest_id, False
        newest = control.client.generation
        ahead = self.ahead
        if isinstance(ahead, PreparedLeave):
            # a leave was announced: hand over once every survivor has prepared
            waiting = ahead.rank is not None and not ahead.ready(_LEAVE_PATIENCE_S)
        elif (
            self.leave_requested
            and self._awaiting_since is None  # (the announcement would hold them back)
            and not self._leave_deferred(engine, control.rank)
        ):
            # announce the leave first, where a step is short enough to afford it
            waiting = self.clock.estimate() <= _ANNOUNCE_MAX_STEP_S
        elif (
            newest is not None
            and newest.id > control.generation.id
            and change.grows(control.generation, newest)
            and not change.ready_for(self, engine, newest)
        ):
            generation, waiting = control.generation.id, True
        return BoundaryVote(
            generation=generation,
            leaving_rank=control.rank if self.leave_requested else None,
            staying=not self.leave_requested,
            waiting=waiting,
        )

    def generation_id(self) -> int:
        return 0 if self.control is None else self.control.generation.id

    def replica_bytes(self) -> int:
        return self.keeper.nbytes()

    def log_gradients(
        self, engine: ZeroEngine, grads: list[torch.Tensor], used: list[int]
    ) -> Handle | None:
        """[Note: rolling a lost rank forward] in worker/live/replicas.py. Whether
        to send depends only on what every rank agrees on (config, world, stage), so
        every rank's send meets its neighbour's receive."""
        st, config = engine.state, engine.config
        if not (
            not self.rings  # a lost rank of a mesh rolls its ring back to the replicas
            and blocks.size(engine) == 1  # and a lost block (worker/elastic/blocks.py)
            and config.replica_interval
            and config.replica_gradient_log
            and st.stage.optimizer_sharded
            and not st.placement.optimizer_on_host
            and st.comm.distributed
            and grads
        ):
            return None
        return self.keeper.log.start(
            st.comm,
            admitted(self).generation.id,
            st.global_steps + 1,
            grads,
            used,
            st.optimizer.hyperparams(),
        )

    def after_load(self, engine: ZeroEngine) -> None:
        # replicas of the state before the load would roll a recovery back past it
        # (should a peer die in the refresh, the checkpoint just loaded serves)
        self.keeper.drop_refresh(wait=True)
        self.keeper.retire(self.keeper.replicas)
        self.keeper.replicas = []
        self._refresh_replica(engine)

    def after_step(self, engine: ZeroEngine, agreed: BoundaryVote, stepped: bool) -> None:
        if self.rings:
            rings.boundary(self, engine, stepped)
            return
        control = admitted(self)
        if stepped:
            self.keeper.log.commit(engine.global_steps)
        self.clock.tick()
        self._confirm_refresh(engine)  # before anything changes the membership
        switching = agreed.switches_to_newer(control.generation.id)
        everyone = agreed.everyone_leaving and not switching and not self._newcomers_awaited()
        if not agreed.everyone_leaving:
            self._awaiting_since = None  # (those it waited for joined)
        leaving = None if agreed.everyone_leaving else agreed.leaving_rank
        if leaving is not None and self._leave_deferred(engine, leaving):
            leaving = None
        if leaving is not None and agreed.waiting:
            change.prepare_leave(self, engine, leaving)  # announced: hand over once prepared
            leaving = None
        changing = everyone or leaving is not None or switching
        if stepped:
            interval = engine.config.replica_interval
            if interval and engine.global_steps % interval == 0 and not changing:
                self._refresh_replica(engine)  # (a change refreshes once it is made)
            if control.report_due():
                report(control, engine)
        start = time.perf_counter()
        if changing:
            change.join_ahead(self, drop=not (switching or leaving is not None))
        if everyone:
            change.leave_holding_state(self, engine, "every member was asked to leave at this step")
        if leaving is not None:
            change.hand_over(self, engine, leaving)
            engine.stats.record_pause("scale_down", time.perf_counter() - start)
        elif switching:
            gen = control.wait_newer()
            while gen.id < agreed.generation:
                control.generation, gen = gen, control.wait_newer()
            change.grow_to(self, engine, gen)
            engine.stats.record_pause("scale_up", time.perf_counter() - start)

    def _newcomers_awaited(self) -> bool:
        """Every member was asked to leave: whether they agree to train on for
        workers on their way (``change.newcomers_awaited``)."""
        since = self._awaiting_since or time.monotonic()
        awaited = change.newcomers_awaited(self, since)
        if awaited and self._awaiting_since is None:
            logger.warning(
                "every member was asked to leave, but workers are on their way: training "
                "goes on, and the members hand over to them once they join"
            )
        self._awaiting_since = since if awaited else None
        return awaited

    def _leave_deferred(self, engine: ZeroEngine, leaving: int) -> bool:
        """Rank ``leaving``'s block (its ep or cp group) is the whole world while the
        job goes on (not everyone was asked): nobody could take its shards, so the
        leave waits until a newcomer's block joins (a launcher below its minimum
        starts one; coordinator/commands/keeping.py ``keep_minimum``), like the last
        copy of a mesh's ring (worker/elastic/rings.py [Note: the last copy of a
        ring])."""
        deferred = len(blocks.leaving_group(engine, leaving)) >= engine.world_size > 1
        if deferred and not self._told_deferred:
            self._told_deferred = True
            logger.warning(
                "rank %d was asked to leave, but its group is the whole job: the leave "
                "waits until another group joins",
                leaving,
            )
        return deferred

    def settle(self) -> None:
        if self.phase is Phase.MEMBER:
            self.keeper.drop_refresh(wait=True)  # every member started it

    def recover(self, engine: ZeroEngine, exc: CollectiveError) -> NoReturn:
        """A peer is gone: form the coordinator's next generation and restore
        (worker/elastic/recovery.py; on a mesh, ring by ring: worker/elastic/rings.py)."""
        if self.rings:
            rings.recover(self, engine, exc)
        recovery.recover(self, engine, exc)

    def peer_lost(self) -> bool:
        """Whether the coordinator confirms a lost peer (a newer generation), for an
        error raised inside torch's DTensor or pipeline schedule (worker/mesh_engine.py
        ``MeshEngine._peer_loss``)."""
        return rings.peer_lost(self)

    def close(self) -> None:
        member = self.phase is Phase.MEMBER
        change.join_ahead(self)
        self.settle()
        self._forget_exit(send=member)
        if self.phase is not Phase.LEFT and self.control is not None:
            # a member closing its engine has ended training ([Note: a finishing job])
            self.control.close(leave=True, reason=FINISHED if member else "")
        self.phase = Phase.LEFT

    # ------------------------------------------------------------ for the phases' work

    def _refresh_replica(self, engine: ZeroEngine) -> None:
        """Start a refresh: every rank of the generation, at the same step boundary (a
        collective). The next boundary confirms it ([Note: a refresh overlaps a step]
        in worker/live/replicas.py)."""
        if not engine.config.replica_interval:
            return
        self.keeper.refresh(
            engine.state,
            admitted(self).generation.id,
            stride=blocks.size(engine),  # [Note: a lost block] in worker/elastic/blocks.py
            also=() if engine.experts is None else (engine.experts.state,),
        )

    def _confirm_refresh(self, engine: ZeroEngine) -> None:
        """Confirm the refresh in flight, if any (:meth:`ReplicaKeeper.confirm`)."""
        self.keeper.confirm()

    def _adopt(self, engine: ZeroEngine, handover: Handover, comm: Collectives | None) -> None:
        """``engine.adopt``; the buffer the hand-over arrived in is then free."""
        engine.adopt(handover, comm)
        self.keeper.keep_spare(handover.received)

    def _recover_in_formed(self, engine: ZeroEngine, intended: Generation) -> NoReturn:
        """A change's rendezvous was superseded by a generation that lost ranks
        (worker/elastic/recovery.py)."""
        recovery.recover_in_formed(self, engine, intended)
