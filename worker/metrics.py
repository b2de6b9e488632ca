"""Prometheus metrics of one worker, from snapshots its engine publishes.

    server, port = serve_metrics(engine, port=0)   # 0: a free port
    ...                                            # GET http://host:port/metrics
    server.close()

The training loop does no metric work beyond the few counter updates of
``engine.stats`` (worker/stats.py) and ``engine.comm`` (worker/collectives.py)
and, at each step boundary, one immutable :class:`Snapshot` of what the
metrics show, put on a :class:`SnapshotBoard`. A scrape turns the latest
snapshot into metric families; it never reads a live engine, so it cannot
see one half rebuilt by a membership change. Every series carries ``rank``
and ``stage`` labels; Prometheus adds ``job`` and ``instance`` (the
coordinator's service discovery sets ``job`` to the zeroplane job's name).

[Note: stage-0 baseline]
``zeroplane_model_state_baseline_bytes{kind}`` is what this rank would hold
for the same model, precision, optimizer and world size at stage 0, from the
ZeRO formulas (coordinator/core/memory.py) plus the frozen parameters and buffers
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
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any
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

from coordinator.core.memory import model_state_bytes
from coordinator.core.settings import METRICS_HOST_ENV, METRICS_PORT_ENV
from worker.config import ZeroConfig

__all__ = [
    "COLLECTIVE_OPS",
    "METRIC_NAMES",
    "EngineCollector",
    "ExpertLayerLoad",
    "MetricsServer",
    "Snapshot",
    "SnapshotBoard",
    "baseline_bytes",
    "metrics_text",
    "serve_metrics",
    "start_metrics",
]

logger = logging.getLogger(__name__)


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
    "zeroplane_model_state_host_bytes",
    "zeroplane_activation_saved_bytes",
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
    "zeroplane_expert_tokens_total",
    "zeroplane_expert_dropped_tokens_total",
    "zeroplane_expert_all_to_all_bytes_total",
)

MEMBERSHIP_CHANGES = ("scale_up", "scale_down", "crash")

try:
    VERSION = metadata.version("zeroplane")
except metadata.PackageNotFoundError:
    VERSION = "0+unknown"

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class ExpertLayerLoad:
    """One mixture-of-experts layer's exchanges on this rank under expert parallelism
    (worker/moe/dispatch.py ``ExpertLoad``): rows its experts ``first``,
    ``first + 1``, ... received (``tokens``), assignments dropped over capacity,
    all-to-all bytes; counters since the engine started."""

    layer: str
    first: int
    tokens: tuple[int, ...]
    dropped: int
    a2a_bytes: int


@dataclass(frozen=True)
class Snapshot:
    """What one rank's metrics show, as of its last step boundary."""

    rank: int
    stage: int
    world_size: int
    generation: int
    backend: str
    device: torch.device
    dtype: str
    compression: str
    trainable_numel: int
    # elements of fp32 master weights this rank optimizes, and frozen-parameter bytes
    master_numel: int
    frozen_bytes: int
    memory: dict[str, int]
    # op -> (calls, bytes, wire bytes, seconds)
    collectives: dict[str, tuple[int, int, int, float]]
    step_histogram: tuple[list[tuple[str, int]], float]
    global_steps: int
    skipped_steps: int
    changes: dict[str, int] = field(default_factory=dict)
    pause_seconds: dict[str, float] = field(default_factory=dict)
    samples: int = 0
    tokens: int = 0
    # the last micro-batch loss, detached: read at scrape time, so a CUDA loss
    # costs the training loop no synchronization
    loss: torch.Tensor | None = None
    # the part of ``memory`` that offload keeps in host memory, by kind
    memory_host: dict[str, int] = field(default_factory=dict)
    # the rank's device-mesh coordinates as labels (pp, dp, tp; worker/mesh.py),
    # empty outside a mesh: there ``rank`` alone tells the ranks apart
    mesh: dict[str, str] = field(default_factory=dict)
    # each mixture-of-experts layer's load under expert parallelism (none without)
    experts: tuple[ExpertLayerLoad, ...] = ()


class SnapshotBoard:
    """The latest :class:`Snapshot`, handed from the training thread to scrapes."""

    def __init__(self) -> None:
        self._latest: Snapshot | None = None
        self._lock = threading.Lock()
        # whether an endpoint serves this board (else the engine publishes nothing)
        self.watched = False

    def publish(self, snapshot: Snapshot) -> None:
        with self._lock:
            self._latest = snapshot

    def latest(self) -> Snapshot | None:
        with self._lock:
            return self._latest


