"""The Coordinator service's gRPC plumbing: its handlers, registered by hand, the token
checked before a request is read, oversized or undecodable requests refused, and the
membership's errors mapped to status codes.

Handlers are registered by hand instead of through the generated
``add_CoordinatorServicer_to_server`` so that a request that does not parse
gets INVALID_ARGUMENT (grpc's own deserialization failure is INTERNAL), and so
that authentication, validation and error mapping live in one place (``guard``).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from coordinator._proto.zeroplane.coordinator.v1 import coordinator_pb2 as pb
from coordinator.control.membership import (
    Fenced,
    InvalidRequest,
    InventoryMismatch,
    StaleGeneration,
    UnknownWorker,
)
from coordinator.core.messages import GENERATION_METADATA_KEY, printable

__all__ = [
    "SERVICE_NAME",
    "Abort",
    "Malformed",
    "NoMetadataValues",
    "TokenCheck",
    "service_handler",
    "to_abort",
]

logger = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"]
SERVICE_NAME = SERVICE.full_name


class NoMetadataValues(logging.Filter):
    """Drops grpc's own report of metadata that is not valid UTF-8: it logs the raw
    value, which is a bearer token when the header is ``authorization``. Such a
    call is still answered (its token is wrong), only never logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Invalid encoding on")


GRPC_LOGGER = "grpc._cython.cygrpc"


class Abort(Exception):
    def __init__(self, code: grpc.StatusCode, detail: str, trailing: tuple = ()) -> None:
        super().__init__(detail)
        self.code, self.trailing = code, trailing
        # an error echoes at most a bounded, escaped prefix of what it was sent
        self.detail = printable(detail)


class Malformed:
    """Stands in for a request that could not be decoded, so the handler can say why."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _deserializer(cls: type, limit: int) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        if len(data) > limit:
            return Malformed(f"request is {len(data)} bytes, over the limit of {limit}")
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            return Malformed(f"request is not a valid {cls.DESCRIPTOR.name}: {exc}")

    return parse


def _serializer(cls: type) -> Callable[[Any], bytes]:
    def serialize(msg: Any) -> bytes:
        return msg if isinstance(msg, bytes) else cls.SerializeToString(msg)

    return serialize


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


def service_handler(
    behaviours: dict[str, Callable[..., Any]], limit: int, authorize: Callable[[Any], str | None]
) -> grpc.GenericRpcHandler:
    """The Coordinator's handlers: ``behaviours`` by method name, each behind its guard
    (errors mapped to status codes), requests over ``limit`` bytes refused, and every
    call behind ``authorize`` (a ``TokenCheck``)."""
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
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(guard_bidi(fn), **kwargs)
        elif method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(guard_stream(fn), **kwargs)
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(guard(fn), **kwargs)
    return _Service(handlers, authorize)


# [Note: authentication first]
# The token is checked when grpc looks up a call's handler, from its metadata
# alone, before any byte of the request is read: a call without the token gets
# a handler that answers UNAUTHENTICATED and never reads the request, so a
# tokenless gzip bomb is never decompressed (_Refuse).


class TokenCheck:
    """The bearer token check (see [Note: authentication first]): called with a call's
    metadata, says why the call is not let in; None when it is."""

    def __init__(self, token: str | None) -> None:
        self._digest = None if token is None else hashlib.sha256(token.encode()).digest()

    def __call__(self, metadata: Any) -> str | None:
        if self._digest is None:
            return None
        value = dict(metadata or ()).get("authorization")
        if value is None:
            return "missing bearer token (metadata 'authorization: Bearer <token>')"
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        scheme, _, token = value.partition(" ")
        digest = hashlib.sha256(token.strip().encode("utf-8", "replace")).digest()
        # Compare digests, so neither the token's content nor its length leaks through timing.
        if not (scheme.lower() == "bearer" and hmac.compare_digest(digest, self._digest)):
            return "wrong bearer token"
        return None


def to_abort(exc: Exception) -> Abort:
    """The status code and detail a handler's exception answers with."""
    if isinstance(exc, Abort):
        return exc
    if isinstance(exc, InvalidRequest):
        return Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, StaleGeneration):
        trailing = ((GENERATION_METADATA_KEY, str(exc.current)),)
        return Abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc), trailing)
    if isinstance(exc, InventoryMismatch):
        return Abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
    if isinstance(exc, UnknownWorker):
        return Abort(grpc.StatusCode.NOT_FOUND, str(exc))
    if isinstance(exc, Fenced):
        return Abort(grpc.StatusCode.ABORTED, str(exc))
    logger.exception("internal error in the coordinator", exc_info=exc)
    return Abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")


def guard(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            if isinstance(request, Malformed):
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
            return await fn(request, context)
        except Exception as exc:
            abort = to_abort(exc)
        await context.abort(abort.code, abort.detail, abort.trailing)

    return handle


def guard_stream(fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator]:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            if isinstance(request, Malformed):
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
            stream = fn(request, context)
            first = await anext(stream, None)
        except Exception as exc:
            abort = to_abort(exc)
            await context.abort(abort.code, abort.detail, abort.trailing)
            return
        if first is None:
            return
        yield first
        async for item in stream:
            yield item

    return handle


def guard_bidi(fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator]:
    async def handle(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in fn(_checked(requests), context):
                yield item
        except Exception as exc:
            abort = to_abort(exc)
            await context.abort(abort.code, abort.detail, abort.trailing)

    return handle


async def _checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, Malformed):
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        yield request
