from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ParamInfo(_message.Message):
    __slots__ = ("name", "shape", "dtype", "requires_grad", "group", "unit")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    REQUIRES_GRAD_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    requires_grad: bool
    group: int
    unit: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., requires_grad: _Optional[bool] = ..., group: _Optional[int] = ..., unit: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "host", "device_kind", "device_memory_bytes", "metrics_endpoint", "free_ports", "incarnation", "stage", "fixed_rank", "fixed_world_size", "mesh", "held", "experts", "context_parallel")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    METRICS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    FREE_PORTS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    FIXED_RANK_FIELD_NUMBER: _ClassVar[int]
    FIXED_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MESH_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    host: str
    device_kind: str
    device_memory_bytes: int
    metrics_endpoint: str
    free_ports: _containers.RepeatedScalarFieldContainer[int]
    incarnation: str
    stage: int
    fixed_rank: int
    fixed_world_size: int
    mesh: MeshRequest
    held: MeshCoords
    experts: ExpertRequest
    context_parallel: int
    def __init__(self, worker_id: _Optional[str] = ..., host: _Optional[str] = ..., device_kind: _Optional[str] = ..., device_memory_bytes: _Optional[int] = ..., metrics_endpoint: _Optional[str] = ..., free_ports: _Optional[_Iterable[int]] = ..., incarnation: _Optional[str] = ..., stage: _Optional[int] = ..., fixed_rank: _Optional[int] = ..., fixed_world_size: _Optional[int] = ..., mesh: _Optional[_Union[MeshRequest, _Mapping]] = ..., held: _Optional[_Union[MeshCoords, _Mapping]] = ..., experts: _Optional[_Union[ExpertRequest, _Mapping]] = ..., context_parallel: _Optional[int] = ...) -> None: ...

class ExpertRequest(_message.Message):
    __slots__ = ("expert_parallel", "numel")
    EXPERT_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    expert_parallel: int
    numel: int
    def __init__(self, expert_parallel: _Optional[int] = ..., numel: _Optional[int] = ...) -> None: ...

class MeshRequest(_message.Message):
    __slots__ = ("tensor_parallel", "pipeline_parallel")
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    tensor_parallel: int
    pipeline_parallel: int
    def __init__(self, tensor_parallel: _Optional[int] = ..., pipeline_parallel: _Optional[int] = ...) -> None: ...

class MeshShape(_message.Message):
    __slots__ = ("pp", "dp", "tp")
    PP_FIELD_NUMBER: _ClassVar[int]
    DP_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    pp: int
    dp: int
    tp: int
    def __init__(self, pp: _Optional[int] = ..., dp: _Optional[int] = ..., tp: _Optional[int] = ...) -> None: ...

