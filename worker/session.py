"""A worker's life in a coordinator's job: joining, following generations,
handing over, recovering. The engine (worker/engine.py) knows none of it:
it asks this session for its vote at each step boundary, tells it when a
step is done, and hands it any collective that failed.

[Note: session phases]
    JOINING ──admitted──▶ MEMBER ──SIGTERM voted──▶ LEAVING ──handed over──▶ LEFT
       │                   │  ▲                                            ▲
       │                   │  └────── restored ──── RECOVERING ◀── a collective failed
       └──stopped before admission──────────────────────────────────────────┘
* JOINING: registered with the coordinator, waiting for a rank, then forming
  the generation's group and receiving this rank's shards.
* MEMBER: training; at each step boundary the ranks' votes (worker/ballot.py)
  say whether a newer generation or a leave request is pending, and every
  rank acts on it at the same boundary (see [Note: membership changes]).
* LEAVING: this rank hands its shards to the survivors, leaves the
  coordinator and exits 0.
* RECOVERING: a peer was lost mid-step; the session forms the coordinator's
  next generation, restores one consistent state from the best source the
  group holds (worker/elastic.py [Note: recovery sources]) and raises
  :class:`StepAborted` so the training loop carries on from
  ``engine.global_steps``.
A SIGTERM in any phase only sets ``leave_requested``: it becomes a graceful
hand-over at the first step boundary, and before admission a plain leave.

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

import atexit
import collections
import contextlib
import dataclasses
import enum
import functools
import json
import logging
import math
import os
import signal
import statistics
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from coordinator.core.messages import FINISHED, STOPPED, Generation
from worker import ds_sections, elastic
from worker.ballot import BoundaryVote
from worker.collectives import CollectiveError, Collectives, Handle
from worker.compat import abort_default_group, backend_for
from worker.config import ZeroConfig
from worker.control import ControlPlane, JobFinished, LeftBeforeAdmission, coordinator_address
from worker.engine import (
    OptimizerArg,
    ZeroEngine,
    build_inventory_for,
    module_device,
    resolve_optimizer,
)
from worker.flat import Reserve
from worker.metrics import SnapshotBoard, start_metrics
from worker.schedule import SchedulerArg, resolve_scheduler
from worker.state import ShardState

__all__ = ["AttachedSession", "ElasticSession", "PeerLost", "Phase", "StepAborted", "initialize"]

logger = logging.getLogger(__name__)


class StepAborted(RuntimeError):
    """A peer was lost mid-step. The session has re-formed the job and rolled back to
    ``engine.global_steps``: carry on with the training loop from that step."""


# how long members train on waiting for a scale-up's ranks to be ready before
# switching anyway ([Note: meeting ahead] in worker/control.py)
_AHEAD_PATIENCE_S = 30.0
# [Note: a leave prepared ahead]: a rank asked to leave announces it first only
# when its steps are this short (the announcement costs it a step before it can
# hand over); the survivors hand over after preparing this long at most
_ANNOUNCE_MAX_STEP_S = 2.0
_LEAVE_PATIENCE_S = 4.0
_NO_GENERATION = "asked to leave while waiting for a generation, and the job is over"


class PeerLost(CollectiveError):
    """A generation lost members that were expected to carry on: recover as from a crash."""


@dataclasses.dataclass(frozen=True)
class _Timing:
    """Where a recovery's pause went: waiting for the coordinator's generation
    without the lost peer, then forming its group (the restore is timed after)."""

    waited_s: float
    formed_s: float

    def describe(self, restored_s: float) -> str:
        return (
            f"{self.waited_s:.2f}s for the new generation, {self.formed_s:.2f}s to form "
            f"its group, {restored_s:.2f}s to restore"
        )


class Phase(enum.Enum):
    """Where a worker is in its job ([Note: session phases])."""

    JOINING = "joining"
    MEMBER = "member"
    LEAVING = "leaving"
    RECOVERING = "recovering"
    LEFT = "left"


_TRANSITIONS: dict[Phase, set[Phase]] = {
    Phase.JOINING: {Phase.MEMBER, Phase.RECOVERING, Phase.LEFT},
    Phase.MEMBER: {Phase.MEMBER, Phase.LEAVING, Phase.RECOVERING, Phase.LEFT},
    Phase.LEAVING: {Phase.LEFT, Phase.RECOVERING},
    # a peer lost while recovering from an earlier loss: recover again
    Phase.RECOVERING: {Phase.MEMBER, Phase.RECOVERING, Phase.LEAVING, Phase.LEFT},
    Phase.LEFT: set(),
}


def initialize(
    model: nn.Module,
    optimizer: OptimizerArg | None = None,
    *,
    config: ZeroConfig | Mapping[str, Any] | str | os.PathLike | None = None,
    group: dist.ProcessGroup | None = None,
    coordinator: str | None = None,
    lr_scheduler: SchedulerArg | None = None,
) -> ZeroEngine:
    """Wrap ``model`` and ``optimizer`` in a ZeRO engine over ``group``.

    ``model`` must be identical on every rank (rank 0's values are broadcast
    regardless). ``optimizer`` is an optimizer over the model's parameters with
    no state yet, or a callable that takes param groups and returns one.
    ``lr_scheduler``: a torch LR scheduler of that optimizer, or a callable that
    builds one from it. The engine steps it after every optimizer step (do not
    step it yourself), saves it in checkpoints and keeps it at the engine's step
    when workers join, leave or crash (worker/schedule.py).

    ``config``: a :class:`ZeroConfig`, or a DeepSpeed config (a dict, or the
    path of its JSON file) read by :meth:`ZeroConfig.from_deepspeed`. As
    ``deepspeed.initialize`` does, its ``optimizer`` and ``scheduler`` sections
    build the optimizer and the LR schedule when the script passes none
    (worker/ds_sections.py); passing one and configuring one is an error.

    With a coordinator (``coordinator="host:port"`` or ``$ZEROPLANE_COORDINATOR``)
    and torch.distributed not yet initialized, the worker registers, is given
    a rank, and forms the process group itself; the coordinator's stage and
    layout apply. Otherwise torch.distributed must be initialized already (as
    under torchrun), or not at all for one process.
    """
    config, optimizer, lr_scheduler = _resolve_config(config, optimizer, lr_scheduler)
    address = coordinator_address(coordinator)
    if address is None and group is None:
        _init_from_launcher_env(model)
    own_group = group is not None or (dist.is_available() and dist.is_initialized())
    if address is None:
        return ZeroEngine(model, optimizer, config=config, group=group, lr_scheduler=lr_scheduler)
    if own_group:
        return AttachedSession.attach(
            model, optimizer, config=config, address=address, group=group, scheduler=lr_scheduler
        )
    return ElasticSession.join(
        model, optimizer, config=config, address=address, scheduler=lr_scheduler
    )


def _resolve_config(
    config: ZeroConfig | Mapping[str, Any] | str | os.PathLike | None,
    optimizer: OptimizerArg | None,
    lr_scheduler: SchedulerArg | None,
) -> tuple[ZeroConfig, OptimizerArg, SchedulerArg | None]:
    """The ZeroConfig, optimizer and scheduler that :func:`initialize` was given or
    that a DeepSpeed config's sections describe."""
    if config is None or isinstance(config, ZeroConfig):
        if optimizer is None:
            raise ValueError(
                "worker.initialize needs an optimizer, or a DeepSpeed config with an "
                "'optimizer' section"
            )
        return config or ZeroConfig(), optimizer, lr_scheduler
    if isinstance(config, str | os.PathLike):
        path = Path(config)
        try:
            ds = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read the DeepSpeed config {path}: {exc}") from exc
    else:
        ds = config
    if not isinstance(ds, Mapping):
        raise ValueError(f"a DeepSpeed config is a JSON object, got {type(ds).__name__}")
    ds = dict(ds)
    optimizer_section, scheduler_section = ds.pop("optimizer", None), ds.pop("scheduler", None)
    for given, section, what in (
        (optimizer, optimizer_section, "optimizer"),
        (lr_scheduler, scheduler_section, "scheduler"),
    ):
        if given is not None and section is not None:
            raise ValueError(
                f"a {what} was passed to worker.initialize and the DeepSpeed config has a "
                f"{what!r} section: give one of them"
            )
    if optimizer is None:
        if optimizer_section is None:
            raise ValueError(
                "worker.initialize needs an optimizer: pass one, or give the DeepSpeed "
                "config an 'optimizer' section"
            )
        ds_sections.optimizer_from_deepspeed(optimizer_section, [torch.zeros(1)])  # checked now
        optimizer = functools.partial(ds_sections.optimizer_from_deepspeed, optimizer_section)
    if scheduler_section is not None:
        lr_scheduler = ds_sections.scheduler_from_deepspeed(scheduler_section)
    return ZeroConfig.from_deepspeed(ds), optimizer, lr_scheduler


