"""Prometheus metrics of one worker, read from its engine at scrape time.

    server, port = serve_metrics(engine, port=0)   # 0: a free port
    ...                                            # GET http://host:port/metrics
    server.close()

The training loop does no metric work beyond the few counter updates of
``engine.stats`` (worker/stats.py) and ``engine.comm`` (worker/collectives.py):
:class:`EngineCollector` turns the engine's state into metric families only
when Prometheus asks. Every series carries ``rank`` and ``stage`` labels;
Prometheus adds ``job`` and ``instance`` (the coordinator's service discovery
sets ``job`` to the zeroplane job's name).

[Note: stage-0 baseline]
``zeroplane_model_state_baseline_bytes{kind}`` is what this rank would hold
for the same model, precision, optimizer and world size at stage 0, from the
ZeRO formulas (coordinator/memory.py) plus the frozen parameters and buffers
that no stage shards. So ``zeroplane_model_state_bytes /
zeroplane_model_state_baseline_bytes`` is the fraction each stage keeps, by
kind and rank, in one division. The optimizer's per-element state count is
measured (state bytes over the elements this rank optimizes), so the
baseline's optimizer bytes stay 0 until the first step creates the state,
exactly as the real ones do.

Counters restart from zero when a live reshard builds a new process group
(the collectives' counts belong to it); ``rate()`` treats that as a reset.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any, TypeVar
from wsgiref.simple_server import WSGIServer

import torch
from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from coordinator.config import METRICS_HOST_ENV, METRICS_PORT_ENV
from coordinator.memory import model_state_bytes

if TYPE_CHECKING:
    from worker.engine import ZeroEngine

__all__ = [
    "COLLECTIVE_OPS",
    "METRIC_NAMES",
    "EngineCollector",
    "MetricsServer",
    "baseline_bytes",
    "metrics_text",
    "serve_metrics",
    "start_metrics",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Always exported (zero until used), so a dashboard's series exist from the start.
COLLECTIVE_OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")
STATE_KINDS = ("params", "grads", "master", "optimizer", "buffers")

# Every metric family a worker exports (histograms by their base name).
METRIC_NAMES = (
    "zeroplane_worker_info",
    "zeroplane_stage",
    "zeroplane_world_size",
    "zeroplane_rank",
    "zeroplane_generation",
    "zeroplane_trainable_parameters",
    "zeroplane_model_state_bytes",
    "zeroplane_model_state_baseline_bytes",
    "zeroplane_device_memory_allocated_bytes",
    "zeroplane_device_memory_reserved_bytes",
    "zeroplane_device_memory_peak_bytes",
    "zeroplane_device_memory_total_bytes",
    "zeroplane_host_memory_resident_bytes",
    "zeroplane_host_memory_total_bytes",
    "zeroplane_host_memory_available_bytes",
    "zeroplane_collective_calls_total",
    "zeroplane_collective_bytes_total",
    "zeroplane_collective_wire_bytes_total",
    "zeroplane_collective_seconds_total",
    "zeroplane_compression_raw_bytes_total",
    "zeroplane_compression_wire_bytes_total",
    "zeroplane_compression_ratio",
    "zeroplane_step_duration_seconds",
    "zeroplane_steps_total",
    "zeroplane_skipped_steps_total",
    "zeroplane_samples_total",
    "zeroplane_tokens_total",
    "zeroplane_loss",
    "zeroplane_membership_changes_total",
    "zeroplane_membership_pause_seconds_total",
)

MEMBERSHIP_CHANGES = ("scale_up", "scale_down", "crash")

try:
    VERSION = metadata.version("zeroplane")
except metadata.PackageNotFoundError:
    VERSION = "0+unknown"

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _retry(fn: Callable[[], T], attempts: int = 3) -> T | None:
    """``fn()``; the training thread may resize a dict we iterate, so try again."""
    for _ in range(attempts):
        try:
            return fn()
        except RuntimeError:
            continue
    logger.debug("metrics: %s kept changing during the scrape; skipped", fn)
    return None


def baseline_bytes(engine: ZeroEngine, report: dict[str, int]) -> dict[str, int]:
    """Stage-0 bytes by kind for this engine's model (see [Note: stage-0 baseline])."""
    held = sum(b.master.numel() for b in engine.buckets)
    k = round(report["optimizer"] / (4 * held)) if held else 0
    formula = model_state_bytes(
        engine.layout.numel,
        stage=0,
        world_size=engine.world_size,
        dtype=engine.config.dtype,
        optimizer_states=k,
    )
    frozen = sum(
        p.numel() * p.element_size()
        for p in engine.inventory.params.values()
        if not p.requires_grad
    )
    return {
        "params": int(formula.params) + frozen,
        "grads": int(formula.grads),
        "master": int(formula.master),
        "optimizer": int(formula.optimizer),
        "buffers": report["buffers"],
    }


