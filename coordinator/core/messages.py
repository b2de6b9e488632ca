"""Control-plane messages as Python objects, and their protobuf wire form.

Workers and the rest of zeroplane use these dataclasses; only this module, the
server and the client touch the generated protobuf classes. Conversions from
the wire validate and raise ``ValueError`` naming the bad field.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from google.protobuf.message import Message

from coordinator._proto.zeroplane.coordinator.v1 import coordinator_pb2 as pb
from coordinator.core.layout import Bucket, Layout, ParamSpec, Slot
from coordinator.core.meshplan import MeshCoords, MeshShape
from coordinator.core.reshard import LazyMoves, Move, ReshardSchedule
from coordinator.core.settings import MembershipConfig
from coordinator.core.steps import STEP, Steps, finish

__all__ = [
    "FINISHED",
    "GENERATION_METADATA_KEY",
    "STOPPED",
    "Event",
    "Generation",
    "Member",
    "MissingPrevious",
    "RankBeat",
    "StatusReport",
    "WorkerInfo",
    "WorkerReport",
    "WorkerStatus",
    "check_count",
    "check_worker_id",
    "generation_from_proto",
    "generation_steps",
    "generation_to_proto",
    "inventory_digest",
    "inventory_from_proto",
    "inventory_steps",
    "inventory_wire",
    "inventory_wire_steps",
    "members_delta",
    "metrics_target",
    "moves_to_proto",
    "param_from_proto",
    "param_to_proto",
    "printable",
    "rank_beat_to_proto",
    "report_from_proto",
    "report_to_proto",
    "serialize_steps",
    "status_from_proto",
    "status_to_proto",
    "worker_from_proto",
    "worker_to_proto",
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

    def __post_init__(self) -> None:
        _check_id("WorkerInfo.worker_id", self.worker_id)
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


def rank_beat_to_proto(beat: RankBeat) -> pb.RankBeat:
    msg = pb.RankBeat(
        worker_id=beat.worker_id,
        generation_id=beat.generation_id,
        free_ports=beat.free_ports,
        leaving=beat.leaving,
    )
    if beat.report is not None:
        msg.report.CopyFrom(report_to_proto(beat.report))
    return msg


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
    # "member", "standby" (registered, waiting for a generation) or "lost"
    # (a member of the current generation whose lease ran out or who left).
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
        # a member that left stays in the status, "lost", until the next generation forms
        here = {w.info.worker_id for w in self.workers if w.state != "lost"}
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


# ---- wire conversions -------------------------------------------------------------------


def param_to_proto(spec: ParamSpec) -> pb.ParamInfo:
    return pb.ParamInfo(
        name=spec.name,
        shape=list(spec.shape),
        dtype=spec.dtype,
        requires_grad=spec.requires_grad,
        group=spec.group,
        unit=spec.unit,
    )


def param_from_proto(msg: pb.ParamInfo) -> ParamSpec:
    """A parameter from the wire, every field bounded (see [Note: bounds])."""
    name, dtype, shape, group, unit = msg.name, msg.dtype, tuple(msg.shape), msg.group, msg.unit
    if not name or len(name) > 1024:
        raise ValueError(f"parameter name {name[:40]!r} must be 1-1024 characters")
    if not dtype or len(dtype) > 32:
        raise ValueError(f"parameter {name!r} has dtype {dtype[:40]!r}: must be 1-32 chars")
    if len(shape) > 32:
        raise ValueError(f"parameter {name!r} has {len(shape)} dims, more than 32")
    numel = math.prod(shape)
    if not 0 < numel <= MAX_PARAM_NUMEL or (shape and min(shape) < 1):
        if any(dim < 0 for dim in shape):
            raise ValueError(f"parameter {name!r} has a negative dim in shape {shape}")
        if 0 in shape:
            raise ValueError(f"parameter {name!r} has a zero dim in shape {shape}: no elements")
        raise ValueError(
            f"parameter {name!r} has shape {shape}: {numel} elements, more than {MAX_PARAM_NUMEL}"
        )
    if group > MAX_GROUP:
        raise ValueError(f"parameter {name!r} has group {group}, more than {MAX_GROUP}")
    if unit > MAX_UNIT:
        raise ValueError(f"parameter {name!r} has unit {unit}, more than {MAX_UNIT}")
    return ParamSpec(
        name=name,
        shape=shape,
        dtype=dtype,
        requires_grad=msg.requires_grad,
        group=group,
        unit=unit,
    )


def inventory_wire(msgs: Sequence[pb.ParamInfo]) -> bytes:
    """The canonical encoding of an inventory (see ``PersistedInventory`` in the proto)."""
    wire = pb.PersistedInventory()
    wire.params.MergeFrom(msgs)
    return wire.SerializeToString(deterministic=True)


def inventory_wire_steps(inventory: Sequence[ParamSpec | pb.ParamInfo]) -> Steps[bytes]:
    """``inventory_wire``, in steps (coordinator/core/steps.py), of a decoded inventory too."""
    wire = pb.PersistedInventory()
    for i in range(0, len(inventory), STEP):
        part = inventory[i : i + STEP]
        wire.params.extend(p if isinstance(p, pb.ParamInfo) else param_to_proto(p) for p in part)
        yield
    return wire.SerializeToString(deterministic=True)


def inventory_digest(inventory: Sequence[ParamSpec] | bytes) -> str:
    """The digest of an inventory (or of its canonical encoding, ``inventory_wire``):
    equal inventories, equal digests; a registration's is computed without decoding it."""
    if not isinstance(inventory, bytes):
        inventory = finish(inventory_wire_steps(inventory))
    return hashlib.sha256(inventory).hexdigest()


