"""The elastic session and what it moves: a worker's life in a coordinator's job,
and the live exchange, replicas and restore plan under it.

The modules, bottom up (each imports only those above it in this list):
* live_exchange.py: moving live training state between world sizes (pack and
  unpack, :func:`exchange`, :func:`adopt`, buffers written ahead and their bounds;
  [Note: live reshard]);
* restore_plan.py: what each rank holds after a loss and the source every rank
  restores from (:class:`Holding`, :class:`RestorePlan`, :func:`plan_restore`;
  [Note: recovery sources]); pure;
* replicas.py: in-memory replicas, their refresh, the gradient log, and the
  session's hold of them (:class:`ReplicaKeeper`);
* prepared.py: a membership change a member prepares for while it trains (a
  scale-up, a leave) and the buffers it writes ahead for it;
* phases.py: the session's phases and their transitions ([Note: session phases]),
  the sub-states a member keeps, the exceptions, and the :class:`Session` the
  modules below take;
* change.py: the prepared change made: scale-up, hand-over, a leave with nobody
  to hand over to;
* recovery.py: forming the next generation after a loss and restoring from the
  plan's source;
* joining.py: registering, building ahead, the first exchange;
* session.py: :class:`ElasticSession`, the engine's seams, dispatching to those.

This package's own namespace is what ``worker.elastic`` offered as one module: the
live exchange, the replicas and the restore plan. worker/engine.py imports it, so
it imports nothing that imports the engine; the session is
``worker.elastic.session.ElasticSession``. The modules above reach the ones below
through it (``elastic.exchange(...)``), as the session did before.
"""

from worker.elastic.live_exchange import (
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
from worker.elastic.live_exchange import _Packing as _Packing  # the wire format, for tests
from worker.elastic.replicas import (
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
from worker.elastic.restore_plan import (
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
