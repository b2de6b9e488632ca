"""The membership's workers, each in one explicit state, and the moves between states.

[Note: worker states]
A worker the coordinator knows is in one of five states:

* JOINING: registered, not in the current generation; the next one may admit it;
* STANDBY: as JOINING, but bound to the mesh position its engine was built for (an
  elastic mesh job's survivor whose group broke up, or a worker that says it holds
  one, ``WorkerInfo.held``): only a group that takes that position admits it
  (coordinator/core/meshplan.py [Note: arranging whole groups]);
* MEMBER: in the current generation, holding a lease;
* LOST: a member of the current generation that is gone (its lease ran out, its
  process exited, or it registered again as a new process);
* LEFT: a member of the current generation that asked to leave.

LOST and LEFT last until the next generation is committed, which lists their old
ranks in ``lost_ranks`` or ``left_ranks``; a waiting worker that goes is forgotten at
once. A member whose process comes back as a new incarnation is LOST under its old
record and JOINING under the new one, so the roster keeps the gone apart from the
live, by id. ``Roster.move`` is the one place a state changes; the collections the
membership reads (the live workers by id, the waiting in the order they began to
wait, the standbys in the order they were bound, the gone) are indexes it keeps.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass

from coordinator.core.meshplan import MeshCoords
from coordinator.core.messages import WorkerInfo, WorkerReport, metrics_target

__all__ = ["Roster", "WorkerEntry", "WorkerState"]


class WorkerState(enum.Enum):
    """A worker's state in the membership ([Note: worker states])."""

    JOINING = "joining"
    STANDBY = "standby"
    MEMBER = "member"
    LOST = "lost"
    LEFT = "left"

    @property
    def waiting(self) -> bool:
        """Registered and not in the current generation."""
        return self in (WorkerState.JOINING, WorkerState.STANDBY)

    @property
    def gone(self) -> bool:
        """A member of the current generation that is no longer there."""
        return self in (WorkerState.LOST, WorkerState.LEFT)


_J, _S, _M, _LO, _LE = WorkerState
# the moves a worker may make; None: not in the roster (before it registers, once forgotten)
_MOVES: dict[WorkerState | None, frozenset[WorkerState | None]] = {
    None: frozenset({_J, _S, _M, _LE}),  # registered, or restored from a snapshot
    _J: frozenset({_S, _M, None}),
    _S: frozenset({_S, _M, None}),  # bound again: its newest position
    _M: frozenset({_J, _S, _LO, _LE}),
    _LO: frozenset({None}),
    _LE: frozenset({None}),
}


@dataclass(eq=False)
class WorkerEntry:
    """One worker as the membership holds it."""

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
    # set by Roster.move only
    state: WorkerState | None = None
    # a STANDBY's mesh position; None in every other state
    position: MeshCoords | None = None

    @property
    def metrics_url(self) -> str:
        """The worker's metrics at the address it connects from (see WorkerStatus)."""
        if not self.peer or not self.info.metrics_endpoint:
            return ""
        _, port, path = metrics_target(self.info.metrics_endpoint)
        host = f"[{self.peer}]" if ":" in self.peer else self.peer
        return f"http://{host}:{port}{path}"


class Roster:
    """Every worker the membership knows, by state ([Note: worker states])."""

    def __init__(self) -> None:
        # JOINING, STANDBY and MEMBER workers by id, in registration order
        self.live: dict[str, WorkerEntry] = {}
        # LOST and LEFT workers by id, in the order they went
        self.gone: dict[str, WorkerEntry] = {}
        # JOINING and STANDBY ids, in the order they began to wait
        self._waiting: dict[str, None] = {}
        # STANDBY ids, in the order they were bound to their position
        self._standby: dict[str, None] = {}

    def move(
        self, worker: WorkerEntry, to: WorkerState | None, position: MeshCoords | None = None
    ) -> None:
        """Put ``worker`` in state ``to`` (None: forget it); ``position``: a STANDBY's."""
        wid, was = worker.info.worker_id, worker.state
        if to not in _MOVES[was]:
            raise RuntimeError(f"worker {wid!r}: no move from {was} to {to}")
        if was is None:
            if to is not None and to.gone:
                self.gone[wid] = worker
            else:
                self.live[wid] = worker
        elif to is None:
            (self.gone if was.gone else self.live).pop(wid)
        elif to.gone:
            del self.live[wid]
            self.gone[wid] = worker
        if to is not None and to.waiting and not (was is not None and was.waiting):
            self._waiting[wid] = None
        if was is not None and was.waiting and not (to is not None and to.waiting):
            del self._waiting[wid]
        if to is WorkerState.STANDBY:
            self._standby[wid] = None
        elif was is WorkerState.STANDBY:
            del self._standby[wid]
        worker.state = to
        worker.position = position if to is WorkerState.STANDBY else None

    def get(self, worker_id: str) -> WorkerEntry | None:
        """The live worker ``worker_id`` (JOINING, STANDBY or MEMBER); None if none."""
        return self.live.get(worker_id)

    def waiting(self) -> Iterator[str]:
        """The JOINING and STANDBY workers' ids, in the order they began to wait."""
        return iter(self._waiting)

    @property
    def waiting_count(self) -> int:
        return len(self._waiting)

    def first_waiting(self) -> WorkerEntry:
        return self.live[next(iter(self._waiting))]

    def standby(self) -> dict[str, MeshCoords]:
        """Each STANDBY's position, in the order they were bound."""
        return {wid: self.live[wid].position for wid in self._standby}  # type: ignore[misc]

    def left(self) -> list[str]:
        """The LEFT workers' ids."""
        return [wid for wid, w in self.gone.items() if w.state is WorkerState.LEFT]

    def forget_gone(self) -> None:
        """The current generation is replaced: its LOST and LEFT are forgotten."""
        for worker in list(self.gone.values()):
            self.move(worker, None)
