"""Naming a stall: the coordinator compares where the ranks are, and acts on it.

Each rank's heartbeat says where it is (worker/whereabouts.py [Note: naming a
stall]): in which collective it waits (its kind, its number on its process
group, the group's ranks, the unit that issued it) and since when, or that it
runs outside any wait, re-forms, or checkpoints. A healthy job's waits last
milliseconds; one that lasts ``after_s`` (``--stall-after``, 5 s by default) is
a stall, and the ranks it waits for say why:

- **silent**: a rank of the group has sent no heartbeat for longer than two of
  its intervals: stopped (SIGSTOP, a frozen host) or dead without its
  connections closing;
- **stuck**: a rank of the group runs outside any collective, as long as the
  waiters have waited: a script stuck in its own code (a deadlock, a loop, an
  input that never comes);
- **mismatch**: a rank of the group waits in another collective on the same
  group (another number, kind or unit): the ranks' scripts diverged, as
  data-dependent module execution does;
- **waiting**: none of those (every rank waits in the same call, or on another
  group whose ranks all wait): a network or a backend that does not deliver.

A rank that waits on another group is followed to the ranks that one waits for,
so a pipeline's chain of waits is named by its cause. The stall shows in
``zeroplane status``, the status page, the metrics and the log within
``after_s`` and a heartbeat. Once its longest wait reaches ``bound_s``
(``--stall-timeout``, 30 s by default, within the collective timeout's 60 s)
the coordinator acts, once per stall:
the silent and stuck ranks are dropped as lost and fenced (a fenced rank's next
heartbeat tells it to exit; the survivors blocked on it release their waits,
worker/whereabouts.py ``release_dropped``) and the job re-forms without them;
a mismatch stops the job with the stall's words, which every worker exits with.
A rank that re-forms, checkpoints, or runs a collective the others wait in is
never dropped, nor one that is still advancing (it ran less than ``after_s``).
Where the waiting ranks' collectives time out first, they wait for the job to
re-form, which the coordinator, seeing nobody lost, would not do: the stall's
cause as last named is kept and acted on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from coordinator.core.messages import Whereabouts

if TYPE_CHECKING:
    from coordinator.control.membership import Membership

__all__ = [
    "KINDS",
    "RankView",
    "Stall",
    "StallWatch",
    "diagnose",
    "drop_reason",
    "dropped_in_stall",
    "parse_ranks",
    "ranks_words",
    "where_short",
]

logger = logging.getLogger(__name__)

KINDS = ("silent", "stuck", "mismatch", "waiting")


_DROPPED = " in a stall: "


def drop_reason(kind: str, text: str) -> str:
    """Why a rank was dropped in a stall of ``kind`` (its "expired" event's detail)."""
    return f"{kind}{_DROPPED}{text}"


def dropped_in_stall(detail: str) -> bool:
    """Whether an "expired" event's ``detail`` is :func:`drop_reason`'s: its launcher
    kills the process (stopped, or stuck: it would never exit by itself)."""
    return detail.split(" ", 1)[0] in KINDS and _DROPPED in detail


def parse_ranks(text: str) -> tuple[int, ...]:
    """Global ranks from their short form (worker/whereabouts.py ``describe_ranks``):
    ``0-3``, ``1-7/2``, ``0,5``; () for text that is none."""
    out: list[int] = []
    try:
        for part in filter(None, text.split(",")):
            span, _, stride = part.partition("/")
            first, _, last = span.partition("-")
            lo, hi, step = int(first), int(last or first), int(stride or 1)
            if step < 1 or hi < lo or (hi - lo) // step > 1 << 20:
                return ()
            out.extend(range(lo, hi + 1, step))
    except ValueError:
        return ()
    return tuple(out)


def ranks_words(ranks: Iterable[int]) -> str:
    """ "rank 3" or "ranks 0-2, 5"."""
    rs = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(parts)


@dataclass(frozen=True, slots=True)
class RankView:
    """A member as the coordinator last heard it: its rank, its id, where it said it
    was, and how long ago it said so."""

    rank: int
    worker_id: str
    where: Whereabouts | None
    heard_s: float
    step: int = 0

    @property
    def for_s(self) -> float:
        """How long it has been where it said, as of now."""
        return (0.0 if self.where is None else self.where.for_s) + self.heard_s


@dataclass(frozen=True, slots=True)
class Stall:
    """A named stall: its kind (:data:`KINDS`), its words, the ranks it blames (to drop,
    for "silent" and "stuck"), and the longest wait in it."""

    kind: str
    text: str
    culprits: tuple[RankView, ...]
    waited_s: float

    @property
    def key(self) -> tuple:
        return (self.kind, tuple(v.worker_id for v in self.culprits))


def where_short(w: Whereabouts | None) -> str:
    """A rank's whereabouts in a status table's column: ``all-gather #58 (blocks.1) 6s``,
    ``running 0s``, ``recovering 3s``; "-" for a rank that says nothing."""
    if w is None:
        return "-"
    if w.state == "torch":
        return f"torch {w.op} {w.for_s:.0f}s"
    if w.state != "collective":
        return f"{w.state} {w.for_s:.0f}s"
    unit = f" ({w.unit})" if w.unit else ""
    return f"{w.op.replace('_', '-')} #{w.seq}{unit} {w.for_s:.0f}s"


def _call_words(w: Whereabouts) -> str:
    unit = f", unit {w.unit}" if w.unit else ""
    return f"{w.op.replace('_', '-')} #{w.seq} on ranks {w.group}{unit}"


def _elsewhere(v: RankView) -> str:
    """What a rank that is not in the awaited call does, in words."""
    w = v.where
    if w is None:
        return f"rank {v.rank} says nothing of where it is"
    phase = f", in the {w.phase}" if w.phase else ""
    step = f" (step {v.step})"
    if w.state == "collective":
        return f"rank {v.rank} is in {_call_words(w)} for {v.for_s:.0f}s{phase}{step}"
    if w.state == "recovering":
        return f"rank {v.rank} waits for the job to re-form for {v.for_s:.0f}s{step}"
    if w.state == "checkpoint":
        return f"rank {v.rank} saves or loads a checkpoint for {v.for_s:.0f}s{step}"
    if w.state == "torch":
        return (
            f"rank {v.rank} waits in torch.distributed's {w.op} (not numbered: DTensor, "
            f"a pipeline schedule or the script) for {v.for_s:.0f}s{phase}{step}"
        )
    last = f"; its last collective was {_call_words(w)}" if w.seq else ""
    return f"rank {v.rank} runs outside any collective for {v.for_s:.0f}s{phase}{step}{last}"


def diagnose(views: Sequence[RankView], *, after_s: float, silent_s: float) -> Stall | None:
    """The stall of a job whose members are ``views``, or None while it advances
    (see the module docstring). ``silent_s``: how long without a heartbeat a rank
    is silent. A rank that waits for the job to re-form (its collective failed)
    waits for every member. Each group waited on is walked once, so a job whose
    every rank waits on the world costs one walk of it."""
    waiters = [
        v
        for v in views
        if v.where is not None
        and v.where.state in ("collective", "recovering")
        and v.for_s >= after_s
    ]
    if not waiters:
        return None
    by_rank = {v.rank: v for v in views}
    on_group: dict[str, list[RankView]] = {}  # who waits on each group ("" = to re-form)
    for v in views:
        w = v.where
        if w is not None and w.state in ("collective", "recovering"):
            on_group.setdefault(w.group if w.state == "collective" else "", []).append(v)
    # follow the waits: whom does each group's waiting wait for, and what is that one doing
    culprits: dict[int, str] = {}  # rank -> kind
    involved: set[int] = set()
    todo = {w.where.group if w.where.state == "collective" else "" for w in waiters}  # type: ignore[union-attr]
    done: set[str] = set()
    while todo:
        group = todo.pop()
        done.add(group)
        waiting = on_group.get(group, [])
        calls = {(v.where.seq, v.where.op, v.where.unit) for v in waiting if group}  # type: ignore[union-attr]
        involved.update(v.rank for v in waiting)
        if len(calls) > 1:  # ranks of one group wait in different calls on it
            for v in waiting:
                culprits.setdefault(v.rank, "mismatch")
        in_call = {v.rank for v in waiting}
        for r in parse_ranks(group) if group else by_rank:
            peer = by_rank.get(r)
            if peer is None or r in in_call:
                continue
            if peer.heard_s >= silent_s:
                culprits[r] = "silent"
                continue
            pw = peer.where
            if pw is None or pw.state in ("recovering", "checkpoint", "torch"):
                continue  # (in torch's own collective: blocked on a group nobody named)
            if pw.state == "running":
                if peer.for_s >= after_s:
                    culprits.setdefault(r, "stuck")
            elif pw.group not in done:
                todo.add(pw.group)  # it waits on another group: follow it
    kind = next((k for k in KINDS if k in culprits.values()), "waiting")
    blamed = [by_rank[r] for r, k in sorted(culprits.items()) if k == kind]
    if kind == "mismatch":
        blamed = _minority(blamed, views)
    elif kind == "waiting":
        # every rank involved waits in a collective; in more than one, they deadlock
        # (a rank waits on a group where its peers wait on another)
        calls_seen = _calls(v for v in views if v.rank in involved)
        if len(calls_seen) > 1:
            kind, blamed = "mismatch", _outside_largest(calls_seen)
    longest = max(w.for_s for w in waiters)
    return Stall(kind, _words(kind, waiters, blamed, views), tuple(blamed), longest)


def _calls(views: Iterable[RankView]) -> dict[tuple, list[RankView]]:
    """The ranks waiting in a collective, by the call they wait in."""
    calls: dict[tuple, list[RankView]] = {}
    for v in views:
        w = v.where
        if w is not None and w.state == "collective":
            calls.setdefault((w.group, w.seq, w.op, w.unit), []).append(v)
    return calls


def _outside_largest(calls: dict[tuple, list[RankView]]) -> list[RankView]:
    """The ranks outside the largest set of ranks in one call (the lowest ranks' set
    on a tie)."""
    largest = max(calls.values(), key=lambda vs: (len(vs), -min(v.rank for v in vs)))
    return sorted((v for vs in calls.values() if vs is not largest for v in vs), key=_rank)


def _rank(v: RankView) -> int:
    return v.rank


def _minority(mismatched: Sequence[RankView], views: Sequence[RankView]) -> list[RankView]:
    """Of the ranks waiting in one group under different calls, those outside the
    largest set of ranks in one call."""
    group = mismatched[0].where.group  # type: ignore[union-attr]
    return _outside_largest(
        _calls(v for v in views if v.where is not None and v.where.group == group)
    )


def _words(
    kind: str, waiters: Sequence[RankView], blamed: Sequence[RankView], views: Sequence[RankView]
) -> str:
    # the waiting ranks, grouped by the call they wait in
    calls: dict[tuple, list[RankView]] = {}
    for w in waiters:
        assert w.where is not None
        key = (w.where.group, w.where.seq, w.where.op, w.where.unit)
        calls.setdefault(key if w.where.state == "collective" else (), []).append(w)
    waiting = "; ".join(
        f"{ranks_words(v.rank for v in vs)} {'wait' if len(vs) > 1 else 'waits'} "
        + (f"in {_call_words(vs[0].where)}" if key else "for the job to re-form")  # type: ignore[arg-type]
        + f" for {max(v.for_s for v in vs):.0f}s"
        for key, vs in calls.items()
    )
    # ranks blocked in torch's own collectives: named, never blamed
    in_torch = [v for v in views if v.where is not None and v.where.state == "torch"]
    if in_torch and kind != "waiting":
        waiting += "; " + "; ".join(_elsewhere(v) for v in in_torch[:4])
    if kind == "silent":
        cause = "; ".join(
            f"rank {v.rank} ({v.worker_id}) has sent no heartbeat for {v.heard_s:.0f}s: "
            "stopped, or dead with its connections open"
            for v in blamed
        )
    elif kind == "stuck":
        cause = "; ".join(_elsewhere(v) for v in blamed) + ": stuck in the script"
    elif kind == "mismatch":
        apart = [_elsewhere(v) for v in blamed if v not in waiters]
        cause = ("; ".join(apart) + ": " if apart else "") + (
            f"{ranks_words(v.rank for v in blamed)} issued other collectives than the rest "
            "of their group (data-dependent module execution, or a branch some ranks take)"
        )
    else:
        others = [v for v in views if v not in waiters]
        cause = ("; ".join(_elsewhere(v) for v in others[:4]) + "; ") if others else ""
        cause += "no rank is missing from the call: the network or the backend does not deliver"
    return f"{waiting}; {cause}"


def member_views(m: Membership, now: float) -> list[RankView]:
    """The members of ``m``'s current generation as its roster last heard them."""
    gen, lease = m.generation, m.config.lease_timeout_s
    views = []
    for member in () if gen is None else gen.members:
        w = m.roster.live.get(member.worker_id)
        if w is None:
            continue  # lost or left: the next generation forms without it
        report = w.report
        views.append(
            RankView(
                member.rank,
                member.worker_id,
                None if report is None else report.where,
                max(0.0, now - (w.deadline - lease)),
                0 if report is None else report.step,
            )
        )
    return views


class StallWatch:
    """Diagnoses a job at every :meth:`check`, says so when a stall starts and
    ends, and returns the stall to act on once it reaches ``bound_s`` (once each)."""

    def __init__(
        self,
        after_s: float,
        bound_s: float,
        silent_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < after_s <= bound_s:
            raise ValueError(
                f"a stall is named after {after_s:g}s and acted on after {bound_s:g}s: "
                "need 0 < --stall-after <= --stall-timeout"
            )
        self.after_s, self.bound_s, self.silent_s = after_s, bound_s, silent_s
        self._clock = clock
        self.current: Stall | None = None
        # the last stall with a cause: when its ranks' collectives time out, they wait
        # for the job to re-form, and the cause is no longer in what they say
        self._cause: Stall | None = None
        self._acted: tuple | None = None
        self._began = 0.0  # when the current stall's longest wait began
        self.count = 0  # stalls named so far

    def check(self, views: Sequence[RankView]) -> Stall | None:
        """Diagnose ``views``; the stall to act on now, if one reached the bound."""
        now = self._clock()
        stall = diagnose(views, after_s=self.after_s, silent_s=self.silent_s)
        if stall is not None and stall.kind == "waiting" and self._cause is not None:
            cause = self._cause
            stall = Stall(cause.kind, f"{stall.text} (after: {cause.text})", cause.culprits, 0.0)
        before, self.current = self.current, stall
        if stall is None:
            if before is not None:
                logger.info("the stall ended: the job advances again")
                self._acted = self._cause = None
            return None
        if before is None:
            self._began = now - stall.waited_s
        if stall.kind != "waiting":
            self._cause = stall
        if before is None or before.key != stall.key:
            self.count += 1
            logger.warning("stall (%s): %s", stall.kind, stall.text)
        if now - self._began < self.bound_s or stall.kind == "waiting":
            return None
        if self._acted == stall.key:
            return None
        self._acted = stall.key
        return stall