def baseline_bytes(snap: Snapshot) -> dict[str, int]:
    """Stage-0 bytes by kind for this rank's model (see [Note: stage-0 baseline])."""
    held = snap.master_numel
    k = round(snap.memory["optimizer"] / (4 * held)) if held else 0
    formula = model_state_bytes(
        snap.trainable_numel,
        stage=0,
        world_size=snap.world_size,
        dtype=snap.dtype,
        optimizer_states=k,
    )
    return {
        "params": int(formula.params) + snap.frozen_bytes,
        "grads": int(formula.grads),
        "master": int(formula.master),
        "optimizer": int(formula.optimizer),
        "buffers": snap.memory["buffers"],
    }


def _expert_families(e: Snapshot, labels: tuple, values: tuple) -> Iterator[Metric]:
    """The load of each mixture-of-experts layer under expert parallelism (no series
    without it, the families still there): rows received per expert of this rank,
    assignments dropped over capacity, all-to-all bytes."""
    tokens = CounterMetricFamily(
        "zeroplane_expert_tokens",
        "Token rows this rank's experts received under expert parallelism, by layer and "
        "expert (the load balance: rate() by expert).",
        labels=(*labels, "layer", "expert"),
    )
    dropped = CounterMetricFamily(
        "zeroplane_expert_dropped_tokens",
        "Routed token assignments dropped over an expert's capacity (capacity_factor), by layer.",
        labels=(*labels, "layer"),
    )
    moved = CounterMetricFamily(
        "zeroplane_expert_all_to_all_bytes",
        "Bytes this rank's token all-to-alls sent and received (dispatch and combine, "
        "forward and backward), by layer.",
        labels=(*labels, "layer"),
    )
    for layer in e.experts:
        for j, count in enumerate(layer.tokens):
            tokens.add_metric((*values, layer.layer, str(layer.first + j)), count)
        dropped.add_metric((*values, layer.layer), layer.dropped)
        moved.add_metric((*values, layer.layer), layer.a2a_bytes)
    yield from (tokens, dropped, moved)


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
    """A prometheus_client collector over the snapshots ``read()`` returns."""

    def __init__(self, read: Callable[[], Snapshot | None]) -> None:
        self.read = read

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        snap = self.read()
        if snap is None:
            return  # not yet a member of a process group (joining a job)
        yield from (m for m in self._collect(snap) if m is not None)

    def _collect(self, e: Snapshot) -> Iterator[Metric | None]:
        device = e.device
        labels = ("rank", "stage", *sorted(e.mesh))
        values = (str(e.rank), str(e.stage), *(e.mesh[k] for k in sorted(e.mesh)))

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
                "backend": e.backend,
                "device_kind": device.type,
                "torch_version": torch.__version__,
                "dtype": e.dtype,
                "compression": e.compression,
            },
        )
        yield info
        yield gauge("zeroplane_stage", "ZeRO stage of this rank (0-3).", e.stage)
        yield gauge("zeroplane_world_size", "Ranks in the process group.", e.world_size)
        yield gauge("zeroplane_rank", "This worker's rank.", e.rank)
        yield gauge("zeroplane_generation", "Coordinator generation (0: none).", e.generation)
        yield gauge(
            "zeroplane_trainable_parameters",
            "Trainable parameter elements of the model (Psi).",
            e.trainable_numel,
        )

        yield from self._memory(e, device, labels, values, gauge)
        yield from self._collectives(e.collectives, labels, values, gauge)

        buckets, total = e.step_histogram
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
                e.changes,
            ),
            (
                "zeroplane_membership_pause_seconds_total",
                "Seconds training paused on this rank for membership changes, by kind "
                "(crash: from the failed collective to training again, rollback included).",
                e.pause_seconds,
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
            e.samples,
        )
        yield counter(
            "zeroplane_tokens_total",
            "Tokens this rank trained on (engine.step(tokens=...)).",
            e.tokens,
        )
        loss = None if e.loss is None else float(e.loss.float().mean())
        yield gauge("zeroplane_loss", "The last micro-batch loss.", loss)
        yield from _expert_families(e, labels, values)

    def _memory(
        self, e: Snapshot, device: torch.device, labels, values, gauge
    ) -> Iterator[Metric | None]:
        state = GaugeMetricFamily(
            "zeroplane_model_state_bytes",
            "Model-state bytes this rank holds, by kind (bucket padding included).",
            labels=(*labels, "kind"),
        )
        for kind, value in e.memory.items():
            if kind not in ("total", "activations"):
                state.add_metric((*values, kind), value)
        yield state
        host = GaugeMetricFamily(
            "zeroplane_model_state_host_bytes",
            "The part of zeroplane_model_state_bytes kept in host memory by offload "
            "(offload_optimizer / offload_params), by kind; the rest is on the device.",
            labels=(*labels, "kind"),
        )
        for kind in e.memory:
            if kind not in ("total", "activations"):
                host.add_metric((*values, kind), e.memory_host.get(kind, 0))
        yield host
        yield gauge(
            "zeroplane_activation_saved_bytes",
            "Bytes autograd kept for backward in the last measured forward (activations; "
            "activation checkpointing lowers it).",
            e.memory.get("activations", 0),
        )
        base = GaugeMetricFamily(
            "zeroplane_model_state_baseline_bytes",
            "Bytes this rank would hold for the same model at stage 0, by kind.",
            labels=(*labels, "kind"),
        )
        for kind, value in baseline_bytes(e).items():
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

    def _collectives(
        self, stats: dict[str, tuple[int, int, int, float]], labels, values, gauge
    ) -> Iterator[Metric | None]:
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
    board: SnapshotBoard
    _server: WSGIServer

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def metrics_text(source: Any) -> str:
    """The metrics of ``source`` (an engine: a fresh snapshot; or a board) in the
    Prometheus text format, as a scrape returns them."""
    read = source.snapshot if hasattr(source, "snapshot") else source.latest
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(read))
    return generate_latest(registry).decode()