class MeshCoords(_message.Message):
    __slots__ = ("pp", "dp", "tp")
    PP_FIELD_NUMBER: _ClassVar[int]
    DP_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    pp: int
    dp: int
    tp: int
    def __init__(self, pp: _Optional[int] = ..., dp: _Optional[int] = ..., tp: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker", "inventory")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerInfo
    inventory: _containers.RepeatedCompositeFieldContainer[ParamInfo]
    def __init__(self, worker: _Optional[_Union[WorkerInfo, _Mapping]] = ..., inventory: _Optional[_Iterable[_Union[ParamInfo, _Mapping]]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("worker_id", "lease_timeout_s", "heartbeat_interval_s", "generation_id", "reattached", "epoch")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    GENERATION_ID_FIELD_NUMBER: _ClassVar[int]
    REATTACHED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    lease_timeout_s: float
    heartbeat_interval_s: float
    generation_id: int
    reattached: bool
    epoch: str
    def __init__(self, worker_id: _Optional[str] = ..., lease_timeout_s: _Optional[float] = ..., heartbeat_interval_s: _Optional[float] = ..., generation_id: _Optional[int] = ..., reattached: _Optional[bool] = ..., epoch: _Optional[str] = ...) -> None: ...

class WorkerReport(_message.Message):
    __slots__ = ("model_state_bytes", "device_allocated_bytes", "device_reserved_bytes", "step", "applied_generation_id", "loss", "samples", "tokens", "checkpoint", "total_steps", "where")
    class ModelStateBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MODEL_STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    APPLIED_GENERATION_ID_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    WHERE_FIELD_NUMBER: _ClassVar[int]
    model_state_bytes: _containers.ScalarMap[str, int]
    device_allocated_bytes: int
    device_reserved_bytes: int
    step: int
    applied_generation_id: int
    loss: float
    samples: int
    tokens: int
    checkpoint: str
    total_steps: int
    where: Whereabouts
    def __init__(self, model_state_bytes: _Optional[_Mapping[str, int]] = ..., device_allocated_bytes: _Optional[int] = ..., device_reserved_bytes: _Optional[int] = ..., step: _Optional[int] = ..., applied_generation_id: _Optional[int] = ..., loss: _Optional[float] = ..., samples: _Optional[int] = ..., tokens: _Optional[int] = ..., checkpoint: _Optional[str] = ..., total_steps: _Optional[int] = ..., where: _Optional[_Union[Whereabouts, _Mapping]] = ...) -> None: ...

class Whereabouts(_message.Message):
    __slots__ = ("state", "for_s", "op", "seq", "group", "unit", "phase")
    STATE_FIELD_NUMBER: _ClassVar[int]
    FOR_S_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    state: str
    for_s: float
    op: str
    seq: int
    group: str
    unit: str
    phase: str
    def __init__(self, state: _Optional[str] = ..., for_s: _Optional[float] = ..., op: _Optional[str] = ..., seq: _Optional[int] = ..., group: _Optional[str] = ..., unit: _Optional[str] = ..., phase: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "generation_id", "report", "free_ports", "leaving")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_ID_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    FREE_PORTS_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    generation_id: int
    report: WorkerReport
    free_ports: _containers.RepeatedScalarFieldContainer[int]
    leaving: bool
    def __init__(self, worker_id: _Optional[str] = ..., generation_id: _Optional[int] = ..., report: _Optional[_Union[WorkerReport, _Mapping]] = ..., free_ports: _Optional[_Iterable[int]] = ..., leaving: _Optional[bool] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("generation_id", "lease_remaining_s", "job_finished", "stalled")
    GENERATION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_S_FIELD_NUMBER: _ClassVar[int]
    JOB_FINISHED_FIELD_NUMBER: _ClassVar[int]
    STALLED_FIELD_NUMBER: _ClassVar[int]
    generation_id: int
    lease_remaining_s: float
    job_finished: bool
    stalled: str
    def __init__(self, generation_id: _Optional[int] = ..., lease_remaining_s: _Optional[float] = ..., job_finished: _Optional[bool] = ..., stalled: _Optional[str] = ...) -> None: ...

class RankBeat(_message.Message):
    __slots__ = ("worker_id", "generation_id", "report", "free_ports", "leaving", "age_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_ID_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    FREE_PORTS_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    generation_id: int
    report: WorkerReport
    free_ports: _containers.RepeatedScalarFieldContainer[int]
    leaving: bool
    age_s: float
    def __init__(self, worker_id: _Optional[str] = ..., generation_id: _Optional[int] = ..., report: _Optional[_Union[WorkerReport, _Mapping]] = ..., free_ports: _Optional[_Iterable[int]] = ..., leaving: _Optional[bool] = ..., age_s: _Optional[float] = ...) -> None: ...

class HostHeartbeatRequest(_message.Message):
    __slots__ = ("host_id", "ranks")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    ranks: _containers.RepeatedCompositeFieldContainer[RankBeat]
    def __init__(self, host_id: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[RankBeat, _Mapping]]] = ...) -> None: ...

class RankBeatResult(_message.Message):
    __slots__ = ("worker_id", "outcome", "lease_remaining_s", "detail")
    class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OUTCOME_UNSPECIFIED: _ClassVar[RankBeatResult.Outcome]
        OK: _ClassVar[RankBeatResult.Outcome]
        STALE_GENERATION: _ClassVar[RankBeatResult.Outcome]
        UNKNOWN_WORKER: _ClassVar[RankBeatResult.Outcome]
        INVALID: _ClassVar[RankBeatResult.Outcome]
        FENCED: _ClassVar[RankBeatResult.Outcome]
    OUTCOME_UNSPECIFIED: RankBeatResult.Outcome
    OK: RankBeatResult.Outcome
    STALE_GENERATION: RankBeatResult.Outcome
    UNKNOWN_WORKER: RankBeatResult.Outcome
    INVALID: RankBeatResult.Outcome
    FENCED: RankBeatResult.Outcome
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_S_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    outcome: RankBeatResult.Outcome
    lease_remaining_s: float
    detail: str
    def __init__(self, worker_id: _Optional[str] = ..., outcome: _Optional[_Union[RankBeatResult.Outcome, str]] = ..., lease_remaining_s: _Optional[float] = ..., detail: _Optional[str] = ...) -> None: ...

class HostHeartbeatResponse(_message.Message):
    __slots__ = ("generation_id", "job_finished", "ranks", "stalled")
    GENERATION_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_FINISHED_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    STALLED_FIELD_NUMBER: _ClassVar[int]
    generation_id: int
    job_finished: bool
    ranks: _containers.RepeatedCompositeFieldContainer[RankBeatResult]
    stalled: str
    def __init__(self, generation_id: _Optional[int] = ..., job_finished: _Optional[bool] = ..., ranks: _Optional[_Iterable[_Union[RankBeatResult, _Mapping]]] = ..., stalled: _Optional[str] = ...) -> None: ...

class AgentBeat(_message.Message):
    __slots__ = ("beat", "seq", "lease_timeout_s", "heartbeat_interval_s", "flush")
    BEAT_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    FLUSH_FIELD_NUMBER: _ClassVar[int]
    beat: RankBeat
    seq: int
    lease_timeout_s: float
    heartbeat_interval_s: float
    flush: bool
    def __init__(self, beat: _Optional[_Union[RankBeat, _Mapping]] = ..., seq: _Optional[int] = ..., lease_timeout_s: _Optional[float] = ..., heartbeat_interval_s: _Optional[float] = ..., flush: _Optional[bool] = ...) -> None: ...

class AgentReply(_message.Message):
    __slots__ = ("result", "forwarded_seq", "generation_id", "job_finished", "unavailable", "stalled")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    FORWARDED_SEQ_FIELD_NUMBER: _ClassVar[int]
    GENERATION_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_FINISHED_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    STALLED_FIELD_NUMBER: _ClassVar[int]
    result: RankBeatResult
    forwarded_seq: int
    generation_id: int
    job_finished: bool
    unavailable: str
    stalled: str
    def __init__(self, result: _Optional[_Union[RankBeatResult, _Mapping]] = ..., forwarded_seq: _Optional[int] = ..., generation_id: _Optional[int] = ..., job_finished: _Optional[bool] = ..., unavailable: _Optional[str] = ..., stalled: _Optional[str] = ...) -> None: ...

class WatchGenerationsRequest(_message.Message):
    __slots__ = ("worker_id", "after_generation_id", "incremental")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_GENERATION_ID_FIELD_NUMBER: _ClassVar[int]
    INCREMENTAL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    after_generation_id: int
    incremental: bool
    def __init__(self, worker_id: _Optional[str] = ..., after_generation_id: _Optional[int] = ..., incremental: _Optional[bool] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("worker_id", "reason")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    reason: str
    def __init__(self, worker_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Member(_message.Message):
    __slots__ = ("worker_id", "rank", "host", "previous_rank", "device_memory_bytes", "mesh")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MESH_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    rank: int
    host: str
    previous_rank: int
    device_memory_bytes: int
    mesh: MeshCoords
    def __init__(self, worker_id: _Optional[str] = ..., rank: _Optional[int] = ..., host: _Optional[str] = ..., previous_rank: _Optional[int] = ..., device_memory_bytes: _Optional[int] = ..., mesh: _Optional[_Union[MeshCoords, _Mapping]] = ...) -> None: ...

class Slot(_message.Message):
    __slots__ = ("name", "offset", "numel", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    numel: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., numel: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class Bucket(_message.Message):
    __slots__ = ("index", "group", "dtype", "unit", "slots", "numel", "padded_numel")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    PADDED_NUMEL_FIELD_NUMBER: _ClassVar[int]
    index: int
    group: int
    dtype: str
    unit: int
    slots: _containers.RepeatedCompositeFieldContainer[Slot]
    numel: int
    padded_numel: int
    def __init__(self, index: _Optional[int] = ..., group: _Optional[int] = ..., dtype: _Optional[str] = ..., unit: _Optional[int] = ..., slots: _Optional[_Iterable[_Union[Slot, _Mapping]]] = ..., numel: _Optional[int] = ..., padded_numel: _Optional[int] = ...) -> None: ...

class Layout(_message.Message):
    __slots__ = ("world_size", "bucket_numel", "align", "by_unit", "buckets")
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BUCKET_NUMEL_FIELD_NUMBER: _ClassVar[int]
    ALIGN_FIELD_NUMBER: _ClassVar[int]
    BY_UNIT_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    bucket_numel: int
    align: int
    by_unit: bool
    buckets: _containers.RepeatedCompositeFieldContainer[Bucket]
    def __init__(self, world_size: _Optional[int] = ..., bucket_numel: _Optional[int] = ..., align: _Optional[int] = ..., by_unit: _Optional[bool] = ..., buckets: _Optional[_Iterable[_Union[Bucket, _Mapping]]] = ...) -> None: ...

class Move(_message.Message):
    __slots__ = ("name", "start", "stop", "old_owner", "new_owner")
    NAME_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    OLD_OWNER_FIELD_NUMBER: _ClassVar[int]
    NEW_OWNER_FIELD_NUMBER: _ClassVar[int]
    name: str
    start: int
    stop: int
    old_owner: int
    new_owner: int
    def __init__(self, name: _Optional[str] = ..., start: _Optional[int] = ..., stop: _Optional[int] = ..., old_owner: _Optional[int] = ..., new_owner: _Optional[int] = ...) -> None: ...

class ReshardSchedule(_message.Message):
    __slots__ = ("from_generation_id", "from_world_size", "from_stage", "moves", "lost_ranks", "left_ranks", "partial")
    FROM_GENERATION_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    FROM_STAGE_FIELD_NUMBER: _ClassVar[int]
    MOVES_FIELD_NUMBER: _ClassVar[int]
    LOST_RANKS_FIELD_NUMBER: _ClassVar[int]
    LEFT_RANKS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    from_generation_id: int
    from_world_size: int
    from_stage: int
    moves: _containers.RepeatedCompositeFieldContainer[Move]
    lost_ranks: _containers.RepeatedScalarFieldContainer[int]
    left_ranks: _containers.RepeatedScalarFieldContainer[int]
    partial: bool
    def __init__(self, from_generation_id: _Optional[int] = ..., from_world_size: _Optional[int] = ..., from_stage: _Optional[int] = ..., moves: _Optional[_Iterable[_Union[Move, _Mapping]]] = ..., lost_ranks: _Optional[_Iterable[int]] = ..., left_ranks: _Optional[_Iterable[int]] = ..., partial: _Optional[bool] = ...) -> None: ...

class MembersDelta(_message.Message):
    __slots__ = ("from_generation_id", "removed_ranks", "added")
    FROM_GENERATION_ID_FIELD_NUMBER: _ClassVar[int]
    REMOVED_RANKS_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    from_generation_id: int
    removed_ranks: _containers.RepeatedScalarFieldContainer[int]
    added: _containers.RepeatedCompositeFieldContainer[Member]
    def __init__(self, from_generation_id: _Optional[int] = ..., removed_ranks: _Optional[_Iterable[int]] = ..., added: _Optional[_Iterable[_Union[Member, _Mapping]]] = ...) -> None: ...

class Generation(_message.Message):
    __slots__ = ("id", "members", "world_size", "rendezvous_endpoint", "stage", "stage_reason", "layout", "reshard", "inventory_digest", "created_unix_s", "epoch", "members_delta", "mesh", "mesh_reason")
    ID_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STAGE_REASON_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    RESHARD_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_DELTA_FIELD_NUMBER: _ClassVar[int]
    MESH_FIELD_NUMBER: _ClassVar[int]
    MESH_REASON_FIELD_NUMBER: _ClassVar[int]
    id: int
    members: _containers.RepeatedCompositeFieldContainer[Member]
    world_size: int
    rendezvous_endpoint: str
    stage: int
    stage_reason: str
    layout: Layout
    reshard: ReshardSchedule
    inventory_digest: str
    created_unix_s: float
    epoch: str
    members_delta: MembersDelta
    mesh: MeshShape
    mesh_reason: str
    def __init__(self, id: _Optional[int] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., world_size: _Optional[int] = ..., rendezvous_endpoint: _Optional[str] = ..., stage: _Optional[int] = ..., stage_reason: _Optional[str] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., reshard: _Optional[_Union[ReshardSchedule, _Mapping]] = ..., inventory_digest: _Optional[str] = ..., created_unix_s: _Optional[float] = ..., epoch: _Optional[str] = ..., members_delta: _Optional[_Union[MembersDelta, _Mapping]] = ..., mesh: _Optional[_Union[MeshShape, _Mapping]] = ..., mesh_reason: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("info", "rank", "lease_remaining_s", "report", "state", "leaving")
    INFO_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_S_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    info: WorkerInfo
    rank: int
    lease_remaining_s: float
    report: WorkerReport
    state: str
    leaving: bool
    def __init__(self, info: _Optional[_Union[WorkerInfo, _Mapping]] = ..., rank: _Optional[int] = ..., lease_remaining_s: _Optional[float] = ..., report: _Optional[_Union[WorkerReport, _Mapping]] = ..., state: _Optional[str] = ..., leaving: _Optional[bool] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("unix_s", "kind", "worker_id", "generation_id", "detail")
    UNIX_S_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_ID_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    unix_s: float
    kind: str
    worker_id: str
    generation_id: int
    detail: str
    def __init__(self, unix_s: _Optional[float] = ..., kind: _Optional[str] = ..., worker_id: _Optional[str] = ..., generation_id: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class MembershipSettings(_message.Message):
    __slots__ = ("min_workers", "max_workers", "join_window_s", "lease_timeout_s", "heartbeat_interval_s")
    MIN_WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_WORKERS_FIELD_NUMBER: _ClassVar[int]
    JOIN_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    min_workers: int
    max_workers: int
    join_window_s: float
    lease_timeout_s: float
    heartbeat_interval_s: float
    def __init__(self, min_workers: _Optional[int] = ..., max_workers: _Optional[int] = ..., join_window_s: _Optional[float] = ..., lease_timeout_s: _Optional[float] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("phase", "waiting_reason", "generation_id", "world_size", "stage", "stage_reason", "rendezvous_endpoint", "workers", "events", "settings", "trainable_numel", "inventory_digest", "server_version", "epoch", "mesh", "mesh_reason", "stall", "stall_kind", "newcomers")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    WAITING_REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATION_ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STAGE_REASON_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    TRAINABLE_NUMEL_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MESH_FIELD_NUMBER: _ClassVar[int]
    MESH_REASON_FIELD_NUMBER: _ClassVar[int]
    STALL_FIELD_NUMBER: _ClassVar[int]
    STALL_KIND_FIELD_NUMBER: _ClassVar[int]
    NEWCOMERS_FIELD_NUMBER: _ClassVar[int]
    phase: str
    waiting_reason: str
    generation_id: int
    world_size: int
    stage: int
    stage_reason: str
    rendezvous_endpoint: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    events: _containers.RepeatedCompositeFieldContainer[Event]
    settings: MembershipSettings
    trainable_numel: int
    inventory_digest: str
    server_version: str
    epoch: str
    mesh: MeshShape
    mesh_reason: str
    stall: str
    stall_kind: str
    newcomers: int
    def __init__(self, phase: _Optional[str] = ..., waiting_reason: _Optional[str] = ..., generation_id: _Optional[int] = ..., world_size: _Optional[int] = ..., stage: _Optional[int] = ..., stage_reason: _Optional[str] = ..., rendezvous_endpoint: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ..., settings: _Optional[_Union[MembershipSettings, _Mapping]] = ..., trainable_numel: _Optional[int] = ..., inventory_digest: _Optional[str] = ..., server_version: _Optional[str] = ..., epoch: _Optional[str] = ..., mesh: _Optional[_Union[MeshShape, _Mapping]] = ..., mesh_reason: _Optional[str] = ..., stall: _Optional[str] = ..., stall_kind: _Optional[str] = ..., newcomers: _Optional[int] = ...) -> None: ...

class PersistedState(_message.Message):
    __slots__ = ("format_version", "inventory", "generation", "members", "epoch", "inventory_digest", "left", "finished_by", "stopping")
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_BY_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    inventory: _containers.RepeatedCompositeFieldContainer[ParamInfo]
    generation: Generation
    members: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    epoch: str
    inventory_digest: str
    left: _containers.RepeatedScalarFieldContainer[str]
    finished_by: str
    stopping: str
    def __init__(self, format_version: _Optional[int] = ..., inventory: _Optional[_Iterable[_Union[ParamInfo, _Mapping]]] = ..., generation: _Optional[_Union[Generation, _Mapping]] = ..., members: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., epoch: _Optional[str] = ..., inventory_digest: _Optional[str] = ..., left: _Optional[_Iterable[str]] = ..., finished_by: _Optional[str] = ..., stopping: _Optional[str] = ...) -> None: ...

class PersistedInventory(_message.Message):
    __slots__ = ("params",)
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    params: _containers.RepeatedCompositeFieldContainer[ParamInfo]
    def __init__(self, params: _Optional[_Iterable[_Union[ParamInfo, _Mapping]]] = ...) -> None: ...
