"""An elastic mesh worker (tensor and pipeline parallel) in a coordinator's job
(:class:`MeshSession`).

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
   same source (worker/live/restore_plan.py ``plan_mesh_restore``): the
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
from torch.distributed, which the engine (worker/mesh.py
``MeshEngine._peer_loss``) takes for a lost peer only once the coordinator
has formed a newer generation (:meth:`peer_lost`). Replicas need
``ZeroConfig.replica_interval`` (1: every step); without them a lost rank's
shards come from the last checkpoint, and without one the job ends.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import torch
from torch import nn

from coordinator.core.meshplan import MeshCoords, MeshShape
from coordinator.core.messages import FINISHED, Generation
from worker import live
from worker.ballot import BoundaryVote
from worker.birth import Init
from worker.collectives import CollectiveError, Collectives, Handle, StepAborted
from worker.compat import abort_default_group
from worker.config import ZeroConfig
from worker.engine import LossFn, OptimizerArg, ZeroEngine, build_inventory_for, resolve_optimizer
from worker.entries import Entries
from worker.live.restore_plan import (
    RestoreSource,
    current_rings,
    plan_mesh_restore,
    ring_lost,
)
from worker.mesh import MeshEngine, ParallelConfig, build_mesh, engine_on_mesh
from worker.metrics import SnapshotBoard, start_metrics
from worker.rendezvous import ControlPlane, JobFinished, LeftBeforeAdmission, env_seconds
from worker.reporting import FinalReport, planned_config, report
from worker.schedule import SchedulerArg, resolve_scheduler
from worker.state import Counters

if TYPE_CHECKING:
    from worker.pipeline import Split

__all__ = ["PEER_LOSS_WAIT_ENV", "MeshSession"]

logger = logging.getLogger(__name__)

# how long a tensor-parallel error waits for the coordinator to confirm a lost
# peer (a newer generation) before it is taken for the script's own error
PEER_LOSS_WAIT_ENV = "ZEROPLANE_PEER_LOSS_WAIT_S"


class MeshSession(FinalReport):
    """One tensor-parallel worker's membership in an elastic coordinator's job
    ([Note: elastic by whole groups])."""

    def __init__(self, control: ControlPlane) -> None:
        super().__init__()
        self.control = control
        self.keeper = live.ReplicaKeeper()
        self.leave_requested = False
        # what this rank brought to a change still being made: a peer lost during
        # it leaves the state half rebuilt, and the next attempt brings this again
        self._carried: _Held | None = None

    def _on_sigterm(self, signum: int, frame: object) -> None:
        logger.info("SIGTERM: leaving at the next step boundary")
        self.leave_requested = True
        self.control.client.announce_leaving()

    # ------------------------------------------------------------ joining

    @classmethod
    def join(
        cls,
        model: nn.Module,
        optimizer: OptimizerArg,
        *,
        config: ZeroConfig,
        address: str,
        parallel: ParallelConfig,
        plan: object,
        device: torch.device,
        split: Split | None = None,
        loss_fn: LossFn | None = None,
        scheduler: SchedulerArg | None = None,
        init: Init | None = None,
    ) -> MeshEngine:
        """Register at ``address`` asking for ``parallel``'s tp and pp, wait for a
        place in a generation, form its group and mesh, and build the engine (a
        :class:`MeshEngine`, or a pipeline's stage): from the module in the job's
        first generation, from the members' shards after."""
        user_optimizer = resolve_optimizer(model, optimizer)
        scheduler = resolve_scheduler(scheduler, user_optimizer)
        # the whole model's inventory: the coordinator plans for the model as it is
        inventory = build_inventory_for(model, user_optimizer, config)
        metrics = start_metrics(config, SnapshotBoard())
        requested = threading.Event()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: requested.set())
        try:
            control = ControlPlane.join(
                address,
                inventory,
                device=device,
                metrics_port=None if metrics is None else metrics.port,
                stop=requested.is_set,
                stage=config.stage,
                mesh=(parallel.tensor_parallel, parallel.pipeline_parallel),
            )
        except LeftBeforeAdmission as exc:
            if metrics is not None:
                metrics.close()
            finished = isinstance(exc, JobFinished)
            logger.info("%s: nothing to do", "the job finished" if finished else "SIGTERM")
            raise SystemExit(0) from None
        session = cls(control)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, session._on_sigterm)
            if requested.is_set():
                session._on_sigterm(signal.SIGTERM, None)
        control.init_process_group()
        gen = control.generation
        shape = gen.mesh
        asked = (parallel.tensor_parallel, parallel.pipeline_parallel)
        if shape is None or (shape.tp, shape.pp) != asked:
            control.close(leave=True)
            raise RuntimeError(
                f"generation {gen.id} has the mesh {shape} ({gen.mesh_reason or 'none'}), "
                f"not tp={asked[0]}, pp={asked[1]}: is another job registered with this "
                "coordinator?"
            )
        mesh = build_mesh(shape, device.type)
        coords = shape.coords(control.rank)
        planned = planned_config(config, gen, control.rank)
        born = "peers" if gen.reshard is not None else "module"
        if shape.pp > 1:
            from worker.pipeline import lm_loss, pipeline_on_mesh

            engine: MeshEngine = pipeline_on_mesh(
                model, user_optimizer, config=planned, parallel=parallel, mesh=mesh,
                shape=shape, coords=coords, split=split, loss_fn=loss_fn or lm_loss,
                plan=plan, lr_scheduler=scheduler, device=device, metrics=metrics,
                initial_state=born,
            )  # fmt: skip
        else:
            engine = engine_on_mesh(
                MeshEngine, model, user_optimizer, model, planned, mesh, shape, coords, plan,
                scheduler, device=device, init=init, metrics=metrics, initial_state=born,
            )  # fmt: skip
            engine.loss_fn = loss_fn
        newcomer = born == "peers"
        engine.membership = session
        control.client.hold_position(engine.coords)
        session.report_at_exit(engine)
        if newcomer:
            # joining a running job: the members hand this rank its shards
            session._restore(engine, gen, held=None)
        else:
            session._refresh(engine)
        engine.state.drop_module_values()
        logger.info(
            "mesh %s from generation %d: this rank is %s, at step %d",
            _words(shape), gen.id, _words(engine.coords), engine.global_steps,
        )  # fmt: skip
        report(control, engine)
        return engine

    # ------------------------------------------------------------ the engine's seams

    def vote(self, engine: ZeroEngine) -> BoundaryVote:
        # the dp ballot carries no membership: the world votes in after_step
        return BoundaryVote(generation=self.control.generation.id)

    def generation_id(self) -> int:
        return self.control.generation.id

    def replica_bytes(self) -> int:
        return self.keeper.nbytes()

    def log_gradients(
        self, engine: ZeroEngine, grads: list[torch.Tensor], used: list[int]
    ) -> Handle | None:
        return None  # a lost rank rolls the job back to the replicas

    def after_load(self, engine: ZeroEngine) -> None:
        # replicas of the state before the load would roll a recovery back past it
        self.keeper.drop_refresh(wait=True)
        self.keeper.retire(self.keeper.replicas)
        self.keeper.replicas = []
        self._refresh(engine)

    def after_step(self, engine: ZeroEngine, agreed: BoundaryVote, stepped: bool) -> None:
        control = self.control
        self.keeper.confirm()  # the refresh started at the last boundary
        if stepped and control.report_due():
            report(control, engine)
        vote = torch.tensor(
            [control.latest_id, int(self.leave_requested)], dtype=torch.int64, device=engine.device
        )
        Collectives(None).all_reduce(vote, op="max", control=True)
        newest, leaving = (int(v) for v in vote.tolist())
        if leaving:
            self._leave_step(engine)
        elif newest > control.generation.id:
            start = time.perf_counter()
            gen = control.client.generation
            while gen is None or gen.id < newest:
                gen = control.wait_newer(member=False)
            self._switch(engine, gen, broken=False)
            engine.stats.record_pause("scale_up", time.perf_counter() - start)
        elif stepped:
            interval = engine.config.replica_interval
            if interval and engine.global_steps % interval == 0:
                self._refresh(engine)

    def recover(self, engine: ZeroEngine, exc: CollectiveError) -> NoReturn:
        """A peer is gone: form the coordinator's next generation, restore, and
        have the training loop carry on from ``engine.global_steps``."""
        start = time.perf_counter()
        self.keeper.drop_refresh(wait=False)  # its group is broken
        logger.warning("step abandoned (%s); waiting for the coordinator's next generation", exc)
        gen = self._next_generation()
        if gen is None:
            self._exit("the job ended while this rank waited to re-form")
        reached = engine.global_steps
        self._switch(engine, gen, broken=True)
        engine.mark_restored()
        engine.stats.record_pause("crash", time.perf_counter() - start)
        logger.warning(
            "recovered as %s of %s at step %d (this rank had reached step %d)",
            _words(engine.coords), _words(engine.shape), engine.global_steps, reached,  # type: ignore[attr-defined]
        )  # fmt: skip
        raise StepAborted(
            f"step abandoned after a lost peer; resume at step {engine.global_steps}"
        ) from exc

    def peer_lost(self) -> bool:
        """Whether the coordinator formed a newer generation (a peer was lost),
        waiting up to ``$ZEROPLANE_PEER_LOSS_WAIT_S`` (default 30 s) for it."""
        deadline = time.monotonic() + env_seconds(PEER_LOSS_WAIT_ENV, 30.0)
        while self.control.latest_id <= self.control.generation.id:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def settle(self) -> None:
        self.keeper.drop_refresh(wait=True)

    def close(self) -> None:
        self.settle()
        self._forget_exit(send=True)
        self.control.close(leave=True, reason=FINISHED)

    # ------------------------------------------------------------ changes

    def _leave_step(self, engine: ZeroEngine) -> None:
        """Some rank was asked to leave: every rank's replica is made current (one
        refresh, confirmed at once), the leavers go, and the rest re-form in the
        generation the coordinator forms without them, restoring from the replicas
        of this very step (nothing is trained again)."""
        self.keeper.refresh(engine.state, self.control.generation.id)
        self.keeper.confirm()
        if self.leave_requested:
            report(self.control, engine)
            self._exit("asked to leave")
        start = time.perf_counter()
        gen = self._next_generation()
        if gen is None:
            self._exit("the job ended while this rank waited to re-form")
        self._switch(engine, gen, broken=True)
        engine.stats.record_pause("scale_down", time.perf_counter() - start)

    def _next_generation(self) -> Generation | None:
        """The coordinator's next generation, whether it places this rank or not (a
        rank it leaves out stands by: :meth:`_switch`); None once the job is over.
        Below the job's minimum that may take a while: up to
        ``$ZEROPLANE_MEMBERSHIP_WAIT_S``."""
        control = self.control
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

    def _exit(self, why: str) -> NoReturn:
        """Leave the job and end this process with 0: what it held is the others' now."""
        self._forget_exit()  # not a finish: the job goes on without this rank
        self.control.final_report()
        self.control.close(leave=True)
        logger.info("left the job: %s", why)
        raise SystemExit(0)

    def _switch(self, engine: ZeroEngine, gen: Generation, *, broken: bool) -> None:
        """Move to ``gen``: re-form there, or stand by until a generation places this rank."""
        assert isinstance(engine, MeshEngine)
        control = self.control
        me = control.client.worker_id
        held = self._carried if self._carried is not None else self._hold(engine)
        self._carried = held
        engine.state.release()
        if gen.rank_of(me) is None:
            logger.warning(
                "generation %d has no place for this rank (its group was not whole): "
                "standing by", gen.id,
            )  # fmt: skip
            abort_default_group(control.timeout)
            held = self._carried = None
            placed = control.wait_to_re_form(stop=lambda: True)
            if placed is None:
                self._exit("the job ended while this rank stood by")
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
        self._restore(engine, gen, held=held)
        self._carried = None

    def _hold(self, engine: MeshEngine) -> _Held:
        """What this rank brings to the next generation, taken before its buffers go."""
        whole = engine.state.whole and not engine.state.micro_in_step
        replicas, self.keeper.replicas = self.keeper.replicas, []
        return _Held(
            generation=self.control.generation.id,
            pp=engine.coords.pp,
            tp=engine.coords.tp,
            dp=engine.rank,
            dp_size=engine.world_size,
            step=engine.global_steps,
            live=engine.state.export_ranges(copy=True) if whole else None,
            counters=engine.state.counters(),
            replicas=replicas,
        )

    def _restore(self, engine: MeshEngine, gen: Generation, held: _Held | None) -> None:
        """Every rank of ``gen``, in its new group: agree on the source and re-shard
        each ring over the new dp group ([Note: elastic by whole groups])."""
        coords, shape = engine.coords, engine.shape
        ring = coords.pp * shape.tp + coords.tp
        keep = held is not None and (held.pp, held.tp) == (coords.pp, coords.tp)
        mine = live.Holding(
            live=(held.generation, held.dp, held.dp_size)
            if keep and held is not None and held.live is not None
            else None,
            replicas=tuple(r.ident for r in held.replicas) if keep and held is not None else (),
            holds_state=keep,
            checkpoint=None if engine.last_checkpoint is None else str(engine.last_checkpoint),
            live_step=held.step if keep and held is not None and held.live is not None else -1,
        )
        table = torch.zeros(gen.world_size, 1 + mine.WIDTH, dtype=torch.int64, device=engine.device)
        table[self.control.rank, 0] = ring
        table[self.control.rank, 1:] = mine.encode()
        Collectives(None).all_reduce(table, op="sum", control=True)
        rows = table.cpu()
        rings: list[list[live.Holding]] = [[] for _ in range(shape.group_size)]
        for row in rows:
            rings[int(row[0])].append(live.Holding.decode(row[1:]))
        held_words = "; ".join(
            f"ring {r} (pp {r // shape.tp}, tp {r % shape.tp}): "
            + ", ".join(f"live {h.live} at {h.live_step}, replicas {h.replicas}" for h in held_by)
            for r, held_by in enumerate(rings)
        )
        logger.info("generation %d: the ranks hold %s", gen.id, held_words)
        rings = current_rings(rings)
        plan = plan_mesh_restore(rings)
        dp_comm = Collectives(engine.mesh["dp"].get_group())
        entries: Entries = {}
        counters: Counters | None = None
        if (
            plan.source is RestoreSource.LIVE
            and keep
            and held is not None
            and held.generation == plan.generation
        ):
            entries, counters = held.live or {}, held.counters
        elif plan.source is RestoreSource.REPLICA and keep and held is not None:
            wanted = (plan.generation, plan.step)
            replica = next((r for r in held.replicas if r.ident[:2] == wanted), None)
            if replica is not None:  # else it stood by: its state is older
                entries, counters = dict(replica.own), replica.counters
                assert plan.generation is not None and plan.step is not None
                if replica.neighbour_rank in ring_lost(rings[ring], *wanted):
                    entries.update(replica.neighbour)
        if plan.source is RestoreSource.CHECKPOINT:
            engine.state.build(dp_comm, from_module=False)  # torn until the checkpoint is in
            engine.load_checkpoint(plan.checkpoint or "")
        elif plan.source is RestoreSource.MODULE:
            engine.state.build_from_kept_module(dp_comm)
            engine.publish_snapshot()
        else:
            handover = live.exchange(
                engine.state,
                holds_state=bool(entries),
                via=dp_comm.group,
                new_members=list(range(shape.dp)),
                entries=entries,
                counters=counters,
            )
            engine.adopt(handover, dp_comm)
        if held is not None:
            self.keeper.retire(held.replicas)
        logger.info(
            "generation %d: restored from %s (step %d)", gen.id, plan.source, engine.global_steps
        )
        self._refresh(engine)
        report(self.control, engine)

    def _refresh(self, engine: ZeroEngine) -> None:
        """Start a replica refresh over the dp ring (confirmed at the next boundary)."""
        if engine.config.replica_interval:
            self.keeper.refresh(engine.state, self.control.generation.id)


def _words(mesh: MeshShape | MeshCoords) -> str:
    return f"pp={mesh.pp} dp={mesh.dp} tp={mesh.tp}"


@dataclass
class _Held:
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
