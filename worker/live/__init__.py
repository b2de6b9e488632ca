"""What the engine and the elastic sessions move: live state between world sizes,
in-memory replicas, and the plan of a restore after a loss. A library under the
engine: worker/engine.py imports it (``reconfigure``, ``adopt``), so it imports
nothing of the engine or of the sessions above it (worker/elastic/).

The modules, bottom up (each imports only those above it in this list):
* exchange.py: moving live training state between world sizes (pack and
  unpack, :func:`exchange`, :func:`adopt`, buffers written ahead and their bounds;
  [Note: live reshard]);
* restore_plan.py: what each rank holds after a loss and the source every rank
  restores from (:class:`Holding`, :class:`RestorePlan`, :func:`plan_restore`;
  [Note: recovery sources]); pure;
* replicas.py: in-memory replicas, their refresh, the gradient log, and the
  session's hold of them (:class:`ReplicaKeeper`).

This package's namespace is what ``worker.elastic`` offered as one module before
the sessions became a package: the live exchange, the replicas and the restore
plan. The sessions reach it as ``live.exchange(...)``.
"""

from worker.live.exchange import (
    ExchangeBuffers,
    Handover,
    adopt,
    exchange,
    pack_entries,
    packed_bound,
    sent_bound,
    unpack_entries,
    wire_device,
)
from worker.live.exchange import _Packing as _Packing  # the wire format, for tests
from worker.live.replicas import (
    GradientLog,
    LoggedStep,
    PendingRefresh,
    Replica,
    ReplicaKeeper,
    buffer_of,
    refresh_replica,
    roll_forward,
    start_refresh,
)
from worker.live.restore_plan import (
    Holding,
    ReplicaId,
    RestorePlan,
    RestoreSource,
    StateId,
    plan_restore,
)

__all__ = [
    "ExchangeBuffers",
    "GradientLog",
    "Handover",
    "Holding",
    "LoggedStep",
    "PendingRefresh",
    "Replica",
    "ReplicaId",
    "ReplicaKeeper",
    "RestorePlan",
    "RestoreSource",
    "StateId",
    "adopt",
    "buffer_of",
    "exchange",
    "pack_entries",
    "packed_bound",
    "plan_restore",
    "refresh_replica",
    "roll_forward",
    "sent_bound",
    "start_refresh",
    "unpack_entries",
    "wire_device",
]