def start_metrics(config: ZeroConfig, board: SnapshotBoard) -> MetricsServer | None:
    """Serve ``board``'s snapshots if ``config.metrics_port`` or
    ``$ZEROPLANE_METRICS_PORT`` asks for it (bound to ``$ZEROPLANE_METRICS_HOST``,
    default all interfaces); None otherwise."""
    port = config.metrics_port
    if port is None:
        value = os.environ.get(METRICS_PORT_ENV, "").strip()
        if not value:
            return None
        port = env_metrics_port(value, int(os.environ.get("LOCAL_RANK") or 0))
    server, _ = serve_metrics(board, port, host=os.environ.get(METRICS_HOST_ENV) or "0.0.0.0")
    return server


def env_metrics_port(value: str, local_rank: int) -> int:
    """The port ``$ZEROPLANE_METRICS_PORT`` gives this process: a port (0: a free
    one), or ``FIRST-LAST``, from which local rank i takes FIRST + i (a pod of
    several processes whose ports its manifests name); a local rank beyond the
    range (a process the launcher added) takes a free port, which /sd still lists."""
    first, dash, last = value.partition("-")
    try:
        low, high = int(first), int(last if dash else first)
    except ValueError:
        raise ValueError(
            f"${METRICS_PORT_ENV} must be a port number or a range FIRST-LAST, got {value!r}"
        ) from None
    if not 0 <= low <= high <= 65535 or (dash and low == 0):
        raise ValueError(f"${METRICS_PORT_ENV}={value!r} is not a port or a range of ports")
    if not dash:
        return low
    if low + local_rank > high:
        logger.warning(
            "$%s=%s has no port for local rank %d: serving /metrics on a free port",
            METRICS_PORT_ENV,
            value,
            local_rank,
        )
        return 0
    return low + local_rank


def serve_metrics(
    source: Any, port: int = 0, *, host: str = "0.0.0.0"
) -> tuple[MetricsServer, int]:
    """Serve the snapshots of ``source`` (an engine, or a :class:`SnapshotBoard`) at
    ``http://host:port/metrics`` on a daemon thread. ``port`` 0 picks a free
    port; the bound one is returned.
    """
    board = source if isinstance(source, SnapshotBoard) else source.board
    board.watched = True
    if board.latest() is None and hasattr(source, "publish_snapshot"):
        source.publish_snapshot()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(board.latest))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    bound = int(server.server_port)
    logger.info("metrics on http://%s:%d/metrics", host, bound)
    return MetricsServer(port=bound, registry=registry, board=board, _server=server), bound
