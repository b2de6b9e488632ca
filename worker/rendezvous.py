"""The worker's side of the control plane: register, form the process group, report.

A worker started with ``ZEROPLANE_COORDINATOR=host:port`` in its environment
(or ``worker.initialize(..., coordinator="host:port")``) registers its
parameter inventory, waits for the first generation that includes it, and
forms the process group at that generation's rendezvous endpoint with the
rank the coordinator assigned (or, when the script formed a group itself,
keeps that group and its ranks). The generation's stage and bucket layout win
over the local ``ZeroConfig``: the coordinator plans for the whole job, from
the stage the workers ask for unless it was given one.
Heartbeats carry this rank's model-state bytes so ``zeroplane status`` can
show them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from coordinator.control.client import ClientConfig, CoordinatorClient, CoordinatorError
from coordinator.core.messages import Generation, WorkerInfo, WorkerReport
from coordinator.core.settings import ADDRESS_ENV, WORKER_ID_ENV, env_seconds
from worker.compat import (
    abort_default_group,
    backend_for,
    close_connections_to,
    serving_store,
    time_out_subgroups_as,
)
from worker.inventory import Inventory
from worker.whereabouts import TRACKER

__all__ = ["ControlPlane", "coordinator_address"]

logger = logging.getLogger(__name__)

HOST_ENV = "ZEROPLANE_HOST"
TIMEOUT_ENV = "ZEROPLANE_COLLECTIVE_TIMEOUT_S"
# how long members holding the job's state wait for the coordinator's next
# generation after a loss or a leave (it may first need newcomers: min_workers)
MEMBERSHIP_WAIT_ENV = "ZEROPLANE_MEMBERSHIP_WAIT_S"
# a worker's exit code when the coordinator stopped its job, or dropped it, in a stall
STALL_EXIT_CODE = 3


def coordinator_address(explicit: str | None) -> str | None:
    return explicit or os.environ.get(ADDRESS_ENV) or None


def _default_worker_id() -> str:
    host = socket.gethostname()
    local = os.environ.get("LOCAL_RANK")
    return f"{host}-{local}" if local is not None else f"{host}-{os.getpid()}"


def _reachable_host(coordinator: str) -> str:
    """The address other workers reach this one at (rank 0 hosts the rendezvous)."""
    if os.environ.get(HOST_ENV):
        return os.environ[HOST_ENV]
    host = coordinator.rsplit(":", 1)[0].strip("[]")
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    return socket.gethostname()


# how often a worker waiting for a generation checks whether it was told to stop
_STOP_POLL_S = 0.2
# how often a member waiting for the job to re-form says why
_WAIT_REPORT_S = 30.0
# how often a rank meeting the others at a generation's store looks again: soon
# at first (the ranks of a membership change arrive within milliseconds of each
# other, at one step boundary), then backing off to at most _MEET_PROBE_S apart
# (for the store, a refused connect the kernel answers; then a small request to
# rank 0's store), and from the first interval again once connected ([Note: a
# newcomer waits at the store]); a store request gives up after _MEET_POLL_S * 10
_MEET_FIRST_POLL_S = 0.002
_MEET_PROBE_S = 0.01
_MEET_POLL_S = 0.1
_EXCEPTHOOK = sys.excepthook  # as it was before any process group
# a process group that has not formed this long after twice the collective timeout
# never will ([Note: a group that never forms]); the exit status it leaves with
_FORM_MARGIN_S = 30.0
STUCK_FORMING_EXIT = 75


@contextlib.contextmanager
def _exit_if_stuck(timeout: timedelta, what: str) -> Iterator[None]:
    """End this process if the block does not return in time.

    [Note: a group that never forms]
    The meeting at a generation's store proves every rank was alive when the group
    began to form, not that it stays so: a peer killed in the second after, while
    gloo connects every pair, can leave a rank waiting for that pair without end
    (seen under chaos: a rank in ``init_process_group`` for over five minutes, a
    60 s timeout given, while the others formed a newer generation without it).
    A thread cannot interrupt that wait, so after twice the timeout and a margin
    the process exits (status ``STUCK_FORMING_EXIT``) saying why: the coordinator
    drops it as it would a crash, and its launcher starts it again, as a newcomer
    that holds nothing. What it held is covered as a crash's is (replicas, a
    checkpoint), which is better than the job waiting on it forever."""
    limit = 2 * timeout.total_seconds() + _FORM_MARGIN_S

    def stuck() -> None:
        logger.error(
            "%s did not finish within %.0fs: a peer vanished while it formed; this "
            "worker exits for its launcher to start it again",
            what,
            limit,
        )
        os._exit(STUCK_FORMING_EXIT)

    timer = threading.Timer(limit, stuck)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


class LeftBeforeAdmission(Exception):
    """The worker was told to stop while it waited for a rank, and left."""


class JobFinished(LeftBeforeAdmission):
    """The job's members ended training before this worker formed a group with
    them ([Note: a finishing job] in coordinator/control/membership.py): it left, and has
    nothing to do."""


@dataclass
class _Ahead:
    """A generation's store, connected before this rank switches to it."""

    generation: int
    store: dist.Store
    marked: bool = False  # this rank counted itself ready


