"""Membership: leases, standbys and the formation of generations.

A pure state machine (no gRPC, no threads): the server calls it from one event
loop and passes no time in; the clock is injected so tests can drive it.

[Note: generations]
A generation is a fixed membership. Its members keep their relative order
from one generation to the next (so a surviving rank 0 stays rank 0 and keeps
hosting the rendezvous); joiners are appended, grouped by host. A member that
leaves, loses its lease, or comes back as a new process (a new incarnation)
is *lost*: it is not in the next generation, whose reshard schedule lists
its old rank in ``left_ranks`` if it asked to leave (a zeroplane worker hands
its shards over first) or else in ``lost_ranks`` (its state is gone).
Heartbeats are fenced by generation id so that no worker keeps a lease
without knowing the current membership.

[Note: atomic formation]
Forming a generation is three steps: ``propose`` decides who is in it and
where its rendezvous is (cheap, reads the state), ``build_generation``
computes its layout and reshard schedule from that proposal alone (pure,
linear in the inventory, so the server runs it in steps, see
coordinator/core/steps.py, while other requests go on), and
``commit`` publishes it only if the proposal still holds (no proposed worker
went away meanwhile; else the server proposes again). A server that cannot
encode a built generation calls ``refuse`` instead: nothing changes, the
reason shows in status, and no generation is proposed again until the
membership changes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from coordinator.core.conversions import inventory_digest
from coordinator.core.layout import ParamSpec, layout_steps
from coordinator.core.meshplan import (
    GroupArrangement,
    MeshCoords,
    MeshShape,
    arrange_groups,
    choose_mesh,
    tp_sharded_numel,
)
from coordinator.core.messages import (
    FINISHED,
    STOPPED,
    Event,
    Generation,
    Member,
    RankBeat,
    StatusReport,
    WorkerInfo,
    WorkerReport,
    WorkerStatus,
    metrics_target,
)
from coordinator.core.planner import PlanConfig, StageChoice, choose_stage
from coordinator.core.ports import free_port
from coordinator.core.reshard import LazyMoves, ReshardSchedule, check_reshardable
from coordinator.core.settings import MembershipConfig
from coordinator.core.steps import Steps, finish

__all__ = [
    "InvalidRequest",
    "InventoryMismatch",
    "Membership",
    "MembershipError",
    "Proposal",
    "Snapshot",
    "StaleGeneration",
    "UnknownWorker",
    "build_generation",
    "build_steps",
    "first_difference",
]

logger = logging.getLogger(__name__)

# workers whose last report is kept for the job's summary (the newest)
MAX_LAST_REPORTS = 4096


def _mesh_words(mesh: tuple[int, int] | None) -> str:
    if mesh is None:
        return "no mesh (data parallel only)"
    tp, pp = (str(d) if d else "auto" for d in mesh)
    return f"tp={tp}, pp={pp}"


class MembershipError(Exception):
    """A request the membership cannot honour; the server maps each kind to a status code."""


class InvalidRequest(MembershipError):
    """Malformed or out of range (INVALID_ARGUMENT)."""


class InventoryMismatch(MembershipError):
    """The worker's parameter inventory is not the job's (FAILED_PRECONDITION)."""


class UnknownWorker(MembershipError):
    """No lease for this worker: it must register again (NOT_FOUND)."""


class StaleGeneration(MembershipError):
    """The request carries a generation other than the current one (FAILED_PRECONDITION)."""

    def __init__(self, given: int, current: int) -> None:
        super().__init__(f"generation {given} is stale: the current generation is {current}")
        self.given = given
        self.current = current


@dataclass
class _Worker:
    info: WorkerInfo
    registered_at: float
    deadline: float
    free_ports: tuple[int, ...]
    report: WorkerReport | None = None
    # open generation streams, and since when none is (see [Note: disconnects])
    streams: int = 0
    unwatched_since: float | None = None
    # the IP address its last register or heartbeat came from; "" if unknown
    peer: str = ""
    # it said it was asked to leave (HeartbeatRequest.leaving)
    leaving: bool = False

    @property
    def metrics_url(self) -> str:
        """The worker's metrics at the address it connects from (see WorkerStatus)."""
        if not self.peer or not self.info.metrics_endpoint:
            return ""
        _, port, path = metrics_target(self.info.metrics_endpoint)
        host = f"[{self.peer}]" if ":" in self.peer else self.peer
        return f"http://{host}:{port}{path}"


@dataclass(frozen=True, kw_only=True)
class Proposal:
    """Who is in the next generation, decided on the server's loop (see [Note: atomic
    formation]); everything ``build_generation`` needs, so it can run anywhere."""

    id: int
    previous: Generation | None
    # In rank order, with the info each registered with.
    workers: tuple[_Worker, ...]
    infos: tuple[WorkerInfo, ...]
    admitted: tuple[str, ...]
    lost: frozenset[str]
    left: frozenset[str]
    choice: StageChoice
    rendezvous_endpoint: str
    inventory: tuple[ParamSpec, ...]
    digest: str
    bucket_numel: int
    align: int
    created_unix_s: float
    epoch: str
    mesh: MeshShape | None = None
    mesh_reason: str = ""
    # survivors of the previous generation left out (an elastic mesh job's broken group)
    standby: tuple[str, ...] = ()