def inventory_from_proto(msgs: Sequence[pb.ParamInfo], *, max_params: int) -> tuple[ParamSpec, ...]:
    """A whole inventory from the wire: each parameter bounded, names unique, and the
    element count of all of them bounded (see [Note: bounds]). Linear in its length."""
    return finish(inventory_steps(msgs, max_params=max_params))


def inventory_steps(
    msgs: Sequence[pb.ParamInfo], *, max_params: int
) -> Steps[tuple[ParamSpec, ...]]:
    """``inventory_from_proto`` in steps (coordinator/core/steps.py [Note: steps])."""
    if len(msgs) > max_params:
        raise ValueError(f"inventory has {len(msgs)} parameters, over the limit of {max_params}")
    specs: list[ParamSpec] = []
    names: set[str] = set()
    total = 0
    for i in range(0, len(msgs), STEP):
        part = list(map(param_from_proto, msgs[i : i + STEP]))
        names.update(spec.name for spec in part)
        specs.extend(part)
        if len(names) != len(specs):
            seen: set[str] = set()
            dup = next(s.name for s in specs if s.name in seen or seen.add(s.name))
            raise ValueError(f"inventory: parameter {dup!r} appears twice")
        total += sum(math.prod(spec.shape) for spec in part)
        if total > MAX_TOTAL_NUMEL:
            raise ValueError(
                f"inventory has more than {MAX_TOTAL_NUMEL} elements in all ({total} "
                f"in its first {len(specs)} parameters)"
            )
        yield
    return tuple(specs)


def worker_to_proto(info: WorkerInfo) -> pb.WorkerInfo:
    return pb.WorkerInfo(
        worker_id=info.worker_id,
        host=info.host,
        device_kind=info.device_kind,
        device_memory_bytes=info.device_memory_bytes,
        metrics_endpoint=info.metrics_endpoint,
        free_ports=list(info.free_ports),
        incarnation=info.incarnation,
        stage=info.stage,
        fixed_rank=info.fixed_rank,
        fixed_world_size=info.fixed_world_size,
        mesh=None
        if info.mesh is None
        else pb.MeshRequest(tensor_parallel=info.mesh[0], pipeline_parallel=info.mesh[1]),
        held=_coords_to_proto(info.held),
    )


def worker_from_proto(msg: pb.WorkerInfo) -> WorkerInfo:
    return WorkerInfo(
        worker_id=msg.worker_id,
        host=msg.host,
        device_kind=msg.device_kind,
        device_memory_bytes=msg.device_memory_bytes,
        metrics_endpoint=msg.metrics_endpoint,
        free_ports=tuple(msg.free_ports),
        incarnation=msg.incarnation,
        stage=msg.stage if msg.HasField("stage") else None,
        fixed_rank=msg.fixed_rank if msg.HasField("fixed_rank") else None,
        fixed_world_size=msg.fixed_world_size if msg.HasField("fixed_world_size") else None,
        mesh=(msg.mesh.tensor_parallel, msg.mesh.pipeline_parallel)
        if msg.HasField("mesh")
        else None,
        held=_coords_from_proto(msg, "held"),
    )


