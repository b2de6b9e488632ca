"""Progress a person can follow: one line per job, live on a terminal, periodic otherwise.

The launcher already has what a progress line needs: every worker's heartbeat
carries its report (step, last step's loss, samples and tokens so far, and the
total steps the script announced with ``engine.progress(total=...)``), and the
coordinator's status has the world size, the generation and the membership
events. :class:`ProgressTracker` turns successive reads of those into a
:class:`ProgressSample` (rates from the difference between reads, so nothing
new crosses the wire), and :class:`ProgressDisplay` shows samples:

* on a terminal, a live ``rich`` line per job (a bar when the total is known),
  with the workers' output and the launcher's log lines printed above it;
* elsewhere (CI, Kubernetes logs), a plain line per job every ``interval_s``
  and at its last step, and one line per membership event as it happens.

``zeroplane run``, ``zeroplane demo`` and ``zeroplane tune`` use the same display.
Torch-free: it reads the coordinator's messages only.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any

from coordinator.core.messages import Event, StatusReport, WorkerReport
from coordinator.launchers.summary import format_duration

__all__ = ["ProgressDisplay", "ProgressSample", "ProgressTracker", "describe_event"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ProgressSample:
    """What one job's progress line shows at one moment (None: not known yet)."""

    label: str
    step: int = 0
    total: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    samples_per_s: float | None = None
    step_s: float | None = None
    eta_s: float | None = None
    world_size: int = 0
    generation: int = 0
    stage: int | None = None
    # what a step is: "step" (an optimizer step), "trial" (zeroplane tune's runs)
    unit: str = "step"

    @property
    def done(self) -> bool:
        return self.total is not None and self.step >= self.total

    def text(self) -> str:
        """The line's figures, e.g. ``step 40/100  loss 2.3456  1,234 tok/s ...``."""
        unit = self.unit
        parts = [f"{unit} {self.step}/{self.total}" if self.total else f"{unit} {self.step}"]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:,.0f} tok/s")
        elif self.samples_per_s is not None:
            parts.append(f"{self.samples_per_s:,.1f} samples/s")
        if self.step_s is not None:
            if self.unit == "step":
                parts.append(f"{self.step_s * 1e3:,.1f} ms/step")
            else:
                parts.append(f"{self.step_s:,.2f} s/{unit}")
        if self.total:
            eta = "?" if self.eta_s is None else format_duration(self.eta_s)
            parts.append(f"ETA {eta}")
        if self.world_size:
            parts.append(f"world {self.world_size}")
        if self.generation:
            parts.append(f"gen {self.generation}")
        return "  ".join(parts)


def describe_event(event: Event) -> str:
    """``scale_up: worker w-3 (generation 4): detail``."""
    text = event.kind
    if event.worker_id:
        text += f": worker {event.worker_id}"
    if event.generation_id:
        text += f" (generation {event.generation_id})"
    if event.detail:
        text += f": {event.detail}"
    return text