def _init_from_launcher_env(model: nn.Module) -> None:
    """Under torchrun (or any launcher that sets ``WORLD_SIZE`` > 1 and
    ``MASTER_ADDR``) with no process group yet, form the default group from that
    environment, as ``deepspeed.initialize`` does: a script that forgot
    ``dist.init_process_group`` must not silently train ``WORLD_SIZE`` separate
    copies of the model."""
    if not dist.is_available() or dist.is_initialized():
        return
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "MASTER_ADDR" not in os.environ:
        return
    backend = backend_for(module_device(model))
    dist.init_process_group(backend)
    logger.info(
        "formed the process group from the launcher's environment (%s, rank %d of %d)",
        backend,
        dist.get_rank(),
        dist.get_world_size(),
    )


def _report(control: ControlPlane, engine: ZeroEngine) -> None:
    """What this rank's heartbeats carry from now on: memory, step, loss, throughput."""
    control.report(
        engine.memory_report(),
        engine.global_steps,
        loss=engine.stats.last_step_loss(),
        samples=engine.stats.samples,
        tokens=engine.stats.tokens,
        checkpoint="" if engine.last_checkpoint is None else str(engine.last_checkpoint.resolve()),
        total_steps=engine.stats.total_steps,
    )


def _report_at_exit(
    control: ControlPlane, engine_ref: weakref.ref[ZeroEngine], settle: Callable[[], None]
) -> None:
    """At interpreter exit, the coordinator's last view of this rank is its last step;
    a script that ends without an uncaught exception has finished training. What the
    session still has on the wire lands first (``settle``)."""
    engine = engine_ref()
    if engine is not None and engine.membership is not None:
        finished = getattr(sys, "last_value", None) is None  # set when a traceback was printed
        if finished:
            settle()
        _report(control, engine)
        control.final_report()
        if finished:
            control.close(leave=True, reason=FINISHED)


@dataclass
class _Ahead:
    """A membership change a member prepares for while it trains: a scale-up
    ([Note: meeting ahead] in worker/control.py) or, with ``leaver`` (that rank
    of the current generation), a leave ([Note: a leave prepared ahead]). The
    generation (for a leave, the current one), since when, this rank's place
    after the change (None: it is the leaver), and the thread writing its
    buffers: the build's (worker/state.py [Note: a build from buffers written
    ahead]) and the exchange's."""

    generation: int
    since: float
    rank: int | None
    world_size: int
    leaver: int | None = None
    thread: threading.Thread | None = None
    wire: elastic.ExchangeBuffers | None = None

    def start(self, state: ShardState) -> None:
        # what to make is read here, beside the step; the thread only allocates
        send = elastic.sent_bound(state, self.rank, self.world_size)
        stays = self.rank is not None
        recv = elastic.packed_bound(state, self.rank, self.world_size) if stays else 0
        plan = state.reserve_plan(self.rank, self.world_size) if stays else []
        device = elastic.wire_device(state.comm)

        def write() -> None:
            try:
                if plan:
                    state.reserve = Reserve.make(plan)
                self.wire = elastic.ExchangeBuffers.make(send, recv, device)
            except Exception as exc:  # out of memory, say: the change allocates as before
                logger.warning("writing the buffers of generation %d ahead failed: %s",
                               self.generation, exc)  # fmt: skip

        self.thread = threading.Thread(target=write, name="zeroplane-prepare", daemon=True)
        self.thread.start()

    @property
    def written(self) -> bool:
        return self.thread is not None and not self.thread.is_alive()

    def prepares_leave(self, generation: int, leaver: int) -> bool:
        """Whether this prepares ``leaver``'s leave from ``generation``."""
        return (self.generation, self.leaver) == (generation, leaver)

    def ready(self, patience_s: float) -> bool:
        """Written, or prepared for longer than ``patience_s`` (then the change
        goes ahead with what is written, as it would unprepared)."""
        return self.written or time.monotonic() - self.since > patience_s


