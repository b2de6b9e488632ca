"""Where this rank is: the collective it waits in, or what it does instead.

[Note: naming a stall]
A hung job is silent: every rank waits in a collective for a peer that never
comes, and after the collective timeout (10-30 minutes on NCCL) each prints a
traceback that names no cause. The coordinator hears every rank, so each rank
tells it, with every heartbeat, where it is (:func:`snapshot`, sampled by the
heartbeat thread: the training thread may be the one that is blocked):

- every collective is issued through worker/collectives.py, which numbers it
  on its process group (:meth:`Tracker.issue`). The ranks of a group issue the
  same collectives in the same order, so the same number on two ranks is the
  same call, and two ranks waiting on a group under different numbers, or
  under one number in different kinds or units, have diverged;
- the wait on a collective is marked (:meth:`Tracker.waiting`), so a rank
  blocked in one says which, and since when;
- the engine labels the gather unit (or gradient bucket) whose collective it
  issues, and its phase (forward, backward, step), so that a divergence from
  data-dependent module execution names the modules;
- the elastic session marks a rank that waits for the job to re-form, and
  checkpoints mark their I/O, which are no stalls of the script;
- collectives zeroplane does not issue (DTensor's under tensor parallelism, a
  pipeline schedule's sends and receives, the script's own ``torch.distributed``
  calls) are not numbered; a rank blocked in one would read as running outside
  any collective, and could be blamed as stuck for its peer's stall. So the
  snapshot looks at the training thread's innermost Python frames: inside
  torch.distributed's collectives (``distributed_c10d``, the functional
  collectives DTensor waits through, the pipelining schedules) it reports the
  state ``torch`` and the function (``wait_tensor``, ``recv``), which the
  coordinator never blames and does not follow (the group is unknown).

The coordinator compares what the ranks say (coordinator/control/stalls.py). A
rank's own view suffices for the rest: a rank blocked on a group in which a
peer was dropped as lost closes its connections to that peer, so the wait
fails now rather than at the collective timeout (:func:`release_dropped`).

The cost is a counter, two clock reads and a small object per collective.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from coordinator.core.messages import Whereabouts

__all__ = ["TRACKER", "Call", "GroupTag", "Tracker", "describe_ranks", "during"]

F = TypeVar("F", bound=Callable[..., Any])


def describe_ranks(ranks: Sequence[int]) -> str:
    """Global ranks in a short form the coordinator parses back
    (coordinator/control/stalls.py ``parse_ranks``): runs of a constant stride of
    three or more as ``first-last`` (stride 1) or ``first-last/stride``, the rest
    one by one, comma-separated: ``0-3``, ``1-7/2``, ``0,5``."""
    out: list[str] = []
    i, n = 0, len(ranks)
    while i < n:
        j = i + 1
        if j < n:
            stride = ranks[j] - ranks[i]
            while j + 1 < n and ranks[j + 1] - ranks[j] == stride:
                j += 1
            if j - i >= 2 and stride > 0:
                tail = "" if stride == 1 else f"/{stride}"
                out.append(f"{ranks[i]}-{ranks[j]}{tail}")
                i = j + 1
                continue
        out.append(str(ranks[i]))
        i += 1
    return ",".join(out)


@dataclass(frozen=True, slots=True)
class GroupTag:
    """A process group as the tracker knows it: the name torch gave it (unique
    among the live groups; numbers restart with a new default group), its global
    ranks, and those described (:func:`describe_ranks`)."""

    name: str
    ranks: tuple[int, ...]
    described: str
    pg: object | None

    @classmethod
    def of(cls, pg: object | None, ranks: Sequence[int]) -> GroupTag:
        name = str(getattr(pg, "group_name", "") or "")
        return cls(name, tuple(ranks), describe_ranks(list(ranks)), pg)


@dataclass(slots=True)
class Call:
    """One collective as issued: its kind, its number on its group, the group (its
    global ranks, described and as a tuple), the unit that issued it, and the
    process group object (to close its connections to a dropped peer)."""

    op: str
    seq: int
    group: str
    ranks: tuple[int, ...]
    unit: str
    pg: object | None


class Tracker:
    """This process's whereabouts ([Note: naming a stall]). One per process
    (:data:`TRACKER`); written by the training thread, read by the heartbeat thread."""

    def __init__(self) -> None:
        self._seq: dict[str, int] = {}
        self.unit = ""
        self.phase = ""
        self._last: Call | None = None
        self._waiting: Call | None = None
        self._state = "running"
        self._since = time.monotonic()
        self._lock = threading.Lock()  # the snapshot reads three fields together
        # the thread that trains (issues the collectives): the main one until one does
        self._thread = threading.main_thread().ident

    def issue(self, op: str, group: GroupTag) -> Call:
        """Number a collective on ``group`` as it is issued."""
        self._thread = threading.get_ident()
        seq = self._seq.get(group.name, 0) + 1
        self._seq[group.name] = seq
        call = Call(op, seq, group.described, group.ranks, self.unit, group.pg)
        self._last = call
        return call

    def forget_groups(self) -> None:
        """A new default group: torch names its groups from "0" again, and every
        group's collectives are numbered from 1 again."""
        self._seq.clear()
        self._last = None

    @contextlib.contextmanager
    def waiting(self, call: Call | None) -> Iterator[None]:
        """The training thread waits for ``call`` to complete inside the block."""
        if call is None or self._waiting is not None:  # a wait within a wait: the outer one
            yield
            return
        with self._lock:
            self._waiting, self._state, self._since = call, "collective", time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._waiting, self._state, self._since = None, "running", time.monotonic()

    @contextlib.contextmanager
    def state(self, state: str) -> Iterator[None]:
        """The rank is in ``state`` ("recovering", "checkpoint") inside the block;
        a collective waited on inside it still shows as one."""
        with self._lock:
            before, self._state, self._since = self._state, state, time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._state, self._since = before, time.monotonic()

    @contextlib.contextmanager
    def labelled(self, unit: str) -> Iterator[None]:
        """The collectives issued inside the block are ``unit``'s."""
        before, self.unit = self.unit, unit
        try:
            yield
        finally:
            self.unit = before

    @property
    def last(self) -> Call | None:
        """The collective issued last."""
        return self._last

    @property
    def waiting_on(self) -> Call | None:
        """The collective the training thread waits on now, if any."""
        return self._waiting

    def snapshot(self) -> Whereabouts:
        """Where this rank is now (the heartbeat thread calls this)."""
        with self._lock:
            state, since, call = self._state, self._since, self._waiting
        call = call or self._last
        inside = in_torch_collective(self._thread) if state == "running" else ""
        if inside:  # a collective zeroplane did not number: said, not numbered
            return Whereabouts(
                state="torch",
                for_s=round(max(0.0, time.monotonic() - since), 3),
                op=inside,
                unit=self.unit[:256],
                phase=self.phase,
            )
        return Whereabouts(
            state=state,
            for_s=round(max(0.0, time.monotonic() - since), 3),
            op="" if call is None else call.op,
            seq=0 if call is None else call.seq,
            group="" if call is None else call.group[:256],
            unit="" if call is None else call.unit[:256],
            phase=self.phase,
        )


TRACKER = Tracker()

# where torch.distributed's blocking collectives run in Python: c10d's calls, the
# functional collectives (DTensor's waits), the pipelining schedules' sends and receives
_TORCH_COLLECTIVES = tuple(
    os.path.join("torch", "distributed", *part)
    for part in (("distributed_c10d.py",), ("_functional_collectives.py",), ("pipelining", ""))
)


def in_torch_collective(thread: int | None, depth: int = 4) -> str:
    """The torch.distributed function ``thread`` is blocked in (within its innermost
    ``depth`` Python frames); "" where it is elsewhere."""
    frame = sys._current_frames().get(thread) if thread is not None else None
    for _ in range(depth):
        if frame is None:
            return ""
        if any(part in frame.f_code.co_filename for part in _TORCH_COLLECTIVES):
            return frame.f_code.co_name
        frame = frame.f_back
    return ""


def during(phase: str) -> Callable[[F], F]:
    """A method of the engine that runs in ``phase`` (forward, backward, step)."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            before, TRACKER.phase = TRACKER.phase, phase
            try:
                return fn(*args, **kwargs)
            finally:
                TRACKER.phase = before

        return inner  # type: ignore[return-value]

    return wrap