class ProgressTracker:
    """Successive views of one job -> progress samples and the events not seen yet.

    Rates are taken over the reads of the last ``window_s`` seconds: step time
    is seconds per step, throughput the tokens (and samples) the ranks reported
    per second, the ETA the steps left times the step time.
    """

    def __init__(
        self,
        label: str = "job",
        *,
        window_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not window_s > 0:
            raise ValueError(f"ProgressTracker window_s must be > 0, got {window_s!r}")
        self.label = label
        self._window_s = window_s
        self._clock = clock
        # (time, step, tokens, samples)
        self._reads: collections.deque[tuple[float, int, int, int]] = collections.deque()
        self._seen: set[tuple[float, str, str, int]] = set()

    def observe(
        self,
        status: StatusReport | None,
        reports: Mapping[str, WorkerReport] | None = None,
    ) -> tuple[ProgressSample, list[Event]]:
        """The job's progress now, from the coordinator's status and every worker's
        last report (``None``: the members' reports in ``status``)."""
        now = self._clock()
        if status is None:
            return ProgressSample(label=self.label), []
        if reports is None:
            reports = {w.info.worker_id: w.report for w in status.workers if w.report is not None}
        members = {w.info.worker_id for w in status.members}
        current = [r for wid, r in reports.items() if wid in members] or list(reports.values())
        step = max((r.step for r in current), default=0)
        totals = [r.total_steps for r in current if r.total_steps is not None]
        total = max(totals) if totals else None
        losses = [r.loss for r in current if r.step == step and r.loss is not None]
        tokens = sum(r.tokens for r in reports.values())
        samples = sum(r.samples for r in reports.values())
        reads = self._reads
        # a read is kept when the step moved (rates start at the first step seen:
        # start-up is no step's time); rates run from the window's first read to the
        # newest, so a job that has stopped stepping keeps its last rates
        if step > 0 and (not reads or step > reads[-1][1]):
            reads.append((now, step, tokens, samples))
        while len(reads) > 2 and now - reads[1][0] >= self._window_s:
            reads.popleft()
        step_s = tokens_per_s = samples_per_s = eta_s = None
        t0, step0, tokens0, samples0 = reads[0] if reads else (now, step, tokens, samples)
        elapsed = reads[-1][0] - t0 if reads else 0.0
        if elapsed > 0 and step > step0:
            step_s = elapsed / (step - step0)
            if tokens > tokens0:
                tokens_per_s = (tokens - tokens0) / elapsed
            if samples > samples0:
                samples_per_s = (samples - samples0) / elapsed
            if total is not None:
                eta_s = max(0, total - step) * step_s
        if total is not None and step >= total:
            eta_s = 0.0
        new_events = []
        for event in status.events:
            key = (event.unix_s, event.kind, event.worker_id, event.generation_id)
            if key not in self._seen:
                self._seen.add(key)
                new_events.append(event)
        sample = ProgressSample(
            label=self.label,
            step=step,
            total=total,
            loss=sum(losses) / len(losses) if losses else None,
            tokens_per_s=tokens_per_s,
            samples_per_s=samples_per_s,
            step_s=step_s,
            eta_s=eta_s,
            world_size=status.world_size,
            generation=status.generation_id,
            stage=status.stage,
        )
        return sample, new_events


class ProgressDisplay:
    """One line per job: live (``rich``) on a terminal, plain periodic lines otherwise.

    ``stream``: where the lines go (default stderr, where the launcher logs).
    ``interactive``: force the terminal or the plain form (default: whether
    ``stream`` is a terminal). ``interval_s``: seconds between a job's plain
    lines (its first step, its last and each event are printed regardless).
    ``console``: a ``rich.console.Console`` to draw on (tests pass one that
    records). Use as a context manager: while it is open on a terminal, lines
    written to stdout/stderr, the launcher's log lines included, print above
    the live lines.
    """

    def __init__(
        self,
        stream: IO[str] | None = None,
        *,
        interactive: bool | None = None,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        console: Any = None,
    ) -> None:
        if not interval_s >= 0:
            raise ValueError(f"ProgressDisplay interval_s must be >= 0, got {interval_s!r}")
        self._stream = stream
        self._interval_s = interval_s
        self._clock = clock
        self._console = console
        if interactive is None and console is not None:
            interactive = console.is_terminal
        elif interactive is None:
            interactive = bool(getattr(stream or sys.stderr, "isatty", lambda: False)())
        self.interactive = interactive
        self._progress: Any = None
        self._tasks: dict[str, Any] = {}
        self._printed: dict[str, tuple[float, int]] = {}
        self._swapped: list[tuple[logging.StreamHandler, IO[str]]] = []

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> ProgressDisplay:
        if self.interactive:
            self._start_live()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start_live(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn
        from rich.table import Column

        console = self._console or Console(file=self._stream or sys.stderr, force_terminal=True)
        self._progress = Progress(
            TextColumn("[bold]{task.description}", table_column=Column(no_wrap=True, min_width=8)),
            BarColumn(bar_width=20, table_column=Column(min_width=20)),
            # on a narrow terminal the figures are cut short, never the job's name
            TextColumn(
                "{task.fields[figures]}",
                table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1),
            ),
            console=console,
            transient=False,
            redirect_stdout=True,
            redirect_stderr=True,
            refresh_per_second=4,
        )
        before = sys.stderr
        self._progress.start()
        # log handlers hold the stream they were made with: point those writing to the
        # terminal at rich's proxy too, so a log line never tears the live lines
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is before:
                self._swapped.append((handler, handler.setStream(sys.stderr)))

    def close(self) -> None:
        for handler, stream in self._swapped:
            handler.setStream(stream)
        self._swapped.clear()
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    # -- what is shown ---------------------------------------------------------------------

    def update(self, sample: ProgressSample) -> None:
        """Show ``sample`` as its job's line (created on first sight)."""
        if self._progress is not None:
            task = self._tasks.get(sample.label)
            if task is None:
                task = self._tasks[sample.label] = self._progress.add_task(
                    sample.label, total=sample.total, figures=""
                )
            self._progress.update(
                task, completed=sample.step, total=sample.total, figures=sample.text()
            )
            return
        if sample.step == 0:
            return
        now = self._clock()
        last = self._printed.get(sample.label)
        due = last is None or (
            sample.step != last[1] and (now - last[0] >= self._interval_s or sample.done)
        )
        if due:
            self._printed[sample.label] = (now, sample.step)
            self._write(f"{sample.label}: {sample.text()}")

    def event(self, label: str, text: str) -> None:
        """A membership event (or any one-off message) as a line of its own."""
        self.message(f"{label}: {text}")

    def message(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False)
        else:
            self._write(text)

    def finish(self, label: str, text: str | None = None) -> None:
        """The job is over: its live line stays as it is; ``text`` is printed below."""
        if self._progress is not None and label in self._tasks:
            self._progress.stop_task(self._tasks[label])
        if text:
            self.message(text)

    def _write(self, line: str) -> None:
        stream = self._stream or sys.stderr
        stream.write(line + "\n")
        stream.flush()


@contextlib.contextmanager
def follow(
    display: ProgressDisplay,
    tracker: ProgressTracker,
    read: Callable[[], tuple[StatusReport | None, Mapping[str, WorkerReport] | None]],
    *,
    every_s: float = 1.0,
    events: bool = True,
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[Callable[[], None]]:
    """A ``tick()`` to call from a wait loop: at most every ``every_s`` seconds it reads
    the job (``read``) and shows its progress and (``events``) its new membership
    events; a read that fails is skipped (the display must never fail a job). The
    last tick runs on exit."""
    last = [-float("inf")]

    def tick(force: bool = False) -> None:
        now = clock()
        if not force and now - last[0] < every_s:
            return
        last[0] = now
        try:
            status, reports = read()
        except Exception as exc:
            logger.debug("progress: no status (%s)", exc)
            return
        sample, new_events = tracker.observe(status, reports)
        for event in new_events if events else ():
            display.event(tracker.label, describe_event(event))
        display.update(sample)

    try:
        yield tick
    finally:
        tick(force=True)
