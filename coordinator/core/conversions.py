"""The control-plane messages' protobuf form: parameters and inventories, a worker's
info and report, a host heartbeat's beats, mesh shapes and coordinates, status.

A generation's form, whole or as a change from the one before, is
coordinator/core/generation_codec.py. Conversions from the wire validate and raise
``ValueError`` naming the bad field (coordinator/core/messages.py [Note: bounds]).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

from google.protobuf.message import Message

from coordinator._proto.zeroplane.coordinator.v1 import coordinator_pb2 as pb
from coordinator.core.layout import ParamSpec
from coordinator.core.meshplan import MeshCoords, MeshShape
from coordinator.core.messages import (
    MAX_GROUP,
    MAX_PARAM_NUMEL,
    MAX_TOTAL_NUMEL,
    MAX_UNIT,
    Event,
    RankBeat,
    StatusReport,
    Whereabouts,
    WorkerInfo,
    WorkerReport,
    WorkerStatus,
)
from coordinator.core.settings import MembershipConfig
from coordinator.core.steps import STEP, Steps, finish

__all__ = [
    "coords_from_proto",
    "coords_to_proto",
    "inventory_digest",
    "inventory_from_proto",
    "inventory_steps",
    "inventory_wire",
    "inventory_wire_steps",
    "mesh_from_proto",
    "mesh_to_proto",
    "param_from_proto",
    "param_to_proto",
    "rank_beat_to_proto",
    "report_from_proto",
    "report_to_proto",
    "status_from_proto",
    "status_to_proto",
    "worker_from_proto",
    "worker_to_proto",
]


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
    """A parameter from the wire, every field bounded (messages.py [Note: bounds])."""
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
    element count of all of them bounded (messages.py [Note: bounds]). Linear in its length."""
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
        held=coords_to_proto(info.held),
        experts=None
        if info.experts is None
        else pb.ExpertRequest(expert_parallel=info.experts[0], numel=info.experts[1]),
        context_parallel=info.context_parallel,
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
        held=coords_from_proto(msg, "held"),
        experts=(msg.experts.expert_parallel, msg.experts.numel)
        if msg.HasField("experts")
        else None,
        context_parallel=msg.context_parallel if msg.HasField("context_parallel") else None,
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
        where=None if report.where is None else where_to_proto(report.where),
    )


def where_to_proto(where: Whereabouts) -> pb.Whereabouts:
    return pb.Whereabouts(
        state=where.state,
        for_s=where.for_s,
        op=where.op,
        seq=where.seq,
        group=where.group,
        unit=where.unit,
        phase=where.phase,
    )


def where_from_proto(msg: pb.Whereabouts) -> Whereabouts:
    return Whereabouts(
        state=msg.state,
        for_s=msg.for_s,
        op=msg.op,
        seq=msg.seq,
        group=msg.group,
        unit=msg.unit,
        phase=msg.phase,
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
        where=where_from_proto(msg.where) if msg.HasField("where") else None,
    )


def coords_to_proto(coords: MeshCoords | None) -> pb.MeshCoords | None:
    return None if coords is None else pb.MeshCoords(pp=coords.pp, dp=coords.dp, tp=coords.tp)


def coords_from_proto(msg: Message, field: str) -> MeshCoords | None:
    """``msg``'s ``MeshCoords`` field ``field``, or None where it is not set."""
    if not msg.HasField(field):
        return None
    c = getattr(msg, field)
    return MeshCoords(pp=c.pp, dp=c.dp, tp=c.tp)


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
        stall=status.stall,
        stall_kind=status.stall_kind,
        newcomers=status.newcomers,
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
        stall=msg.stall,
        stall_kind=msg.stall_kind,
        newcomers=msg.newcomers,
    )
