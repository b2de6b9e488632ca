"""Keeping a local job's size (``zeroplane run``): what the launcher reads of its
embedded coordinator (departed workers, whole groups, the job's end, stalls),
replacing workers that left from outside below ``--min-workers``, and adding and
retiring workers (or whole groups) on SIGUSR1/SIGUSR2."""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence

from coordinator.control.stalls import dropped_in_stall
from coordinator.core.messages import STOPPED, StatusReport
from coordinator.launchers.local import JobResult, LocalJob

__all__ = [
    "departed",
    "embedded_status",
    "expect_more",
    "group_size",
    "keep_minimum",
    "kill_dropped",
    "member_groups",
    "over",
    "placeable",
    "replace_ahead",
    "retirees",
    "stopped_in_stall",
    "stopped_unfinished",
    "wait_scaling",
]

logger = logging.getLogger(__name__)


def group_size(args: argparse.Namespace) -> int:
    """Workers per model-parallel, ep or cp group: what a mesh, expert- or
    context-parallel job scales by (1 for ZeRO alone)."""
    group = max(1, getattr(args, "tp", 1)) * max(1, getattr(args, "pp", 1))
    return group * max(1, getattr(args, "ep", 1)) * max(1, getattr(args, "cp", 1))


def embedded_status(services: Sequence[object]) -> StatusReport | None:
    """The embedded coordinator's status, read in process; None without one (or
    while it stops)."""
    for service in services:
        server = getattr(service, "server", None)
        if server is not None:
            try:
                return server.status()
            except Exception as exc:  # stopping: count processes only
                logger.debug("no status: %s", exc)
                return None
    return None


def departed(services: Sequence[object]) -> set[str]:
    """:meth:`StatusReport.departed` of the embedded coordinator (none without one)."""
    status = embedded_status(services)
    return set() if status is None else status.departed()


def member_groups(services: Sequence[object], size: int) -> dict[str, int]:
    """Each member of the embedded coordinator's current generation: the index of its
    whole group (its dp coordinate on a mesh, its block's index else)."""
    status = embedded_status(services)
    if status is None:
        return {}
    out = {}
    for w in status.workers:
        if w.state == "member" and w.rank is not None:
            coords = status.coords(w.rank)
            out[w.info.worker_id] = coords.dp if coords is not None else w.rank // size
    return out


def placeable(services: Sequence[object], workers: set[str]) -> int:
    """How many of ``workers`` the embedded coordinator could place in whole groups (all
    of them without one: a job of another launcher's coordinator, or stopping)."""
    for service in services:
        server = getattr(service, "server", None)
        if server is not None:
            try:
                return server.placeable(workers)
            except Exception as exc:  # stopping: count processes only
                logger.debug("no placement: %s", exc)
    return len(workers)


def expect_more(services: Sequence[object], count: int) -> None:
    """Tell the embedded coordinator the launcher started ``count`` more workers."""
    for service in services:
        server = getattr(service, "server", None)
        if server is not None:
            server.expect_more(count)


def kill_dropped(job: LocalJob, services: Sequence[object]) -> None:
    """Kill the workers the coordinator dropped in a stall (coordinator/control/stalls.py):
    a stopped or stuck process would never exit by itself, and the job would wait for it."""
    status = embedded_status(services)
    if status is None:
        return
    dropped = {e.worker_id: e.detail for e in status.events if e.kind == "expired"}
    for index in job.running:
        detail = dropped.get(job.worker_id(index), "")
        if dropped_in_stall(detail):
            job.kill_worker(index, f"the coordinator dropped it as {detail.split(':', 1)[0]}")


def stopped_in_stall(services: Sequence[object]) -> str:
    """Why the embedded coordinator stopped the job in a stall ("" where it did not)."""
    status = embedded_status(services)
    if status is None or status.stall_kind != "mismatch" or status.phase != "finished":
        return ""
    return f"the coordinator stopped the job in a stall: {status.stall}"


def over(services: Sequence[object]) -> bool:
    """:meth:`StatusReport.over` of the embedded coordinator; True when there is none
    to ask (an exit 0 is then taken for the end of training)."""
    status = embedded_status(services)
    return status is None or status.over()


def stopped_unfinished(status: StatusReport) -> bool:
    """The last members left with nobody to hand over to (reason "stopped") and
    none had ended training: the job stopped unfinished."""
    kinds = {(e.kind, e.detail) for e in status.events}
    return ("left", STOPPED) in kinds and not any(kind == "finished" for kind, _ in kinds)


def keep_minimum(
    job: LocalJob,
    low: int,
    departed: Callable[[], set[str]],
    over: Callable[[], bool],
    placeable: Callable[[set[str]], int] = len,
    early: bool = False,
) -> None:
    """Workers that left the coordinator and exited 0 without the launcher asking,
    while the job is not over (:func:`over`), left on a SIGTERM from outside:
    a scale-down while at least ``low`` members remain. Below that the others
    wait for workers nobody starts, so each leaver is replaced (an elastic job
    with restarts left) or the job stops, saying why.

    Members count as the coordinator places them (``placeable``): in a job of whole
    groups, two survivors of broken groups at one tp position make no group, and
    neither counts (two workers but no member). ``early`` (about once a second):
    also look at leavers still running (:func:`replace_ahead`)."""
    if job.stopping:
        return
    exited = job.left_unasked()
    if not (exited or early) or not job.running or over():
        return  # nothing new, everyone has exited, or the job is over
    gone = departed()
    if not exited:
        replace_ahead(job, low, gone, placeable)
        return
    # a script that never joined the coordinator just ended: not a leave
    leavers = [i for i in exited if job.worker_id(i) in gone]
    members = placeable(set(map(job.worker_id, job.running)) - gone)
    short = low - members
    for index in leavers:
        job.settle(index)
        if short <= 0:
            logger.info("worker %d left the job; %d member(s) go on", index, members)
            continue
        short -= 1
        if not job.replace(index, "left the job without being asked (a SIGTERM from outside?)"):
            job.abandon(
                f"worker {index} left the job without being asked (a SIGTERM from outside "
                f"the launcher?) and {members} worker(s) remain, fewer than the {low} it "
                "needs; stopped the others"
            )
            return


