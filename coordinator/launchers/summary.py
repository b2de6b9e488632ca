"""The one-screen summary a job ends with: steps, time, throughput, loss,
membership, where the checkpoint and the metrics went.

Built from the coordinator's last status: every worker's final report (each
sends one as it exits) carries its step, its last step's loss, the samples
and tokens it trained on and its last checkpoint.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from coordinator.core.messages import StatusReport, WorkerReport

__all__ = ["JobSummary", "format_duration"]


def format_duration(seconds: float) -> str:
    """``42.3s``, ``3m 07s``, ``2h 05m``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


def _rate(count: int, seconds: float, unit: str) -> str:
    return f"{count / seconds:,.0f} {unit}/s ({count:,} {unit})" if seconds > 0 else ""


@dataclass(frozen=True)
class JobSummary:
    """What a finished job did, as its coordinator saw it."""

    ok: bool
    outcome: str  # "finished" or why it failed
    wall_s: float
    status: StatusReport | None
    # every worker's last report, those that left included (CoordinatorServer.last_reports)
    reports: Mapping[str, WorkerReport] = field(default_factory=dict)
    status_page: str | None = None  # http://host:port/ of the coordinator, if served

    def _reports(self) -> list[WorkerReport]:
        if self.reports or self.status is None:
            return list(self.reports.values())
        return [w.report for w in self.status.workers if w.report is not None]

    def lines(self) -> list[str]:
        head = "finished" if self.ok else f"failed: {self.outcome}"
        out = [f"zeroplane run: {head} in {format_duration(self.wall_s)}"]
        reports, status = self._reports(), self.status
        if status is None or not reports:
            out.append("  (no worker reported to the coordinator)")
            return self._metrics(out)
        step = max(r.step for r in reports)
        out.append(
            f"  steps       {step} (generation {status.generation_id}, "
            f"world size {status.world_size}, stage {status.stage})"
        )
        # the last step's loss, averaged over the ranks that reached it
        last = [r.loss for r in reports if r.step == step and r.loss is not None]
        if last:
            mean = sum(last) / len(last)
            out.append(f"  loss        {mean:.4f} (step {step}, mean over {len(last)} ranks)")
        tokens, samples = sum(r.tokens for r in reports), sum(r.samples for r in reports)
        rates = [_rate(tokens, self.wall_s, "tokens"), _rate(samples, self.wall_s, "samples")]
        rates = [r for r, n in zip(rates, (tokens, samples), strict=True) if n and r]
        if rates:
            out.append("  throughput  " + ", ".join(rates) + " over the job's wall time")
        kinds = Counter(e.kind for e in status.events)
        if kinds:
            events = ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items()))
            out.append(f"  membership  {events}")
        checkpoints = sorted({r.checkpoint for r in reports if r.checkpoint})
        if checkpoints:
            out.append("  checkpoint  " + ", ".join(checkpoints))
        return self._metrics(out)

    def _metrics(self, out: list[str]) -> list[str]:
        if self.status_page:
            out.append(
                f"  metrics     {self.status_page} (stopped with the job; "
                "Prometheus keeps what it scraped from /sd)"
            )
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())
