"""The Coordinator service over one Membership: its RPC handlers, the requests they
validate, and the reconcile that forms generations, on the server's one event loop.

Every call reaches the membership from that loop only, so it needs no locks. The
gRPC plumbing (registration, the token check, error mapping) is coordinator/control/
rpc.py; the published generation, coordinator/control/published.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
from collections.abc import AsyncIterator, Callable
from importlib import metadata
from typing import Any
from urllib.parse import unquote

import grpc

from coordinator._proto.zeroplane.coordinator.v1 import coordinator_pb2 as pb
from coordinator.control.membership import (
    Fenced,
    InvalidRequest,
    InventoryMismatch,
    Membership,
    MembershipError,
    StaleGeneration,
    UnknownWorker,
    first_difference,
)
from coordinator.control.published import Published, publish_steps
from coordinator.control.rpc import TokenCheck, service_handler
from coordinator.control.stalls import StallWatch, drop_reason, member_views
from coordinator.control.statefile import StateStore
from coordinator.control.telemetry import CoordinatorMetrics
from coordinator.core.conversions import (
    inventory_digest,
    inventory_steps,
    inventory_wire_steps,
    report_from_proto,
    status_to_proto,
    worker_from_proto,
)
from coordinator.core.layout import ParamSpec
from coordinator.core.messages import (
    RankBeat,
    WorkerInfo,
    check_count,
    check_worker_id,
    metrics_target,
    printable,
)
from coordinator.core.settings import CoordinatorConfig
from coordinator.core.steps import Steps, finish_async

__all__ = ["VERSION", "Servicer"]

logger = logging.getLogger(__name__)

try:
    VERSION = metadata.version("zeroplane")
except metadata.PackageNotFoundError:
    VERSION = "0+unknown"

MAX_HOST_RANKS = 1024  # ranks in one host heartbeat
_STALL_CHECK_S = 1.0  # how often the members' whereabouts are compared


class Servicer:
    """The Coordinator service over one Membership, on one event loop."""

    def __init__(
        self,
        config: CoordinatorConfig,
        membership: Membership,
        metrics: CoordinatorMetrics | None = None,
    ) -> None:
        self.config = config
        self.m = membership
        self.metrics = metrics or CoordinatorMetrics(job_name=config.http.job_name)
        self._changed = asyncio.Condition()
        self._forming = asyncio.Lock()
        self._stopping = False
        self._ticker: asyncio.Task | None = None
        # The newest generation as watchers get it, set once it is in the state file:
        # its common part serialized once, however many watch it.
        self._published: Published | None = None
        if membership.generation is not None:
            self._published = Published.of(membership.generation, None)
        self._store = StateStore(config.server.state_file)
        # peer strings of connections -> their IP address (see _peer)
        self._peers: dict[str, str] = {}
        # ranks host agents left out since the last reconcile
        self._dropped = 0
        ms = config.membership
        windows = [ms.lease_timeout_s / 10] + ([ms.join_window_s / 5] if ms.join_window_s else [])
        self._tick_s = max(0.01, min(0.1, *windows))
        # names the job's stalls from the members' whereabouts, and acts on them
        self.stalls = StallWatch(
            ms.stall_after_s,
            ms.stall_timeout_s,
            silent_s=2.5 * ms.heartbeat_interval_s,
            clock=membership._clock,
        )

    # ---- plumbing ---------------------------------------------------------------------

    def handler(self) -> grpc.GenericRpcHandler:
        behaviours = {
            "Register": self.register,
            "Heartbeat": self.heartbeat,
            "HostHeartbeat": self.host_heartbeat,
            "HostHeartbeats": self.host_heartbeats,
            "WatchGenerations": self.watch_generations,
            "Leave": self.leave,
            "Status": self.status,
        }
        limit = self.config.server.max_request_bytes
        return service_handler(behaviours, limit, TokenCheck(self.config.server.token))

    # ---- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def stop(self) -> None:
        self._stopping = True
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        async with self._changed:
            self._changed.notify_all()

    async def _tick(self) -> None:
        # Expiry scans every lease: at 100,000 ranks, ten times a second would cost the
        # loop a third of a core, so it runs every 1/20 of a lease (which bounds how
        # late a lease is seen to run out), the join window's check every tick.
        every = max(self._tick_s, self.config.membership.lease_timeout_s / 20)
        loop = asyncio.get_running_loop()
        last = watched = loop.time()
        while True:
            await asyncio.sleep(self._tick_s)
            expire = loop.time() - last >= every
            if expire:
                last = loop.time()
            try:
                await self._reconcile(expire=expire)
                if loop.time() - watched >= self._stall_check_s():
                    watched = loop.time()
                    await self._watch_stalls()
            except Exception:
                logger.exception("membership reconcile failed")

    def _stall_check_s(self) -> float:
        """How often the members' whereabouts are compared: every second up to 10,000
        ranks, then in proportion (a comparison walks every member)."""
        gen = self.m.generation
        return _STALL_CHECK_S * max(1.0, (0 if gen is None else gen.world_size) / 10_000)

    async def _watch_stalls(self) -> None:
        """Name the job's stall, if any; act on one that reached its bound
        (coordinator/control/stalls.py)."""
        if self.m.finished:
            return
        named = self.stalls.count
        act = self.stalls.check(member_views(self.m, self.m._clock()))
        current = self.stalls.current
        self.m.stall = "" if current is None else current.text
        self.m.stall_kind = "" if current is None else current.kind
        if current is not None and self.stalls.count != named:
            self.metrics.stalls.labels(current.kind).inc()
        if act is None:
            return
        if act.kind == "mismatch":
            self.m.stalled = act.text
            await self.stop_job(f"stalled: {act.text}")
            return
        for view in act.culprits:
            self.m.fence(view.worker_id, drop_reason(act.kind, act.text))
        self.metrics.on_expired(len(act.culprits))
        await self._reconcile()

    async def stop_job(self, why: str) -> None:
        """A launcher is stopping the job: form nothing more, and tell every worker
        still waiting for a generation (heartbeats) that the job is over. Durable: a
        restarted coordinator forms nothing more either."""
        if self.m.finished:
            return
        self.m.stop(why)
        async with self._forming:
            await self._store.save(self.m.snapshot())

    async def expect_more(self, count: int) -> None:
        """A launcher started ``count`` more workers (Membership.expect_more)."""
        self.m.expect_more(count)
        await self._reconcile()

    async def process_exited(self, worker_id: str, how: str) -> None:
        """A launcher saw the worker's process exit: drop it and re-form now."""
        if self.m.process_exited(worker_id, how):
            self.metrics.on_expired(1)
            await self._reconcile()

    async def _reconcile(self, *, expire: bool = False) -> None:
        # Expiry scans every lease, so only the ticker does it; a register or a
        # leave only needs to know whether a generation is due (O(1)).
        if expire:
            self.metrics.on_expired(len(self.m.expire()))
        async with self._forming:
            # see coordinator/control/membership.py [Note: atomic formation]
            while (proposal := self.m.propose()) is not None:
                try:
                    generation, published = await finish_async(publish_steps(proposal))
                except Exception as exc:
                    logger.debug("building generation %d failed", proposal.id, exc_info=True)
                    self.m.refuse(proposal, printable(f"{type(exc).__name__}: {exc}"))
                    return
                if not self.m.commit(proposal, generation):
                    continue  # a proposed worker went away meanwhile
                self.metrics.on_generation(generation)
                # Durable before anyone hears of it: a restart must never hand out
                # this id again with other content.
                snapshot = published.for_state_file(self.m.snapshot())
                if snapshot.inventory and not snapshot.inventory_wire:
                    wire = await finish_async(inventory_wire_steps(snapshot.inventory))
                    snapshot = dataclasses.replace(snapshot, inventory_wire=wire)
                await self._store.save(snapshot)
                self._published = published
                async with self._changed:
                    self._changed.notify_all()

    # ---- RPCs -------------------------------------------------------------------------

    async def register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterResponse:
        info = _valid("worker", worker_from_proto, request.worker)
        peer = _peer_address(context)
        if info.metrics_endpoint:
            _check_metrics_host(info, peer)
        inventory, digest, wire = await self._inventory_of(request)
        reattached = self.m.register(info, inventory, digest=digest, wire=wire, peer=peer)
        self.metrics.on_register(reattached)
        await self._reconcile()
        ms = self.config.membership
        return pb.RegisterResponse(
            worker_id=info.worker_id,
            lease_timeout_s=ms.lease_timeout_s,
            heartbeat_interval_s=ms.heartbeat_interval_s,
            generation_id=self.m.generation_id,
            reattached=reattached,
            epoch=self.m.epoch,
        )

    async def _inventory_of(
        self, request: pb.RegisterRequest
    ) -> tuple[tuple[ParamSpec, ...], str, bytes]:
        """The request's inventory, checked against the job's (the job's own tuple when
        equal); linear, in steps (coordinator/core/steps.py [Note: steps])."""
        job, digest = self.m.inventory, self.m.digest
        limit = self.config.server.max_params
        return await finish_async(_inventory_steps(request, job, digest, limit))

    async def heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatResponse:
        beat = _rank_beat(request, "HeartbeatRequest")
        remaining = self.m.heartbeat(
            beat.worker_id,
            beat.generation_id,
            beat.report,
            beat.free_ports,
            self._peer(context),
            leaving=beat.leaving,
        )
        return pb.HeartbeatResponse(
            generation_id=self.m.generation_id,
            lease_remaining_s=remaining,
            job_finished=self.m.finished,
            stalled=self.m.stalled,
        )

    def _peer(self, context: grpc.aio.ServicerContext) -> str:
        # Parsing an address costs more than the rest of a heartbeat: once per connection.
        raw = context.peer() or ""
        peer = self._peers.get(raw)
        if peer is None:
            if len(self._peers) >= 65536:
                self._peers.clear()
            peer = self._peers[raw] = _peer_address(context)
        return peer

    def _host_beat(self, request: pb.HostHeartbeatRequest, peer: str) -> pb.HostHeartbeatResponse:
        """One host heartbeat (coordinator/control/membership.py [Note: host heartbeats])."""
        host_id = _valid(
            "HostHeartbeatRequest.host_id",
            lambda v: check_worker_id("HostHeartbeatRequest.host_id", v),
            request.host_id,
        )
        if len(request.ranks) > MAX_HOST_RANKS:
            raise InvalidRequest(
                f"HostHeartbeatRequest.ranks: {len(request.ranks)}, over the limit of "
                f"{MAX_HOST_RANKS}"
            )
        response = pb.HostHeartbeatResponse()
        beats, results = [], []
        for i, msg in enumerate(request.ranks):
            try:
                beats.append(_rank_beat(msg, f"HostHeartbeatRequest.ranks[{i}]"))
                results.append(None)
            except InvalidRequest as exc:
                results.append(
                    pb.RankBeatResult(
                        worker_id=printable(msg.worker_id, 256),
                        outcome=pb.RankBeatResult.INVALID,
                        detail=str(exc),
                    )
                )
        dropped, outcomes_list = self.m.host_heartbeat(host_id, beats, peer)
        self._dropped += len(dropped)
        outcomes = iter(outcomes_list)
        add = response.ranks.add
        for result in results:
            if result is not None:
                add().CopyFrom(result)
                continue
            worker_id, outcome = next(outcomes)
            if isinstance(outcome, MembershipError):
                code = (
                    pb.RankBeatResult.STALE_GENERATION
                    if isinstance(outcome, StaleGeneration)
                    else pb.RankBeatResult.UNKNOWN_WORKER
                    if isinstance(outcome, UnknownWorker)
                    else pb.RankBeatResult.FENCED
                    if isinstance(outcome, Fenced)
                    else pb.RankBeatResult.INVALID
                )
                add(worker_id=worker_id, outcome=code, detail=printable(str(outcome)))
            else:
                add(worker_id=worker_id, outcome=pb.RankBeatResult.OK, lease_remaining_s=outcome)
        response.generation_id = self.m.generation_id
        response.job_finished = self.m.finished
        response.stalled = self.m.stalled
        return response

    async def host_heartbeat(
        self, request: pb.HostHeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HostHeartbeatResponse:
        response = self._host_beat(request, self._peer(context))
        await self._reconcile_if_lost()
        return response

    async def host_heartbeats(
        self, requests: AsyncIterator[pb.HostHeartbeatRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.HostHeartbeatResponse]:
        peer = self._peer(context)
        async for request in requests:
            yield self._host_beat(request, peer)
            await self._reconcile_if_lost()

    async def _reconcile_if_lost(self) -> None:
        """A host agent left out a rank: re-form now, not at the next tick."""
        if self._dropped:
            self.metrics.on_expired(self._dropped)
            self._dropped = 0
            await self._reconcile()

    async def watch_generations(
        self, request: pb.WatchGenerationsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator:
        after = _count(request, "after_generation_id")
        # An anonymous watch (fetch_generation before registering) has no worker id.
        if request.worker_id:
            _worker_id(request)

        def due() -> bool:
            # reads the loop's ``after`` as it is now: each generation is sent once
            return self._stopping or (self._published is not None and self._published.id > after)

        # ends on cancellation too: a worker's process dying closes its stream
        # (see coordinator/control/membership.py [Note: disconnects])
        token = self.m.watch_opened(request.worker_id)
        try:
            while True:
                async with self._changed:
                    await self._changed.wait_for(due)
                if self._stopping:
                    return
                published = self._published
                if request.incremental:
                    data = published.incremental(request.worker_id, after)
                else:
                    data = await published.whole()
                after = published.id
                yield data
        finally:
            self.m.watch_closed(request.worker_id, token)

    async def leave(
        self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext
    ) -> pb.LeaveResponse:
        worker_id = _worker_id(request)
        gen = self.m.generation
        member = gen is not None and gen.rank_of(worker_id) is not None
        if self.m.leave(worker_id, printable(request.reason, 256)):
            self.metrics.on_leave()
            if member:
                # durable before the leaver exits: a restart must not take it for lost
                async with self._forming:
                    await self._store.save(self.m.snapshot())
        await self._reconcile()
        return pb.LeaveResponse()

    async def status(
        self, request: pb.StatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatusResponse:
        return status_to_proto(self.m.status(VERSION))


def _peer_address(context: grpc.aio.ServicerContext) -> str:
    """The IP address a call came from ("" when it is not an IP connection)."""
    kind, _, rest = (context.peer() or "").partition(":")
    if kind not in ("ipv4", "ipv6"):
        return ""
    host = rest.rsplit(":", 1)[0].strip("[]")
    try:
        address = ipaddress.ip_address(unquote(host))
    except ValueError:
        return ""
    mapped = getattr(address, "ipv4_mapped", None)
    return str(mapped or address)


def _check_metrics_host(info: WorkerInfo, peer: str) -> None:
    """A worker may only name itself as its metrics host: the address it registers
    from, or the host it gives the other workers. (Either way the coordinator reads
    the metrics at the peer's address, see WorkerStatus.metrics_url.)"""
    host = metrics_target(info.metrics_endpoint)[0]
    mine = {info.host.lower().strip("[]")} | ({peer} if peer else set())
    with contextlib.suppress(ValueError):
        host = str(ipaddress.ip_address(host))
    if host.lower() not in mine:
        raise InvalidRequest(
            f"WorkerInfo.metrics_endpoint: host {printable(host, 80)!r} is neither the "
            f"address this worker registers from ({peer or 'unknown'}) nor its host "
            f"{info.host!r}"
        )


def _inventory_steps(
    request: pb.RegisterRequest,
    job: tuple[ParamSpec, ...] | None,
    job_digest: str,
    limit: int,
) -> Steps[tuple[tuple[ParamSpec, ...], str, bytes]]:
    """(inventory, its digest, its canonical encoding) of a registration; the job's own
    inventory (and no encoding) when it is the job's."""
    if len(request.inventory) > limit:
        raise InvalidRequest(
            f"inventory has {len(request.inventory)} parameters, over the limit of {limit}"
        )
    wire = yield from inventory_wire_steps(request.inventory)
    digest = inventory_digest(wire)
    if job is not None and digest == job_digest:
        return job, digest, b""
    try:
        specs = yield from inventory_steps(request.inventory, max_params=limit)
    except ValueError as exc:
        raise InvalidRequest(f"inventory: {exc}") from None
    if job is None:
        return specs, digest, wire
    if specs != job:
        diff = first_difference(job, specs)
        raise InventoryMismatch(f"parameter inventory differs from the job's: {diff}")
    return job, job_digest, b""


def _rank_beat(msg: pb.HeartbeatRequest | pb.RankBeat, what: str) -> RankBeat:
    """A Heartbeat's (or a host heartbeat's rank's) fields, validated."""
    try:  # the common case, with no field names built (one per rank per interval)
        worker_id = check_worker_id("", msg.worker_id)
        generation_id = check_count("", msg.generation_id)
    except ValueError:  # again, to say which field of ``what`` is wrong
        worker_id = _valid(
            f"{what}.worker_id", lambda v: check_worker_id(f"{what}.worker_id", v), msg.worker_id
        )
        generation_id = _valid(
            f"{what}.generation_id",
            lambda v: check_count(f"{what}.generation_id", v),
            msg.generation_id,
        )
    ports = tuple(msg.free_ports)
    if len(ports) > 8 or any(not 0 < p < 65536 for p in ports):
        raise InvalidRequest("free_ports: at most 8 ports, each in [1, 65535]")
    report = None
    if msg.HasField("report"):
        report = _valid("report", report_from_proto, msg.report)
    age_s = msg.age_s if isinstance(msg, pb.RankBeat) else 0.0
    if not 0.0 <= age_s < 1e6:  # NaN fails both
        raise InvalidRequest(f"age_s: {age_s}, not a number of seconds in [0, 1e6)")
    return RankBeat(
        worker_id=worker_id,
        generation_id=generation_id,
        report=report,
        free_ports=ports,
        leaving=msg.leaving,
        age_s=age_s,
    )


def _valid(what: str, convert: Callable[[Any], Any], msg: Any) -> Any:
    try:
        return convert(msg)
    except ValueError as exc:
        raise InvalidRequest(f"{what}: {exc}") from None


def _worker_id(request: Any) -> str:
    name = f"{type(request).__name__}.worker_id"
    return _valid(name, lambda v: check_worker_id(name, v), request.worker_id)


def _count(request: Any, field: str) -> int:
    name = f"{type(request).__name__}.{field}"
    return _valid(name, lambda v: check_count(name, v), getattr(request, field))
