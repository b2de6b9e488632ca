"""Prometheus metrics of the coordinator (torch-free).

Two sources:

* events the server reports as they happen (:class:`CoordinatorMetrics`'
  ``on_*`` methods and :class:`RpcMetricsInterceptor`), kept in counters and
  histograms;
* the membership's state, read at scrape time through a callable that returns
  the current ``StatusReport`` (the server hops onto its event loop for it).

Metric names and labels:

==================================================  =====================================
zeroplane_coordinator_info{version, job_name}       1
zeroplane_coordinator_workers{state}                member / standby / lost / left
zeroplane_coordinator_generation                    current generation id (0: none)
zeroplane_coordinator_world_size                    ranks in the current generation
zeroplane_coordinator_stage                         the current generation's ZeRO stage
zeroplane_coordinator_trainable_parameters          the job's Ψ
zeroplane_coordinator_generations_total             generations formed
zeroplane_coordinator_generation_formation_seconds  first membership change to formation
zeroplane_coordinator_lease_expiries_total          workers dropped for a missed lease
zeroplane_coordinator_scale_events_total{direction} generations that grew (up) or shrank (down)
zeroplane_coordinator_registrations_total{kind}     new / reattached
zeroplane_coordinator_rpcs_total{method, code}      finished RPCs by gRPC status code
zeroplane_coordinator_rpc_duration_seconds{method}  unary RPC latency
==================================================  =====================================

``method`` is ``Service/Method`` with the package dropped (``Coordinator/Register``,
``Health/Check``). Streams (``Coordinator/WatchGenerations``) are counted when
they end and have no latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from coordinator.control.stalls import KINDS as STALL_KINDS
from coordinator.core.messages import Generation, StatusReport

__all__ = [
    "METRIC_NAMES",
    "WORKER_STATES",
    "CoordinatorMetrics",
    "RpcMetricsInterceptor",
]

logger = logging.getLogger(__name__)

WORKER_STATES = ("member", "standby", "lost", "left")

METRIC_NAMES = (
    "zeroplane_coordinator_info",
    "zeroplane_coordinator_workers",
    "zeroplane_coordinator_stalled",
    "zeroplane_coordinator_generation",
    "zeroplane_coordinator_world_size",
    "zeroplane_coordinator_stage",
    "zeroplane_coordinator_trainable_parameters",
    "zeroplane_coordinator_generations_total",
    "zeroplane_coordinator_generation_formation_seconds",
    "zeroplane_coordinator_lease_expiries_total",
    "zeroplane_coordinator_scale_events_total",
    "zeroplane_coordinator_registrations_total",
    "zeroplane_coordinator_stalls_total",
    "zeroplane_coordinator_rpcs_total",
    "zeroplane_coordinator_rpc_duration_seconds",
)

_RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
_FORMATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class _StateCollector(Collector):
    def __init__(self, status: Callable[[], StatusReport | None], job_name: str) -> None:
        self._status = status
        self._job_name = job_name

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            report = self._status()
        except Exception:
            # A stopping server: the counters still export, the state does not.
            logger.debug("coordinator state unavailable for a scrape", exc_info=True)
            report = None
        info = InfoMetricFamily("zeroplane_coordinator", "The coordinator's version and job.")
        info.add_metric(
            (),
            {
                "version": "" if report is None else report.server_version,
                "job_name": self._job_name,
            },
        )
        yield info
        if report is None:
            return
        workers = GaugeMetricFamily(
            "zeroplane_coordinator_workers", "Workers by state.", labels=("state",)
        )
        for state in WORKER_STATES:
            workers.add_metric((state,), sum(1 for w in report.workers if w.state == state))
        yield workers
        stalled = GaugeMetricFamily(
            "zeroplane_coordinator_stalled",
            "1 while the job stalls, by the stall's kind (coordinator/control/stalls.py).",
            labels=("kind",),
        )
        for kind in STALL_KINDS:
            stalled.add_metric((kind,), float(report.stall_kind == kind))
        yield stalled
        for name, doc, value in (
            ("generation", "Current generation id (0: none yet).", report.generation_id),
            ("world_size", "Ranks in the current generation.", report.world_size),
            ("stage", "ZeRO stage of the current generation.", report.stage),
            (
                "trainable_parameters",
                "Trainable elements of the job's model.",
                report.trainable_numel,
            ),
        ):
            yield GaugeMetricFamily(f"zeroplane_coordinator_{name}", doc, value=value)


class _WithoutCreated(Collector):
    """``registry``'s metrics less the ``_created`` timestamps prometheus_client adds to
    counters and histograms: Prometheus' text format stores each as one more series."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class CoordinatorMetrics:
    """The coordinator's registry, and the hooks the server calls as things happen."""

    def __init__(
        self,
        *,
        status: Callable[[], StatusReport | None] = lambda: None,
        job_name: str = "zeroplane",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._clock = clock
        self._pending_since: float | None = None
        self._world_size = 0
        r = CollectorRegistry(auto_describe=False)  # the event counters, exported below
        self.generations = Counter(
            "zeroplane_coordinator_generations", "Generations formed.", registry=r
        )
        self.formation_seconds = Histogram(
            "zeroplane_coordinator_generation_formation_seconds",
            "Seconds from the first membership change after a generation to the next one.",
            buckets=_FORMATION_BUCKETS,
            registry=r,
        )
        self.lease_expiries = Counter(
            "zeroplane_coordinator_lease_expiries",
            "Workers dropped because their lease ran out.",
            registry=r,
        )
        self.scale_events = Counter(
            "zeroplane_coordinator_scale_events",
            "Generations whose world size grew (up) or shrank (down).",
            ("direction",),
            registry=r,
        )
        self.registrations = Counter(
            "zeroplane_coordinator_registrations",
            "Accepted registrations: new workers, or re-attaches of known ones.",
            ("kind",),
            registry=r,
        )
        self.rpcs = Counter(
            "zeroplane_coordinator_rpcs",
            "Finished RPCs by method and gRPC status code.",
            ("method", "code"),
            registry=r,
        )
        self.rpc_seconds = Histogram(
            "zeroplane_coordinator_rpc_duration_seconds",
            "Latency of unary RPCs, by method.",
            ("method",),
            buckets=_RPC_BUCKETS,
            registry=r,
        )
        self.stalls = Counter(
            "zeroplane_coordinator_stalls",
            "Stalls named, by kind (coordinator/control/stalls.py).",
            ("kind",),
            registry=r,
        )
        for kind in STALL_KINDS:
            self.stalls.labels(kind)
        for direction in ("up", "down"):
            self.scale_events.labels(direction)
        for kind in ("new", "reattached"):
            self.registrations.labels(kind)
        self.registry.register(_WithoutCreated(r))
        self.registry.register(_StateCollector(status, job_name))

    # ---- hooks (called on the server's event loop) ------------------------------------

    def _membership_changed(self) -> None:
        if self._pending_since is None:
            self._pending_since = self._clock()

    def on_register(self, reattached: bool) -> None:
        self.registrations.labels("reattached" if reattached else "new").inc()
        if not reattached:
            self._membership_changed()

    def on_leave(self) -> None:
        self._membership_changed()

    def on_expired(self, count: int) -> None:
        if count:
            self.lease_expiries.inc(count)
            self._membership_changed()

    def on_generation(self, generation: Generation) -> None:
        self.generations.inc()
        if self._pending_since is not None:
            self.formation_seconds.observe(max(0.0, self._clock() - self._pending_since))
            self._pending_since = None
        if generation.world_size != self._world_size:
            self.scale_events.labels(
                "up" if generation.world_size > self._world_size else "down"
            ).inc()
        self._world_size = generation.world_size

    def on_restore(self, generation: Generation | None) -> None:
        """A restart from the state file: the restored generation is not a scale event."""
        self._world_size = 0 if generation is None else generation.world_size

    def on_rpc(self, method: str, code: str, seconds: float | None) -> None:
        self.rpcs.labels(method, code).inc()
        if seconds is not None:
            self.rpc_seconds.labels(method).observe(seconds)

    def text(self) -> bytes:
        return generate_latest(self.registry)


def _method_label(full: str) -> str:
    # "/zeroplane.coordinator.v1.Coordinator/Register" -> "Coordinator/Register"
    service, _, method = full.lstrip("/").rpartition("/")
    return f"{service.rsplit('.', 1)[-1]}/{method}"


def _code_of(context: grpc.aio.ServicerContext, exc: BaseException | None) -> str:
    code = None
    with contextlib.suppress(Exception):  # not every context implements code()
        code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):  # some grpc versions keep the raw integer
        return next((c.name for c in grpc.StatusCode if c.value[0] == code), "UNKNOWN")
    if exc is None:
        return "OK"
    if isinstance(exc, GeneratorExit | asyncio.CancelledError):
        return "CANCELLED"
    return "UNKNOWN"


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts every RPC by method and status code, and times unary ones."""

    def __init__(self, metrics: CoordinatorMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        method = _method_label(details.method)
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._unary(method, handler.unary_unary))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._stream(method, handler.unary_stream))
        # Client-streaming handlers stand in for calls refused before their request is read
        # (coordinator/control/rpc.py [Note: authentication first]): counted, not timed.
        if handler.stream_unary is not None:
            behaviour = self._unary(method, handler.stream_unary, timed=False)
            return handler._replace(stream_unary=behaviour)
        if handler.stream_stream is not None:
            return handler._replace(stream_stream=self._stream(method, handler.stream_stream))
        return handler

    def _unary(
        self, method: str, behaviour: Callable[..., Any], *, timed: bool = True
    ) -> Callable[..., Any]:
        """``timed``: book the latency (not for a stream's lifetime)."""

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start = time.perf_counter()
            exc: BaseException | None = None
            try:
                return await behaviour(request, context)
            except BaseException as e:
                exc = e
                raise
            finally:
                seconds = time.perf_counter() - start if timed else None
                self.metrics.on_rpc(method, _code_of(context, exc), seconds)

        return call

    def _stream(self, method: str, behaviour: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behaviour):

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                exc: BaseException | None = None
                try:
                    async for item in behaviour(request, context):
                        yield item
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    self.metrics.on_rpc(method, _code_of(context, exc), None)

            return stream

        # a stream handler that writes with context.write() (the health Watch)
        return self._unary(method, behaviour, timed=False)