def mesh_to_proto(shape: MeshShape | None, out: pb.MeshShape) -> None:
    if shape is not None:
        out.pp, out.dp, out.tp = shape.pp, shape.dp, shape.tp


def mesh_from_proto(msg: pb.Generation | pb.StatusResponse) -> MeshShape | None:
    if not msg.HasField("mesh"):
        return None
    m = msg.mesh
    try:
        return MeshShape(pp=m.pp, dp=m.dp, tp=m.tp)
    except ValueError as exc:
        raise ValueError(f"generation {getattr(msg, 'id', '')}: {exc}") from None


def report_to_proto(report: WorkerReport) -> pb.WorkerReport:
    return pb.WorkerReport(
        model_state_bytes=dict(report.model_state_bytes),
        device_allocated_bytes=report.device_allocated_bytes,
        device_reserved_bytes=report.device_reserved_bytes,
        step=report.step,
        applied_generation_id=report.applied_generation_id,
        loss=report.loss,
        samples=report.samples,
        tokens=report.tokens,
        checkpoint=report.checkpoint,
        total_steps=report.total_steps,
    )


def report_from_proto(msg: pb.WorkerReport) -> WorkerReport:
    return WorkerReport(
        model_state_bytes=dict(msg.model_state_bytes),
        device_allocated_bytes=msg.device_allocated_bytes,
        device_reserved_bytes=msg.device_reserved_bytes,
        step=msg.step,
        applied_generation_id=msg.applied_generation_id,
        loss=msg.loss if msg.HasField("loss") else None,
        samples=msg.samples,
        tokens=msg.tokens,
        checkpoint=msg.checkpoint,
        total_steps=msg.total_steps if msg.HasField("total_steps") else None,
    )


def _layout_steps(
    msg: pb.Layout, layout: Layout, *, bucket_numel: int, align: int, by_unit: bool
) -> Steps[None]:
    msg.world_size, msg.bucket_numel, msg.align, msg.by_unit = (
        layout.world_size,
        bucket_numel,
        align,
        by_unit,
    )
    # Filled in place: a layout has a slot per parameter, and this is its hot loop.
    add_bucket = msg.buckets.add
    done = 0
    for b in layout.buckets:
        bucket = add_bucket(
            index=b.index,
            group=b.group,
            dtype=b.dtype,
            unit=b.unit,
            numel=b.numel,
            padded_numel=b.padded_numel,
        )
        add_slot = bucket.slots.add
        for s in b.slots:
            slot = add_slot()
            slot.name, slot.offset, slot.numel = s.name, s.offset, s.numel
            slot.shape.extend(s.shape)
        done += len(b.slots) + 1
        if done >= STEP:
            done = 0
            yield


def _layout_from_proto(msg: pb.Layout) -> Layout:
    world = msg.world_size
    if world < 1:
        raise ValueError(f"Layout.world_size must be >= 1, got {world}")
    buckets = []
    for i, b in enumerate(msg.buckets):
        if b.index != i or b.padded_numel % world or b.padded_numel < b.numel:
            raise ValueError(f"Layout bucket {i} is inconsistent with world size {world}")
        slots = tuple(Slot(s.name, s.offset, s.numel, tuple(s.shape)) for s in b.slots)
        buckets.append(
            Bucket(
                index=b.index,
                group=b.group,
                dtype=b.dtype,
                unit=b.unit,
                slots=slots,
                numel=b.numel,
                padded_numel=b.padded_numel,
                world_size=world,
            )
        )
    return Layout(world_size=world, buckets=tuple(buckets))


def generation_to_proto(gen: Generation) -> pb.Generation:
    return finish(generation_steps(gen))


