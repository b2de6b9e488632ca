"""Control-plane messages as Python objects, and the bounds on what crosses the wire.

Workers and the rest of zeroplane use these dataclasses. Their protobuf form is
coordinator/core/conversions.py (a generation's, with its incremental encoding:
coordinator/core/generation_codec.py); only those two modules and the control plane's
wire ends (server, client, host agent, state file) touch the generated protobuf
classes. Conversions from the wire validate and raise ``ValueError`` naming the bad
field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from coordinator.core.layout import Layout
from coordinator.core.meshplan import MeshCoords, MeshShape
from coordinator.core.reshard import ReshardSchedule
from coordinator.core.settings import MembershipConfig

__all__ = [
    "FINISHED",
    "GENERATION_METADATA_KEY",
    "STOPPED",
    "Event",
    "Generation",
    "Member",
    "RankBeat",
    "StatusReport",
    "WorkerInfo",
    "WorkerReport",
    "WorkerStatus",
    "check_count",
    "check_worker_id",
    "metrics_target",
    "printable",
]

# Trailing metadata of a FAILED_PRECONDITION for a stale generation: the current id.
GENERATION_METADATA_KEY = "zeroplane-generation"
# The leave reason of a member whose training loop ended: the job is finishing.
FINISHED = "finished"
# The leave reason of members asked to leave with nobody to hand their shards to.
STOPPED = "stopped"
MAX_ID_CHARS = 253  # a DNS name, so a pod name always fits
MAX_PORTS = 8
MAX_WORLD_SIZE = 1 << 20  # ranks in one process group

# [Note: bounds]
# Every number that crosses the wire is bounded here, far above any real model or
# machine and far below where arithmetic on it could overflow a protobuf field
# (uint64 element offsets, sums of byte counts): what is not refused at the
# boundary can no longer break a generation, a status or the state file.
MAX_PARAM_NUMEL = 1 << 48  # elements in one parameter (a 2**48-element tensor: 1 PB in bf16)
MAX_TOTAL_NUMEL = 1 << 52  # elements in a whole inventory
MAX_BYTES = 1 << 60  # any byte count a worker reports (1 EiB)
MAX_COUNT = 1 << 62  # steps and generation ids
MAX_GROUP = (1 << 16) - 1  # optimizer param groups
MAX_UNIT = (1 << 31) - 1  # stage-3 gather units
MAX_DETAIL_CHARS = 512  # the most of any input an error detail or a log line echoes


@dataclass(frozen=True, kw_only=True)
class WorkerInfo:
    """Who a worker is and what it runs on, as it registers."""

    worker_id: str
    # Address the other workers reach this one at.
    host: str
    device_kind: str = "cpu"
    # One device's memory; 0 when unknown.
    device_memory_bytes: int = 0
    # host:port of its Prometheus exporter.
    metrics_endpoint: str = ""
    # Free ports on host for the rendezvous store should it become rank 0.
    free_ports: tuple[int, ...] = ()
    # Random per process: a restarted worker with the same id is a new incarnation
    # (its state is lost), not a re-attach.
    incarnation: str = ""
    # The stage the worker's ZeroConfig asks for (used when the coordinator has none).
    stage: int | None = None
    # Rank and world size of a process group the worker's script formed itself.
    fixed_rank: int | None = None
    fixed_world_size: int | None = None
    # The mesh a worker trains on, as ``(tensor_parallel, pipeline_parallel)``; 0
    # leaves a degree to the coordinator (``--mesh auto``); None: data parallel only.
    mesh: tuple[int, int] | None = None
    # An elastic mesh job's worker whose engine is built: the position it held in the
    # last generation it trained in, the only (pp, tp) it can fill when it registers
    # again (coordinator/core/meshplan.py [Note: arranging whole groups]).
    held: MeshCoords | None = None
    # A worker that splits its model's experts over ranks: (expert_parallel, the
    # experts' elements), which the inventory leaves out and the planner counts
    experts: tuple[int, int] | None = None
    # A worker that splits each sequence over ranks: the context-parallel degree (its
    # groups are blocks of consecutive ranks, which the coordinator forms whole)
    context_parallel: int | None = None

    def __post_init__(self) -> None:
        _check_id("WorkerInfo.worker_id", self.worker_id)
        if self.context_parallel is not None:
            _check_range("WorkerInfo.context_parallel", self.context_parallel, 1, 1 << 20)
        if self.experts is not None:
            ep, numel = self.experts
            _check_range("WorkerInfo.experts expert_parallel", ep, 1, 1 << 20)
            _check_range("WorkerInfo.experts numel", numel, 0, MAX_BYTES)
        _check_id("WorkerInfo.host", self.host)
        if len(self.device_kind) > 64:
            raise ValueError("WorkerInfo.device_kind is longer than 64 characters")
        _check_range("WorkerInfo.device_memory_bytes", self.device_memory_bytes, 0, MAX_BYTES)
        if len(self.metrics_endpoint) > 2 * MAX_ID_CHARS:
            raise ValueError("WorkerInfo.metrics_endpoint is too long")
        if self.metrics_endpoint:
            metrics_target(self.metrics_endpoint)
        _check_ports("WorkerInfo.free_ports", self.free_ports)
        if len(self.incarnation) > 64:
            raise ValueError("WorkerInfo.incarnation is longer than 64 characters")
        if self.stage is not None and self.stage not in (0, 1, 2, 3):
            raise ValueError(f"WorkerInfo.stage must be 0-3, got {self.stage}")
        if (self.fixed_rank is None) != (self.fixed_world_size is None):
            raise ValueError("WorkerInfo.fixed_rank and fixed_world_size come together")
        if self.fixed_world_size is not None and not (
            1 <= self.fixed_world_size <= MAX_WORLD_SIZE
            and 0 <= (self.fixed_rank or 0) < self.fixed_world_size
        ):
            raise ValueError(
                f"WorkerInfo.fixed_rank {self.fixed_rank} is not a rank of a group of "
                f"{self.fixed_world_size} (at most {MAX_WORLD_SIZE})"
            )
        if self.mesh is not None:
            if len(self.mesh) != 2:
                raise ValueError("WorkerInfo.mesh is (tensor_parallel, pipeline_parallel)")
            for name, degree in zip(
                ("tensor_parallel", "pipeline_parallel"), self.mesh, strict=True
            ):
                _check_range(f"WorkerInfo.mesh.{name}", degree, 0, MAX_WORLD_SIZE)
        if self.held is not None:
            if self.mesh is None:
                raise ValueError("WorkerInfo.held is a mesh position: it needs WorkerInfo.mesh")
            for name, value, degree in (
                ("pp", self.held.pp, self.mesh[1]),
                ("tp", self.held.tp, self.mesh[0]),
                ("dp", self.held.dp, 0),
            ):
                top = (degree or MAX_WORLD_SIZE) - 1
                _check_range(f"WorkerInfo.held.{name}", value, 0, top)


# what a rank can be doing (Whereabouts.state)
WHERE_STATES = ("collective", "running", "recovering", "checkpoint", "torch")


@dataclass(frozen=True, kw_only=True, slots=True)
class Whereabouts:
    """Where a rank is, sampled at each heartbeat (proto ``Whereabouts``): blocked in a
    collective (which one: its kind, its number on its group, the group's global
    ranks, the unit that issued it), blocked in a collective of torch's that
    zeroplane did not number ("torch": which function), running outside any wait,
    re-forming, or checkpointing, and for how long (coordinator/control/stalls.py)."""

    state: str = "running"
    for_s: float = 0.0
    op: str = ""
    seq: int = 0
    group: str = ""
    unit: str = ""
    phase: str = ""

    def __post_init__(self) -> None:
        if self.state not in WHERE_STATES:
            raise ValueError(f"Whereabouts.state must be one of {WHERE_STATES}, got {self.state!r}")
        if not (math.isfinite(self.for_s) and 0 <= self.for_s <= 1e9):
            raise ValueError(f"Whereabouts.for_s must be in [0, 1e9] seconds, got {self.for_s}")
        _check_range("Whereabouts.seq", self.seq, 0, MAX_COUNT)
        for name, most in (("op", 32), ("group", 256), ("unit", 256), ("phase", 32)):
            if len(getattr(self, name)) > most:
                raise ValueError(f"Whereabouts.{name} is longer than {most} characters")


@dataclass(frozen=True, kw_only=True)
class WorkerReport:
    """What a worker holds, sent with each heartbeat."""

    # Model-state bytes by kind: "params", "grads", "master", "optimizer".
    model_state_bytes: Mapping[str, int] = field(default_factory=dict)
    device_allocated_bytes: int = 0
    device_reserved_bytes: int = 0
    step: int = 0
    # The generation the worker trains in.
    applied_generation_id: int = 0
    # This rank's loss in its last optimizer step (mean over its micro-batches).
    loss: float | None = None
    # What this rank reported through engine.step(samples=, tokens=), in total.
    samples: int = 0
    tokens: int = 0
    # The directory of the last checkpoint this rank saved ("" if none).
    checkpoint: str = ""
    # The optimizer steps the script means to train for (engine.progress(total=)).
    total_steps: int | None = None
    # Where the rank is now (sampled at each heartbeat); None from a worker that does not say.
    where: Whereabouts | None = None

    def __post_init__(self) -> None:
        # one heartbeat per rank per interval: the common case is checked in one
        # expression, and only a report that fails it is walked to say what is wrong
        loss, total = self.loss, self.total_steps
        if (
            len(self.checkpoint) <= 4096
            and len(self.model_state_bytes) <= 16
            and all(
                0 < len(k) <= 64 and 0 <= v <= MAX_BYTES for k, v in self.model_state_bytes.items()
            )
            and 0 <= self.device_allocated_bytes <= MAX_BYTES
            and 0 <= self.device_reserved_bytes <= MAX_BYTES
            and 0 <= self.step <= MAX_COUNT
            and 0 <= self.applied_generation_id <= MAX_COUNT
            and 0 <= self.samples <= MAX_COUNT
            and 0 <= self.tokens <= MAX_COUNT
            and (loss is None or math.isfinite(loss))
            and (total is None or 1 <= total <= MAX_COUNT)
        ):
            return
        self._explain()

    def _explain(self) -> None:
        if len(self.checkpoint) > 4096:
            raise ValueError("WorkerReport.checkpoint is longer than 4096 characters")
        if len(self.model_state_bytes) > 16:
            raise ValueError("WorkerReport.model_state_bytes has more than 16 kinds")
        for kind, value in self.model_state_bytes.items():
            if not kind or len(kind) > 64:
                raise ValueError(f"WorkerReport.model_state_bytes kind {kind!r} is not 1-64 chars")
            _check_range(f"WorkerReport.model_state_bytes[{kind!r}]", value, 0, MAX_BYTES)
        for name in ("device_allocated_bytes", "device_reserved_bytes"):
            _check_range(f"WorkerReport.{name}", getattr(self, name), 0, MAX_BYTES)
        for name in ("step", "applied_generation_id", "samples", "tokens"):
            _check_range(f"WorkerReport.{name}", getattr(self, name), 0, MAX_COUNT)
        if self.loss is not None and not math.isfinite(self.loss):
            raise ValueError("WorkerReport.loss must be finite")
        if self.total_steps is not None:
            _check_range("WorkerReport.total_steps", self.total_steps, 1, MAX_COUNT)


@dataclass(frozen=True, kw_only=True, slots=True)
class RankBeat:
    """One rank's part of a host heartbeat: what its own Heartbeat would carry."""

    worker_id: str
    generation_id: int
    report: WorkerReport | None = None
    free_ports: tuple[int, ...] = ()
    leaving: bool = False
    # how long ago the rank's agent received this beat (0: the rank sent it just now)
    age_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Member:
    worker_id: str
    rank: int
    host: str
    # Rank in the previous generation; None for a worker new to the job.
    previous_rank: int | None = None
    device_memory_bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class Generation:
    """A fixed membership of the job and everything a worker needs to run in it."""

    id: int
    # In rank order.
    members: tuple[Member, ...]
    # host:port of the rendezvous store, hosted by rank 0, fresh per generation.
    rendezvous_endpoint: str
    stage: int
    stage_reason: str
    layout: Layout
    # The compute_layout arguments that reproduce ``layout`` from the inventory.
    bucket_numel: int
    align: int
    # None for the job's first generation.
    reshard: ReshardSchedule | None
    inventory_digest: str
    created_unix_s: float = 0.0
    # Random per job state; ids compare only within one epoch (see the proto).
    epoch: str = ""
    # The device mesh the members train on (None: data parallel only), and why.
    mesh: MeshShape | None = None
    mesh_reason: str = ""

    @property
    def world_size(self) -> int:
        return len(self.members)

    def coords(self, rank: int) -> MeshCoords | None:
        """Rank ``rank``'s place in the mesh ([Note: mesh rank order]); None without one."""
        return None if self.mesh is None else self.mesh.coords(rank)

    @property
    def by_unit(self) -> bool:
        return self.stage == 3

    @property
    def rendezvous_host(self) -> str:
        return self.rendezvous_endpoint.rsplit(":", 1)[0].strip("[]")

    @property
    def rendezvous_port(self) -> int:
        return int(self.rendezvous_endpoint.rsplit(":", 1)[1])

    def member(self, worker_id: str) -> Member | None:
        return next((m for m in self.members if m.worker_id == worker_id), None)

    def rank_of(self, worker_id: str) -> int | None:
        member = self.member(worker_id)
        return None if member is None else member.rank