def build_generation(p: Proposal) -> Generation:
    """The generation ``p`` proposes: its layout, and the reshard schedule from the previous
    one. Pure and linear in the inventory (see [Note: atomic formation])."""
    return finish(build_steps(p))


def build_steps(p: Proposal) -> Steps[Generation]:
    """``build_generation`` in steps (coordinator/core/steps.py [Note: steps])."""
    layout = yield from layout_steps(
        p.inventory,
        len(p.infos),
        bucket_numel=p.bucket_numel,
        align=p.align,
        by_unit=p.choice.stage == 3,
    )
    previous = p.previous
    reshard = None
    if previous is not None:
        # the moves are built when asked for, whole or per worker
        # (coordinator/core/reshard.py [Note: incremental schedule])
        check_reshardable(previous.layout, layout)
        yield
        reshard = ReshardSchedule(
            from_generation_id=previous.id,
            from_world_size=previous.world_size,
            from_stage=previous.stage,
            moves=LazyMoves(previous.layout, layout),
            lost_ranks=tuple(
                sorted(
                    m.rank
                    for m in previous.members
                    if m.worker_id in p.lost and m.worker_id not in p.left
                )
            ),
            left_ranks=tuple(sorted(m.rank for m in previous.members if m.worker_id in p.left)),
        )
    # a lost member that registered again is a joiner: its state is gone
    survivors = () if previous is None else previous.members
    previous_rank = {m.worker_id: m.rank for m in survivors if m.worker_id not in p.lost}
    members = tuple(
        Member(
            worker_id=info.worker_id,
            rank=rank,
            host=info.host,
            previous_rank=previous_rank.get(info.worker_id),
            device_memory_bytes=info.device_memory_bytes,
        )
        for rank, info in enumerate(p.infos)
    )
    return Generation(
        id=p.id,
        members=members,
        rendezvous_endpoint=p.rendezvous_endpoint,
        stage=p.choice.stage,
        stage_reason=p.choice.reason,
        layout=layout,
        bucket_numel=p.bucket_numel,
        align=p.align,
        reshard=reshard,
        inventory_digest=p.digest,
        created_unix_s=p.created_unix_s,
        epoch=p.epoch,
        mesh=p.mesh,
        mesh_reason=p.mesh_reason,
    )


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """What running workers need to survive a coordinator restart."""

    inventory: tuple[ParamSpec, ...]
    generation: Generation | None
    members: tuple[WorkerInfo, ...]
    epoch: str
    # inventory_digest(inventory) and inventory_wire of it, when known
    inventory_digest: str = ""
    inventory_wire: bytes = field(default=b"", repr=False, compare=False)
    # members of ``generation`` that left since it formed; the member that ended training
    left: tuple[str, ...] = ()
    finished_by: str = ""
    # why the job is stopping unfinished, once it is
    stopping: str = ""
    # ``generation`` serialized as the server publishes it, less what follows from the
    # inventory (a ``Generation`` with its members whole, its layout without buckets,
    # its reshard schedule without moves), and the same with its members as a
    # ``MembersDelta`` from the generation before; empty when not at hand. The state
    # file stores these bytes rather than encoding the generation again
    # (coordinator/control/statefile.py [Note: state file format]).
    generation_wire: bytes = field(default=b"", repr=False, compare=False)
    generation_delta_wire: bytes = field(default=b"", repr=False, compare=False)

    def inconsistency(self) -> str | None:
        """What makes this snapshot unusable, in words; None if nothing."""
        gen = self.generation
        if gen is None:
            return None
        if not self.inventory:
            return f"generation {gen.id} has no parameter inventory"
        known = {info.worker_id for info in self.members}
        for m in gen.members:
            if m.worker_id not in known:
                return f"generation {gen.id} lists {m.worker_id!r}, who is not among the members"
        if len(known) != len(self.members):
            return "a member is listed twice"
        strangers = sorted(set(self.left) - {m.worker_id for m in gen.members})
        if strangers:
            return f"generation {gen.id} has no member {strangers[0]!r}, who is listed as left"
        return None


def first_difference(job: Sequence[ParamSpec], given: Sequence[ParamSpec]) -> str | None:
    """The first parameter where ``given`` differs from ``job``, in words; None if equal."""
    for i, (a, b) in enumerate(zip(job, given, strict=False)):
        if a.name != b.name:
            return f"parameter {i} is {b.name!r} where the job's is {a.name!r}"
        for attr in ("shape", "dtype", "requires_grad", "group", "unit"):
            mine, theirs = getattr(b, attr), getattr(a, attr)
            if mine != theirs:
                return f"parameter {b.name!r} has {attr} {mine!r} where the job's has {theirs!r}"
    if len(given) < len(job):
        return (
            f"parameter {job[len(given)].name!r} is missing "
            f"({len(given)} parameters where the job has {len(job)})"
        )
    if len(given) > len(job):
        return (
            f"parameter {given[len(job)].name!r} is not in the job's inventory "
            f"({len(given)} parameters where the job has {len(job)})"
        )
    return None