def _warm(engine: ZeroEngine, wire: list[elastic.ExchangeBuffers]) -> None:
    """A newcomer built ahead, while it meets the members: the transient buffers
    of its first backward (ShardState.warm), the optimizer state its import
    makes and a buffer to receive its shards into (worker/state.py [Note: a
    build from buffers written ahead]); appended to ``wire``."""
    state = engine.state
    state.warm()
    try:
        fields = state.state_fields()  # a probe: found once for both
        plan = state.reserve_plan(state.rank, state.world_size, buffers=False, fields=fields)
        state.reserve = Reserve.make(plan)
        recv = elastic.packed_bound(state, state.rank, state.world_size, fields)
        wire.append(elastic.ExchangeBuffers.make(0, recv, elastic.wire_device(state.comm)))
    except Exception as exc:  # out of memory, say: the import allocates as before
        logger.warning("writing the newcomer's buffers ahead failed: %s", exc)


def _grows(old: Generation, gen: Generation) -> bool:
    """Whether ``gen`` only adds ranks to ``old``: its first ranks are ``old``'s
    members, in order, and nobody left or was lost."""
    old_ids = [m.worker_id for m in old.members]
    lost = gen.reshard is not None and (gen.reshard.lost_ranks or gen.reshard.left_ranks)
    return not lost and [m.worker_id for m in gen.members[: len(old_ids)]] == old_ids


def _after_loss(gen: Generation) -> bool:
    """Whether ``gen`` replaces lost ranks: its members restore together, newcomers
    included, rather than exchange."""
    return gen.reshard is not None and bool(gen.reshard.lost_ranks)


def _planned(config: ZeroConfig, gen: Generation, rank: int) -> ZeroConfig:
    """``config`` with the generation's stage and bucket size, the coordinator's plan
    for the whole job; a stage other than the script's is said (once, by rank 0)."""
    changes: dict[str, Any] = {"bucket_numel": gen.bucket_numel}
    if gen.stage != config.stage:
        if rank == 0:
            logger.warning(
                "stage %d applies, not this script's ZeroConfig(stage=%d): %s",
                gen.stage,
                config.stage,
                gen.stage_reason or "the coordinator's plan",
            )
        changes["stage"] = gen.stage
        if gen.stage != 3:
            changes["stage3_gather_compression"] = "none"
            changes["offload_params"] = "none"
        if gen.stage == 0:
            changes["offload_optimizer"] = "none"
    return config.replace(**changes)


class _FinalReport:
    """A session whose last report (the final step, loss, tokens) reaches the
    coordinator when the interpreter exits, for the job's summary."""

    control: ControlPlane | None

    def __init__(self) -> None:
        self._at_exit: Callable[[], None] | None = None

    def report_at_exit(self, engine: ZeroEngine) -> None:
        assert self.control is not None
        self._at_exit = functools.partial(
            _report_at_exit, self.control, weakref.ref(engine), self.settle
        )
        atexit.register(self._at_exit)

    def settle(self) -> None:
        """Let what this session still has on the wire land (at the script's end)."""

    def _forget_exit(self, *, send: bool = False) -> None:
        """Drop the exit hook; ``send``: send its final report now (closing early)."""
        at_exit, self._at_exit = self._at_exit, None
        if at_exit is not None:
            atexit.unregister(at_exit)
            if send:
                at_exit()


class AttachedSession(_FinalReport):
    """A worker whose script formed the process group itself, in a coordinator's job.

    It registers (keeping the script's ranks), heartbeats, reports and serves
    metrics like any member, and takes the coordinator's stage and layout. The
    group is the script's, so zeroplane cannot re-form it: no worker joins or
    leaves while it runs, and a lost peer ends the job (as under torchrun).
    """

    def __init__(self, control: ControlPlane) -> None:
        super().__init__()
        self.control = control

    @classmethod
    def attach(
        cls,
        model: nn.Module,
        optimizer: OptimizerArg,
        *,
        config: ZeroConfig,
        address: str,
        group: dist.ProcessGroup | None,
        scheduler: SchedulerArg | None = None,
    ) -> ZeroEngine:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        user_optimizer = resolve_optimizer(model, optimizer)
        scheduler = resolve_scheduler(scheduler, user_optimizer)
        inventory = build_inventory_for(model, user_optimizer, config)
        metrics = start_metrics(config, SnapshotBoard())
        control = ControlPlane.join(
            address,
            inventory,
            device=module_device(model),
            metrics_port=None if metrics is None else metrics.port,
            stage=config.stage,
            fixed=(rank, world),
        )
        gen = control.generation
        if gen.world_size != world or control.rank != rank:
            control.close(leave=True)
            raise RuntimeError(
                f"the coordinator placed this worker at rank {control.rank} of "
                f"{gen.world_size}, but the script's process group has it at rank "
                f"{rank} of {world}: is another job registered with this coordinator?"
            )
        if rank == 0:
            logger.warning(
                "this script formed its own process group, which zeroplane cannot "
                "re-form: workers joining or leaving (elastic scaling, crash recovery "
                "from replicas) are off for this job. Let worker.initialize form the "
                "group (no dist.init_process_group in the script) to have them."
            )
        engine = ZeroEngine(
            model,
            user_optimizer,
            config=_planned(config, gen, rank),
            group=group,
            inventory=inventory,
            align=gen.align,
            metrics=metrics,
            lr_scheduler=scheduler,
        )
        if engine.layout != gen.layout:
            control.close(leave=True)
            raise RuntimeError(
                "the coordinator's bucket layout differs from this worker's: "
                "are all workers running the same model and zeroplane version?"
            )
        session = cls(control)
        engine.membership = session
        session.report_at_exit(engine)
        _report(control, engine)
        return engine

    # ------------------------------------------------------------ the engine's seams

    def vote(self, engine: ZeroEngine) -> BoundaryVote:
        return BoundaryVote(generation=self.control.generation.id)

    def generation_id(self) -> int:
        return self.control.generation.id

    def replica_bytes(self) -> int:
        return 0

    def log_gradients(
        self, engine: ZeroEngine, grads: list[torch.Tensor], used: list[int]
    ) -> Handle | None:
        return None  # no replicas: a lost peer ends the job

    def after_load(self, engine: ZeroEngine) -> None:
        pass

    def after_step(self, engine: ZeroEngine, agreed: BoundaryVote, stepped: bool) -> None:
        if stepped and self.control.report_due():
            _report(self.control, engine)

    def recover(self, engine: ZeroEngine, exc: CollectiveError) -> NoReturn:
        raise exc

    def close(self) -> None:
        self._forget_exit(send=True)
        self.control.close(leave=True, reason=FINISHED)