def _host_memory() -> tuple[int | None, int | None, int | None]:
    """(resident bytes of this process, physical bytes, available bytes); None if unknown."""
    resident = total = available = None
    try:
        with open("/proc/self/statm") as f:
            resident = int(f.read().split()[1]) * _PAGE
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: line.split()[1] for line in f}
        total = int(info["MemTotal"]) * 1024
        available = int(info.get("MemAvailable", 0)) * 1024 or None
    except (OSError, KeyError, ValueError, IndexError):
        pass
    return resident, total, available


class EngineCollector(Collector):
    """A prometheus_client collector over one ZeroEngine (see the module notes)."""

    def __init__(self, engine: ZeroEngine) -> None:
        self.engine = engine

    def describe(self) -> list[Metric]:
        # Nothing up front: registering must not read a half-built engine.
        return []

    def collect(self) -> Iterator[Metric]:
        # Built whole before yielding: a scrape that lands mid-reshard (buffers
        # being rebuilt) gets nothing rather than a half-read engine.
        try:
            metrics = [m for m in self._collect() if m is not None]
        except (AttributeError, RuntimeError, IndexError, KeyError):
            logger.debug("metrics: engine changed during the scrape; skipped", exc_info=True)
            return
        yield from metrics

    def _collect(self) -> Iterator[Metric | None]:
        e = self.engine
        comm = getattr(e, "comm", None)
        if comm is None or getattr(e, "layout", None) is None:
            return  # not yet attached to a process group (joining a job)
        device = getattr(e, "device", torch.device("cpu"))
        labels = ("rank", "stage")
        values = (str(e.rank), str(e.stage))

        def gauge(name: str, doc: str, value: float | None) -> Metric | None:
            if value is None:
                return None
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> Metric:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        info = InfoMetricFamily(
            "zeroplane_worker",
            "The worker's software and device.",
            labels=labels,
        )
        info.add_metric(
            values,
            {
                "version": VERSION,
                "backend": str(getattr(comm, "backend", "none")),
                "device_kind": device.type,
                "torch_version": torch.__version__,
                "dtype": e.config.dtype,
                "compression": e.config.compression,
            },
        )
        yield info
        control = getattr(e, "control", None)
        generation = getattr(getattr(control, "generation", None), "id", 0)
        yield gauge("zeroplane_stage", "ZeRO stage of this rank (0-3).", e.stage)
        yield gauge("zeroplane_world_size", "Ranks in the process group.", e.world_size)
        yield gauge("zeroplane_rank", "This worker's rank.", e.rank)
        yield gauge("zeroplane_generation", "Coordinator generation (0: none).", generation)
        yield gauge(
            "zeroplane_trainable_parameters",
            "Trainable parameter elements of the model (Psi).",
            e.layout.numel,
        )

        yield from self._memory(e, device, labels, values, gauge)
        yield from self._collectives(comm, labels, values, gauge)

        buckets, total = e.stats.histogram()
        hist = HistogramMetricFamily(
            "zeroplane_step_duration_seconds",
            "Optimizer step duration: first forward/backward of the accumulation window "
            "to the end of step().",
            labels=labels,
        )
        hist.add_metric(values, buckets, total)
        yield hist
        yield counter("zeroplane_steps_total", "Optimizer steps taken.", e.global_steps)
        yield counter(
            "zeroplane_skipped_steps_total",
            "Optimizer steps skipped on an fp16 overflow.",
            e.skipped_steps,
        )
        for name, doc, by_kind in (
            (
                "zeroplane_membership_changes_total",
                "Membership changes this rank went through, by kind (scale_up, scale_down, crash).",
                e.stats.changes,
            ),
            (
                "zeroplane_membership_pause_seconds_total",
                "Seconds training paused on this rank for membership changes, by kind "
                "(crash: from the failed collective to training again, rollback included).",
                e.stats.pause_seconds,
            ),
        ):
            family = CounterMetricFamily(name, doc, labels=(*labels, "kind"))
            # every kind from the start, so a dashboard shows zero rather than no data
            for kind in MEMBERSHIP_CHANGES:
                family.add_metric((*values, kind), by_kind.get(kind, 0))
            yield family
        yield counter(
            "zeroplane_samples_total",
            "Samples this rank trained on (engine.step(samples=...)).",
            e.stats.samples,
        )
        yield counter(
            "zeroplane_tokens_total",
            "Tokens this rank trained on (engine.step(tokens=...)).",
            e.stats.tokens,
        )
        yield gauge("zeroplane_loss", "The last micro-batch loss.", e.stats.last_loss())

    def _memory(
        self, e: ZeroEngine, device: torch.device, labels, values, gauge
    ) -> Iterator[Metric | None]:
        report = _retry(e.memory_report)
        if report is not None:
            state = GaugeMetricFamily(
                "zeroplane_model_state_bytes",
                "Model-state bytes this rank holds, by kind (bucket padding included).",
                labels=(*labels, "kind"),
            )
            for kind, value in report.items():
                if kind != "total":
                    state.add_metric((*values, kind), value)
            yield state
            baseline = _retry(lambda: baseline_bytes(e, report))
            if baseline is not None:
                base = GaugeMetricFamily(
                    "zeroplane_model_state_baseline_bytes",
                    "Bytes this rank would hold for the same model at stage 0, by kind.",
                    labels=(*labels, "kind"),
                )
                for kind, value in baseline.items():
                    base.add_metric((*values, kind), value)
                yield base
        if device.type == "cuda":
            cuda = torch.cuda
            for name, doc, value in (
                ("allocated", "CUDA memory allocated by tensors.", cuda.memory_allocated(device)),
                (
                    "reserved",
                    "CUDA memory reserved by the caching allocator.",
                    cuda.memory_reserved(device),
                ),
                (
                    "peak",
                    "Peak CUDA memory allocated since start.",
                    cuda.max_memory_allocated(device),
                ),
                (
                    "total",
                    "The CUDA device's memory.",
                    cuda.get_device_properties(device).total_memory,
                ),
            ):
                yield gauge(f"zeroplane_device_memory_{name}_bytes", doc, value)
        resident, total, available = _host_memory()
        for name, doc, value in (
            ("resident", "Resident memory of this worker process.", resident),
            ("total", "Physical memory of the host.", total),
            ("available", "Memory available on the host (MemAvailable).", available),
        ):
            yield gauge(f"zeroplane_host_memory_{name}_bytes", doc, value)

    def _collectives(self, comm: Any, labels, values, gauge) -> Iterator[Metric | None]:
        stats = (
            _retry(
                lambda: {
                    op: (s.calls, s.bytes, s.wire_bytes, s.seconds)
                    for op, s in list(comm.stats.items())
                }
            )
            or {}
        )
        ops = list(COLLECTIVE_OPS) + sorted(set(stats) - set(COLLECTIVE_OPS))
        families = [
            CounterMetricFamily(name, doc, labels=(*labels, "op"))
            for name, doc in (
                ("zeroplane_collective_calls_total", "Collective calls, by op."),
                (
                    "zeroplane_collective_bytes_total",
                    "Logical bytes of collectives (the full tensor of each call), by op.",
                ),
                (
                    "zeroplane_collective_wire_bytes_total",
                    "Bytes collectives sent (after compression), by op.",
                ),
                (
                    "zeroplane_collective_seconds_total",
                    "Seconds from issue to completion of collectives, by op.",
                ),
            )
        ]
        raw = wire = 0
        for op in ops:
            calls, nbytes, wire_bytes, seconds = stats.get(op, (0, 0, 0, 0.0))
            for family, value in zip(families, (calls, nbytes, wire_bytes, seconds), strict=True):
                family.add_metric((*values, op), value)
            if op != "control":  # bookkeeping reductions are never compressed
                raw += nbytes
                wire += wire_bytes
        yield from families
        for name, doc, value in (
            ("raw", "Collective payload bytes before compression (data-plane ops).", raw),
            ("wire", "Collective payload bytes sent after compression (data-plane ops).", wire),
        ):
            family = CounterMetricFamily(f"zeroplane_compression_{name}_bytes", doc, labels=labels)
            family.add_metric(values, value)
            yield family
        yield gauge(
            "zeroplane_compression_ratio",
            "Raw over wire bytes since start (1.0 when compression is off).",
            raw / wire if wire else 1.0,
        )


@dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint; ``close()`` stops it."""

    port: int
    registry: CollectorRegistry
    _server: WSGIServer

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def metrics_text(engine: ZeroEngine) -> str:
    """The engine's metrics in the Prometheus text format (what a scrape returns)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))
    return generate_latest(registry).decode()


def start_metrics(engine: ZeroEngine) -> MetricsServer | None:
    """Serve ``engine``'s metrics if ``engine.config.metrics_port`` or
    ``$ZEROPLANE_METRICS_PORT`` asks for it (bound to ``$ZEROPLANE_METRICS_HOST``,
    default all interfaces); None otherwise."""
    port = engine.config.metrics_port
    if port is None:
        value = os.environ.get(METRICS_PORT_ENV, "").strip()
        if not value:
            return None
        try:
            port = int(value)
        except ValueError:
            raise ValueError(f"${METRICS_PORT_ENV} must be a port number, got {value!r}") from None
    server, _ = serve_metrics(engine, port, host=os.environ.get(METRICS_HOST_ENV) or "0.0.0.0")
    return server


def serve_metrics(
    engine: ZeroEngine, port: int = 0, *, host: str = "0.0.0.0"
) -> tuple[MetricsServer, int]:
    """Serve ``engine``'s metrics at ``http://host:port/metrics`` on a daemon thread.

    ``port`` 0 picks a free port; the bound one is returned.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    bound = int(server.server_port)
    logger.info("metrics on http://%s:%d/metrics", host, bound)
    return MetricsServer(port=bound, registry=registry, _server=server), bound