class Membership:
    """Workers, their leases, and the current generation of one job (see the module notes)."""

    def __init__(
        self,
        config: MembershipConfig,
        plan: PlanConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.plan = plan
        self._clock = clock
        self._wall = wall_clock
        # Replaced by the snapshot's on restore; a fresh start is a new epoch.
        self.epoch = uuid.uuid4().hex[:16]
        self.inventory: tuple[ParamSpec, ...] | None = None
        self.digest = ""
        self.inventory_wire = b""
        self.trainable_numel = 0
        self.generation: Generation | None = None
        self._workers: dict[str, _Worker] = {}
        # the ranks each host agent listed in its last heartbeat ([Note: host heartbeats])
        self._hosts: dict[str, set[str]] = {}
        # Registered workers not in the current generation, in registration order.
        self._joiners: dict[str, None] = {}
        # an elastic mesh job's standbys and the position each held: its engine is
        # built for that pipeline stage and tp slice, so it can fill only that
        # position ([Note: arranging whole groups])
        self._standby_at: dict[str, MeshCoords] = {}
        # the rendezvous endpoints of the last generations, not given out again soon
        self._recent_endpoints: deque[str] = deque(maxlen=8)
        # every worker's last report, kept after it leaves or is lost (the job's summary)
        self._last_reports: dict[str, WorkerReport] = {}
        # Members of the current generation that are gone (left, expired, replaced).
        self._lost: dict[str, _Worker] = {}
        self._left: set[str] = set()  # the lost that asked to leave
        self._finished_by: str | None = None  # the first member whose training ended
        # why the job is stopping unfinished (a launcher stopping it, or members told
        # to leave with nobody to hand over to)
        self._stopping: str | None = None
        self.events: deque[Event] = deque(maxlen=config.event_history)
        # A refused formation: the state it was refused in, and why (see [Note: atomic formation]).
        self._refused: tuple[tuple, str] | None = None

    # ---- requests ---------------------------------------------------------------------

    @property
    def generation_id(self) -> int:
        return 0 if self.generation is None else self.generation.id

    def register(
        self,
        info: WorkerInfo,
        inventory: Sequence[ParamSpec],
        *,
        digest: str | None = None,
        wire: bytes = b"",
        peer: str = "",
    ) -> bool:
        """Admit ``info`` (or re-attach it); True when it was a re-attach.

        ``inventory`` may be the job's own tuple (``self.inventory``), which is then not
        compared again; ``digest`` and ``wire``: its digest and canonical encoding
        (``conversions.inventory_wire``), if the caller has them. ``peer``: the IP address
        the registration came from.
        """
        self._check_inventory(inventory, digest, wire)
        self._check_mesh(info)
        now = self._clock()
        lease = now + self.config.lease_timeout_s
        old = self._workers.get(info.worker_id)
        if old is not None and old.info.incarnation == info.incarnation:
            old.info, old.deadline = info, lease
            old.free_ports = info.free_ports or old.free_ports
            old.peer = peer or old.peer
            self._bind_held(info)
            self._event("reattached", info.worker_id)
            return True
        if old is not None:
            self._drop(info.worker_id, "replaced", "registered again as a new process")
        self._workers[info.worker_id] = _Worker(info, now, lease, info.free_ports, peer=peer)
        self._joiners[info.worker_id] = None
        self._bind_held(info)
        self._event("registered", info.worker_id, f"host {info.host}")
        return False

    def _bind_held(self, info: WorkerInfo) -> None:
        """A joiner whose engine holds a mesh position (``WorkerInfo.held``: it trained
        before, and registers again after a coordinator restart or a lost lease) is
        arranged only there, as a standby is ([Note: arranging whole groups]). The
        worker says so itself, so the binding survives a restart without a state file
        entry."""
        if info.held is not None and info.worker_id in self._joiners:
            self._standby_at[info.worker_id] = info.held

    def _check_mesh(self, info: WorkerInfo) -> None:
        """Every worker of a job asks for the same mesh (or none): one rank on another
        mesh would build a different DeviceMesh and hang the first collective."""
        for other in self._workers.values():
            if other.info.worker_id != info.worker_id and other.info.mesh != info.mesh:
                raise InventoryMismatch(
                    f"worker {info.worker_id!r} asks for {_mesh_words(info.mesh)}, the job's "
                    f"workers for {_mesh_words(other.info.mesh)}: every worker of a job runs "
                    "the same --tp/--pp"
                )
            break

    def heartbeat(
        self,
        worker_id: str,
        generation_id: int,
        report: WorkerReport | None = None,
        free_ports: tuple[int, ...] = (),
        peer: str = "",
        leaving: bool = False,
    ) -> float:
        """Renew the lease; returns the seconds it now has left. ``peer``: the IP address
        the heartbeat came from; ``leaving``: the worker was asked to leave and hands
        over at its next step boundary (kept even from a stale heartbeat)."""
        worker = self._workers.get(worker_id)
        if worker is None:
            raise UnknownWorker(f"no lease for worker {worker_id!r}: register again")
        if leaving and not worker.leaving:
            worker.leaving = True
            self._event("leaving", worker_id, "asked to leave; it goes at its next step boundary")
        if generation_id != self.generation_id:
            raise StaleGeneration(generation_id, self.generation_id)
        worker.deadline = self._clock() + self.config.lease_timeout_s
        if report is not None:
            worker.report = report
            self._last_reports.pop(worker_id, None)  # newest last, oldest evicted first
            self._last_reports[worker_id] = report
            while len(self._last_reports) > MAX_LAST_REPORTS:
                del self._last_reports[next(iter(self._last_reports))]
        if free_ports:
            worker.free_ports = free_ports
        if peer:
            worker.peer = peer
        return self.config.lease_timeout_s

    # [Note: host heartbeats]
    # At 100,000 ranks one heartbeat per rank is 100,000 RPCs a second, beyond
    # what one Python process serves. A host's agent (its launcher, or its lowest
    # local rank) sends one heartbeat for all the ranks on it, so the load is
    # hosts. Each rank in it counts as that rank's own heartbeat (fenced by its
    # own generation id, its report kept), and the agent lists every rank it
    # knows alive: a rank it listed last time and leaves out now has died, and
    # is dropped at once, as when a launcher sees a process exit. So detection
    # is never slower than with per-rank heartbeats (the next host heartbeat,
    # within the lease); a silent host loses all its ranks' leases together,
    # and the next generation forms without all of them at once.

    def host_heartbeat(
        self, host_id: str, beats: Sequence[RankBeat], peer: str = ""
    ) -> tuple[list[str], list[tuple[str, float | MembershipError]]]:
        """Renew the lease of every rank in ``beats`` for the agent of ``host_id``; drop
        the ranks it reported before and leaves out now ([Note: host heartbeats]).
        Returns the ranks dropped, and per beat, in order, the rank and its lease's
        seconds left or the error its own heartbeat would have raised."""
        seen = {b.worker_id for b in beats}
        before = self._hosts.get(host_id)
        dropped = []
        if before:
            for wid in sorted(before - seen):
                if wid in self._workers:
                    self._drop(wid, "expired", f"its host agent {host_id} no longer reports it")
                    dropped.append(wid)
        self._hosts[host_id] = seen
        out: list[tuple[str, float | MembershipError]] = []
        for b in beats:
            try:
                remaining = self.heartbeat(
                    b.worker_id, b.generation_id, b.report, b.free_ports, peer, b.leaving
                )
            except MembershipError as exc:
                out.append((b.worker_id, exc))
            else:
                out.append((b.worker_id, remaining))
        return dropped, out

    def leave(self, worker_id: str, reason: str = "") -> bool:
        """Drop ``worker_id``; False if it held no lease (leaving twice is fine).

        A member leaving because its training loop ended (``reason`` FINISHED)
        finishes the job: no generation forms after it, and workers still waiting
        for a rank are told to go ([Note: a finishing job])."""
        if worker_id not in self._workers:
            return False
        member = worker_id not in self._joiners
        self._drop(worker_id, "left", reason)
        if reason == FINISHED and member and self._finished_by is None:
            self._finished_by = worker_id
            self._event("finished", worker_id, "training ended; no new generation will form")
        if reason == STOPPED and member:
            self.stop(f"{worker_id} was told to leave with nobody to hand over to")
        return True

    def stop(self, why: str) -> None:
        """The job is stopping unfinished (``why``): as after a finish, no generation
        forms any more, and heartbeats tell every worker still waiting for one that
        the job is over ([Note: a finishing job])."""
        if self._stopping is None and self._finished_by is None:
            self._stopping = why
            self._event("stopping", detail=f"{why}; no new generation will form")

    # [Note: a finishing job]
    # Members reach the end of training at the same step and leave one by one.
    # Without a word from them, each leave looks like a member lost: the
    # coordinator would re-form the job for the rest, and a worker added at that
    # moment would be admitted into a generation whose members are exiting, wait
    # at its rendezvous and fail a job whose result is already written. So a
    # member whose loop ended says so (leave reason FINISHED); from then on the
    # coordinator forms nothing, and heartbeats tell standbys and admitted
    # newcomers that have not formed their group yet that the job is done.

    @property
    def finished(self) -> bool:
        """Whether the job is over: a member left because its training ended, or the
        job is stopping (:meth:`stop`)."""
        return self._finished_by is not None or self._stopping is not None

    # [Note: disconnects]
    # Every worker keeps a generation stream (WatchGenerations) open for as long as
    # it runs. When its process dies the kernel closes the connection and the
    # stream ends at once, long before the lease runs out. A live worker whose
    # stream breaks opens a new one within its client's back-off (0.1 s at
    # first), so a worker with no open stream for a heartbeat interval is taken
    # as gone (MembershipConfig.disconnect_grace_s): a crash then costs the
    # survivors about one heartbeat interval of waiting instead of a whole lease.
    # The lease still covers a worker that hangs with its connection open, and a
    # network that drops packets silently.

    def watch_opened(self, worker_id: str) -> object | None:
        """A generation stream of ``worker_id`` opened; returns a token for
        :meth:`watch_closed` (None for a worker without a lease)."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            worker.streams += 1
            worker.unwatched_since = None
        return worker

    def watch_closed(self, worker_id: str, token: object | None) -> None:
        worker = self._workers.get(worker_id)
        if worker is None or worker is not token:
            return  # dropped meanwhile, or the stream of an older incarnation
        worker.streams -= 1
        if worker.streams == 0:
            worker.unwatched_since = self._clock()

    def process_exited(self, worker_id: str, how: str) -> bool:
        """The launcher that runs ``worker_id`` saw its process exit (``how``: the
        exit code or signal, in words): drop it at once, without waiting for its
        connection's grace or its lease. False if it was not here (it had left)."""
        if worker_id not in self._workers:
            return False
        self._drop(worker_id, "expired", f"its process {how}")
        return True

    def expire(self) -> list[str]:
        """Drop every worker whose lease has run out, or whose generation stream
        closed and stayed closed for a heartbeat interval; returns their ids."""
        now = self._clock()
        grace = self.config.disconnect_grace_s
        if grace is None:
            grace = self.config.heartbeat_interval_s
        gone: list[tuple[str, str]] = []
        for wid, w in self._workers.items():
            if w.deadline < now:
                gone.append((wid, f"no heartbeat for {self.config.lease_timeout_s:g}s"))
            elif w.unwatched_since is not None and now - w.unwatched_since > grace:
                gone.append((wid, f"its connection closed and stayed closed for {grace:g}s"))
        for wid, why in gone:
            self._drop(wid, "expired", why)
        return [wid for wid, _ in gone]

    # ---- generations ------------------------------------------------------------------

    def maybe_form(self) -> Generation | None:
        """Form the next generation if one is due (see MembershipConfig); else None."""
        proposal = self.propose()
        if proposal is None:
            return None
        generation = build_generation(proposal)
        committed = self.commit(proposal, generation)
        assert committed, "nothing changed between propose and commit"
        return generation

    def propose(self) -> Proposal | None:
        """The next generation's membership if one is due; else None."""
        if not self._due():
            return None
        assert self.inventory is not None
        previous = self.generation
        survivors = (
            []
            if previous is None
            else [m.worker_id for m in previous.members if m.worker_id not in self._lost]
        )
        fixed = self._fixed_group()
        arranged = self._arrange_groups()
        standby: tuple[str, ...] = ()
        if fixed is not None:
            # a group the workers' script formed itself: its ranks are theirs
            admitted = sorted(fixed, key=lambda wid: self._workers[wid].info.fixed_rank or 0)
        elif arranged is not None:
            # an elastic mesh job: whole groups, each survivor keeping its position
            survivors, admitted = list(arranged.order), list(arranged.admitted)
            standby = arranged.standby
        else:
            _, admitted_count = self._target_size()
            admitted = [w for w in self._joiners if self._workers[w].info.fixed_rank is None]
            admitted = admitted[:admitted_count]
            # Joiners grouped by host, so that ranks on one machine are neighbours.
            admitted.sort(key=lambda wid: (self._workers[wid].info.host, wid))
        order = survivors if arranged is not None else survivors + admitted
        workers = tuple(self._workers[wid] for wid in order)
        infos = tuple(w.info for w in workers)
        memories = [i.device_memory_bytes for i in infos if i.device_memory_bytes > 0]
        plan, asked = self.plan, self._asked_stage(workers)
        if asked is not None:
            plan = dataclasses.replace(plan, stage=asked)
        # The generation's stage must be one the workers can run as they are
        # configured; offload is their ZeroConfig's, so it is planned without and,
        # where only offload fits, proposed in the reason (planner.py [Note:
        # planning offload]).
        choice = choose_stage(
            self.trainable_numel,
            world_size=len(workers),
            device_memory_bytes=min(memories, default=0),
            config=dataclasses.replace(plan, offload=False),
        )
        if not choice.fits and memories and plan.offload and plan.stage is None:
            advice = choose_stage(
                self.trainable_numel,
                world_size=len(workers),
                device_memory_bytes=min(memories),
                config=plan,
            )
            if advice.offload != "none":
                proposal = advice.reason.split("; ", 1)[-1]
                choice = dataclasses.replace(choice, reason=f"{choice.reason}; {proposal}")
        if asked is not None:
            choice = dataclasses.replace(
                choice,
                reason=choice.reason.replace("set by configuration", "asked for by the workers"),
            )
        mesh, mesh_reason = None, ""
        if infos[0].mesh is not None:
            mesh, mesh_reason, choice = self._plan_mesh(
                infos[0].mesh, len(infos), memories, choice, asked
            )
        if not choice.fits and memories:
            logger.warning("generation %d: %s", self.generation_id + 1, choice.reason)
        return Proposal(
            id=self.generation_id + 1,
            previous=previous,
            workers=workers,
            infos=infos,
            admitted=tuple(admitted),
            lost=frozenset(self._lost),
            left=frozenset(self._left),
            choice=choice,
            rendezvous_endpoint=self._rendezvous(workers[0], previous),
            inventory=self.inventory,
            digest=self.digest,
            bucket_numel=self.plan.bucket_numel,
            align=self.plan.align,
            created_unix_s=self._wall(),
            epoch=self.epoch,
            mesh=mesh,
            mesh_reason=mesh_reason,
            standby=standby,
        )

    def _plan_mesh(
        self,
        asked: tuple[int, int],
        world: int,
        memories: list[int],
        choice: StageChoice,
        stage_asked: int | None,
    ) -> tuple[MeshShape, str, StageChoice]:
        """The mesh of a generation of ``world`` ranks, why, and the stage it runs.

        The degrees the workers ask for stand; one they leave to the coordinator (0:
        ``--mesh auto``) is :func:`~coordinator.core.meshplan.choose_mesh`'s choice
        from the inventory and the smallest device memory, and so is the stage unless
        one was configured or asked for. With the device memory unknown nothing is
        chosen: a degree left open is 1, and a pipeline's stage at most 2 (what
        worker/mesh.py runs with pp > 1)."""
        tp, pp = asked
        stage_free = self.plan.stage is None and stage_asked is None
        if not memories:
            shape = MeshShape.for_world(world, tp=tp or 1, pp=pp or 1)
            reason = (
                f"tp={shape.tp}, pp={shape.pp} as asked"
                if tp and pp
                else f"device memory unknown: tp={shape.tp}, pp={shape.pp}, no model "
                "parallelism that was not asked for"
            )
            if stage_free and shape.pp > 1 and choice.stage > 2:
                choice = dataclasses.replace(
                    choice, stage=2, reason="stage 2, the highest a pipeline runs"
                )
            return shape, reason, choice
        assert self.inventory is not None
        picked = choose_mesh(
            self.trainable_numel,
            sharded_numel=tp_sharded_numel((p.name, p.numel) for p in self.inventory),
            world_size=world,
            device_memory_bytes=min(memories),
            config=dataclasses.replace(self.plan, offload=False, stage=None),
            tp=tp or None,
            pp=pp or None,
            # tp must divide the heads, pp at most the layers, where the plan knows them
            heads=None if self.plan.activations is None else self.plan.activations.heads,
            layers=None if self.plan.activations is None else self.plan.activations.layers,
        )
        best = picked.chosen
        if stage_free:
            choice = dataclasses.replace(
                choice, stage=best.stage, reason=f"stage {best.stage} on the mesh", fits=picked.fits
            )
        who = "as asked" if tp and pp else "chosen by the coordinator"
        return best.shape, f"{who}: {picked.reason}", choice

    def commit(self, proposal: Proposal, generation: Generation) -> bool:
        """Publish ``generation``, built from ``proposal``; False (nothing changes) when
        the proposal no longer holds: propose again."""
        if (
            self.generation is not proposal.previous
            or set(self._lost) != proposal.lost
            or any(self._workers.get(w.info.worker_id) is not w for w in proposal.workers)
        ):
            return False
        self.generation = generation
        self._recent_endpoints.append(generation.rendezvous_endpoint)
        for wid in proposal.admitted:
            del self._joiners[wid]
            self._standby_at.pop(wid, None)
        for wid in proposal.standby:
            # a survivor whose model-parallel group could not be completed
            self._joiners[wid] = None
            previous = proposal.previous
            if previous is not None and previous.mesh is not None:
                rank = previous.rank_of(wid)
                if rank is not None:
                    self._standby_at[wid] = previous.mesh.coords(rank)
            self._event("standby", wid, "its model-parallel group is not whole")
        self._lost.clear()
        self._left.clear()
        self._refused = None
        self._event(
            "generation",
            detail=f"world size {generation.world_size}, stage {generation.stage}, "
            f"rendezvous {generation.rendezvous_endpoint}",
        )
        return True

    def refuse(self, proposal: Proposal, reason: str) -> None:
        """``proposal`` cannot be published (its generation does not encode): keep the
        current generation and propose nothing until the membership changes."""
        self._refused = (self._formation_state(), reason)
        detail = f"generation {proposal.id} cannot form: {reason}"
        self._event("refused", detail=detail, level=logging.ERROR)

    def _formation_state(self) -> tuple:
        return (self.generation_id, tuple(self._joiners), tuple(self._lost))

    def _refusal(self) -> str | None:
        if self._refused is None or self._refused[0] != self._formation_state():
            return None
        return self._refused[1]

    def _fixed_group(self) -> list[str] | None:
        """The joiners of a process group their script formed itself, once all of
        its ranks have registered (None: no such group is complete)."""
        fixed = [w for w in self._joiners if self._workers[w].info.fixed_rank is not None]
        if not fixed:
            return None
        size = self._workers[fixed[0]].info.fixed_world_size
        ranks = {self._workers[w].info.fixed_rank for w in fixed}
        return fixed if len(fixed) == size and ranks == set(range(size or 0)) else None

    def _asked_stage(self, workers: Sequence[_Worker]) -> int | None:
        """The stage the workers' ZeroConfig asks for, when the coordinator has none."""
        if self.plan.stage is not None or not self.plan.stage_from_workers:
            return None
        asked = sorted({w.info.stage for w in workers if w.info.stage is not None})
        if len(asked) > 1:
            logger.warning(
                "the workers ask for different stages (%s): stage %d, the highest, applies",
                ", ".join(map(str, asked)),
                asked[-1],
            )
        return asked[-1] if asked else None

    def _elastic_mesh(self) -> tuple[int, int] | None:
        """The (tp, pp) of an elastic mesh job: workers that ask for fixed degrees
        (not ``--mesh auto``) without a group of their own; None otherwise."""
        for w in self._workers.values():
            mesh = w.info.mesh
            if mesh is None or w.info.fixed_rank is not None or 0 in mesh:
                return None
            return mesh
        return None

    def _arrange_groups(self) -> GroupArrangement | None:
        """An elastic mesh job's next generation as whole groups
        (coordinator/core/meshplan.py [Note: arranging whole groups]); None for any
        other job."""
        degrees = self._elastic_mesh()
        if degrees is None:
            return None
        previous = self.generation
        survivors: dict[str, MeshCoords] = {}
        if previous is not None and previous.mesh is not None:
            survivors = {
                m.worker_id: previous.mesh.coords(m.rank)
                for m in previous.members
                if m.worker_id not in self._lost
            }
        # a standby keeps the position its engine was built for: queued with the
        # survivors there, admitted when a group takes it
        bound = {w: c for w, c in self._standby_at.items() if w in self._joiners}
        joiners = [
            w for w in self._joiners if self._workers[w].info.fixed_rank is None and w not in bound
        ]
        joiners.sort(key=lambda wid: (self._workers[wid].info.host, wid))  # a group on one host
        arranged = arrange_groups(
            tp=degrees[0],
            pp=degrees[1],
            survivors={**survivors, **bound},
            joiners=joiners,
            max_world=self.config.max_workers,
        )
        placed = set(arranged.order)
        return dataclasses.replace(
            arranged,
            admitted=arranged.admitted + tuple(w for w in bound if w in placed),
            standby=tuple(w for w in arranged.standby if w not in bound),
        )

    def _target_size(self) -> tuple[int, int]:
        arranged = self._arrange_groups()
        if arranged is not None:
            return arranged.world_size - len(arranged.admitted), len(arranged.admitted)
        survivors = 0 if self.generation is None else self.generation.world_size - len(self._lost)
        admitted = min(len(self._joiners), self.config.max_workers - survivors)
        if survivors >= self.config.min_workers and self._recovering():
            admitted = 0
        return survivors, admitted

    def _recovering(self) -> bool:
        """The current generation replaced lost ranks and not every member has
        applied it yet. Newcomers wait for it: its members restore together, and a
        generation that superseded it before it formed must replace lost ranks too,
        so that everyone in it takes the same path (worker/rendezvous.py
        [Note: superseded rendezvous])."""
        gen = self.generation
        if gen is None or gen.reshard is None or not gen.reshard.lost_ranks:
            return False
        for m in gen.members:
            if m.worker_id in self._lost:
                continue
            w = self._workers.get(m.worker_id)
            if w is None or w.report is None or w.report.applied_generation_id < gen.id:
                return True
        return False

    def _due(self) -> bool:
        if self.finished:
            return False
        if self.generation is None and any(
            self._workers[w].info.fixed_rank is not None for w in self._joiners
        ):
            return self._fixed_group() is not None
        survivors, admitted = self._target_size()
        if not self._lost and admitted == 0:
            return False
        if self._refused is not None and self._refusal() is not None:
            return False
        if survivors + admitted < self.config.min_workers:
            return False
        if self._lost or survivors + admitted >= self.config.max_workers:
            return True
        return self._clock() - self._window_start() >= self.config.join_window_s

    def _window_start(self) -> float:
        first = next(iter(self._joiners))
        return self._workers[first].registered_at

    def waiting_reason(self) -> str:
        if self._finished_by is not None:
            return f"the job finished ({self._finished_by} ended training)"
        if self._stopping is not None:
            return f"the job is stopping ({self._stopping})"
        refused = None if self._refused is None else self._refusal()
        if refused is not None:
            return f"generation {self.generation_id + 1} cannot form: {refused}"
        survivors, admitted = self._target_size()
        have, need = survivors + admitted, self.config.min_workers
        if self._lost and have < need:
            return (
                f"generation {self.generation_id} lost {len(self._lost)} member(s); "
                f"{have} worker(s) left, the job needs at least {need}"
            )
        if admitted == 0:
            return "" if self.generation is not None else f"no workers yet (need at least {need})"
        if have < need:
            return f"{have} of at least {need} workers registered"
        left = self.config.join_window_s - (self._clock() - self._window_start())
        return f"join window: generation {self.generation_id + 1} forms in {max(left, 0):.1f}s"

    def _rendezvous(self, rank0: _Worker, previous: Generation | None) -> str:
        # A fresh port per generation: an old store may still be up while ranks move
        # over, and a broken generation's for as long as its group is held after an
        # abort (worker/compat.py abort_default_group): not one of the last few.
        used = set(self._recent_endpoints)
        if previous is not None:
            used.add(previous.rendezvous_endpoint)
        for port in rank0.free_ports:
            endpoint = _endpoint(rank0.info.host, port)
            if endpoint not in used:
                return endpoint
        # Correct only when rank 0 runs beside the coordinator (local runs).
        while True:
            endpoint = _endpoint(rank0.info.host, free_port())
            if endpoint not in used:
                logger.warning(
                    "rank 0 (%s) reported no free port; using %s, free on the coordinator's host",
                    rank0.info.worker_id,
                    endpoint,
                )
                return endpoint

    # ---- status and persistence -------------------------------------------------------

    def last_reports(self) -> dict[str, WorkerReport]:
        """Each worker's last report by id, including workers that left or were lost."""
        return dict(self._last_reports)

    def status(self, server_version: str = "") -> StatusReport:
        now = self._clock()
        rows: list[WorkerStatus] = []
        gen = self.generation
        for m in () if gen is None else gen.members:
            lost = self._lost.get(m.worker_id)
            w = lost or self._workers[m.worker_id]
            rows.append(
                WorkerStatus(
                    info=w.info,
                    state="lost" if lost else "member",
                    rank=m.rank,
                    lease_remaining_s=w.deadline - now,
                    report=w.report,
                    metrics_url=w.metrics_url,
                    leaving=w.leaving and not lost,
                )
            )
        for wid in self._joiners:
            w = self._workers[wid]
            rows.append(
                WorkerStatus(
                    info=w.info,
                    state="standby",
                    rank=None,
                    lease_remaining_s=w.deadline - now,
                    report=w.report,
                    metrics_url=w.metrics_url,
                    leaving=w.leaving,
                )
            )
        reason = self.waiting_reason()
        return StatusReport(
            phase="running" if gen is not None and not self._lost else "waiting",
            waiting_reason=reason,
            generation_id=self.generation_id,
            world_size=0 if gen is None else gen.world_size,
            stage=0 if gen is None else gen.stage,
            stage_reason="" if gen is None else gen.stage_reason,
            rendezvous_endpoint="" if gen is None else gen.rendezvous_endpoint,
            workers=tuple(rows),
            events=tuple(self.events),
            settings=self.config,
            trainable_numel=self.trainable_numel,
            inventory_digest=self.digest,
            server_version=server_version,
            epoch=self.epoch,
            mesh=None if gen is None else gen.mesh,
            mesh_reason="" if gen is None else gen.mesh_reason,
        )

    def snapshot(self) -> Snapshot:
        gen = self.generation
        members = ()
        if gen is not None:
            members = tuple(
                (self._lost.get(m.worker_id) or self._workers[m.worker_id]).info
                for m in gen.members
            )
        return Snapshot(
            inventory=self.inventory or (),
            generation=gen,
            members=members,
            epoch=self.epoch,
            inventory_digest=self.digest,
            inventory_wire=self.inventory_wire,
            left=tuple(w for w in self._left if gen is not None and gen.rank_of(w) is not None),
            finished_by=self._finished_by or "",
            stopping=self._stopping or "",
        )

    def restore(self, snapshot: Snapshot) -> None:
        """Take over a snapshot after a restart; every member gets a fresh lease to re-attach."""
        if self._workers or self.generation is not None:
            raise RuntimeError("restore() needs a fresh Membership")
        problem = snapshot.inconsistency()
        if problem is not None:
            raise ValueError(f"inconsistent snapshot: {problem}")
        if snapshot.epoch:
            self.epoch = snapshot.epoch
        if snapshot.inventory:
            self._set_inventory(
                snapshot.inventory, snapshot.inventory_digest or None, snapshot.inventory_wire
            )
        self.generation = snapshot.generation
        now = self._clock()
        grace = self.config.lease_timeout_s + self.config.reattach_grace_s
        for info in snapshot.members:
            worker = _Worker(info, now, now + grace, info.free_ports)
            if info.worker_id in snapshot.left:  # gone for good: re-form without them
                self._lost[info.worker_id] = worker
                self._left.add(info.worker_id)
            else:
                self._workers[info.worker_id] = worker
        self._finished_by = snapshot.finished_by or None
        self._stopping = snapshot.stopping or None
        waiting = len(snapshot.members) - len(snapshot.left)
        self._event(
            "restored",
            detail=f"{waiting} member(s) get {grace:g}s to re-attach"
            + (f"; {len(snapshot.left)} had left" if snapshot.left else ""),
        )

    # ---- helpers ----------------------------------------------------------------------

    def _check_inventory(
        self, inventory: Sequence[ParamSpec], digest: str | None, wire: bytes
    ) -> None:
        if self.inventory is not None and inventory is self.inventory:
            return
        if not inventory:
            raise InvalidRequest("inventory is empty")
        if self.inventory is None:
            names: set[str] = set()
            for p in inventory:
                if p.name in names:
                    raise InvalidRequest(f"inventory: parameter {p.name!r} appears twice")
                names.add(p.name)
            if not any(p.requires_grad for p in inventory):
                raise InvalidRequest("inventory has no trainable parameter")
            self._set_inventory(tuple(inventory), digest, wire)
            return
        diff = first_difference(self.inventory, inventory)
        if diff is not None:
            raise InventoryMismatch(f"parameter inventory differs from the job's: {diff}")

    def _set_inventory(
        self, inventory: tuple[ParamSpec, ...], digest: str | None = None, wire: bytes = b""
    ) -> None:
        self.inventory = inventory
        self.digest = digest or inventory_digest(wire or inventory)
        self.inventory_wire = wire
        self.trainable_numel = sum(p.numel for p in inventory if p.requires_grad)

    def _drop(self, worker_id: str, kind: str, detail: str) -> None:
        worker = self._workers.pop(worker_id)
        self._standby_at.pop(worker_id, None)
        if worker_id in self._joiners:
            del self._joiners[worker_id]
        else:  # not a standby, so a member of the current generation
            self._lost[worker_id] = worker
            if kind == "left":
                self._left.add(worker_id)
        self._event(kind, worker_id, detail)

    def _event(
        self, kind: str, worker_id: str = "", detail: str = "", *, level: int = logging.INFO
    ) -> None:
        event = Event(
            unix_s=self._wall(),
            kind=kind,
            worker_id=worker_id,
            generation_id=self.generation_id,
            detail=detail,
        )
        self.events.append(event)
        logger.log(
            level,
            "%s%s (generation %d)%s",
            kind,
            f" {worker_id}" if worker_id else "",
            event.generation_id,
            f": {detail}" if detail else "",
        )


def _endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
