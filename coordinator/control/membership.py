"""Membership: leases, standbys and the formation of generations.

A pure state machine (no gRPC, no threads): the server calls it from one event
loop and passes no time in; the clock is injected so tests can drive it. Each
worker is in one state (coordinator/control/roster.py [Note: worker states]); how
a proposal arranges them is the job's arrangement, chosen by its first worker
(coordinator/control/arrangement.py [Note: arrangements]); a proposal, its stage and
mesh, and the generation built from it are coordinator/control/formation.py.

[Note: generations]
A generation is a fixed membership. Its members keep their relative order
from one generation to the next (so a surviving rank 0 stays rank 0 and keeps
hosting the rendezvous); joiners are appended, grouped by host (a fixed group
keeps its script's ranks, a mesh job forms whole groups: [Note: arrangements]).
A member that leaves, loses its lease, or comes back as a new process (a new
incarnation) is *lost*: it is not in the next generation, whose reshard schedule lists
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

import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from coordinator.control.arrangement import Arrangement, ElasticArrangement, arrangement_for
from coordinator.control.formation import (
    Proposal,
    build_generation,
    build_steps,
    plan_generation,
    rendezvous_endpoint,
)
from coordinator.control.roster import Roster, WorkerEntry, WorkerState
from coordinator.core.conversions import inventory_digest
from coordinator.core.layout import ParamSpec
from coordinator.core.messages import (
    FINISHED,
    STOPPED,
    Event,
    Generation,
    RankBeat,
    StatusReport,
    WorkerInfo,
    WorkerReport,
    WorkerStatus,
)
from coordinator.core.planner import PlanConfig
from coordinator.core.settings import MembershipConfig

__all__ = [
    "Fenced",
    "InvalidRequest",
    "InventoryMismatch",
    "Membership",
    "MembershipError",
    "Proposal",
    "Snapshot",
    "StaleGeneration",
    "UnknownWorker",
    "WorkerState",
    "build_generation",
    "build_steps",
    "first_difference",
]

logger = logging.getLogger(__name__)

# workers whose last report is kept for the job's summary (the newest)
MAX_LAST_REPORTS = 4096


def _row(w: WorkerEntry, state: str, rank: int | None, now: float) -> WorkerStatus:
    """A worker's row of the status (``state``: member, standby, left, lost)."""
    return WorkerStatus(
        info=w.info,
        state=state,
        rank=rank,
        lease_remaining_s=w.deadline - now,
        report=w.report,
        metrics_url=w.metrics_url,
        leaving=w.leaving and state in ("member", "standby"),
    )


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


class Fenced(MembershipError):
    """The worker was dropped as stuck or silent in a stall (coordinator/control/stalls.py):
    it must exit, not register again."""


class UnknownWorker(MembershipError):
    """No lease for this worker: it must register again (NOT_FOUND)."""