def generation_steps(gen: Generation) -> Steps[pb.Generation]:
    """``generation_to_proto`` in steps (coordinator/core/steps.py [Note: steps])."""
    msg = pb.Generation(
        id=gen.id,
        members=[
            pb.Member(
                worker_id=m.worker_id,
                rank=m.rank,
                host=m.host,
                previous_rank=-1 if m.previous_rank is None else m.previous_rank,
                device_memory_bytes=m.device_memory_bytes,
                mesh=_coords_to_proto(gen.coords(m.rank)),
            )
            for m in gen.members
        ],
        world_size=gen.world_size,
        rendezvous_endpoint=gen.rendezvous_endpoint,
        stage=gen.stage,
        stage_reason=gen.stage_reason,
        inventory_digest=gen.inventory_digest,
        created_unix_s=gen.created_unix_s,
        epoch=gen.epoch,
        mesh_reason=gen.mesh_reason,
    )
    mesh_to_proto(gen.mesh, msg.mesh)
    yield from _layout_steps(
        msg.layout, gen.layout, bucket_numel=gen.bucket_numel, align=gen.align, by_unit=gen.by_unit
    )
    if gen.reshard is not None:
        r = gen.reshard
        reshard = msg.reshard
        reshard.from_generation_id = r.from_generation_id
        reshard.from_world_size = r.from_world_size
        reshard.from_stage = r.from_stage
        reshard.lost_ranks.extend(r.lost_ranks)
        reshard.left_ranks.extend(r.left_ranks)
        reshard.partial = r.partial
        add_move = reshard.moves.add
        for i, m in enumerate(r.moves):
            if i % STEP == 0:
                yield
            move = add_move()
            move.name, move.start, move.stop = m.name, m.start, m.stop
            move.old_owner, move.new_owner = m.old_owner, m.new_owner
    return msg


def _coords_to_proto(coords: MeshCoords | None) -> pb.MeshCoords | None:
    return None if coords is None else pb.MeshCoords(pp=coords.pp, dp=coords.dp, tp=coords.tp)


def _coords_from_proto(msg: Message, field: str) -> MeshCoords | None:
    """``msg``'s ``MeshCoords`` field ``field``, or None where it is not set."""
    if not msg.HasField(field):
        return None
    c = getattr(msg, field)
    return MeshCoords(pp=c.pp, dp=c.dp, tp=c.tp)


def serialize_steps(msg: pb.Generation) -> Steps[bytes]:
    """``msg.SerializeToString()`` in steps (coordinator/core/steps.py): its layout's buckets
    and its reshard moves go out in pieces, each a ``Generation`` holding a few of them.
    Parsing concatenated messages merges them (a message field merges, a repeated field
    appends), so the bytes parse to ``msg``; the pieces just never take long."""
    head = pb.Generation()
    for descriptor, value in msg.ListFields():
        name = descriptor.name
        if name in ("layout", "reshard"):
            continue
        if isinstance(value, Message):
            getattr(head, name).CopyFrom(value)
        elif hasattr(value, "extend"):  # a repeated field
            getattr(head, name).extend(value)
        else:
            setattr(head, name, value)
    layout, reshard = msg.layout, msg.reshard
    head.layout.world_size, head.layout.bucket_numel = layout.world_size, layout.bucket_numel
    head.layout.align, head.layout.by_unit = layout.align, layout.by_unit
    if msg.HasField("reshard"):
        head.reshard.from_generation_id = reshard.from_generation_id
        head.reshard.from_world_size = reshard.from_world_size
        head.reshard.from_stage = reshard.from_stage
        head.reshard.lost_ranks.extend(reshard.lost_ranks)
        head.reshard.left_ranks.extend(reshard.left_ranks)
    pieces = [head.SerializeToString()]
    buckets, moves = msg.layout.buckets, msg.reshard.moves
    start = slots = 0
    for i, bucket in enumerate(buckets):
        slots += len(bucket.slots) + 1
        if slots >= STEP or i == len(buckets) - 1:
            yield
            piece = pb.Generation(layout=pb.Layout(buckets=buckets[start : i + 1]))
            pieces.append(piece.SerializeToString())
            start, slots = i + 1, 0
    for i in range(0, len(moves), STEP):
        yield
        piece = pb.Generation(reshard=pb.ReshardSchedule(moves=moves[i : i + STEP]))
        pieces.append(piece.SerializeToString())
    return b"".join(pieces)


