"""The coordinator's gRPC server.

    server, port = create_server(CoordinatorConfig(...))
    server.start()
    ...
    server.stop(grace=5)

or ``serve(config)``, which blocks until SIGTERM/SIGINT and then stops
gracefully. The server runs on grpc.aio in an event loop of its own (one
thread): every watch stream is a coroutine, not a thread, so thousands of
workers can watch at once, and the membership state is only ever touched from
that loop, so it needs no locks. ``CoordinatorServer`` is a synchronous handle
on it, for launchers and tests.

Handlers are registered by hand instead of through the generated
``add_CoordinatorServicer_to_server`` so that a request that does not parse
gets INVALID_ARGUMENT (grpc's own deserialization failure is INTERNAL), and so
that authentication, validation and error mapping live in one place
(``_Servicer._guard``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import ipaddress
import logging
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import metadata
from typing import Any
from urllib.parse import unquote

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from coordinator._proto.zeroplane.coordinator.v1 import coordinator_pb2 as pb
from coordinator.control.membership import (
    InvalidRequest,
    InventoryMismatch,
    Membership,
    MembershipError,
    Proposal,
    Snapshot,
    StaleGeneration,
    UnknownWorker,
    build_steps,
    first_difference,
)
from coordinator.control.statefile import StateStore, length_delimited, load_snapshot
from coordinator.control.telemetry import CoordinatorMetrics, RpcMetricsInterceptor
from coordinator.control.web import CoordinatorHttp
from coordinator.core.conversions import (
    inventory_digest,
    inventory_steps,
    inventory_wire_steps,
    report_from_proto,
    status_to_proto,
    worker_from_proto,
)
from coordinator.core.generation_codec import (
    generation_steps,
    members_delta,
    moves_to_proto,
    serialize_steps,
)
from coordinator.core.layout import ParamSpec
from coordinator.core.messages import (
    GENERATION_METADATA_KEY,
    Generation,
    RankBeat,
    StatusReport,
    WorkerInfo,
    WorkerReport,
    check_count,
    check_worker_id,
    metrics_target,
    printable,
)
from coordinator.core.reshard import LazyMoves, RankSchedules
from coordinator.core.settings import (
    CoordinatorConfig,
)
from coordinator.core.steps import Steps, finish, finish_async

__all__ = [
    "SERVICE_NAME",
    "CoordinatorServer",
    "create_server",
    "serve",
]

logger = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"]
SERVICE_NAME = SERVICE.full_name

try:
    VERSION = metadata.version("zeroplane")
except metadata.PackageNotFoundError:
    VERSION = "0+unknown"


class _NoMetadataValues(logging.Filter):
    """Drops grpc's own report of metadata that is not valid UTF-8: it logs the raw
    value, which is a bearer token when the header is ``authorization``. Such a
    call is still answered (its token is wrong), only never logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Invalid encoding on")


_GRPC_LOGGER = "grpc._cython.cygrpc"


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, detail: str, trailing: tuple = ()) -> None:
        super().__init__(detail)
        self.code, self.trailing = code, trailing
        # an error echoes at most a bounded, escaped prefix of what it was sent
        self.detail = printable(detail)


class _Malformed:
    """Stands in for a request that could not be decoded, so the handler can say why."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _deserializer(cls: type, limit: int) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        if len(data) > limit:
            return _Malformed(f"request is {len(data)} bytes, over the limit of {limit}")
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            return _Malformed(f"request is not a valid {cls.DESCRIPTOR.name}: {exc}")

    return parse


def _serializer(cls: type) -> Callable[[Any], bytes]:
    def serialize(msg: Any) -> bytes:
        return msg if isinstance(msg, bytes) else cls.SerializeToString(msg)

    return serialize


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


class _Refuse:
    """Handlers that answer UNAUTHENTICATED without reading the request.

    They are registered as client-streaming, so grpc hands over an iterator of
    request messages instead of reading (and decompressing) the one message
    first; the iterator is never touched. On the wire a unary call and a
    client stream with one message are the same.
    """

    def __init__(self, detail: str) -> None:
        self.detail = detail

    async def unary(self, requests: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, self.detail)

    async def stream(self, requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, self.detail)
        yield  # an async generator, like the stream it stands in for


class _Service(grpc.GenericRpcHandler):
    """The Coordinator's handlers, behind the token check (see [Note: authentication first])."""

    def __init__(
        self,
        handlers: dict[str, grpc.RpcMethodHandler],
        authorize: Callable[[Any], str | None],
    ) -> None:
        self._handlers = {f"/{SERVICE_NAME}/{name}": h for name, h in handlers.items()}
        self._authorize = authorize

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self._handlers.get(details.method)
        if handler is None:
            return None
        refusal = self._authorize(details.invocation_metadata)
        if refusal is None:
            return handler
        refuse = _Refuse(refusal)
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse.stream)
        return grpc.stream_unary_rpc_method_handler(refuse.unary)