class StaleGeneration(MembershipError):
    """The request carries a generation other than the current one (FAILED_PRECONDITION)."""

    def __init__(self, given: int, current: int) -> None:
        super().__init__(f"generation {given} is stale: the current generation is {current}")
        self.given = given
        self.current = current


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
        # the workers the current generation admitted (none for the first: arrangement.py)
        self.admitted_last: frozenset[str] = frozenset()
        # every worker, in its state (coordinator/control/roster.py [Note: worker states])
        self.roster = Roster()
        # how proposals arrange the workers, chosen by the first to register
        # (coordinator/control/arrangement.py [Note: arrangements])
        self._arrangement: Arrangement = ElasticArrangement()
        # the ranks each host agent listed in its last heartbeat ([Note: host heartbeats])
        self._hosts: dict[str, set[str]] = {}
        # the rendezvous endpoints of the last generations, not given out again soon
        self._recent_endpoints: deque[str] = deque(maxlen=8)
        # every worker's last report, kept after it leaves or is lost (the job's summary)
        self._last_reports: dict[str, WorkerReport] = {}
        self._finished_by: str | None = None  # the first member whose training ended
        # why the job is stopping unfinished (a launcher stopping it, or members told
        # to leave with nobody to hand over to)
        self._stopping: str | None = None
        self.events: deque[Event] = deque(maxlen=config.event_history)
        # A refused formation: the state it was refused in, and why (see [Note: atomic formation]).
        self._refused: tuple[tuple, str] | None = None
        # the job's stall as the servicer's StallWatch names it, and its kind ("" for none);
        # the stall that stopped the job; the workers dropped in a stall, and why
        # (coordinator/control/stalls.py)
        self.stall, self.stall_kind, self.stalled = "", "", ""
        self._fenced: dict[str, str] = {}
        # the world a launcher's workers make once registered: the next generation forms
        # then, without the rest of the join window (expect_more; None: the window decides)
        self._expected = config.expected_workers
        # workers a launcher said it started (expect_more) that have not registered yet
        self._starting = 0

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
        self._fenced.pop(info.worker_id, None)  # a new process under the dropped one's name
        now = self._clock()
        lease = now + self.config.lease_timeout_s
        old = self.roster.get(info.worker_id)
        if old is not None and old.info.incarnation == info.incarnation:
            old.info, old.deadline = info, lease
            old.free_ports = info.free_ports or old.free_ports
            old.peer = peer or old.peer
            if old.state.waiting:
                self._wait(old)
            self._event("reattached", info.worker_id)
            return True
        if old is not None:
            self._drop(info.worker_id, "replaced", "registered again as a new process")
        if not self.roster.live:
            self._arrangement = arrangement_for(info)
        self._wait(WorkerEntry(info, now, lease, info.free_ports, peer=peer))
        self._starting = max(0, self._starting - 1)
        self._event("registered", info.worker_id, f"host {info.host}")
        return False

    def _wait(self, worker: WorkerEntry) -> None:
        """``worker`` waits for a generation: JOINING, or STANDBY where its engine holds a
        mesh position (``WorkerInfo.held``: it trained before, and registers again after
        a coordinator restart or a lost lease), arranged only there ([Note: arranging
        whole groups]). The worker says so itself, so the binding survives a restart
        without a state file entry."""
        held = worker.info.held
        if held is not None:
            self.roster.move(worker, WorkerState.STANDBY, held)
        elif worker.state is None:
            self.roster.move(worker, WorkerState.JOINING)

    def _check_mesh(self, info: WorkerInfo) -> None:
        """Every worker of a job asks for the same mesh (or none): one rank on another
        mesh would build a different DeviceMesh and hang the first collective."""
        for other in self.roster.live.values():
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
        age_s: float = 0.0,
    ) -> float:
        """Renew the lease; returns the seconds it now has left. ``peer``: the IP address
        the heartbeat came from; ``leaving``: the worker was asked to leave and hands
        over at its next step boundary (kept even from a stale heartbeat); ``age_s``: how
        long ago the worker sent it (a beat its host agent relays), the lease dated from then."""
        worker = self.roster.get(worker_id)
        if worker is None:
            if worker_id in self._fenced:
                raise Fenced(f"dropped in a stall: {self._fenced[worker_id]}")
            raise UnknownWorker(f"no lease for worker {worker_id!r}: register again")
        if leaving and not worker.leaving:
            worker.leaving = True
            self._event("leaving", worker_id, "asked to leave; it goes at its next step boundary")
        if generation_id != self.generation_id:
            raise StaleGeneration(generation_id, self.generation_id)
        now, lease = self._clock(), self.config.lease_timeout_s
        worker.deadline = max(worker.deadline, now + lease - min(age_s, lease))
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
        return worker.deadline - now

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
                if wid in self.roster.live:
                    self._drop(wid, "expired", f"its host agent {host_id} no longer reports it")
                    dropped.append(wid)
        self._hosts[host_id] = seen
        out: list[tuple[str, float | MembershipError]] = []
        for b in beats:
            try:
                remaining = self.heartbeat(
                    b.worker_id, b.generation_id, b.report, b.free_ports, peer, b.leaving, b.age_s
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
        worker = self.roster.get(worker_id)
        if worker is None:
            return False
        member = worker.state is WorkerState.MEMBER
        self._drop(worker_id, "left", reason)
        if reason == FINISHED and member and self._finished_by is None:
            self._finished_by = worker_id
            self._event("finished", worker_id, "training ended; no new generation will form")
        if reason == STOPPED and member:
            self.stop(f"{worker_id} was told to leave with nobody to hand over to")
        return True

    def expect_more(self, count: int) -> None:
        """A launcher started ``count`` more workers: the next generation forms as soon as
        the world they make has registered, without the rest of the join window."""
        base = self._expected
        if base is None:
            base = 0 if self.generation is None else self.generation.world_size
        self._expected = base + count
        self._starting += count

    @property
    def newcomers(self) -> int:
        """Workers on their way: started by a launcher and not registered yet, or
        waiting for a generation and not asked to leave; none once over or stopping."""
        if self.finished or self._stopping is not None:
            return 0
        return self._starting + sum(not self.roster.live[w].leaving for w in self.roster.waiting())

    def placeable(self, workers: Collection[str]) -> int:
        """How many of ``workers`` a generation of them alone could hold (whole groups
        only: arrangement.py ``Arrangement.placeable``)."""
        return self._arrangement.placeable(self, workers)

    def fence(self, worker_id: str, why: str) -> None:
        """Drop ``worker_id`` as lost in a stall (``why``) and tell its next heartbeat to
        exit rather than register again (coordinator/control/stalls.py)."""
        if worker_id in self.roster.live:
            self._drop(worker_id, "expired", why)
        self._fenced[worker_id] = why
        while len(self._fenced) > MAX_LAST_REPORTS:
            del self._fenced[next(iter(self._fenced))]

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
        worker = self.roster.get(worker_id)
        if worker is not None:
            worker.streams += 1
            worker.unwatched_since = None
        return worker

    def watch_closed(self, worker_id: str, token: object | None) -> None:
        worker = self.roster.get(worker_id)
        if worker is None or worker is not token:
            return  # dropped meanwhile, or the stream of an older incarnation
        worker.streams -= 1
        if worker.streams == 0:
            worker.unwatched_since = self._clock()

    def process_exited(self, worker_id: str, how: str) -> bool:
        """The launcher that runs ``worker_id`` saw its process exit (``how``: the
        exit code or signal, in words): drop it at once, without waiting for its
        connection's grace or its lease. False if it was not here (it had left)."""
        if worker_id not in self.roster.live:
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
        for wid, w in self.roster.live.items():
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
        arranged = self._arrangement.arrange(self)
        workers = tuple(self.roster.live[wid] for wid in arranged.order)
        infos = tuple(w.info for w in workers)
        choice, mesh, mesh_reason = plan_generation(
            self.plan, self.trainable_numel, self.inventory, infos
        )
        if not choice.fits and any(i.device_memory_bytes > 0 for i in infos):
            logger.warning("generation %d: %s", self.generation_id + 1, choice.reason)
        return Proposal(
            id=self.generation_id + 1,
            previous=previous,
            workers=workers,
            infos=infos,
            admitted=arranged.admitted,
            lost=frozenset(self.roster.gone),
            left=frozenset(self.roster.left()),
            choice=choice,
            rendezvous_endpoint=rendezvous_endpoint(workers[0], previous, self._recent_endpoints),
            inventory=self.inventory,
            digest=self.digest,
            bucket_numel=self.plan.bucket_numel,
            align=self.plan.align,
            created_unix_s=self._wall(),
            epoch=self.epoch,
            mesh=mesh,
            mesh_reason=mesh_reason,
            standby=arranged.standby,
        )

    def survivors(self) -> list[str]:
        """The current generation's members that are still here, in rank order."""
        gen = self.generation
        gone = self.roster.gone
        return [] if gen is None else [m.worker_id for m in gen.members if m.worker_id not in gone]

    def commit(self, proposal: Proposal, generation: Generation) -> bool:
        """Publish ``generation``, built from ``proposal``; False (nothing changes) when
        the proposal no longer holds: propose again."""
        if (
            self.generation is not proposal.previous
            or set(self.roster.gone) != proposal.lost
            or any(self.roster.get(w.info.worker_id) is not w for w in proposal.workers)
        ):
            return False
        self.generation = generation
        self.admitted_last = frozenset(proposal.admitted if proposal.previous else ())
        if self._expected is not None and generation.world_size >= self._expected:
            self._expected = None
        self._recent_endpoints.append(generation.rendezvous_endpoint)
        for wid in proposal.admitted:
            self.roster.move(self.roster.live[wid], WorkerState.MEMBER)
        previous = proposal.previous
        for wid in proposal.standby:
            # a survivor whose model-parallel group could not be completed
            rank = None if previous is None else previous.rank_of(wid)
            if previous is not None and previous.mesh is not None and rank is not None:
                position = previous.mesh.coords(rank)
                self.roster.move(self.roster.live[wid], WorkerState.STANDBY, position)
            else:
                self.roster.move(self.roster.live[wid], WorkerState.JOINING)
            self._event("standby", wid, "its model-parallel or ep group is not whole")
        self.roster.forget_gone()
        self._refused = None
        # the rendezvous store's address stays off the events the unauthenticated
        # status page shows (the store has no authentication of its own)
        self._event(
            "generation", detail=f"world size {generation.world_size}, stage {generation.stage}"
        )
        return True

    def refuse(self, proposal: Proposal, reason: str) -> None:
        """``proposal`` cannot be published (its generation does not encode): keep the
        current generation and propose nothing until the membership changes."""
        self._refused = (self._formation_state(), reason)
        detail = f"generation {proposal.id} cannot form: {reason}"
        self._event("refused", detail=detail, level=logging.ERROR)

    def _formation_state(self) -> tuple:
        return (self.generation_id, tuple(self.roster.waiting()), tuple(self.roster.gone))

    def _refusal(self) -> str | None:
        if self._refused is None or self._refused[0] != self._formation_state():
            return None
        return self._refused[1]

    def recovering(self) -> bool:
        """The current generation replaced lost ranks and not every member has
        applied it yet. Newcomers wait for it: its members restore together, and a
        generation that superseded it before it formed must replace lost ranks too,
        so that everyone in it takes the same path (worker/rendezvous.py
        [Note: superseded rendezvous])."""
        gen = self.generation
        if gen is None or gen.reshard is None or not gen.reshard.lost_ranks:
            return False
        for m in gen.members:
            if m.worker_id in self.roster.gone:
                continue
            w = self.roster.get(m.worker_id)
            if w is None or w.report is None or w.report.applied_generation_id < gen.id:
                return True
        return False

    def _due(self) -> bool:
        if self.finished:
            return False
        ready = self._arrangement.ready(self)
        if ready is not None:
            return ready
        survivors, admitted = self._arrangement.sizes(self)
        lost = self.roster.gone
        if not lost and admitted == 0:
            return False
        if self._refused is not None and self._refusal() is not None:
            return False
        if survivors + admitted < self.config.min_workers:
            return False
        if lost or survivors + admitted >= self.config.max_workers:
            return True
        if self._expected is not None and survivors + admitted >= self._expected:
            return True  # the workers a launcher started are all here
        return self._clock() - self._window_start() >= self.config.join_window_s

    def _window_start(self) -> float:
        return self.roster.first_waiting().registered_at

    def waiting_reason(self) -> str:
        if self._finished_by is not None:
            return f"the job finished ({self._finished_by} ended training)"
        if self._stopping is not None:
            return f"the job is stopping ({self._stopping})"
        refused = None if self._refused is None else self._refusal()
        if refused is not None:
            return f"generation {self.generation_id + 1} cannot form: {refused}"
        survivors, admitted = self._arrangement.sizes(self)
        have, need = survivors + admitted, self.config.min_workers
        lost = self.roster.gone
        if lost and have < need:
            return (
                f"generation {self.generation_id} lost {len(lost)} member(s); "
                f"{have} worker(s) left, the job needs at least {need}"
            )
        if admitted == 0:
            return "" if self.generation is not None else f"no workers yet (need at least {need})"
        if have < need:
            return f"{have} of at least {need} workers registered"
        left = self.config.join_window_s - (self._clock() - self._window_start())
        return f"join window: generation {self.generation_id + 1} forms in {max(left, 0):.1f}s"

    # ---- status and persistence -------------------------------------------------------

    def last_reports(self) -> dict[str, WorkerReport]:
        """Each worker's last report by id, including workers that left or were lost."""
        return dict(self._last_reports)

    def status(self, server_version: str = "") -> StatusReport:
        now = self._clock()
        rows: list[WorkerStatus] = []
        gen = self.generation
        for m in () if gen is None else gen.members:
            gone = self.roster.gone.get(m.worker_id)
            # a member that left (a hand-over, the end of training) is not lost
            state = "member" if gone is None else gone.state.value
            rows.append(_row(gone or self.roster.live[m.worker_id], state, m.rank, now))
        rows += [_row(self.roster.live[wid], "standby", None, now) for wid in self.roster.waiting()]
        reason = self.waiting_reason()
        if self.finished:
            phase = "finished"  # (a finished job is neither waiting nor running)
        else:
            phase = "running" if gen is not None and not self.roster.gone else "waiting"
        return StatusReport(
            phase=phase,
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
            stall=self.stall or self.stalled,
            stall_kind=self.stall_kind or ("mismatch" if self.stalled else ""),
            newcomers=self.newcomers,
        )

    def snapshot(self) -> Snapshot:
        gen = self.generation
        members = ()
        if gen is not None:
            members = tuple(
                (self.roster.gone.get(m.worker_id) or self.roster.live[m.worker_id]).info
                for m in gen.members
            )
        return Snapshot(
            inventory=self.inventory or (),
            generation=gen,
            members=members,
            epoch=self.epoch,
            inventory_digest=self.digest,
            inventory_wire=self.inventory_wire,
            left=tuple(
                w for w in self.roster.left() if gen is not None and gen.rank_of(w) is not None
            ),
            finished_by=self._finished_by or "",
            stopping=self._stopping or "",
        )

    def restore(self, snapshot: Snapshot) -> None:
        """Take over a snapshot after a restart; every member gets a fresh lease to re-attach."""
        if self.roster.live or self.generation is not None:
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
            worker = WorkerEntry(info, now, now + grace, info.free_ports)
            if info.worker_id in snapshot.left:  # gone for good: re-form without them
                self.roster.move(worker, WorkerState.LEFT)
            else:
                if not self.roster.live:
                    self._arrangement = arrangement_for(info)
                self.roster.move(worker, WorkerState.MEMBER)
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
        worker = self.roster.live[worker_id]
        if worker.state is WorkerState.MEMBER:  # gone from the current generation
            self.roster.move(worker, WorkerState.LEFT if kind == "left" else WorkerState.LOST)
        else:  # waiting: forgotten
            self.roster.move(worker, None)
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
