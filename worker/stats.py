"""Per-step figures the engine keeps for the metrics exporter (``worker/metrics.py``).

The training loop only does a few integer and float updates here; the exporter
reads them from its own thread at scrape time. Reads are not locked: a scrape
may see one step's update half applied, which a monitoring sample tolerates,
and the histogram is built so its buckets and count always agree.

Step duration runs from the first ``forward`` or ``backward`` of an
accumulation window to the end of the ``step`` that closes it, so time spent
loading data between steps is not in it (throughput, from the samples
counter, covers wall time).
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field

import torch

__all__ = ["STEP_SECONDS_BUCKETS", "StepStats"]

# Upper bounds of the step-duration histogram, seconds: 1 ms to 2 min.
STEP_SECONDS_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    math.inf,
)


@dataclass
class StepStats:
    """What the engine counts per step; see the module notes."""

    # Samples and tokens this rank reported through ``engine.step(samples=, tokens=)``.
    samples: int = 0
    tokens: int = 0
    # The last micro-batch loss given to ``backward`` (detached; read at scrape time,
    # so a CUDA loss costs the training loop no synchronization).
    loss: torch.Tensor | None = None
    # The last optimizer step's loss: this rank's mean over its micro-batches, and
    # (sum over ranks, ranks) as the engine all-reduced it; detached tensors.
    step_loss: torch.Tensor | None = None
    global_loss: torch.Tensor | None = None
    _window_losses: list[tuple[torch.Tensor, float]] = field(default_factory=list)
    # Step-duration histogram: per-bucket counts (not cumulative) and the sum.
    bucket_counts: list[int] = field(default_factory=lambda: [0] * len(STEP_SECONDS_BUCKETS))
    seconds_sum: float = 0.0
    # membership changes by kind ("scale_up", "scale_down", "crash"): how many,
    # and the seconds training paused for them on this rank
    changes: dict[str, int] = field(default_factory=dict)
    pause_seconds: dict[str, float] = field(default_factory=dict)
    _window_start: float | None = None
    # The optimizer steps the script means to train for (``engine.progress(total=)``),
    # for the launcher's progress display; None: unknown.
    total_steps: int | None = None

    def record_pause(self, kind: str, seconds: float) -> None:
        self.changes[kind] = self.changes.get(kind, 0) + 1
        self.pause_seconds[kind] = self.pause_seconds.get(kind, 0.0) + seconds

    def begin(self) -> None:
        """Mark the start of an accumulation window (idempotent within one)."""
        if self._window_start is None:
            self._window_start = time.perf_counter()

    def add_loss(self, loss: torch.Tensor, weight: float) -> None:
        """A micro-batch loss given to ``backward`` and its weight in the step (no
        synchronization: kept as a tensor)."""
        self.loss = loss.detach()
        self._window_losses.append((self.loss.float().mean(), weight))

    def replace_window_loss(self, loss: torch.Tensor | None, weight: float) -> None:
        """The window's loss is ``loss`` at ``weight`` alone, or none (a pipeline:
        the schedule computed the losses, on its last stage only)."""
        self._window_losses = [] if loss is None else [(loss.detach().float(), weight)]

    def close_window_loss(self, device: torch.device) -> torch.Tensor:
        """This window's weighted loss and weight, ``[Σ w·loss, Σ w]`` in float64 to sum
        over ranks (``[0, 0]`` for a window without a loss); the rank's own mean in
        ``step_loss``. With the engine's weights the sum over ranks is the mean over the
        global batch (worker/data/sampler.py [Note: uneven shares])."""
        pair = torch.zeros(2, dtype=torch.float64, device=device)
        if self._window_losses:
            losses = torch.stack([loss.to(torch.float64) for loss, _ in self._window_losses])
            weights = torch.tensor([w for _, w in self._window_losses], dtype=torch.float64)
            self._window_losses.clear()
            total = weights.sum()
            pair[0], pair[1] = (losses * weights.to(losses.device)).sum(), total
            self.step_loss = (pair[0] / total).float() if total > 0 else losses.mean().float()
        return pair

    def record(self, samples: int, tokens: int) -> None:
        self.samples += samples
        self.tokens += tokens

    def end_step(self) -> None:
        """Close the window at an accumulation boundary and book its duration."""
        if self._window_start is None:
            return
        seconds = time.perf_counter() - self._window_start
        self._window_start = None
        self.bucket_counts[bisect.bisect_left(STEP_SECONDS_BUCKETS, seconds)] += 1
        self.seconds_sum += seconds

    def histogram(self) -> tuple[list[tuple[str, int]], float]:
        """Cumulative ``(le, count)`` buckets and the sum, as a Prometheus histogram."""
        counts = list(self.bucket_counts)
        buckets, running = [], 0
        for bound, n in zip(STEP_SECONDS_BUCKETS, counts, strict=True):
            running += n
            buckets.append(("+Inf" if math.isinf(bound) else repr(bound), running))
        return buckets, self.seconds_sum

    def last_loss(self) -> float | None:
        loss = self.loss
        return None if loss is None else float(loss.float().mean())

    def last_step_loss(self) -> float | None:
        loss = self.step_loss
        return None if loss is None else float(loss)

    def mean_loss(self) -> float | None:
        pair = self.global_loss
        if pair is None or pair[1] == 0:
            return None
        return float(pair[0] / pair[1])
