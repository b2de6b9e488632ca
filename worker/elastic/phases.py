"""Where an elastic session is: its phase and the transitions between phases, the
sub-states a member keeps (its step clock, what its shards are), the exceptions a
lost peer raises, and :class:`Session`, the session as the modules that do its work
(joining, change, recovery) take it.

[Note: session phases]
    JOINING ──admitted──▶ MEMBER ──SIGTERM voted──▶ LEAVING ──handed over──▶ LEFT
       │                   │  ▲                                            ▲
       │                   │  └────── restored ──── RECOVERING ◀── a collective failed
       └──stopped before admission──────────────────────────────────────────┘
* JOINING: registered with the coordinator, waiting for a rank, then forming
  the generation's group and receiving this rank's shards.
* MEMBER: training; at each step boundary the ranks' votes (worker/ballot.py)
  say whether a newer generation or a leave request is pending, and every
  rank acts on it at the same boundary (see [Note: membership changes] in
  worker/elastic/session.py).
* LEAVING: this rank hands its shards to the survivors, leaves the
  coordinator and exits 0.
* RECOVERING: a peer was lost mid-step; the session forms the coordinator's
  next generation, restores one consistent state from the best source the
  group holds (worker/live/restore_plan.py [Note: recovery sources]) and raises
  :class:`StepAborted` so the training loop carries on from
  ``engine.global_steps``.
A SIGTERM in any phase only sets ``leave_requested``: it becomes a graceful
hand-over at the first step boundary, and before admission a plain leave.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
import statistics
import time
from typing import Any, NoReturn, Protocol

from coordinator.core.messages import Generation
from worker import live
from worker.collectives import CollectiveError, Collectives
from worker.elastic.prepared import PreparedLeave, PreparedScaleUp
from worker.engine import ZeroEngine
from worker.rendezvous import ControlPlane

__all__ = [
    "TRANSITIONS",
    "Handed",
    "Held",
    "PeerLost",
    "Phase",
    "RecoveryTiming",
    "Session",
    "StepClock",
    "admitted",
]


class PeerLost(CollectiveError):
    """A generation lost members that were expected to carry on: recover as from a crash."""


@dataclasses.dataclass(frozen=True)
class RecoveryTiming:
    """Where a recovery's pause went: waiting for the coordinator's generation
    without the lost peer, then forming its group (the restore is timed after)."""

    waited_s: float
    formed_s: float

    def describe(self, restored_s: float) -> str:
        return (
            f"{self.waited_s:.2f}s for the new generation, {self.formed_s:.2f}s to form "
            f"its group, {restored_s:.2f}s to restore"
        )


class Phase(enum.Enum):
    """Where a worker is in its job ([Note: session phases])."""

    JOINING = "joining"
    MEMBER = "member"
    LEAVING = "leaving"
    RECOVERING = "recovering"
    LEFT = "left"


TRANSITIONS: dict[Phase, set[Phase]] = {
    Phase.JOINING: {Phase.MEMBER, Phase.RECOVERING, Phase.LEFT},
    Phase.MEMBER: {Phase.MEMBER, Phase.LEAVING, Phase.RECOVERING, Phase.LEFT},
    Phase.LEAVING: {Phase.LEFT, Phase.RECOVERING},
    # a peer lost while recovering from an earlier loss: recover again
    Phase.RECOVERING: {Phase.MEMBER, Phase.RECOVERING, Phase.LEAVING, Phase.LEFT},
    Phase.LEFT: set(),
}


class StepClock:
    """When a member's last step boundary was (monotonic) and the times between
    the last few: how long its steps take."""

    def __init__(self) -> None:
        self._boundary_at: float | None = None  # None: no step timed yet
        self._gaps: collections.deque[float] = collections.deque(maxlen=5)

    def start(self) -> None:
        """The first step is timed from now (a member, just admitted)."""
        self._boundary_at = time.monotonic()

    def tick(self) -> None:
        """A step boundary."""
        now = time.monotonic()
        if self._boundary_at is not None:
            self._gaps.append(now - self._boundary_at)
        self._boundary_at = now

    def estimate(self) -> float:
        """How long this rank's steps take: the median of the last few; before any
        was timed (a newcomer told to leave in its first step), this one so far."""
        if self._gaps:
            return statistics.median(self._gaps)
        if self._boundary_at is None:
            return math.inf
        return time.monotonic() - self._boundary_at


@dataclasses.dataclass(frozen=True)
class Handed:
    """What a survivor was handed in a leave (the whole job, over the survivors)
    and its id (whose state that is), between the two exchanges of a leave and a
    join in one generation."""

    ident: live.StateId
    handover: live.Handover
    # an expert-parallel rank's experts, handed over beside it
    experts: live.Handover | None = None


@dataclasses.dataclass
class Held:
    """What this rank's shards are ([Note: recovery sources]): of ``generation``'s
    membership (None: nothing yet, a worker joining), or, while ``handed`` is set,
    what it was handed in a leave and has not adopted yet."""

    generation: int | None = None
    handed: Handed | None = None


class Session(Protocol):
    """An elastic session (worker/elastic/session.py) as the modules that do its work
    take it: they sit below it, and read and change it through this."""

    phase: Phase
    leave_requested: bool
    # the coordinator connection: None while joining, until admitted
    control: ControlPlane | None
    held: Held
    # the scale-up or leave this member prepares for ([Note: meeting ahead],
    # [Note: a leave prepared ahead])
    ahead: PreparedScaleUp | PreparedLeave | None
    keeper: live.ReplicaKeeper
    clock: StepClock
    # an engine on a mesh: re-formed ring by ring (worker/elastic/rings.py), with
    # what it carries across a change (rings.Carried) while the change is made
    rings: bool
    carried: Any

    def _to(self, phase: Phase) -> None: ...

    def _on_sigterm(self, signum: int, frame: Any) -> None: ...

    def report_at_exit(self, engine: ZeroEngine) -> None: ...

    def _forget_exit(self, *, send: bool = False) -> None: ...

    def _refresh_replica(self, engine: ZeroEngine) -> None: ...

    def _adopt(
        self, engine: ZeroEngine, handover: live.Handover, comm: Collectives | None
    ) -> None: ...

    def _recover_in_formed(self, engine: ZeroEngine, intended: Generation) -> NoReturn: ...


def admitted(session: Session) -> ControlPlane:
    """The session's coordinator connection, which it has from its admission on."""
    assert session.control is not None
    return session.control
