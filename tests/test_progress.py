"""The progress display (coordinator/launchers/progress.py): figures from the coordinator's
reports, plain periodic lines off a terminal, a live rich line on one, and the
total steps a script announces reaching the launcher over the wire."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from coordinator.core.conversions import report_from_proto, report_to_proto
from coordinator.core.messages import Event, StatusReport, WorkerInfo, WorkerReport, WorkerStatus
from coordinator.core.settings import MembershipConfig
from coordinator.launchers.progress import ProgressDisplay, ProgressSample, ProgressTracker, follow

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def status(
    steps: list[int],
    *,
    total: int | None = 100,
    tokens_per_step: int = 64,
    loss: float = 2.0,
    events: tuple[Event, ...] = (),
    generation: int = 1,
) -> StatusReport:
    workers = tuple(
        WorkerStatus(
            info=WorkerInfo(worker_id=f"w{r}", host="127.0.0.1"),
            state="member",
            rank=r,
            lease_remaining_s=5.0,
            report=WorkerReport(
                step=step,
                loss=loss + r,
                tokens=tokens_per_step * step,
                samples=2 * step,
                total_steps=total,
            ),
        )
        for r, step in enumerate(steps)
    )
    return StatusReport(
        phase="running",
        waiting_reason="",
        generation_id=generation,
        world_size=len(steps),
        stage=2,
        stage_reason="",
        rendezvous_endpoint="127.0.0.1:1",
        workers=workers,
        events=events,
        settings=MembershipConfig(),
        trainable_numel=10,
        inventory_digest="x",
    )


def test_total_steps_crosses_the_wire_and_is_checked():
    report = WorkerReport(step=3, total_steps=50)
    assert report_from_proto(report_to_proto(report)).total_steps == 50
    assert report_from_proto(report_to_proto(WorkerReport(step=3))).total_steps is None
    with pytest.raises(ValueError, match="total_steps"):
        WorkerReport(total_steps=0)


def test_tracker_rates_eta_and_new_events():
    clock = Clock()
    tracker = ProgressTracker("job", clock=clock)
    sample, _ = tracker.observe(status([0, 0]))
    assert sample.step == 0 and sample.step_s is None and sample.eta_s is None
    clock.now += 7.0  # start-up: not part of any step's time
    sample, _ = tracker.observe(status([10, 10]))
    assert sample.step == 10 and sample.total == 100 and sample.step_s is None
    assert sample.loss == pytest.approx(2.5)  # the mean over the ranks at that step
    clock.now += 5.0
    joined = Event(unix_s=1.0, kind="generation", worker_id="w2", generation_id=2)
    sample, events = tracker.observe(status([20, 19], events=(joined,), generation=2))
    assert sample.step == 20 and sample.generation == 2 and sample.world_size == 2
    assert sample.step_s == pytest.approx(0.5)
    # tokens of both ranks: (20 + 19 - 20) * 64 over 5 s
    assert sample.tokens_per_s == pytest.approx(19 * 64 / 5)
    assert sample.eta_s == pytest.approx(80 * 0.5)
    assert events == [joined]
    clock.now += 60.0  # the job stalls: the rates stay the last ones seen
    sample, events = tracker.observe(status([20, 20], events=(joined,), generation=2))
    assert sample.step_s == pytest.approx(0.5) and events == []
    text = sample.text()
    for part in ("step 20/100", "loss ", "tok/s", "500.0 ms/step", "ETA 40.0s", "world 2", "gen 2"):
        assert part in text


def test_plain_lines_are_periodic_with_step_total_and_eta():
    clock, out = Clock(), io.StringIO()
    display = ProgressDisplay(out, interactive=False, interval_s=10.0, clock=clock)
    tracker = ProgressTracker("job", clock=clock)
    with display:
        for step in range(1, 41):  # one step a second
            clock.now += 1.0
            display.update(tracker.observe(status([step, step], total=40))[0])
        display.event("job", "scale_up: worker w3")
    lines = out.getvalue().splitlines()
    steps = [int(re.search(r"step (\d+)/40", line).group(1)) for line in lines[:-1]]
    assert steps == [1, 11, 21, 31, 40]  # the first, one every 10 s, and the last
    assert all("ETA " in line for line in lines[:-1])
    assert "ETA 0.0s" in lines[-2] and "1,000.0 ms/step" in lines[-2]
    assert lines[-1] == "job: scale_up: worker w3"


def test_plain_line_without_a_total_has_no_eta():
    out = io.StringIO()
    display = ProgressDisplay(out, interactive=False)
    display.update(ProgressSample(label="job", step=3, loss=1.0))
    assert out.getvalue() == "job: step 3  loss 1.0000\n"


def test_terminal_renders_a_live_line_per_job():
    console = Console(file=io.StringIO(), force_terminal=True, width=160, color_system=None)
    with ProgressDisplay(console=console) as display:
        assert display.interactive
        display.update(ProgressSample(label="stage 0", step=3, total=10, loss=2.5, eta_s=4.0))
        display.update(ProgressSample(label="stage 1", step=7, total=10, step_s=0.25))
        display.message("a line printed above")
        display.finish("stage 0")
    text = console.file.getvalue()
    assert "stage 0" in text and "step 3/10" in text and "loss 2.5000" in text
    assert "ETA 4.0s" in text
    assert "stage 1" in text and "step 7/10" in text and "250.0 ms/step" in text
    assert "a line printed above" in text
    assert "\x1b[" in text  # drawn with terminal control codes, in place


def test_follow_ticks_at_most_every_interval_and_survives_a_failed_read():
    clock, out = Clock(), io.StringIO()
    display = ProgressDisplay(out, interactive=False, interval_s=0.0, clock=clock)
    reads = []

    def read():
        reads.append(clock.now)
        if len(reads) == 2:
            raise RuntimeError("coordinator gone")
        return status([len(reads), len(reads)], total=5), None

    with follow(display, ProgressTracker("job", clock=clock), read, every_s=1.0, clock=clock) as t:
        t()
        t()  # too soon: no read
        clock.now += 1.0
        t()  # the read fails: nothing shown, nothing raised
        clock.now += 1.0
        t()
    assert len(reads) == 4  # the last one on exit
    assert [line.split()[2] for line in out.getvalue().splitlines()] == ["1/5", "3/5", "4/5"]


@pytest.mark.timeout(120)
def test_zeroplane_run_prints_progress_from_the_workers_reports(tmp_path):
    pytest.importorskip("torch")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable, "-m", "coordinator.cli", "run", "--nproc", "2", "--no-http",
        "--progress", "plain", "--progress-interval", "0",
        str(ROOT / "examples" / "train_gpt.py"), "--steps", "6", "--step-sleep", "0.3",
    ]  # fmt: skip
    proc = subprocess.run(
        cmd,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("job: step")]
    assert lines, proc.stderr[-3000:]
    # the total the script announced with engine.progress(total=6), and the last step
    assert all("/6 " in line for line in lines)
    assert "step 6/6" in lines[-1] and "ETA 0.0s" in lines[-1] and "world 2" in lines[-1]
