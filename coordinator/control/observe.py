"""Per-rank figures read from the workers' ``/metrics`` endpoints (torch-free).

What the built-in status page and ``zeroplane status`` show, computed the way
the Grafana dashboard and the recording rules in deploy/prometheus compute
them, from the same metrics:

* model-state bytes by kind against the stage-0 baseline (gauges, as exported);
* collective bandwidth by op: Δ``zeroplane_collective_bytes_total`` over
  Δ``zeroplane_collective_seconds_total`` between two samples, which equals
  ``rate(bytes[w]) / rate(seconds[w])`` over the same window (the
  extrapolation of ``rate`` cancels in the ratio);
* step time: Δsum over Δcount of ``zeroplane_step_duration_seconds``;
* compression ratio, throughput, loss, device and host memory;
* under expert parallelism, the load balance: of each layer's experts on the
  rank, the most token rows one received over the mean (Δ
  ``zeroplane_expert_tokens_total``; 1.0: even), the worst layer's, and the
  share of assignments dropped over capacity (:func:`expert_balance` does the
  same over every rank's experts).

With a single sample (no window yet) the rates fall back to averages since
the worker started.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "RankFigures",
    "RankSample",
    "Sampler",
    "expert_balance",
    "figures",
    "parse_sample",
    "scrape",
]

logger = logging.getLogger(__name__)

_MEMORY = {
    "zeroplane_device_memory_allocated_bytes": "device_allocated",
    "zeroplane_device_memory_reserved_bytes": "device_reserved",
    "zeroplane_device_memory_peak_bytes": "device_peak",
    "zeroplane_device_memory_total_bytes": "device_total",
    "zeroplane_host_memory_resident_bytes": "host_resident",
}


@dataclass(frozen=True, kw_only=True)
class RankSample:
    """One scrape of one worker."""

    at: float  # time.monotonic() of the scrape
    rank: int | None = None
    stage: int | None = None
    world_size: int | None = None
    model_state: dict[str, float] = field(default_factory=dict)
    baseline: dict[str, float] = field(default_factory=dict)
    # the part of model_state offload keeps in host memory, by kind
    model_state_host: dict[str, float] = field(default_factory=dict)
    collective_bytes: dict[str, float] = field(default_factory=dict)
    collective_seconds: dict[str, float] = field(default_factory=dict)
    compression_raw: float = 0.0
    compression_wire: float = 0.0
    step_count: float = 0.0
    step_sum: float = 0.0
    steps: float = 0.0
    samples: float = 0.0
    tokens: float = 0.0
    loss: float | None = None
    memory: dict[str, float] = field(default_factory=dict)
    # under expert parallelism: rows each of this rank's experts received, by layer and
    # expert, and the assignments each layer dropped over capacity
    expert_tokens: dict[str, dict[str, float]] = field(default_factory=dict)
    expert_dropped: dict[str, float] = field(default_factory=dict)


def parse_sample(text: str, at: float) -> RankSample:
    """A :class:`RankSample` from a worker's metrics in the Prometheus text format."""
    gauges: dict[str, float] = {}
    by: dict[str, dict[str, float]] = {
        "model_state": {},
        "baseline": {},
        "model_state_host": {},
        "collective_bytes": {},
        "collective_seconds": {},
    }
    memory: dict[str, float] = {}
    expert_tokens: dict[str, dict[str, float]] = {}
    expert_dropped: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name, labels, value = s.name, s.labels, float(s.value)
            if name == "zeroplane_expert_tokens_total":
                expert_tokens.setdefault(labels["layer"], {})[labels["expert"]] = value
            elif name == "zeroplane_expert_dropped_tokens_total":
                expert_dropped[labels["layer"]] = value
            elif name == "zeroplane_model_state_bytes":
                by["model_state"][labels["kind"]] = value
            elif name == "zeroplane_model_state_baseline_bytes":
                by["baseline"][labels["kind"]] = value
            elif name == "zeroplane_model_state_host_bytes":
                by["model_state_host"][labels["kind"]] = value
            elif name == "zeroplane_collective_bytes_total":
                by["collective_bytes"][labels["op"]] = value
            elif name == "zeroplane_collective_seconds_total":
                by["collective_seconds"][labels["op"]] = value
            elif name in _MEMORY:
                memory[_MEMORY[name]] = value
            else:
                gauges[name] = value

    def num(name: str) -> float:
        return gauges.get(name, 0.0)

    def whole(name: str) -> int | None:
        return int(gauges[name]) if name in gauges else None

    return RankSample(
        at=at,
        rank=whole("zeroplane_rank"),
        stage=whole("zeroplane_stage"),
        world_size=whole("zeroplane_world_size"),
        compression_raw=num("zeroplane_compression_raw_bytes_total"),
        compression_wire=num("zeroplane_compression_wire_bytes_total"),
        step_count=num("zeroplane_step_duration_seconds_count"),
        step_sum=num("zeroplane_step_duration_seconds_sum"),
        steps=num("zeroplane_steps_total"),
        samples=num("zeroplane_samples_total"),
        tokens=num("zeroplane_tokens_total"),
        loss=gauges.get("zeroplane_loss"),
        memory=memory,
        expert_tokens=expert_tokens,
        expert_dropped=expert_dropped,
        **by,
    )