def replace_ahead(
    job: LocalJob, low: int, gone: set[str], placeable: Callable[[set[str]], int]
) -> None:
    """Workers that said they leave (a SIGTERM from outside) and still run, while the
    others alone make fewer than ``low`` members in whole groups: start their
    replacements now, as many as whole groups need. A leave that would take the last
    copy of some state (an ep group that is the whole job, the last rank of a mesh
    position: worker/elastic/rings.py [Note: the last copy of a ring]) waits for
    them; any other leaver is replaced sooner than at its exit."""
    running = set(map(job.worker_id, job.running))
    stay = running - gone
    announced = [i for i in job.running if job.worker_id(i) in gone and not job.settled(i)]
    if not announced or not stay:  # nobody leaving, or everyone (a job stopped from outside)
        return
    need = low - placeable(stay)
    for k in range(max(0, need)):
        index = announced[min(k, len(announced) - 1)]
        what = "is leaving (a SIGTERM from outside?) and the rest are too few"
        if not job.replace(index, what):
            return


def retirees(
    job: LocalJob,
    group: int,
    low: int,
    departed: Callable[[], set[str]],
    placeable: Callable[[set[str]], int],
    groups: Callable[[], dict[str, int]],
) -> list[int]:
    """The workers a SIGUSR2 retires from a job of whole groups of ``group``: that many
    that no generation places (standbys, workers still joining: the newest), else
    the current generation's last group (``groups``: each member's group index);
    none where the workers left could not make ``low`` members in whole groups."""
    gone = departed()
    here = [i for i in sorted(job.running) if job.worker_id(i) not in gone]
    placed = groups()
    unplaced = [i for i in here if job.worker_id(i) not in placed]
    if len(unplaced) >= group or not placed:
        chosen = (unplaced if len(unplaced) >= group else here)[-group:]
    else:
        last = max(placed.values())
        chosen = [i for i in here if placed.get(job.worker_id(i)) == last]
    rest = {job.worker_id(i) for i in here} - {job.worker_id(i) for i in chosen}
    return chosen if chosen and placeable(rest) >= low else []


def wait_scaling(
    job: LocalJob,
    args: argparse.Namespace,
    departed: Callable[[], set[str]] = set,
    *,
    over: Callable[[], bool] = lambda: True,
    tick: Callable[[], None] = lambda: None,
    expect: Callable[[int], None] = lambda count: None,
    placeable: Callable[[set[str]], int] = len,
    groups: Callable[[], dict[str, int]] = dict,
) -> JobResult:
    """Wait for the job, adding (SIGUSR1) or retiring (SIGUSR2) workers on request,
    replacing workers that left from outside when fewer than ``--min-workers``
    remain (:func:`keep_minimum`), and ``tick`` the progress display as it goes.

    A retirement counts members, not processes: a worker told to leave, or one
    that has handed over (``departed``: the coordinator no longer has it) and is
    still exiting, does not count towards ``--min-workers``, nor does one whole
    groups cannot place (``placeable``)."""
    low = args.nproc if args.min_workers is None else args.min_workers
    high = args.nproc if args.max_workers is None else args.max_workers
    ticks = itertools.count()
    if low == high:
        while (result := job.poll()) is None:
            keep_minimum(job, low, departed, over, placeable, early=next(ticks) % 20 == 0)
            tick()
            time.sleep(0.05)
        return result
    requests: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda signum, _: requests.append(signum))
        for sig in (signal.SIGUSR1, signal.SIGUSR2)
    }
    # a mesh job scales by whole model-parallel groups (the newest group retires)
    group = group_size(args)
    unit = "one" if group == 1 else f"a group of {group}"
    print(
        f"zeroplane run: elastic between {low} and {high} workers; "
        f"kill -USR1 {os.getpid()} adds {unit}, kill -USR2 {os.getpid()} removes {unit}",
        file=sys.stderr,
        flush=True,
    )
    try:
        while (result := job.poll()) is None:
            while requests:
                n = len(job.running)
                if requests.pop(0) == signal.SIGUSR1:
                    if n + group <= high:
                        for _ in range(group):
                            job.add_worker()
                        expect(group)
                    else:
                        print(f"zeroplane run: already at {high} workers", file=sys.stderr)
                elif group == 1 and len(set(map(job.worker_id, job.running)) - departed()) > low:
                    job.retire_worker()  # the newest
                elif group > 1 and (
                    chosen := retirees(job, group, low, departed, placeable, groups)
                ):
                    for index in chosen:
                        job.retire_worker(index)
                else:
                    print(f"zeroplane run: already at {low} workers", file=sys.stderr)
            keep_minimum(job, low, departed, over, placeable, early=next(ticks) % 10 == 0)
            tick()
            time.sleep(0.1)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return result