class ElasticSession(_FinalReport):
    """One worker's membership in a coordinator's job (see the module notes)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = Phase.JOINING
        self.leave_requested = False
        self.control: ControlPlane | None = None
        # the confirmed replica, then (while a refresh is unconfirmed) the new one
        self.replicas: list[elastic.Replica] = []
        # a refresh whose copies are on the wire ([Note: a refresh overlaps a step])
        self.refreshing: elastic.PendingRefresh | None = None
        # a host buffer nothing reads any more (a retired replica's snapshot, or
        # where an adopted hand-over arrived), for the next snapshot to reuse
        # (worker/elastic.py [Note: a snapshot into the last one's buffer])
        self.spare: torch.Tensor | None = None
        # the left neighbour's steps since the oldest replica ([Note: rolling a lost rank forward])
        self.log = elastic.GradientLog()
        # the generation whose membership this rank's shards belong to
        self.held_generation: int | None = None
        # between the two exchanges of a leave and a join in one generation: what
        # this survivor was handed (the whole job, over the survivors) and its id
        self.handed: tuple[elastic.StateId, elastic.Handover] | None = None
        # the scale-up or leave this member prepares for ([Note: meeting ahead],
        # [Note: a leave prepared ahead])
        self.ahead: _Ahead | None = None
        # the last step boundary (monotonic) and the times between the last few
        self._boundary_at: float | None = None
        self._gaps: collections.deque[float] = collections.deque(maxlen=5)

    def _to(self, phase: Phase) -> None:
        if phase not in _TRANSITIONS[self.phase]:
            raise RuntimeError(f"worker session: no transition from {self.phase} to {phase}")
        self.phase = phase

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        logger.info("SIGTERM: handing this rank's shards over at the next step boundary")
        self.leave_requested = True
        if self.control is not None:
            self.control.client.announce_leaving()  # a launcher stops counting it now

    # ------------------------------------------------------------ joining

    @classmethod
    def join(
        cls,
        model: nn.Module,
        optimizer: OptimizerArg,
        *,
        config: ZeroConfig,
        address: str,
        scheduler: SchedulerArg | None = None,
    ) -> ZeroEngine:
        """Register at ``address``, wait for a rank, form the generation's group and
        build the engine for it: from the module's values in a new job, from the
        members' shards when joining a running one."""
        session = cls()
        user_optimizer = resolve_optimizer(model, optimizer)
        scheduler = resolve_scheduler(scheduler, user_optimizer)
        inventory = build_inventory_for(model, user_optimizer, config)
        device = module_device(model)
        metrics = start_metrics(config, SnapshotBoard())
        if threading.current_thread() is threading.main_thread():
            # before registering: a SIGTERM while joining (a pod deleted as it
            # starts) is then a graceful leave at the first step boundary
            signal.signal(signal.SIGTERM, session._on_sigterm)

        def build(gen: Generation, rank: int, comm: Collectives | None) -> ZeroEngine:
            return ZeroEngine(
                model,
                user_optimizer,
                config=_planned(config, gen, rank),
                # after the job's first generation a new process holds nothing
                initial_state="peers" if gen.reshard is not None else "module",
                inventory=inventory,
                align=gen.align,
                metrics=metrics,
                lr_scheduler=scheduler,
                build_for=comm,
            )

        engine: ZeroEngine | None = None
        warming: threading.Thread | None = None
        wire: list[elastic.ExchangeBuffers] = []  # what the warm thread writes to receive into
        try:
            control = ControlPlane.join(
                address,
                inventory,
                device=device,
                metrics_port=None if metrics is None else metrics.port,
                stop=lambda: session.leave_requested,
                stage=config.stage,
            )
            session.control = control
            planned = control.generation
            if planned.reshard is not None:
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
                # rank's buffers are written ([Note: meeting ahead] in worker/control.py)
                control.init_process_group(ready=lambda: warming is None or not warming.is_alive())
            finally:
                if warming is not None:
                    warming.join()  # before anything else touches the state
        except LeftBeforeAdmission as exc:
            if isinstance(exc, JobFinished):
                logger.info("the job finished before this worker joined it: nothing to do")
            else:
                logger.info("SIGTERM before this worker was given a rank: left the job")
            if metrics is not None:
                metrics.close()
            session._to(Phase.LEFT)
            raise SystemExit(0) from None
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
        if newcomer and _after_loss(gen):
            # joining in a generation that replaces a lost rank (e.g. a restarted pod
            # under its old name): restore with the survivors, holding nothing
            session._to(Phase.RECOVERING)
            session._restore(engine, gen, holds_state=False)
        elif newcomer:
            # joining a running job: the members hand this rank its shards
            handover = elastic.exchange(
                engine.state,
                holds_state=False,
                via=None,
                new_members=list(range(gen.world_size)),
                buffers=wire[0] if wire else None,
            )
            if handover.nobody_held:
                # the generation this worker was admitted to superseded the job's first
                # before it formed: nobody trained yet, every rank starts from the module
                engine.state.build_from_kept_module(Collectives(None))
                engine.publish_snapshot()
                logger.info("the job starts in generation %d as rank %d", gen.id, engine.rank)
            else:
                session._adopt(engine, handover, None)
                logger.info("joined at step %d as rank %d", engine.global_steps, engine.rank)
            session._refresh_replica(engine)  # as the members do after the exchange
        session.held_generation = gen.id
        engine.state.drop_module_values()
        session._to(Phase.MEMBER)
        session._boundary_at = time.monotonic()  # its first step is timed from here
        _report(control, engine)
        return engine

    # ------------------------------------------------------------ the engine's seams

    def vote(self, engine: ZeroEngine) -> BoundaryVote:
        control = self.control
        assert control is not None
        generation, waiting = control.latest_id, False
        newest = control.client.generation
        ahead = self.ahead
        if ahead is not None and ahead.leaver is not None:
            # a leave was announced: hand over once every survivor has prepared
            waiting = ahead.rank is not None and not ahead.ready(_LEAVE_PATIENCE_S)
        elif self.leave_requested:
            # announce the leave first, where a step is short enough to afford it
            waiting = self._step_estimate() <= _ANNOUNCE_MAX_STEP_S
        elif (
            newest is not None
            and newest.id > control.generation.id
            and _grows(control.generation, newest)
            and not self._ready_for(engine, newest)
        ):
            generation, waiting = control.generation.id, True
        return BoundaryVote(
            generation=generation,
            leaving_rank=control.rank if self.leave_requested else None,
            staying=not self.leave_requested,
            waiting=waiting,
        )

    def _step_estimate(self) -> float:
        """How long this rank's steps take: the median of the last few; before any
        was timed (a newcomer told to leave in its first step), this one so far."""
        if self._gaps:
            return statistics.median(self._gaps)
        if self._boundary_at is None:
            return math.inf
        return time.monotonic() - self._boundary_at

    def _ready_for(self, engine: ZeroEngine, gen: Generation) -> bool:
        """Whether every rank of ``gen``, a scale-up of this one, is ready to switch
        ([Note: meeting ahead] in worker/control.py): polled at each step boundary
        while the members train on, for at most ``_AHEAD_PATIENCE_S``; after that the
        switch goes ahead, and the meeting handles a newcomer that never came. This
        rank is ready once it has written its buffers for ``gen`` (worker/state.py
        [Note: a build from buffers written ahead]), in a thread started here."""
        control = self.control
        assert control is not None
        ahead = self.ahead
        if ahead is None or ahead.generation != gen.id:
            self._join_ahead()
            rank = gen.rank_of(control.client.worker_id)
            assert rank is not None
            self.ahead = ahead = _Ahead(gen.id, time.monotonic(), rank, gen.world_size)
            ahead.start(engine.state)
        if time.monotonic() - ahead.since > _AHEAD_PATIENCE_S:
            return True
        return control.prepare(gen, ready=ahead.written)

    def _join_ahead(self, *, drop: bool = False) -> None:
        """Before anything builds: the thread writing buffers ahead is done;
        ``drop``: the change it prepared for will not come (what the build does
        not take of them goes with the build)."""
        if self.ahead is not None and self.ahead.thread is not None:
            self.ahead.thread.join()
        if drop:
            self.ahead = None

    def generation_id(self) -> int:
        return 0 if self.control is None else self.control.generation.id

    def replica_bytes(self) -> int:
        pending = 0 if self.refreshing is None else self.refreshing.nbytes()
        spare = 0 if self.spare is None else self.spare.numel()
        return sum(r.nbytes() for r in self.replicas) + self.log.nbytes() + pending + spare

    def log_gradients(
        self, engine: ZeroEngine, grads: list[torch.Tensor], used: list[int]
    ) -> Handle | None:
        """[Note: rolling a lost rank forward] in worker/elastic.py. Whether to send
        depends only on what every rank agrees on (config, world, stage), so every
        rank's send meets its neighbour's receive."""
        st, config = engine.state, engine.config
        if not (
            config.replica_interval
            and config.replica_gradient_log
            and st.stage.optimizer_sharded
            and not st.placement.optimizer_on_host
            and st.comm.distributed
            and grads
        ):
            return None
        assert self.control is not None
        return self.log.start(
            st.comm,
            self.control.generation.id,
            st.global_steps + 1,
            grads,
            used,
            st.optimizer.hyperparams(),
        )

    def after_load(self, engine: ZeroEngine) -> None:
        # replicas of the state before the load would roll a recovery back past it
        # (should a peer die in the refresh, the checkpoint just loaded serves)
        self._drop_refresh(wait=True)
        self._retire(self.replicas)
        self.replicas = []
        self._refresh_replica(engine)

    def after_step(self, engine: ZeroEngine, agreed: BoundaryVote, stepped: bool) -> None:
        control = self.control
        assert control is not None
        if stepped:
            self.log.commit(engine.global_steps)
        now = time.monotonic()
        if self._boundary_at is not None:
            self._gaps.append(now - self._boundary_at)
        self._boundary_at = now
        self._confirm_refresh(engine)  # before anything changes the membership
        leaving = None if agreed.everyone_leaving else agreed.leaving_rank
        if leaving is not None and agreed.waiting:
            self._prepare_leave(engine, leaving)  # announced: hand over once prepared
            leaving = None
        switching = agreed.switches_to_newer(control.generation.id)
        changing = agreed.everyone_leaving or leaving is not None or switching
        if stepped:
            interval = engine.config.replica_interval
            if interval and engine.global_steps % interval == 0 and not changing:
                self._refresh_replica(engine)  # (a change refreshes once it is made)
            if control.report_due():
                _report(control, engine)
        start = time.perf_counter()
        if changing:
            self._join_ahead(drop=not (switching or leaving is not None))
        if agreed.everyone_leaving:
            self._leave_holding_state(engine, "every member was asked to leave at this step")
        if leaving is not None:
            self._hand_over(engine, leaving)
            engine.stats.record_pause("scale_down", time.perf_counter() - start)
        elif switching:
            gen = control.wait_newer()
            while gen.id < agreed.generation:
                control.generation, gen = gen, control.wait_newer()
            self._grow_to(engine, gen)
            engine.stats.record_pause("scale_up", time.perf_counter() - start)

    def _refresh_replica(self, engine: ZeroEngine) -> None:
        """Start a refresh: every rank of the generation, at the same step boundary (a
        collective). The next boundary confirms it ([Note: a refresh overlaps a step]
        in worker/elastic.py)."""
        if not engine.config.replica_interval:
            return
        assert self.control is not None
        self._confirm_refresh(engine)
        spare, self.spare = self.spare, None
        self.refreshing = elastic.start_refresh(
            engine.state, self.control.generation.id, into=spare
        )
        if self.log.generation != self.refreshing.generation:
            # a new generation: its log starts at the snapshot (a recovery uses it
            # only with a replica of this generation, i.e. once this one is confirmed)
            self.log.reset(self.refreshing.generation, self.refreshing.counters.global_steps)

    def _confirm_refresh(self, engine: ZeroEngine) -> None:
        """Two-phase (worker/elastic.py [Note: in-memory replicas]): the previous
        replica is dropped only once the barrier proves every rank has the new one."""
        pending, self.refreshing = self.refreshing, None
        if pending is None:
            return
        fresh = pending.finish()
        self.replicas = [*self.replicas[-1:], fresh]
        pending.comm.barrier()
        self._retire(self.replicas[:-1])
        self.replicas = [fresh]
        self.log.reset(fresh.generation, fresh.counters.global_steps)

    def _retire(self, replicas: list[elastic.Replica]) -> None:
        """``replicas`` are dropped: their snapshot buffers may serve the next one."""
        self._keep_spare(*(elastic.buffer_of(r) for r in replicas))

    def _keep_spare(self, *buffers: torch.Tensor | None) -> None:
        """Keep the largest of ``buffers`` (host buffers nothing reads any more) and
        the spare held, for the next snapshot to reuse (worker/elastic.py [Note: a
        snapshot into the last one's buffer])."""
        held = [b for b in (self.spare, *buffers) if b is not None]
        self.spare = max(held, key=lambda b: b.numel(), default=None)

    def _adopt(
        self, engine: ZeroEngine, handover: elastic.Handover, comm: Collectives | None
    ) -> None:
        """``engine.adopt``; the buffer the hand-over arrived in is then free."""
        engine.adopt(handover, comm)
        self._keep_spare(handover.received)

    def settle(self) -> None:
        if self.phase is Phase.MEMBER:
            self._drop_refresh(wait=True)  # every member started it

    def _drop_refresh(self, *, wait: bool) -> None:
        """Forget a refresh in flight (after a loss; ``wait``: let its bytes land first,
        so that no peer's send meets a closed connection)."""
        pending, self.refreshing = self.refreshing, None
        if pending is not None and wait:
            with contextlib.suppress(CollectiveError):
                pending.handle.wait()

    def recover(self, engine: ZeroEngine, exc: CollectiveError) -> NoReturn:
        """A peer is gone: form the coordinator's next generation and restore."""
        control = self.control
        assert control is not None
        self._to(Phase.RECOVERING)
        self._join_ahead(drop=True)
        self._drop_refresh(wait=False)  # its group is broken
        if engine.state.whole:
            # the gradients from the left of the last step, or of the step whose go
            # failed, if they arrived before the loss
            self.log.commit(engine.global_steps)
        logger.warning("step abandoned (%s); waiting for the coordinator's next generation", exc)
        start = time.perf_counter()
        gen = control.wait_to_re_form(stop=lambda: self.leave_requested)
        if gen is None:
            self._leave_holding_state(engine, _NO_GENERATION, broken=True)
        heard = time.perf_counter()
        control.move_to(gen, broken=True)
        timing = _Timing(heard - start, time.perf_counter() - heard)
        self._restore(engine, control.generation, holds_state=True, timing=timing)
        engine.stats.record_pause("crash", time.perf_counter() - start)
        self._to(Phase.MEMBER)
        engine.publish_snapshot()
        raise StepAborted(
            f"step abandoned after a lost peer; resume at step {engine.global_steps}"
        ) from exc

    def _recover_in_formed(self, engine: ZeroEngine, intended: Generation) -> NoReturn:
        """The rendezvous of ``intended`` was superseded by a generation that lost
        ranks: restore in the one formed, as every rank of it does
        ([Note: superseded rendezvous])."""
        assert self.control is not None
        self._to(Phase.RECOVERING)
        formed = self.control.generation
        logger.warning(
            "generation %d was superseded by %d, which lost members: restoring",
            intended.id,
            formed.id,
        )
        self._restore(engine, formed, holds_state=True)
        self._to(Phase.MEMBER)
        engine.publish_snapshot()
        raise StepAborted(
            f"a membership change overlapped a loss; resume at step {engine.global_steps}"
        )

    def close(self) -> None:
        member = self.phase is Phase.MEMBER
        self._join_ahead()
        self.settle()
        self._forget_exit(send=member)
        if self.phase is not Phase.LEFT and self.control is not None:
            # a member closing its engine has ended training ([Note: a finishing job])
            self.control.close(leave=True, reason=FINISHED if member else "")
        self.phase = Phase.LEFT

    # ------------------------------------------------------------ membership changes

    def _prepare_leave(self, engine: ZeroEngine, leaving: int) -> None:
        """Rank ``leaving`` announced its leave ([Note: a leave prepared ahead]):
        write the buffers of the generation without it, in a thread."""
        assert self.control is not None
        current = self.control.generation.id
        if self.ahead is not None and self.ahead.prepares_leave(current, leaving):
            return
        self._join_ahead(drop=True)  # a scale-up's preparation gives way
        survivors = [r for r in range(engine.world_size) if r != leaving]
        rank = None if engine.rank == leaving else survivors.index(engine.rank)
        self.ahead = _Ahead(current, time.monotonic(), rank, len(survivors), leaver=leaving)
        self.ahead.start(engine.state)

    def _hand_over(self, engine: ZeroEngine, leaving: int) -> None:
        """[Note: a leave prepared ahead]
        A leave used to be heard at the boundary it handed over at: the survivors
        then built the new layout's buffers, the optimizer state and the
        hand-over's buffers while everyone waited, and faulted the rest in during
        their first step at the new size (bench/elastic.py, 3→2: 0.41 s of pause,
        0.15 s of it in that step). Now a rank asked to leave votes "waiting" at
        its first boundary, which announces the leave without making it; every
        rank then writes what it will need in a thread (``_Ahead`` with
        ``leaver``: the survivors their buffers for the generation without it,
        the leaver its send buffer) and votes "waiting" until written, at most
        ``_LEAVE_PATIENCE_S``; the hand-over is made at the first boundary nobody
        waits at. The announcement costs the leaver one step, so a rank whose
        steps take longer than ``_ANNOUNCE_MAX_STEP_S`` (the median of its last
        five) hands over unannounced, as before: its grace period is finite. A
        scale-up pending meanwhile waits for the leave; the generation it formed
        still holds the leaver, so the survivors wait for the next one (before,
        they took it for a lost member and recovered, or hung). The send buffer
        is sized to what a rank sends (``elastic.sent_bound``): a scale-down's
        first survivor keeps all it owns and writes none."""
        control = self.control
        assert control is not None
        ahead, self.ahead = self.ahead, None
        prepared = ahead is not None and ahead.prepares_leave(control.generation.id, leaving)
        wire = ahead.wire if prepared else None
        survivors = [r for r in range(engine.world_size) if r != leaving]
        if engine.rank == leaving:
            self._to(Phase.LEAVING)
        handover = elastic.exchange(
            engine.state, holds_state=True, via=None, new_members=survivors, buffers=wire
        )
        if engine.rank == leaving:
            engine.state.release()
            dist.destroy_process_group()
            self._forget_exit()
            control.close(leave=True)
            self._to(Phase.LEFT)
            logger.info("handed over at step %d; leaving", handover.counters.global_steps)
            raise SystemExit(0)
        old = control.generation
        gen = control.wait_to_re_form(stop=lambda: self.leave_requested)
        while gen is not None and _grows(old, gen):
            # a scale-up formed before the leave (the leaver is in it, and its
            # newcomers wait for it): the coordinator forms the next without the leaver
            control.generation = gen
            gen = control.wait_to_re_form(stop=lambda: self.leave_requested)
        if gen is None:
            self._leave_holding_state(engine, _NO_GENERATION)
        survivor_ids = [m.worker_id for m in old.members if m.rank != leaving]
        others_lost = gen.reshard is not None and set(gen.reshard.lost_ranks) - {leaving}
        if others_lost or [m.worker_id for m in gen.members[: len(survivor_ids)]] != survivor_ids:
            # another member vanished meanwhile: recover like a crash
            raise PeerLost(
                f"generation {gen.id} lost more of generation {old.id} than rank {leaving}"
            )
        control.move_to(gen)
        if control.generation.id != gen.id:
            self._recover_in_formed(engine, gen)
        if gen.world_size > len(survivor_ids):
            # workers admitted in the same generation: pass them their shards of what
            # the survivors were just handed (they run the join exchange). Should a
            # newcomer die meanwhile, that hand-over is whole: recovery starts from it.
            me = survivors.index(engine.rank)
            self.handed = ((gen.id, me, len(survivors)), handover)
            handover = elastic.exchange(
                engine.state,
                holds_state=True,
                via=None,
                new_members=list(range(gen.world_size)),
                entries=handover.entries,
                counters=handover.counters,
            )
        self._adopt(engine, handover, Collectives(None))
        self.held_generation, self.handed = gen.id, None
        self._refresh_replica(engine)  # newcomers, at the end of their join, too
        logger.info(
            "rank %d left; now rank %d of %d%s",
            leaving,
            engine.rank,
            engine.world_size,
            "" if wire is None else " (prepared ahead)",
        )

    def _leave_holding_state(
        self, engine: ZeroEngine, why: str, *, broken: bool = False
    ) -> NoReturn:
        """Leave without a hand-over: nobody is left to take this rank's shards
        ([Note: leaving with nobody to hand over to])."""
        assert self.control is not None
        kept = engine.last_checkpoint
        logger.warning(
            "%s: leaving at step %d with nobody to hand the shards over to; the job "
            "stops, and what it trained after %s is not kept",
            why,
            engine.global_steps,
            f"the checkpoint {kept}" if kept is not None else "its start",
        )
        self._to(Phase.LEAVING)
        self._drop_refresh(wait=False)
        engine.state.release()
        if broken:
            abort_default_group(self.control.timeout)
        elif dist.is_initialized():
            dist.destroy_process_group()
        self._forget_exit()
        self.control.close(leave=True, reason=STOPPED)
        self._to(Phase.LEFT)
        raise SystemExit(0)

    def _grow_to(self, engine: ZeroEngine, gen: Generation) -> None:
        control = self.control
        assert control is not None
        old = control.generation
        if not _grows(old, gen):
            # a member vanished without a graceful hand-over: recover like a crash
            raise PeerLost(f"generation {gen.id} lost members of generation {old.id}")

        control.move_to(gen)
        if control.generation.id != gen.id and _after_loss(control.generation):
            self._recover_in_formed(engine, gen)
        gen = control.generation
        ahead, self.ahead = self.ahead, None
        wire = ahead.wire if ahead is not None and ahead.generation == gen.id else None
        # the exchange exports from the old layout and rank, which the state still holds
        handover = elastic.exchange(
            engine.state,
            holds_state=True,
            via=None,
            new_members=list(range(gen.world_size)),
            buffers=wire,
        )
        self._adopt(engine, handover, Collectives(None))
        self.held_generation = gen.id
        self._refresh_replica(engine)  # the newcomers, at the end of their join, too
        logger.info("grew to %d ranks at step %d", engine.world_size, engine.global_steps)

    # ------------------------------------------------------------ recovery

    def _live(self, engine: ZeroEngine) -> elastic.StateId | None:
        """Whose state this rank's shards are, while whole ([Note: recovery sources])."""
        if self.handed is not None:
            return self.handed[0]
        if self.held_generation is None or not engine.state.whole:
            return None
        return (self.held_generation, engine.rank, engine.world_size)

    def _restore(
        self,
        engine: ZeroEngine,
        gen: Generation,
        *,
        holds_state: bool,
        timing: _Timing | None = None,
    ) -> None:
        """Bring every rank of ``gen`` to one consistent state after a loss, from the
        best source the group holds (worker/elastic.py [Note: recovery sources]).
        A collective of the new group; a worker that joins in the same generation
        (a restarted pod under its old name) takes part holding nothing
        (``holds_state=False``)."""
        assert self.control is not None
        started = time.perf_counter()
        reached = engine.global_steps
        replicas, self.replicas = (self.replicas if holds_state else []), []
        log, self.log = self.log, elastic.GradientLog()
        live = self._live(engine) if holds_state else None
        mine = elastic.Holding(
            live=live,
            replicas=tuple(r.ident for r in replicas),
            holds_state=holds_state,
            checkpoint=None if engine.last_checkpoint is None else str(engine.last_checkpoint),
            live_step=engine.global_steps if live is not None else -1,
            log=log.coverage() if holds_state else None,
        )
        table = torch.zeros(gen.world_size, mine.WIDTH, dtype=torch.int64, device=engine.device)
        table[self.control.rank] = mine.encode()
        comm = Collectives(None)
        comm.all_reduce(table, op="sum", control=True)
        holdings = [elastic.Holding.decode(row) for row in table.cpu()]
        plan = elastic.plan_restore(holdings)
        logger.info(
            "recovery plan %s (generation %s, step %s, lost %s) from %s",
            plan.source, plan.generation, plan.step, sorted(plan.lost),
            "; ".join(f"live {h.live} at {h.live_step}, log {h.log}, replicas {h.replicas}"
                      for h in holdings),
        )  # fmt: skip
        members = list(range(gen.world_size))
        if plan.source == "live":
            sends = live is not None and live[0] == plan.generation
            handed, self.handed = self.handed, None
            entries: elastic.Entries | None = None if sends else {}
            if sends and handed is not None:  # a hand-over this rank had not adopted yet
                entries = handed[1].entries
            handover = elastic.exchange(
                engine.state,
                holds_state=sends,
                via=None,
                new_members=members,
                entries=entries,
                counters=None if handed is None else handed[1].counters,
            )
            self._adopt(engine, handover, comm)
            source = "live state, nothing rolled back"
        elif plan.source == "forward":
            # survivors keep their state; each lost rank's comes from its right neighbour
            entries = engine.state.export_ranges(copy=False) if live is not None else {}
            left = (engine.rank - 1) % engine.world_size
            replayed = 0
            if live is not None and left in plan.lost:
                replica = max(
                    (
                        r
                        for r in replicas
                        if r.generation == plan.generation
                        and log.after <= r.counters.global_steps <= (plan.step or 0)
                    ),
                    key=lambda r: r.counters.global_steps,
                )
                steps = log.between(replica.counters.global_steps, plan.step or 0)
                entries.update(elastic.roll_forward(engine.state, left, replica.neighbour, steps))
                replayed = len(steps)
            handover = elastic.exchange(
                engine.state,
                holds_state=live is not None,
                via=None,
                new_members=members,
                entries=entries,
            )
            self._adopt(engine, handover, comm)
            source = (
                f"live state; lost rank(s) {sorted(plan.lost)} brought forward from their "
                f"replicas and logged gradients ({replayed} step(s) here), nothing rolled back"
            )
        elif plan.source == "replica":
            entries = {}
            wanted = (plan.generation, plan.step)
            replica = next((r for r in replicas if r.ident[:2] == wanted), None)
            if replica is not None:
                entries = dict(replica.own)
                if replica.neighbour_rank in plan.lost:
                    entries.update(replica.neighbour)
            handover = elastic.exchange(
                engine.state,
                holds_state=holds_state,
                via=None,
                new_members=members,
                entries=entries,
                counters=None if replica is None else replica.counters,
            )
            self._adopt(engine, handover, comm)
            source = "in-memory replicas"
        elif plan.source == "module":
            engine.state.build_from_kept_module(comm)
            engine.publish_snapshot()
            source = "nothing: every holder of the job's state was lost, it starts again"
        else:
            checkpoint_dir = Path(plan.checkpoint or "")
            engine.state.build(comm, from_module=False)  # torn until the checkpoint is in
            engine.load_checkpoint(checkpoint_dir)
            engine.last_checkpoint = checkpoint_dir
            source = str(checkpoint_dir)
        engine.mark_restored()
        self.held_generation = gen.id
        self._retire(replicas)  # adopted: nothing reads them now
        # a second loss before the next interval must find this generation's replicas
        self._refresh_replica(engine)
        _report(self.control, engine)  # the coordinator admits newcomers once all applied it
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