class _Servicer:
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
        token = config.server.token
        self._token_digest = None if token is None else hashlib.sha256(token.encode()).digest()
        self._changed = asyncio.Condition()
        self._forming = asyncio.Lock()
        self._stopping = False
        self._ticker: asyncio.Task | None = None
        # The newest generation as watchers get it, set once it is in the state file:
        # its common part serialized once, however many watch it.
        self._published: _Published | None = None
        if membership.generation is not None:
            self._published = _Published.of(membership.generation, None)
        self._store = StateStore(config.server.state_file)
        # peer strings of connections -> their IP address (see _peer)
        self._peers: dict[str, str] = {}
        # ranks host agents left out since the last reconcile
        self._dropped = 0
        ms = config.membership
        windows = [ms.lease_timeout_s / 10] + ([ms.join_window_s / 5] if ms.join_window_s else [])
        self._tick_s = max(0.01, min(0.1, *windows))

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
        handlers = {}
        for method in SERVICE.methods:
            request_cls = getattr(pb, method.input_type.name)
            response_cls = getattr(pb, method.output_type.name)
            kwargs = dict(
                request_deserializer=_deserializer(request_cls, limit),
                response_serializer=_serializer(response_cls),
            )
            fn = behaviours[method.name]
            if method.client_streaming:
                handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                    self._guard_bidi(fn), **kwargs
                )
            elif method.server_streaming:
                handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                    self._guard_stream(fn), **kwargs
                )
            else:
                handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                    self._guard(fn), **kwargs
                )
        return _Service(handlers, self._refusal)

    # [Note: authentication first]
    # The token is checked when grpc looks up a call's handler, from its metadata
    # alone, before any byte of the request is read: a call without the token gets
    # a handler that answers UNAUTHENTICATED and never reads the request, so a
    # tokenless gzip bomb is never decompressed (_Refuse).

    def _refusal(self, metadata: Any) -> str | None:
        """Why a call with this metadata is not let in; None when it is."""
        if self._token_digest is None:
            return None
        value = dict(metadata or ()).get("authorization")
        if value is None:
            return "missing bearer token (metadata 'authorization: Bearer <token>')"
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        scheme, _, token = value.partition(" ")
        digest = hashlib.sha256(token.strip().encode("utf-8", "replace")).digest()
        # Compare digests, so neither the token's content nor its length leaks through timing.
        if not (scheme.lower() == "bearer" and hmac.compare_digest(digest, self._token_digest)):
            return "wrong bearer token"
        return None

    @staticmethod
    def _to_abort(exc: Exception) -> _Abort:
        if isinstance(exc, _Abort):
            return exc
        if isinstance(exc, InvalidRequest):
            return _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if isinstance(exc, StaleGeneration):
            trailing = ((GENERATION_METADATA_KEY, str(exc.current)),)
            return _Abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc), trailing)
        if isinstance(exc, InventoryMismatch):
            return _Abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        if isinstance(exc, UnknownWorker):
            return _Abort(grpc.StatusCode.NOT_FOUND, str(exc))
        logger.exception("internal error in the coordinator", exc_info=exc)
        return _Abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")

    def _guard(self, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                if isinstance(request, _Malformed):
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
                return await fn(request, context)
            except Exception as exc:
                abort = self._to_abort(exc)
            await context.abort(abort.code, abort.detail, abort.trailing)

        return handle

    def _guard_stream(self, fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator]:
        async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                if isinstance(request, _Malformed):
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
                stream = fn(request, context)
                first = await anext(stream, None)
            except Exception as exc:
                abort = self._to_abort(exc)
                await context.abort(abort.code, abort.detail, abort.trailing)
                return
            if first is None:
                return
            yield first
            async for item in stream:
                yield item

        return handle

    def _guard_bidi(self, fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator]:
        async def handle(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for item in fn(_checked(requests), context):
                    yield item
            except Exception as exc:
                abort = self._to_abort(exc)
                await context.abort(abort.code, abort.detail, abort.trailing)

        return handle

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
        last = loop.time()
        while True:
            await asyncio.sleep(self._tick_s)
            expire = loop.time() - last >= every
            if expire:
                last = loop.time()
            try:
                await self._reconcile(expire=expire)
            except Exception:
                logger.exception("membership reconcile failed")

    async def stop_job(self, why: str) -> None:
        """A launcher is stopping the job: form nothing more, and tell every worker
        still waiting for a generation (heartbeats) that the job is over. Durable: a
        restarted coordinator forms nothing more either."""
        if self.m.finished:
            return
        self.m.stop(why)
        async with self._forming:
            await self._store.save(self.m.snapshot())

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
                    generation, published = await finish_async(_build_steps(proposal))
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
                    else pb.RankBeatResult.INVALID
                )
                add(worker_id=worker_id, outcome=code, detail=printable(str(outcome)))
            else:
                add(worker_id=worker_id, outcome=pb.RankBeatResult.OK, lease_remaining_s=outcome)
        response.generation_id = self.m.generation_id
        response.job_finished = self.m.finished
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


def _build_steps(proposal: Proposal) -> Steps[tuple[Generation, _Published]]:
    """A proposal's generation and its wire forms (see coordinator/control/membership.py
    [Note: atomic formation])."""
    generation = yield from build_steps(proposal)
    published = yield from _Published.steps(generation, proposal.previous)
    return generation, published


MAX_HOST_RANKS = 1024  # ranks in one host heartbeat
LAYOUT_FIELD = pb.Generation.DESCRIPTOR.fields_by_name["layout"].number


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
    return RankBeat(
        worker_id=worker_id,
        generation_id=generation_id,
        report=report,
        free_ports=ports,
        leaving=msg.leaving,
    )


async def _checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, _Malformed):
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        yield request


