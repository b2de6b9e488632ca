"""``zeroplane demo``: train a small GPT on the shipped corpus at each ZeRO stage.

For each stage in turn it launches ``--nproc`` local workers of
``python -m worker.demo`` through :class:`~coordinator.launchers.local.LocalJob`, shows
their progress with the display ``zeroplane run`` uses (coordinator/launchers/progress.py:
step / total, loss, tokens/s, step time, ETA, read from the workers' reports to
the stage's embedded coordinator), and ends with a table that puts the
model-state bytes each rank measured (``engine.memory_report()``) beside the
planner's prediction (:func:`coordinator.core.memory.model_state_bytes`) and the
stage-0 baseline. Every stage uses the same seed, so the losses are comparable.

Workers leave their final reports as JSON files in a temporary directory; this
module never imports torch.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from coordinator.commands.args import add_alias
from coordinator.core.memory import model_state_bytes
from coordinator.launchers.local import (
    JobResult,
    LaunchSpec,
    LocalJob,
    forward_signals,
    prefix_lines,
    shared_fork_server,
)
from coordinator.launchers.progress import ProgressDisplay, ProgressSample, ProgressTracker
from coordinator.launchers.spawner import ForkServer

__all__ = [
    "DemoError",
    "DemoOptions",
    "StageResult",
    "add_parser",
    "render_table",
    "run_demo",
]

ProgressHandler = Callable[[ProgressSample], None]

MIB = 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    """What the demo runs.

    nproc: local workers per stage. stages: ZeRO stages, run in this order.
    steps: optimizer steps per stage. dtype: "fp32" or "bf16".
    batch_size: sequences per global batch (split across the workers).
    seed: the same for every stage. grace_s: the launcher's SIGTERM-to-SIGKILL grace.
    """

    nproc: int = 2
    stages: tuple[int, ...] = (0, 1, 2, 3)
    steps: int = 40
    dtype: Literal["fp32", "bf16"] = "fp32"
    batch_size: int = 16
    seed: int = 0
    grace_s: float = 5.0

    def __post_init__(self) -> None:
        if not isinstance(self.nproc, int) or self.nproc < 1:
            raise ValueError(f"DemoOptions.nproc must be an integer >= 1, got {self.nproc!r}")
        stages = tuple(self.stages)
        if not stages or any(s not in (0, 1, 2, 3) for s in stages):
            raise ValueError(f"DemoOptions.stages must be stages among 0-3, got {self.stages!r}")
        object.__setattr__(self, "stages", stages)
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"DemoOptions.steps must be an integer >= 1, got {self.steps!r}")
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"DemoOptions.dtype must be 'fp32' or 'bf16', got {self.dtype!r}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(
                f"DemoOptions.batch_size must be an integer >= 1, got {self.batch_size!r}"
            )
        if self.batch_size % self.nproc:
            raise ValueError(
                f"DemoOptions.batch_size ({self.batch_size}) must be divisible by "
                f"nproc ({self.nproc})"
            )


@dataclass(frozen=True, kw_only=True)
class StageResult:
    """One stage's outcome, gathered from every rank's report.

    measured: bytes by kind on the rank that holds the most.
    predicted: the planner's bytes by kind for the same numel, stage, N and dtype.
    losses: per step, the mean of the ranks' losses (the global-batch loss).
    step_s: median step time of the slowest rank, the warm-up excluded (the first
        fifth of the steps, at least one: allocator, caches and the gather plan settle).
    comm_bytes_per_step: logical bytes of rank 0's collectives per training step.
    """

    stage: int
    world_size: int
    dtype: str
    numel: int
    measured: dict[str, int]
    predicted: dict[str, float]
    losses: list[float]
    step_s: float
    comm_bytes_per_step: float
    wall_s: float

    @property
    def final_loss(self) -> float:
        return self.losses[-1]


class DemoError(RuntimeError):
    """A stage failed or was interrupted.

    ``returncode`` is the job's, ``output`` the workers' last lines, ``interrupted``
    whether a signal (Ctrl-C, SIGTERM) ended it rather than a worker failing.
    """

    def __init__(
        self,
        message: str,
        *,
        returncode: int = 1,
        output: Sequence[str] = (),
        interrupted: bool = False,
    ) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.output = list(output)
        self.interrupted = interrupted


def _worker_command(options: DemoOptions, stage: int, out: Path) -> tuple[str, ...]:
    return (
        sys.executable,
        "-m",
        "worker.demo",
        "--out",
        str(out),
        "--stage",
        str(stage),
        "--dtype",
        options.dtype,
        "--steps",
        str(options.steps),
        "--batch-size",
        str(options.batch_size),
        "--seed",
        str(options.seed),
    )


def _collect(options: DemoOptions, stage: int, out: Path, wall_s: float) -> StageResult:
    reports: list[dict[str, Any]] = []
    for r in range(options.nproc):
        path = out / f"rank{r}.json"
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            raise DemoError(f"stage {stage}: rank {r} left no readable report ({exc})") from exc
    numel = int(reports[0]["numel"])
    kinds = ("params", "grads", "master", "optimizer", "total")
    measured = {k: max(int(rep["memory"].get(k, 0)) for rep in reports) for k in kinds}
    predicted = model_state_bytes(
        numel, stage=stage, world_size=options.nproc, dtype=options.dtype
    ).as_dict()
    losses = [
        statistics.fmean(step) for step in zip(*(rep["losses"] for rep in reports), strict=True)
    ]
    slowest = [max(step) for step in zip(*(rep["step_s"] for rep in reports), strict=True)]
    timed = slowest[max(1, len(slowest) // 5) :] or slowest
    comm_bytes = sum(int(v.get("bytes", 0)) for v in reports[0].get("comm", {}).values())
    return StageResult(
        stage=stage,
        world_size=options.nproc,
        dtype=options.dtype,
        numel=numel,
        measured=measured,
        predicted=predicted,
        losses=losses,
        step_s=statistics.median(timed),
        comm_bytes_per_step=comm_bytes / options.steps,
        wall_s=wall_s,
    )


def _spec(options: DemoOptions, stage: int, out: Path) -> LaunchSpec:
    return LaunchSpec(
        command=_worker_command(options, stage, out),
        nproc=options.nproc,
        stage=str(stage),
        grace_s=options.grace_s,
        fork_server=True,
    )


def _run_stage(
    options: DemoOptions,
    stage: int,
    out: Path,
    on_progress: ProgressHandler | None,
    on_line: Callable[[int, str, str], None],
    fork_server: ForkServer | None = None,
) -> StageResult:
    out.mkdir()
    spec = _spec(options, stage, out)
    t0 = time.monotonic()
    # imported here: the gRPC server is only needed when this process hosts it
    from coordinator.control.embedded import EmbeddedCoordinator

    coordinator = EmbeddedCoordinator.for_local_job(options.nproc, stage)
    job = LocalJob(spec, on_line=on_line, services=(coordinator,), fork_server=fork_server)
    tracker = ProgressTracker(f"stage {stage}")

    def show() -> None:
        # the coordinator's view now, or its last one once the stage is over
        view = coordinator.final
        if view is None and coordinator.server is not None:
            view = (coordinator.server.status(), coordinator.server.last_reports())
        if on_progress is not None and view is not None:
            on_progress(tracker.observe(*view)[0])

    result: JobResult | None = None
    shown = 0.0
    with forward_signals(job), job:
        while result is None:
            result = job.poll()
            if result is None and time.monotonic() - shown >= 0.5:
                shown = time.monotonic()
                show()
            if result is None:
                time.sleep(0.1)
    if result.ok:
        show()
    if not result.ok:
        raise DemoError(
            f"stage {stage}: {result.message}",
            returncode=result.returncode,
            interrupted=result.signal is not None,
        )
    return _collect(options, stage, out, time.monotonic() - t0)


def run_demo(
    options: DemoOptions,
    *,
    on_progress: ProgressHandler | None = None,
    on_line: Callable[[int, str, str], None] | None = None,
    on_stage_done: Callable[[StageResult], None] | None = None,
) -> list[StageResult]:
    """Run every stage in ``options.stages``; raises :class:`DemoError` if one fails.

    Worker output goes to ``on_line`` (rank, stream, line); by default it is kept
    and attached to the error if a stage fails.
    """
    tail: collections.deque[str] = collections.deque(maxlen=40)

    def keep(rank: int, stream: str, line: str) -> None:
        tail.append(f"[rank{rank}] {line}")

    results: list[StageResult] = []
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="zeroplane-demo-"))
        # every stage's workers fork from one server: torch imported once, not per stage
        server = shared_fork_server(_spec(options, options.stages[0], Path(tmp)))
        if server is not None:
            stack.callback(server.close)
        for i, stage in enumerate(options.stages):
            try:
                # (a stage may be listed twice: 3,0,3 runs it again, in a directory of its own)
                result = _run_stage(
                    options,
                    stage,
                    Path(tmp) / f"{i}-stage{stage}",
                    on_progress,
                    on_line or keep,
                    server,
                )
            except DemoError as exc:
                exc.output = list(tail)
                raise
            results.append(result)
            if on_stage_done is not None:
                on_stage_done(result)
    return results


# -- rendering -----------------------------------------------------------------


def _mib(n: float) -> str:
    return f"{n / MIB:.2f}"


def render_table(results: Sequence[StageResult]) -> str:
    """The closing table: measured vs predicted model-state MiB per rank, time, loss."""
    if not results:
        return ""
    first = results[0]
    baseline_result = next((r for r in results if r.stage == 0), None)
    if baseline_result is not None:
        baseline = float(baseline_result.measured["total"])
        baseline_note = "measured"
    else:
        baseline = model_state_bytes(
            first.numel, stage=0, world_size=first.world_size, dtype=first.dtype
        ).total
        baseline_note = "predicted"
    header = (
        "stage",
        "params",
        "grads",
        "optimizer",
        "measured",
        "predicted",
        "vs stage 0",
        "ms/step",
        "final loss",
    )
    rows = [header]
    for r in results:
        m = r.measured
        rows.append(
            (
                str(r.stage),
                _mib(m["params"]),
                _mib(m["grads"]),
                _mib(m["optimizer"] + m["master"]),
                _mib(m["total"]),
                _mib(r.predicted["total"]),
                f"{100 * m['total'] / baseline:.1f}%" if baseline else "-",
                f"{r.step_s * 1e3:.1f}",
                f"{r.final_loss:.4f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        f"GPT, {first.numel:,} trainable parameters, {first.world_size} rank(s), "
        f"{first.dtype}, AdamW.",
        "Model state per rank in MiB, measured by the engine vs predicted by the planner;",
        "optimizer includes any fp32 master weights. "
        f"Stage-0 baseline: {_mib(baseline)} MiB ({baseline_note}).",
        "",
    ]
    for i, row in enumerate(rows):
        lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


# -- CLI -----------------------------------------------------------------------


def _parse_stages(text: str) -> tuple[int, ...]:
    try:
        stages = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--stages wants e.g. 0,1,2,3, got {text!r}") from None
    if not stages or any(s not in (0, 1, 2, 3) for s in stages):
        raise argparse.ArgumentTypeError(f"--stages must list stages among 0-3, got {text!r}")
    return stages


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    default = DemoOptions()
    parser = subparsers.add_parser(
        "demo",
        help="train a small GPT at each ZeRO stage and compare memory",
        description=(
            "Train a small byte-level GPT on the shipped corpus (Austen's Persuasion) on "
            "local workers, once per ZeRO stage with the same seed, and compare each "
            "rank's model-state bytes with the planner's prediction."
        ),
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=default.nproc,
        metavar="N",
        help="local workers (default %(default)s)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=default.steps,
        metavar="N",
        help="steps per stage (default %(default)s)",
    )
    parser.add_argument(
        "--stages",
        type=_parse_stages,
        default=default.stages,
        metavar="S,S,...",
        help="comma-separated ZeRO stages to run, in order (default 0,1,2,3)",
    )
    precision = parser.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default=default.dtype,
        help="the workers' ZeroConfig(dtype=...): parameter and gradient precision "
        "(default %(default)s)",
    )
    add_alias(parser, "--dtype", to=precision)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=default.batch_size,
        metavar="N",
        help="sequences per global batch, split across workers (default %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=default.seed,
        metavar="N",
        help="same for every stage (default %(default)s)",
    )
    parser.set_defaults(func=demo, needs="torch")
    return parser


def demo(args: argparse.Namespace) -> int:
    if not args.verbose:
        # the embedded coordinator's membership log would break up the progress display
        logging.getLogger("coordinator").setLevel(logging.WARNING)
    try:
        options = DemoOptions(
            nproc=args.nproc,
            stages=args.stages,
            steps=args.steps,
            dtype=args.precision,
            batch_size=args.batch_size,
            seed=args.seed,
        )
    except ValueError as exc:
        print(f"zeroplane demo: {exc}", file=sys.stderr)
        return 2
    print(
        f"zeroplane demo: {options.nproc} worker(s), stages "
        f"{','.join(map(str, options.stages))}, {options.steps} steps each, {options.dtype}",
        flush=True,
    )
    t0 = time.monotonic()

    def stage_done(result: StageResult) -> None:
        display.finish(
            f"stage {result.stage}",
            f"stage {result.stage}  done in {result.wall_s:.1f}s, final loss "
            f"{result.final_loss:.3f}",
        )

    try:
        with ProgressDisplay(sys.stdout) as display:
            results = run_demo(
                options,
                on_progress=display.update,
                on_line=prefix_lines() if getattr(args, "verbose", False) else None,
                on_stage_done=stage_done,
            )
    except DemoError as exc:
        if exc.output and not exc.interrupted:
            print("last worker output:", file=sys.stderr)
            print("\n".join(exc.output), file=sys.stderr)
        print(f"zeroplane demo: {exc}", file=sys.stderr)
        return exc.returncode
    print()
    print(render_table(results))
    print(f"\ntotal {time.monotonic() - t0:.1f}s")
    return 0