def moves_to_proto(moves: Sequence[Move]) -> bytes:
    """A ``Generation`` holding just ``moves`` in its schedule, serialized: appended to
    an incremental head, it completes a worker's generation (see serialize_steps)."""
    msg = pb.Generation()
    add_move = msg.reshard.moves.add
    for m in moves:
        move = add_move()
        move.name, move.start, move.stop = m.name, m.start, m.stop
        move.old_owner, move.new_owner = m.old_owner, m.new_owner
    return msg.SerializeToString()


def members_delta(previous: Generation, gen: Generation) -> pb.MembersDelta | None:
    """``gen``'s members as a change from ``previous`` (see the proto's MembersDelta);
    None when they are not survivors in order followed by newcomers."""
    survivors = [m for m in gen.members if m.previous_rank is not None]
    if gen.members[: len(survivors)] != tuple(survivors):
        return None
    kept: set[int] = set()
    last = -1
    for m in survivors:
        if m.previous_rank <= last or m.previous_rank >= previous.world_size:
            return None
        old = previous.members[m.previous_rank]
        if (old.worker_id, old.host, old.device_memory_bytes) != (
            m.worker_id,
            m.host,
            m.device_memory_bytes,
        ):
            return None
        kept.add(m.previous_rank)
        last = m.previous_rank
    delta = pb.MembersDelta(
        from_generation_id=previous.id,
        removed_ranks=[r for r in range(previous.world_size) if r not in kept],
    )
    for m in gen.members[len(survivors) :]:
        delta.added.add(
            worker_id=m.worker_id,
            rank=m.rank,
            host=m.host,
            previous_rank=-1,
            device_memory_bytes=m.device_memory_bytes,
        )
    return delta


def _expand_members(delta: pb.MembersDelta, previous: Generation | None) -> tuple[Member, ...]:
    if previous is None or previous.id != delta.from_generation_id:
        have = "none" if previous is None else previous.id
        raise MissingPrevious(
            f"members are a delta from generation {delta.from_generation_id}; this client "
            f"holds {have}"
        )
    removed = set(delta.removed_ranks)
    members = [
        Member(
            worker_id=m.worker_id,
            rank=rank,
            host=m.host,
            previous_rank=m.rank,
            device_memory_bytes=m.device_memory_bytes,
        )
        for rank, m in enumerate(m for m in previous.members if m.rank not in removed)
    ]
    members += [
        Member(
            worker_id=m.worker_id,
            rank=m.rank,
            host=m.host,
            previous_rank=None,
            device_memory_bytes=m.device_memory_bytes,
        )
        for m in delta.added
    ]
    return tuple(members)


class MissingPrevious(ValueError):
    """An incremental generation that needs a previous generation this side lacks."""


def generation_from_proto(msg: pb.Generation, previous: Generation | None = None) -> Generation:
    """``msg`` as a Generation. An incremental one (a MembersDelta, a partial schedule)
    is completed from ``previous``, the generation it follows: its members from the
    delta and its whole schedule from the two layouts (built on first use, see
    coordinator/core/reshard.py [Note: incremental schedule]); without ``previous``
    a MembersDelta raises MissingPrevious and a partial schedule stays partial."""
    if msg.HasField("members_delta"):
        members = _expand_members(msg.members_delta, previous)
    else:
        members = tuple(
            Member(
                worker_id=m.worker_id,
                rank=m.rank,
                host=m.host,
                previous_rank=None if m.previous_rank < 0 else m.previous_rank,
                device_memory_bytes=m.device_memory_bytes,
            )
            for m in msg.members
        )
    if [m.rank for m in members] != list(range(len(members))) or len(members) != msg.world_size:
        raise ValueError(f"generation {msg.id}: members are not ranks 0..{msg.world_size - 1}")
    mesh = mesh_from_proto(msg)
    if mesh is not None and mesh.world_size != len(members):
        raise ValueError(
            f"generation {msg.id}: a mesh of pp={mesh.pp} x dp={mesh.dp} x tp={mesh.tp} "
            f"for {len(members)} members"
        )
    for m in () if msg.HasField("members_delta") else msg.members:
        given = _coords_from_proto(m, "mesh")
        if given != (None if mesh is None else mesh.coords(m.rank)):
            raise ValueError(
                f"generation {msg.id}: rank {m.rank}'s mesh coordinates {given} are not its "
                "place in the generation's mesh"
            )
    layout = _layout_from_proto(msg.layout)
    reshard = None
    if msg.HasField("reshard"):
        r = msg.reshard
        partial = r.partial
        moves: Sequence[Move]
        if partial and previous is not None and previous.id == r.from_generation_id:
            moves, partial = LazyMoves(previous.layout, layout), False
        else:
            moves = tuple(Move(m.name, m.start, m.stop, m.old_owner, m.new_owner) for m in r.moves)
        reshard = ReshardSchedule(
            from_generation_id=r.from_generation_id,
            from_world_size=r.from_world_size,
            from_stage=r.from_stage,
            moves=moves,
            lost_ranks=tuple(r.lost_ranks),
            left_ranks=tuple(r.left_ranks),
            partial=partial,
        )
    return Generation(
        id=msg.id,
        members=members,
        rendezvous_endpoint=msg.rendezvous_endpoint,
        stage=msg.stage,
        stage_reason=msg.stage_reason,
        layout=layout,
        bucket_numel=msg.layout.bucket_numel,
        align=msg.layout.align,
        reshard=reshard,
        inventory_digest=msg.inventory_digest,
        created_unix_s=msg.created_unix_s,
        epoch=msg.epoch,
        mesh=mesh,
        mesh_reason=msg.mesh_reason,
    )