class _Published:
    """A generation as watchers get it (coordinator/core/reshard.py [Note: incremental
    schedule]): whole, built on first demand, or per worker, a head shared by all
    (members whole, or as a delta from the previous generation; the schedule without
    its moves) and the worker's own moves appended."""

    def __init__(
        self,
        generation: Generation,
        head: bytes,
        delta_head: bytes | None,
        layout: bytes = b"",
    ) -> None:
        self.id = generation.id
        self.generation = generation
        # the heads without the layout's buckets (what the state file stores), and the
        # layout whole appended (a Generation's field 7, merged into the one before)
        self._stored, self._delta_stored = head, delta_head
        self._head = head + layout
        self._delta_head = None if delta_head is None else delta_head + layout
        self._whole: asyncio.Future[bytes] | None = None
        reshard = generation.reshard
        self._schedules: RankSchedules | None = None
        self._ranks: dict[str, tuple[int | None, int | None]] | None = None
        if reshard is not None and isinstance(reshard.moves, LazyMoves):
            self._schedules = reshard.moves.schedules

    @classmethod
    def of(cls, generation: Generation, previous: Generation | None) -> _Published:
        return finish(cls.steps(generation, previous))

    @classmethod
    def steps(cls, generation: Generation, previous: Generation | None) -> Steps[_Published]:
        reshard = generation.reshard
        if reshard is not None:  # the moves go to each worker apart
            reshard = dataclasses.replace(reshard, moves=(), partial=True)
        msg = yield from generation_steps(dataclasses.replace(generation, reshard=reshard))
        # The layout's buckets apart: the state file leaves them out (they follow from
        # the inventory), a watcher gets them appended (a message field given twice is
        # merged, as for the moves appended in incremental()).
        layout = length_delimited(LAYOUT_FIELD, msg.layout.SerializeToString())
        yield
        del msg.layout.buckets[:]
        head = msg.SerializeToString()
        yield
        delta = None if previous is None else members_delta(previous, generation)
        delta_head = None
        if delta is not None:
            yield
            del msg.members[:]
            msg.members_delta.CopyFrom(delta)
            delta_head = msg.SerializeToString()
        return cls(generation, head, delta_head, layout)

    def for_state_file(self, snapshot: Snapshot) -> Snapshot:
        """``snapshot`` (of this generation) with the wire forms the state file stores
        (coordinator/control/statefile.py [Note: state file format])."""
        if snapshot.generation is not self.generation:
            return snapshot
        return dataclasses.replace(
            snapshot,
            generation_wire=self._stored,
            generation_delta_wire=self._delta_stored or b"",
        )

    async def whole(self) -> bytes:
        """The generation with every member and every move (one build, however many ask)."""
        if self._whole is None:
            self._whole = asyncio.ensure_future(finish_async(_whole_steps(self.generation)))
        return await asyncio.shield(self._whole)

    def incremental(self, worker_id: str, after: int) -> bytes:
        reshard = self.generation.reshard
        delta = self._delta_head is not None and reshard is not None
        head = self._delta_head if delta and after == reshard.from_generation_id else self._head
        if reshard is None:
            return head
        old_rank, new_rank = self._ranks_of(worker_id)
        if old_rank is None and new_rank is None:
            return head
        if self._schedules is not None:
            moves = self._schedules.for_rank(old_rank, new_rank)
        else:  # restored from a state file, whole: this worker's part of it
            moves = [m for m in reshard.moves if m.old_owner == old_rank or m.new_owner == new_rank]
        return head + moves_to_proto(moves)

    def _ranks_of(self, worker_id: str) -> tuple[int | None, int | None]:
        if self._ranks is None:
            self._ranks = {m.worker_id: (m.previous_rank, m.rank) for m in self.generation.members}
        return self._ranks.get(worker_id, (None, None))