# The most of a worker's /metrics read (a worker exports a few hundred series).
MAX_METRICS_BYTES = 8 << 20


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None  # a 3xx is an error here: the answer must come from the worker


# Plain HTTP only, no proxy from the environment, no redirect.
_OPENER = urllib.request.OpenerDirector()
for _handler in (
    urllib.request.HTTPHandler(),
    urllib.request.HTTPDefaultErrorHandler(),
    urllib.request.HTTPErrorProcessor(),
    _NoRedirect(),
):
    _OPENER.add_handler(_handler)


def scrape(endpoint: str, timeout: float = 2.0) -> RankSample:
    """Fetch ``http://endpoint/metrics`` once (``endpoint``: ``host:port[/path]`` or an
    ``http://`` URL; redirects are not followed). Raises OSError when unreachable."""
    url = endpoint if "://" in endpoint else f"http://{endpoint}"
    if not url.startswith("http://"):
        raise ValueError(f"metrics endpoint {endpoint!r} is not plain http")
    with _OPENER.open(f"{url.rstrip('/')}/metrics", timeout=timeout) as response:
        data = response.read(MAX_METRICS_BYTES + 1)
    if len(data) > MAX_METRICS_BYTES:
        raise ValueError(f"{endpoint} sent more than {MAX_METRICS_BYTES} bytes of metrics")
    return parse_sample(data.decode("utf-8", errors="replace"), time.monotonic())


@dataclass(frozen=True, kw_only=True)
class RankFigures:
    """What one rank shows on the status page and in ``zeroplane status``."""

    endpoint: str
    rank: int | None = None
    stage: int | None = None
    world_size: int | None = None
    model_state: dict[str, float] = field(default_factory=dict)
    baseline: dict[str, float] = field(default_factory=dict)
    # the part of model_state offload keeps in host memory, by kind
    model_state_host: dict[str, float] = field(default_factory=dict)
    # Bytes per second of collective time, by op; None where the op moved nothing.
    bandwidth: dict[str, float | None] = field(default_factory=dict)
    compression_ratio: float | None = None
    step_seconds: float | None = None
    samples_per_second: float | None = None
    tokens_per_second: float | None = None
    steps: int = 0
    loss: float | None = None
    memory: dict[str, float] = field(default_factory=dict)
    # Seconds between the samples the rates come from; 0: averages since start.
    window_s: float = 0.0
    error: str = ""
    # under expert parallelism, over the window: token rows per expert by layer, the
    # worst layer's most over mean (1.0: even) and the share of assignments dropped
    expert_tokens: dict[str, dict[str, float]] = field(default_factory=dict)
    expert_load: float | None = None
    expert_layer: str = ""
    expert_dropped_share: float | None = None

    @property
    def state_total(self) -> float:
        return sum(v for k, v in self.model_state.items() if k in self.baseline)

    @property
    def host_total(self) -> float:
        """Model-state bytes offload keeps in host memory (part of ``state_total``)."""
        return sum(v for k, v in self.model_state_host.items() if k in self.baseline)

    @property
    def baseline_total(self) -> float:
        return sum(self.baseline.values())

    @property
    def kept(self) -> float | None:
        """Model-state bytes as a fraction of the stage-0 baseline (1 - saving)."""
        return self.state_total / self.baseline_total if self.baseline_total else None

    def as_dict(self) -> dict[str, object]:
        return {
            "endpoint": self.endpoint,
            "rank": self.rank,
            "stage": self.stage,
            "world_size": self.world_size,
            "model_state": self.model_state,
            "baseline": self.baseline,
            "model_state_host": self.model_state_host,
            "host_total": self.host_total,
            "state_total": self.state_total,
            "baseline_total": self.baseline_total,
            "kept": self.kept,
            "bandwidth": self.bandwidth,
            "compression_ratio": self.compression_ratio,
            "step_seconds": self.step_seconds,
            "samples_per_second": self.samples_per_second,
            "tokens_per_second": self.tokens_per_second,
            "steps": self.steps,
            "loss": self.loss,
            "memory": self.memory,
            "window_s": self.window_s,
            "error": self.error,
            "expert_tokens": self.expert_tokens,
            "expert_load": self.expert_load,
            "expert_layer": self.expert_layer,
            "expert_dropped_share": self.expert_dropped_share,
        }


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _worst_layer(tokens: dict[str, dict[str, float]]) -> tuple[float | None, str]:
    """The layer whose busiest expert got the most rows over its mean, and that ratio."""
    worst: tuple[float | None, str] = (None, "")
    for layer, by_expert in tokens.items():
        counts = list(by_expert.values())
        mean = sum(counts) / len(counts) if counts else 0.0
        if mean > 0 and (worst[0] is None or max(counts) / mean > worst[0]):
            worst = (max(counts) / mean, layer)
    return worst


