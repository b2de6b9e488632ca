"""Control-plane messages as Python objects, and their protobuf wire form.

Workers and the rest of zeroplane use these dataclasses; only this module, the
server and the client touch the generated protobuf classes. Conversions from
the wire validate and raise ``ValueError`` naming the bad field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from coordinator._proto.zeroplane.coordinator.v1 import coordinator_pb2 as pb
from coordinator.config import MembershipConfig
from coordinator.layout import Bucket, Layout, ParamSpec, Slot
from coordinator.reshard import Move, ReshardSchedule

__all__ = [
    "GENERATION_METADATA_KEY",
    "Event",
    "Generation",
    "Member",
    "StatusReport",
    "WorkerInfo",
    "WorkerReport",
    "WorkerStatus",
    "generation_from_proto",
    "generation_to_proto",
    "param_from_proto",
    "param_to_proto",
    "report_from_proto",
    "report_to_proto",
    "status_from_proto",
    "status_to_proto",
    "worker_from_proto",
    "worker_to_proto",
]

# Trailing metadata of a FAILED_PRECONDITION for a stale generation: the current id.
GENERATION_METADATA_KEY = "zeroplane-generation"
MAX_ID_CHARS = 253  # a DNS name, so a pod name always fits
MAX_PORTS = 8
MAX_WORLD_SIZE = 1 << 20  # ranks in one process group


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

    def __post_init__(self) -> None:
        _check_id("WorkerInfo.worker_id", self.worker_id)
        _check_id("WorkerInfo.host", self.host)
        if len(self.device_kind) > 64:
            raise ValueError("WorkerInfo.device_kind is longer than 64 characters")
        if self.device_memory_bytes < 0:
            raise ValueError(
                f"WorkerInfo.device_memory_bytes must be >= 0, got {self.device_memory_bytes}"
            )
        if len(self.metrics_endpoint) > MAX_ID_CHARS + 6:
            raise ValueError("WorkerInfo.metrics_endpoint is too long")
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

    def __post_init__(self) -> None:
        if len(self.checkpoint) > 4096:
            raise ValueError("WorkerReport.checkpoint is longer than 4096 characters")
        if len(self.model_state_bytes) > 16:
            raise ValueError("WorkerReport.model_state_bytes has more than 16 kinds")
        for kind, value in self.model_state_bytes.items():
            if not kind or len(kind) > 64:
                raise ValueError(f"WorkerReport.model_state_bytes kind {kind!r} is not 1-64 chars")
            if value < 0:
                raise ValueError(f"WorkerReport.model_state_bytes[{kind!r}] is negative: {value}")
        for name in (
            "device_allocated_bytes",
            "device_reserved_bytes",
            "step",
            "samples",
            "tokens",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"WorkerReport.{name} must be >= 0, got {getattr(self, name)}")


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

    @property
    def world_size(self) -> int:
        return len(self.members)

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

    @property
    def members(self) -> tuple[WorkerStatus, ...]:
        return tuple(w for w in self.workers if w.state == "member")

    def worker(self, worker_id: str) -> WorkerStatus | None:
        return next((w for w in self.workers if w.info.worker_id == worker_id), None)


def _check_id(name: str, value: str) -> None:
    if not value:
        raise ValueError(f"{name} must be non-empty")
    if len(value) > MAX_ID_CHARS:
        raise ValueError(f"{name} is longer than {MAX_ID_CHARS} characters")
    if not value.isprintable() or any(c.isspace() for c in value):
        raise ValueError(f"{name} {value!r} has whitespace or unprintable characters")


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
    if len(msg.name) > 1024:
        raise ValueError(f"parameter name {msg.name[:40]!r}... is longer than 1024 characters")
    if not msg.dtype or len(msg.dtype) > 32:
        raise ValueError(f"parameter {msg.name!r} has dtype {msg.dtype!r}: must be 1-32 chars")
    if len(msg.shape) > 32:
        raise ValueError(f"parameter {msg.name!r} has {len(msg.shape)} dims, more than 32")
    return ParamSpec(
        name=msg.name,
        shape=tuple(msg.shape),
        dtype=msg.dtype,
        requires_grad=msg.requires_grad,
        group=msg.group,
        unit=msg.unit,
    )


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
    )


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
    )


def _layout_to_proto(layout: Layout, *, bucket_numel: int, align: int, by_unit: bool) -> pb.Layout:
    return pb.Layout(
        world_size=layout.world_size,
        bucket_numel=bucket_numel,
        align=align,
        by_unit=by_unit,
        buckets=[
            pb.Bucket(
                index=b.index,
                group=b.group,
                dtype=b.dtype,
                unit=b.unit,
                numel=b.numel,
                padded_numel=b.padded_numel,
                slots=[
                    pb.Slot(name=s.name, offset=s.offset, numel=s.numel, shape=list(s.shape))
                    for s in b.slots
                ],
            )
            for b in layout.buckets
        ],
    )


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
    msg = pb.Generation(
        id=gen.id,
        members=[
            pb.Member(
                worker_id=m.worker_id,
                rank=m.rank,
                host=m.host,
                previous_rank=-1 if m.previous_rank is None else m.previous_rank,
                device_memory_bytes=m.device_memory_bytes,
            )
            for m in gen.members
        ],
        world_size=gen.world_size,
        rendezvous_endpoint=gen.rendezvous_endpoint,
        stage=gen.stage,
        stage_reason=gen.stage_reason,
        layout=_layout_to_proto(
            gen.layout, bucket_numel=gen.bucket_numel, align=gen.align, by_unit=gen.by_unit
        ),
        inventory_digest=gen.inventory_digest,
        created_unix_s=gen.created_unix_s,
        epoch=gen.epoch,
    )
    if gen.reshard is not None:
        r = gen.reshard
        msg.reshard.CopyFrom(
            pb.ReshardSchedule(
                from_generation_id=r.from_generation_id,
                from_world_size=r.from_world_size,
                from_stage=r.from_stage,
                moves=[
                    pb.Move(
                        name=m.name,
                        start=m.start,
                        stop=m.stop,
                        old_owner=m.old_owner,
                        new_owner=m.new_owner,
                    )
                    for m in r.moves
                ],
                lost_ranks=list(r.lost_ranks),
                left_ranks=list(r.left_ranks),
            )
        )
    return msg


def generation_from_proto(msg: pb.Generation) -> Generation:
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
    reshard = None
    if msg.HasField("reshard"):
        r = msg.reshard
        reshard = ReshardSchedule(
            from_generation_id=r.from_generation_id,
            from_world_size=r.from_world_size,
            from_stage=r.from_stage,
            moves=tuple(Move(m.name, m.start, m.stop, m.old_owner, m.new_owner) for m in r.moves),
            lost_ranks=tuple(r.lost_ranks),
            left_ranks=tuple(r.left_ranks),
        )
    return Generation(
        id=msg.id,
        members=members,
        rendezvous_endpoint=msg.rendezvous_endpoint,
        stage=msg.stage,
        stage_reason=msg.stage_reason,
        layout=_layout_from_proto(msg.layout),
        bucket_numel=msg.layout.bucket_numel,
        align=msg.layout.align,
        reshard=reshard,
        inventory_digest=msg.inventory_digest,
        created_unix_s=msg.created_unix_s,
        epoch=msg.epoch,
    )


def status_to_proto(status: StatusReport) -> pb.StatusResponse:
    s = status.settings
    return pb.StatusResponse(
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
    )


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
    )