@dataclass(frozen=True, kw_only=True)
class WorkerStatus:
    info: WorkerInfo
    # "member", "standby" (registered, waiting for a generation), "lost" (a member
    # of the current generation whose lease ran out) or "left" (one that left: a
    # hand-over, the end of training).
    state: str
    rank: int | None
    lease_remaining_s: float
    report: WorkerReport | None
    # Where the coordinator itself reads this worker's metrics: the endpoint's port and
    # path at the address the worker connects from, never a name it gave (not on the wire).
    metrics_url: str = ""
    # it said it was asked to leave and has not left yet
    leaving: bool = False


@dataclass(frozen=True, kw_only=True)
class Event:
    unix_s: float
    kind: str
    worker_id: str = ""
    generation_id: int = 0
    detail: str = ""


@dataclass(frozen=True, kw_only=True)
class StatusReport:
    phase: str
    waiting_reason: str
    generation_id: int
    world_size: int
    stage: int
    stage_reason: str
    rendezvous_endpoint: str
    workers: tuple[WorkerStatus, ...]
    events: tuple[Event, ...]
    settings: MembershipConfig
    trainable_numel: int
    inventory_digest: str
    server_version: str = ""
    epoch: str = ""
    mesh: MeshShape | None = None
    mesh_reason: str = ""
    # a stall named by comparing the members' whereabouts, and its kind (stalls.py)
    stall: str = ""
    stall_kind: str = ""
    # workers on their way into the job (Membership.newcomers; 0 once over or stopping)
    newcomers: int = 0

    def coords(self, rank: int | None) -> MeshCoords | None:
        """A member's place in the generation's mesh; None without one (or a rank)."""
        if self.mesh is None or rank is None or not 0 <= rank < self.mesh.world_size:
            return None
        return self.mesh.coords(rank)

    @property
    def members(self) -> tuple[WorkerStatus, ...]:
        return tuple(w for w in self.workers if w.state == "member")

    def departed(self) -> set[str]:
        """Workers that left (handed over, or dropped) and hold no lease now, whether
        or not their process has exited yet, and those that said they were asked to
        leave (a SIGTERM from outside their launcher) and will."""
        gone = {e.worker_id for e in self.events if e.kind in ("left", "expired")}
        # a member that left stays in the status ("left", or "lost" once its lease ran
        # out) until the next generation forms
        here = {w.info.worker_id for w in self.workers if w.state not in ("lost", "left")}
        return (gone - here) | {w.info.worker_id for w in self.workers if w.leaving}

    def over(self) -> bool:
        """Whether the job is over for its members: one ended training (a "finished"
        event), or members were told to leave with nobody to hand over to (leave
        reason "stopped"). A worker that exits 0 before that left on its own."""
        return any(
            e.kind == "finished" or (e.kind == "left" and e.detail == STOPPED) for e in self.events
        )

    def worker(self, worker_id: str) -> WorkerStatus | None:
        return next((w for w in self.workers if w.info.worker_id == worker_id), None)