def _whole_steps(generation: Generation) -> Steps[bytes]:
    reshard = generation.reshard
    if reshard is not None and isinstance(reshard.moves, LazyMoves):
        yield from reshard.moves.steps()
    msg = yield from generation_steps(generation)
    data = yield from serialize_steps(msg)
    return data


class CoordinatorServer:
    """A coordinator serving on its own event-loop thread; a synchronous handle.

    The port is bound at construction (``port``), serving begins at ``start``.
    """

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="zeroplane-coordinator", daemon=True
        )
        self._terminated = threading.Event()
        self._started = False
        grpc_logger = logging.getLogger(_GRPC_LOGGER)
        if not any(isinstance(f, _NoMetadataValues) for f in grpc_logger.filters):
            grpc_logger.addFilter(_NoMetadataValues())
        self._thread.start()
        # The collector reads the membership at scrape time, on the loop (see status()).
        self.metrics = CoordinatorMetrics(
            status=self._status_or_none, job_name=config.http.job_name
        )
        self.http: CoordinatorHttp | None = None
        try:
            self.port: int = self._call(self._bind())
            if config.http.port is not None:
                self.http = CoordinatorHttp(
                    host=config.http.host or config.server.host,
                    port=config.http.port,
                    metrics=self.metrics,
                    status=lambda: self._call(self._read_status(), timeout=10),
                    job_name=config.http.job_name,
                )
        except BaseException:
            self._close_loop()
            raise

    @property
    def address(self) -> str:
        return _local_address(self.config.server.host, self.port)

    @property
    def http_address(self) -> str | None:
        """host:port of /metrics, /sd and the status page; None when HTTP is off."""
        if self.http is None:
            return None
        return _local_address(self.config.http.host or self.config.server.host, self.http.port)

    def _call(self, coro: Awaitable[Any], timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _bind(self) -> int:
        cfg = self.config
        membership = Membership(cfg.membership, cfg.plan)
        if cfg.server.state_file is not None:
            snapshot = load_snapshot(cfg.server.state_file)
            if snapshot is not None:
                membership.restore(snapshot)
                self.metrics.on_restore(membership.generation)
        self._servicer = _Servicer(cfg, membership, self.metrics)
        limit = cfg.server.max_request_bytes
        self._server = grpc.aio.server(
            interceptors=[RpcMetricsInterceptor(self.metrics)],
            options=[
                # Above the application limit, so an oversized request reaches the handler
                # and gets INVALID_ARGUMENT rather than grpc's RESOURCE_EXHAUSTED.
                # (Beyond this transport limit grpc itself answers RESOURCE_EXHAUSTED.)
                ("grpc.max_receive_message_length", max(2 * limit, limit + (4 << 20))),
                ("grpc.max_send_message_length", cfg.server.max_send_bytes),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 5000),
            ],
        )
        self._server.add_generic_rpc_handlers((self._servicer.handler(),))
        self._health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        host = cfg.server.host
        address = f"[{host}]:{cfg.server.port}" if ":" in host else f"{host}:{cfg.server.port}"
        if cfg.server.tls:
            client_ca = cfg.server.tls_client_ca_file
            credentials = grpc.ssl_server_credentials(
                [(cfg.server.tls_key_file.read_bytes(), cfg.server.tls_cert_file.read_bytes())],
                root_certificates=None if client_ca is None else client_ca.read_bytes(),
                require_client_auth=client_ca is not None,
            )
            port = self._server.add_secure_port(address, credentials)
        else:
            port = self._server.add_insecure_port(address)
        if not port:
            raise OSError(f"coordinator cannot bind {address}")
        return port

    def start(self) -> None:
        self._call(self._start())
        self._started = True
        if self.http is not None:
            self.http.start()
            logger.info("coordinator status page and metrics on http://%s/", self.http_address)
        if self.config.server.token is None:
            logger.warning("no bearer token configured: the coordinator accepts any client")
        logger.info(
            "coordinator serving on %s:%d (%s)",
            self.config.server.host,
            self.port,
            ("mutual TLS" if self.config.server.tls_client_ca_file else "TLS")
            if self.config.server.tls
            else "plaintext",
        )

    async def _start(self) -> None:
        await self._server.start()
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._servicer.start()

    def stop(self, grace: float | None = None) -> None:
        """Stop serving; in-flight RPCs get ``grace`` seconds (default: the config's)."""
        if self._terminated.is_set():
            return
        grace = self.config.server.grace_s if grace is None else grace
        if self.http is not None:
            self.http.close()
        try:
            self._call(self._stop(grace))
        finally:
            self._close_loop()
        logger.info("coordinator on port %d stopped", self.port)

    async def _stop(self, grace: float) -> None:
        await self._health.enter_graceful_shutdown()
        await self._servicer.stop()
        await self._server.stop(grace)

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self._terminated.set()

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self._terminated.wait(timeout)

    def worker_exited(self, worker_id: str, how: str) -> None:
        """The launcher saw ``worker_id``'s process exit: it is gone now (in process)."""
        if self._terminated.is_set() or not hasattr(self, "_servicer"):
            return  # stopped (or never served): nobody to drop
        self._call(self._worker_exited(worker_id, how), timeout=10)

    async def _worker_exited(self, worker_id: str, how: str) -> None:
        await self._servicer.process_exited(worker_id, how)

    def job_stopping(self, why: str) -> None:
        """The launcher stops the job (``why``): no generation forms any more (in
        process)."""
        if self._terminated.is_set() or not hasattr(self, "_servicer"):
            return
        self._call(self._servicer.stop_job(why), timeout=10)

    def status(self) -> StatusReport:
        """The job's status, read in process (no RPC, no token)."""
        return self._call(self._read_status())

    async def _read_status(self) -> StatusReport:
        return self._servicer.m.status(VERSION)

    def last_reports(self) -> dict[str, WorkerReport]:
        """Each worker's last report, including those that left (read in process)."""
        return self._call(self._read_last_reports())

    async def _read_last_reports(self) -> dict[str, WorkerReport]:
        return self._servicer.m.last_reports()

    def _status_or_none(self) -> StatusReport | None:
        if self._terminated.is_set() or not hasattr(self, "_servicer"):
            return None
        return self._call(self._read_status(), timeout=10)

    def __enter__(self) -> CoordinatorServer:
        if not self._started:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _local_address(host: str, port: int) -> str:
    if host in ("0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def create_server(config: CoordinatorConfig) -> tuple[CoordinatorServer, int]:
    """A coordinator bound to its port but not yet serving, and that port."""
    server = CoordinatorServer(config)
    return server, server.port


def serve(config: CoordinatorConfig, *, on_ready: Callable[[int], None] | None = None) -> None:
    """Serve until SIGTERM or SIGINT, then stop gracefully. Call from the main thread."""
    server, port = create_server(config)
    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        server.start()
        if on_ready is not None:
            on_ready(port)
        stop.wait()
        logger.info("stopping, grace %.1fs", config.server.grace_s)
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