def expert_balance(
    ranks: Iterable[Mapping[str, Mapping[str, float]]],
) -> tuple[float | None, str]:
    """The load balance over every rank's experts (``ranks``: each rank's
    ``expert_tokens``): rows per expert summed over the ranks (the ranks holding one
    expert each count the rows of their ep group), the worst layer's most over mean,
    and that layer."""
    total: dict[str, dict[str, float]] = {}
    for tokens in ranks:
        for layer, by_expert in tokens.items():
            into = total.setdefault(layer, {})
            for expert, n in by_expert.items():
                into[expert] = into.get(expert, 0.0) + n
    return _worst_layer(total)


def figures(endpoint: str, samples: Iterable[RankSample]) -> RankFigures:
    """Figures from the oldest and newest of ``samples`` (a single one: since start)."""
    history = sorted(samples, key=lambda s: s.at)
    if not history:
        return RankFigures(endpoint=endpoint, error="no sample")
    last = history[-1]
    # Only samples from the same incarnation of the counters (no reset in between).
    first = next(
        (s for s in history if s.steps <= last.steps and s.step_count <= last.step_count), last
    )
    if first is last:
        first = RankSample(at=last.at)  # all counters start at zero
        window = 0.0
    else:
        window = last.at - first.at
    ops = sorted(set(last.collective_bytes) - {"control"})
    bandwidth = {
        op: _ratio(
            last.collective_bytes.get(op, 0) - first.collective_bytes.get(op, 0),
            last.collective_seconds.get(op, 0) - first.collective_seconds.get(op, 0),
        )
        for op in ops
    }
    raw = last.compression_raw - first.compression_raw
    wire = last.compression_wire - first.compression_wire
    steps = last.step_count - first.step_count
    tokens = {
        layer: {e: n - first.expert_tokens.get(layer, {}).get(e, 0.0) for e, n in by.items()}
        for layer, by in last.expert_tokens.items()
    }
    load, layer = _worst_layer(tokens)
    dropped = sum(last.expert_dropped.values()) - sum(first.expert_dropped.values())
    routed = sum(sum(by.values()) for by in tokens.values())
    return RankFigures(
        endpoint=endpoint,
        rank=last.rank,
        stage=last.stage,
        world_size=last.world_size,
        model_state=dict(last.model_state),
        baseline=dict(last.baseline),
        model_state_host=dict(last.model_state_host),
        bandwidth=bandwidth,
        compression_ratio=_ratio(raw, wire) if wire > 0 else 1.0,
        step_seconds=_ratio(last.step_sum - first.step_sum, steps),
        samples_per_second=_ratio(last.samples - first.samples, window) if window else None,
        tokens_per_second=_ratio(last.tokens - first.tokens, window) if window else None,
        steps=int(last.steps),
        loss=last.loss,
        memory=dict(last.memory),
        window_s=window,
        expert_tokens=tokens,
        expert_load=load,
        expert_layer=layer,
        expert_dropped_share=_ratio(dropped, routed + dropped) if tokens else None,
    )


class Sampler:
    """Scrapes worker endpoints on demand and keeps each one's recent samples.

    ``sample(endpoints)`` scrapes (in parallel, at most once per
    ``min_interval_s`` per endpoint) and returns figures over the samples of
    the last ``window_s``. Thread-safe; endpoints not asked for in a window are
    forgotten.
    """

    def __init__(
        self,
        *,
        window_s: float = 30.0,
        min_interval_s: float = 1.0,
        timeout_s: float = 2.0,
        max_endpoints: int = 256,
    ) -> None:
        self.window_s = window_s
        self.min_interval_s = min_interval_s
        self.timeout_s = timeout_s
        self.max_endpoints = max_endpoints
        self._history: dict[str, deque[RankSample]] = {}
        self._errors: dict[str, str] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="zeroplane-scrape")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _fetch(self, endpoint: str) -> None:
        try:
            sample = scrape(endpoint, self.timeout_s)
        except (OSError, ValueError, urllib.error.URLError) as exc:
            with self._lock:
                self._errors[endpoint] = f"cannot read metrics: {exc}"
            return
        with self._lock:
            self._errors.pop(endpoint, None)
            history = self._history.setdefault(endpoint, deque())
            history.append(sample)
            while history and sample.at - history[0].at > self.window_s:
                history.popleft()

    def sample(self, endpoints: Iterable[str]) -> dict[str, RankFigures]:
        wanted = [e for e in dict.fromkeys(endpoints) if e][: self.max_endpoints]
        now = time.monotonic()
        with self._lock:
            for gone in set(self._history) - set(wanted):
                if now - self._history[gone][-1].at > self.window_s:
                    del self._history[gone]
            due = [
                e
                for e in wanted
                if e not in self._history or now - self._history[e][-1].at >= self.min_interval_s
            ]
        for future in [self._pool.submit(self._fetch, e) for e in due]:
            future.result()
        with self._lock:
            out = {}
            for e in wanted:
                history = list(self._history.get(e, ()))
                result = figures(e, history)
                error = self._errors.get(e, "")
                if error:
                    result = dataclasses.replace(result, error=error)
                out[e] = result
            return out