def _check_id(name: str, value: str) -> None:
    if not value:
        raise ValueError(f"{name} must be non-empty")
    if len(value) > MAX_ID_CHARS:
        raise ValueError(
            f"{name} {value[:40]!r}... is {len(value)} characters, more than {MAX_ID_CHARS}"
        )
    # str.isprintable() is False for every whitespace character but the ASCII space
    if not value.isprintable() or " " in value:
        raise ValueError(f"{name} {value!r} has whitespace or unprintable characters")


def _check_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


def check_count(name: str, value: int) -> int:
    """``value`` if it is a sane step or generation id (see [Note: bounds])."""
    _check_range(name, value, 0, MAX_COUNT)
    return value


def check_worker_id(name: str, value: str) -> str:
    """``value`` if it can be a worker id; the error echoes at most a prefix of it."""
    _check_id(name, value)
    return value


def printable(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    """``text`` cut to ``limit`` characters with control characters escaped, so that
    it cannot forge a log line or a terminal escape."""
    cut = text[:limit]
    if not cut.isprintable():
        cut = "".join(c if c.isprintable() else repr(c)[1:-1] for c in cut)
    return cut + ("..." if len(text) > limit else "")


def metrics_target(endpoint: str) -> tuple[str, int, str]:
    """(host, port, path) of a worker's ``metrics_endpoint``: ``HOST:PORT[/PATH]`` or
    ``http://HOST:PORT[/PATH]``, nothing else (no other scheme, no user, no query)."""
    name = "WorkerInfo.metrics_endpoint"
    url = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    try:
        port = url.port
    except ValueError:
        port = None
    if url.scheme != "http" or url.username is not None or url.query or url.fragment:
        raise ValueError(f"{name} {printable(endpoint, 80)!r} is not http://HOST:PORT/PATH")
    if not url.hostname or not port:
        raise ValueError(
            f"{name} {printable(endpoint, 80)!r} needs a host and a port in [1, 65535]"
        )
    if not url.path.isprintable() or " " in url.path:
        raise ValueError(f"{name} {printable(endpoint, 80)!r} has a path that is not printable")
    return url.hostname, port, url.path


def _check_ports(name: str, ports: Sequence[int]) -> None:
    if len(ports) > MAX_PORTS:
        raise ValueError(f"{name} has more than {MAX_PORTS} ports")
    for port in ports:
        if not 1 <= port <= 65535:
            raise ValueError(f"{name} has port {port} outside [1, 65535]")