def status_to_proto(status: StatusReport) -> pb.StatusResponse:
    s = status.settings
    msg = pb.StatusResponse(
        phase=status.phase,
        waiting_reason=status.waiting_reason,
        generation_id=status.generation_id,
        world_size=status.world_size,
        stage=status.stage,
        stage_reason=status.stage_reason,
        rendezvous_endpoint=status.rendezvous_endpoint,
        workers=[
            pb.WorkerStatus(
                info=worker_to_proto(w.info),
                state=w.state,
                rank=-1 if w.rank is None else w.rank,
                lease_remaining_s=w.lease_remaining_s,
                report=None if w.report is None else report_to_proto(w.report),
                leaving=w.leaving,
            )
            for w in status.workers
        ],
        events=[
            pb.Event(
                unix_s=e.unix_s,
                kind=e.kind,
                worker_id=e.worker_id,
                generation_id=e.generation_id,
                detail=e.detail,
            )
            for e in status.events
        ],
        settings=pb.MembershipSettings(
            min_workers=s.min_workers,
            max_workers=s.max_workers,
            join_window_s=s.join_window_s,
            lease_timeout_s=s.lease_timeout_s,
            heartbeat_interval_s=s.heartbeat_interval_s,
        ),
        trainable_numel=status.trainable_numel,
        inventory_digest=status.inventory_digest,
        server_version=status.server_version,
        epoch=status.epoch,
        mesh_reason=status.mesh_reason,
    )
    mesh_to_proto(status.mesh, msg.mesh)
    return msg


def status_from_proto(msg: pb.StatusResponse) -> StatusReport:
    s = msg.settings
    return StatusReport(
        phase=msg.phase,
        waiting_reason=msg.waiting_reason,
        generation_id=msg.generation_id,
        world_size=msg.world_size,
        stage=msg.stage,
        stage_reason=msg.stage_reason,
        rendezvous_endpoint=msg.rendezvous_endpoint,
        workers=tuple(
            WorkerStatus(
                info=worker_from_proto(w.info),
                state=w.state,
                rank=None if w.rank < 0 else w.rank,
                lease_remaining_s=w.lease_remaining_s if math.isfinite(w.lease_remaining_s) else 0,
                report=report_from_proto(w.report) if w.HasField("report") else None,
                leaving=w.leaving,
            )
            for w in msg.workers
        ),
        events=tuple(
            Event(
                unix_s=e.unix_s,
                kind=e.kind,
                worker_id=e.worker_id,
                generation_id=e.generation_id,
                detail=e.detail,
            )
            for e in msg.events
        ),
        settings=MembershipConfig(
            min_workers=s.min_workers,
            max_workers=s.max_workers,
            join_window_s=s.join_window_s,
            lease_timeout_s=s.lease_timeout_s,
            heartbeat_interval_s=s.heartbeat_interval_s,
        ),
        trainable_numel=msg.trainable_numel,
        inventory_digest=msg.inventory_digest,
        server_version=msg.server_version,
        epoch=msg.epoch,
        mesh=mesh_from_proto(msg),
        mesh_reason=msg.mesh_reason,
    )