def _ready_key(gen: Generation) -> str:
    return f"zeroplane/{gen.id}/ready"


@dataclass
class ControlPlane:
    client: CoordinatorClient
    generation: Generation
    backend: str
    timeout: timedelta
    # how long wait_to_re_form waits ($ZEROPLANE_MEMBERSHIP_WAIT_S)
    patience_s: float = 600.0
    _reported_at: float = -1e9
    # the store of a generation this rank switches to soon ([Note: meeting ahead])
    _ahead: _Ahead | None = None

    @classmethod
    def join(
        cls,
        address: str,
        inventory: Inventory,
        *,
        device: torch.device,
        metrics_endpoint: str = "",
        metrics_port: int | None = None,
        wait_s: float | None = None,
        stop: Callable[[], bool] = lambda: False,
        stage: int | None = None,
        fixed: tuple[int, int] | None = None,
        mesh: tuple[int, int] | None = None,
        experts: tuple[int, int] | None = None,
        context_parallel: int | None = None,
    ) -> ControlPlane:
        """Register with the coordinator at ``address`` and wait to be given a rank.

        ``metrics_port``: this worker serves /metrics there, on the host it registers
        with (the coordinator lists it for Prometheus); ``metrics_endpoint`` overrides.
        ``stop``: polled while waiting; when it turns true before this worker is
        given a rank, it leaves the coordinator and raises :class:`LeftBeforeAdmission`.
        ``stage``: what this worker's ZeroConfig asks for. ``fixed``: (rank, world
        size) of a process group the script formed itself, which the coordinator keeps.
        ``mesh``: the (tensor, pipeline) parallel degrees asked for, 0 for one the
        coordinator chooses (the generation's ``mesh`` says what it chose).
        ``experts``: (expert_parallel, the experts' elements) of a worker that splits its
        experts over ranks, which ``inventory`` leaves out (the planner counts them).
        ``context_parallel``: the degree of a worker that splits each sequence over
        ranks (the coordinator forms whole cp groups).
        """
        # read before registering: a bad value fails here, not in the middle of a job
        timeout = timedelta(seconds=env_seconds(TIMEOUT_ENV, 60.0))
        patience = env_seconds(MEMBERSHIP_WAIT_ENV, 600.0)
        client = CoordinatorClient(ClientConfig.from_env(address=address))
        memory = (
            torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
        )
        host = _reachable_host(address)
        if not metrics_endpoint and metrics_port:
            metrics_endpoint = (
                f"[{host}]:{metrics_port}" if ":" in host else f"{host}:{metrics_port}"
            )
        info = WorkerInfo(
            worker_id=os.environ.get(WORKER_ID_ENV) or _default_worker_id(),
            host=host,
            device_kind=device.type,
            device_memory_bytes=memory,
            metrics_endpoint=metrics_endpoint,
            stage=stage,
            fixed_rank=None if fixed is None else fixed[0],
            fixed_world_size=None if fixed is None else fixed[1],
            mesh=mesh,
            experts=experts,
            context_parallel=context_parallel,
        )
        client.register(info, inventory.specs)
        client.where = TRACKER.snapshot  # [Note: naming a stall]
        client.on_stall = _exit_in_stall
        client.start()
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while True:
            try:
                generation = client.wait_for_generation(after=0, member=True, timeout=_STOP_POLL_S)
                break
            except TimeoutError:
                pass
            if client.job_finished:
                client.close(leave=True, reason="the job finished before it was admitted")
                raise JobFinished(info.worker_id)
            if stop():
                client.close(leave=True, reason="stopped before being admitted")
                raise LeftBeforeAdmission(info.worker_id)
            if deadline is not None and time.monotonic() >= deadline:
                client.close(leave=True, reason="not admitted in time")
                raise TimeoutError(
                    f"the coordinator at {address} gave this worker no rank within {wait_s:g}s"
                )
        plane = cls(client, generation, backend_for(device), timeout, patience)
        client.on_generation = plane._release_lost
        return plane

    def _release_lost(self, gen: Generation) -> None:
        """The watch thread: ``gen`` dropped ranks as lost that the training thread
        waits on in a collective of the current generation; close this rank's
        connections to them, so the wait fails now and the job re-forms, rather than
        at the collective timeout (a stopped rank, or one the coordinator dropped in
        a stall, keeps its connections open) ([Note: naming a stall])."""
        call, current = TRACKER.waiting_on, self.generation
        schedule = gen.reshard
        if call is None or schedule is None or schedule.from_generation_id != current.id:
            return
        lost = set(schedule.lost_ranks) & set(call.ranks)
        if lost and self.backend == "gloo":
            logger.warning(
                "generation %d dropped rank(s) %s, which %s #%d waits on: releasing it",
                gen.id,
                sorted(lost),
                call.op,
                call.seq,
            )
            close_connections_to(sorted(lost), call.pg)

    @property
    def rank(self) -> int:
        rank = self.generation.rank_of(self.client.worker_id)
        assert rank is not None
        return rank

    def init_process_group(self, ready: Callable[[], bool] | None = None) -> None:
        """Form the default process group of this generation, or of the newest one;
        ``ready`` as for :meth:`_meet`.

        [Note: superseded rendezvous]
        A generation's rendezvous can fail to complete: a member died after the
        coordinator formed it (its rank 0 may never host the store), or a member
        is still in an older rendezvous. Meanwhile the coordinator forms the next
        generation, and waiting out the first one (the collective timeout) would
        let the others give up on this rank. So every rank first meets the others
        at the generation's store in short, polled steps; whenever a newer
        generation that includes this rank is known and the store meeting is not
        complete, it moves to that one. Only once all ranks of one generation
        have met does it build the process group (where a failure is retried in
        the newest generation too). ``self.generation`` is the one formed.
        """
        deadline = time.monotonic() + self.patience_s
        while True:
            gen = self.generation
            logger.info(
                "joining generation %d as rank %d of %d at %s",
                gen.id,
                self.rank,
                gen.world_size,
                gen.rendezvous_endpoint,
            )
            store = self._meet(gen, deadline, ready)
            if store is None:
                continue  # superseded: self.generation is the newer one
            try:
                # torch wraps sys.excepthook at each init to prefix tracebacks with the
                # rank: one wrapper, with this generation's rank, not one per generation
                sys.excepthook = _EXCEPTHOOK
                TRACKER.forget_groups()  # the new group's collectives count from 1
                with _exit_if_stuck(self.timeout, f"forming generation {gen.id}'s group"):
                    dist.init_process_group(
                        self.backend,
                        store=dist.PrefixStore(f"zeroplane/{gen.id}", store),
                        rank=self.rank,
                        world_size=gen.world_size,
                        timeout=self.timeout,
                    )
                time_out_subgroups_as(self.timeout)
                return
            except (RuntimeError, dist.DistError) as exc:
                # a peer vanished between the meeting and the group: try the newest
                logger.warning("forming generation %d failed (%s); retrying", gen.id, exc)
                abort_default_group(self.timeout)
                if time.monotonic() >= deadline:
                    raise
                self.generation = self._newest_for_me(gen) or self.wait_newer(timeout=30.0)

    def _newest_for_me(self, gen: Generation) -> Generation | None:
        """A generation newer than ``gen`` that includes this worker, if one is known."""
        latest = self.client.generation
        if latest is None or latest.id <= gen.id:
            return None
        if latest.rank_of(self.client.worker_id) is None:
            raise RuntimeError(
                f"the coordinator formed generation {latest.id} without this worker "
                f"(it was dropped while forming generation {gen.id})"
            )
        return latest

    def _meet(
        self, gen: Generation, deadline: float, ready: Callable[[], bool] | None = None
    ) -> dist.Store | None:
        """Meet every rank of ``gen`` at its store (rank 0 hosts it); None when a newer
        generation for this rank superseded it first ([Note: superseded rendezvous]).
        ``ready``: polled while waiting; once true, this rank counts itself ready for
        the members' switch ([Note: meeting ahead]). A store connected ahead for
        ``gen`` (:meth:`prepare`) is the one met at.

        [Note: a newcomer waits at the store]
        A newcomer reaches a running job's rendezvous a step or more before the
        members, who arrive together at a step boundary, rank 0 opening the store
        as it arrives. Polling with one backoff, the newcomer looked for the store
        every 100 ms by then: in bench/elastic.py, 0.10 s of a 0.36 s scale-up
        (rank 0 from "joining" to "grew") went to that meeting. Now a rank looks
        at most ``_MEET_PROBE_S`` apart, for the store (a refused connect, which
        costs rank 0 nothing) and then for the others' arrival (a small request to
        rank 0's store). Three processes, the newcomer 6 s early, 6 meetings each:
        the last rank met 8-105 ms (median 68) after the members arrived before,
        3-13 ms (median 5) with the look for the store capped.
        """
        ahead, self._ahead = self._ahead, None
        store = ahead.store if ahead is not None and ahead.generation == gen.id else None
        marked = ahead is not None and store is not None and ahead.marked
        key = f"zeroplane/{gen.id}/arrived"
        counted = False
        poll = _MEET_FIRST_POLL_S
        while True:
            try:
                if store is None:
                    store = self._open_store(gen)
                    poll = _MEET_FIRST_POLL_S  # the others are arriving now
                if store is not None:
                    if not counted:
                        store.add(key, 1)
                        counted = True
                    if not marked and ready is not None and ready():
                        store.add(_ready_key(gen), 1)
                        marked = True
                    if store.add(key, 0) >= gen.world_size:
                        store.set_timeout(self.timeout)
                        return store
            except (RuntimeError, dist.DistError) as exc:  # no store (yet), or it went away
                logger.debug("generation %d: meeting at its store: %s", gen.id, exc)
                if self.rank != 0:
                    store, counted, marked = None, False, False
            if self.client.job_finished:
                self.client.close(leave=True, reason="the job finished before it formed a group")
                raise JobFinished(self.client.worker_id)
            newer = self._newest_for_me(gen)
            if newer is not None:
                logger.info("generation %d superseded by %d before it formed", gen.id, newer.id)
                self.generation = newer
                return None
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"generation {gen.id} did not form within {self.patience_s:g}s "
                    f"(${MEMBERSHIP_WAIT_ENV}): not every rank met at {gen.rendezvous_endpoint}"
                )
            time.sleep(poll)
            poll = min(poll * 1.5, _MEET_PROBE_S)

    def _open_store(self, gen: Generation) -> dist.Store | None:
        """``gen``'s store: opened on its rank 0, connected elsewhere; None while rank
        0 does not host it yet (a quiet probe first, see :func:`_listening`)."""
        host, port = gen.rendezvous_endpoint.rsplit(":", 1)
        host = host.strip("[]")
        rank = gen.rank_of(self.client.worker_id)
        timeout = timedelta(seconds=_MEET_POLL_S * 10)
        if rank == 0:
            # on the address the other ranks use, not every interface: the store is
            # unauthenticated (README, Security)
            return serving_store(host, int(port), gen.world_size, timeout)
        if not _listening(host, int(port)):
            return None
        return dist.TCPStore(
            host,
            int(port),
            gen.world_size,
            is_master=False,
            timeout=timeout,
            wait_for_workers=False,
        )

    def prepare(self, gen: Generation, *, ready: bool = True) -> bool:
        """While training in the current generation, connect to ``gen``'s store (rank
        0 opens it) and, once ``ready``, count this rank ready for the switch; whether
        every rank of ``gen`` is ([Note: meeting ahead]). It never waits for a peer:
        a store that is not up yet is looked for again at the next call.

        [Note: meeting ahead]
        A scale-up used to switch at the first step boundary after the members
        heard of the new generation, whether the newcomer had finished building
        ahead or not: in bench/elastic.py the members then waited 0.15-0.35 s in
        the hand-over's first collective for the newcomer's buffers. Now the
        members connect to the new generation's store while they train (rank 0
        opens it at once), every rank adds itself to its ``ready`` count once it
        has prepared (in a thread, beside training: a member writes the new
        layout's buffers, the optimizer state it will import and the hand-over's
        send and receive buffers; a newcomer, built ahead, its transient buffers,
        optimizer state and receive buffer; worker/build_ahead.py [Note: a build from
        buffers written ahead]), and the members keep training in the old group,
        voting "waiting" (worker/ballot.py), until the count is whole. At the
        switch the members add themselves to the ``arrived`` count of the store
        they already hold, and the group forms at once. A rank that has not heard
        of the generation yet does not vote "waiting"; it switches when the others
        do, unprepared. After ``_AHEAD_PATIENCE_S`` (worker/elastic/change.py) the
        members switch anyway, and the meeting deals with a newcomer that never
        came, as before.

        Measured (bench/elastic.py --stages 2, first scale-up on a new 2-core
        machine): the members' preparation took 1.5-2.2 s of fresh memory beside
        training; the pause fell from 1.4-1.7 s to 0.23-0.24 s.
        """
        ahead = self._ahead
        try:
            if ahead is None or ahead.generation != gen.id:
                self._ahead = ahead = None
                store = self._open_store(gen)
                if store is None:
                    return False
                self._ahead = ahead = _Ahead(gen.id, store)
            if ready and not ahead.marked:
                ahead.store.add(_ready_key(gen), 1)
                ahead.marked = True
            return ahead.store.add(_ready_key(gen), 0) >= gen.world_size
        except (RuntimeError, dist.DistError) as exc:  # rank 0's store went away
            logger.debug("generation %d: connecting ahead: %s", gen.id, exc)
            self._ahead = None
            return False

    @property
    def latest_id(self) -> int:
        """The newest generation id the coordinator has told this worker about."""
        latest = self.client.generation
        return self.generation.id if latest is None else max(latest.id, self.generation.id)

    def wait_newer(self, *, member: bool = True, timeout: float | None = 120.0) -> Generation:
        """Block until a generation newer than the applied one arrives."""
        return self.client.wait_for_generation(
            after=self.generation.id, member=member, timeout=timeout
        )

    def wait_to_re_form(
        self,
        *,
        stop: Callable[[], bool] = lambda: False,
        give_up: Callable[[], bool] = lambda: False,
    ) -> Generation | None:
        """Wait for the generation that re-forms the job after a loss or a leave.

        It may be a while: below ``min_workers`` the coordinator waits for
        newcomers. This rank holds part of the job's state, so it waits up to
        ``$ZEROPLANE_MEMBERSHIP_WAIT_S`` (default 600 s, torchrun's join timeout),
        saying every 30 s what the coordinator is waiting for. None once ``stop()``
        (this worker was asked to leave) and the coordinator says the job is over
        (finished or stopping, e.g. its launcher stops it): no generation is coming
        to hand the shards over in. Asked to leave while the job goes on (a
        replacement may be starting), it waits: it hands over in that generation.
        None at once once ``give_up()`` (a standby, holding nothing, asked to leave).
        """
        with TRACKER.state("recovering"):
            return self._wait_to_re_form(stop, give_up)

    def _wait_to_re_form(
        self, stop: Callable[[], bool], give_up: Callable[[], bool]
    ) -> Generation | None:
        patience = self.patience_s
        deadline = time.monotonic() + patience
        report = time.monotonic() + _WAIT_REPORT_S
        while True:
            left = deadline - time.monotonic()
            try:
                return self.wait_newer(timeout=max(0.0, min(_STOP_POLL_S, left)))
            except TimeoutError:
                if left <= _STOP_POLL_S:
                    raise TimeoutError(
                        f"the coordinator formed no generation after {self.generation.id} "
                        f"within {patience:g}s (${MEMBERSHIP_WAIT_ENV}); "
                        f"it says: {self._waiting_reason()}"
                    ) from None
            if give_up() or (stop() and self.client.job_finished):
                return None
            if time.monotonic() >= report:
                report += _WAIT_REPORT_S
                logger.warning("waiting for the job to re-form: %s", self._waiting_reason())

    def _waiting_reason(self) -> str:
        try:
            return self.client.status().waiting_reason or "nothing"
        except CoordinatorError as exc:
            return f"(no status: {exc})"

    def move_to(
        self,
        generation: Generation,
        *,
        broken: bool = False,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        """Leave the current process group and form ``generation``'s; ``broken``: a
        peer died, so abort the old group rather than wait on it; ``ready`` as for
        :meth:`init_process_group`."""
        if broken:
            abort_default_group(self.timeout)
        elif dist.is_initialized():
            dist.destroy_process_group()
        self.generation = generation
        self.init_process_group(ready=ready)

    def report_due(self) -> bool:
        """Heartbeats carry the latest report every interval; refresh it no more
        often than a few times a second, off the per-step path."""
        return time.monotonic() - self._reported_at >= 0.25

    def report(
        self,
        memory: dict[str, int],
        step: int,
        *,
        loss: float | None = None,
        samples: int = 0,
        tokens: int = 0,
        checkpoint: str = "",
        total_steps: int | None = None,
    ) -> None:
        self._reported_at = time.monotonic()
        self.client.set_report(
            WorkerReport(
                model_state_bytes={
                    k: int(v) for k, v in memory.items() if k not in ("total", "activations")
                },
                step=step,
                applied_generation_id=self.generation.id,
                loss=loss if loss is None or math.isfinite(loss) else None,
                samples=samples,
                tokens=tokens,
                checkpoint=checkpoint,
                total_steps=total_steps,
            )
        )

    def final_report(self) -> None:
        """Send what the heartbeats carry now, once more (at the end of training, so
        the coordinator's last view is the final step)."""
        try:
            self.client.heartbeat(flush=True)
        except (CoordinatorError, ValueError, RuntimeError) as exc:  # ValueError: closed
            logger.debug("final report not sent: %s", exc)

    def close(self, *, leave: bool = True, reason: str = "") -> None:
        self.client.close(leave=leave, reason=reason)


def _exit_in_stall(why: str) -> None:
    """The coordinator stopped the job in a stall, or dropped this rank in one: the
    training thread is blocked (or stuck), so this heartbeat thread ends the process,
    with the coordinator's words. The last checkpoint is what the job resumes from."""
    logger.error("%s", why)
    logging.shutdown()
    os._exit(STALL_EXIT_CODE)


def _listening(host: str, port: int) -> bool:
    """Whether something accepts connections at ``host:port``. A quiet probe before
    connecting a TCPStore client: torch logs every refused attempt with a C++ stack
    trace, and rank 0 may start its store a moment after the others look for it."""
    try:
        with socket.create_connection((host, port), timeout=_MEET_POLL_S * 10):
            return True
    except OSError:
        return False
