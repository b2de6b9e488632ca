"""The coordinator of a real ``zeroplane run`` job names each kind of stall within
seconds and handles it within the bound the user set (coordinator/control/stalls.py,
worker/whereabouts.py [Note: naming a stall]): a rank stuck in its script and a
stopped rank are dropped and the job goes on, equal to one process training the same
batches with torch alone; ranks whose collectives diverged stop the job with words
that name the modules."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.scripts.stall_train import batches, build
from tests.test_mesh_elastic import STEPS  # what the mesh_job fixture trains for

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "stall_train.py"
AT = 3  # the step the last rank stalls at
NAMED_WITHIN_S = 10.0


def reference(steps: int) -> dict[str, torch.Tensor]:
    model, opt = build()
    for x, y in batches(steps):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.fixture
def stalling(mesh_job, monkeypatch):
    """``start(kind, stage, world, bound)``: a job of ``world`` workers (one fewer at least)
    whose last rank stalls at step ``AT``, named after 2 s and handled after ``bound``."""

    def start(kind: str, stage: int, world: int, bound: float = 5.0):
        monkeypatch.setenv("ZEROPLANE_TEST_STALL", kind)
        monkeypatch.setenv("ZEROPLANE_TEST_STALL_AT", str(AT))
        monkeypatch.setenv("ZEROPLANE_TEST_STALL_WORLD", str(world))
        monkeypatch.setenv("ZEROPLANE_STALL_AFTER_S", "2")
        monkeypatch.setenv("ZEROPLANE_STALL_TIMEOUT_S", str(bound))
        nproc = ("--nproc", str(world), "--min-nproc", str(world - 1))
        job = mesh_job(*nproc, stage=stage, mesh=(), script=SCRIPT)
        job.wait_until("the stall", (job.tmp / "stalled").exists, timeout=180)
        return job

    return start


def named(job, kind: str, *patterns: str) -> dict:
    """The job's status once the coordinator names a stall of ``kind`` in words that
    match every one of ``patterns``; within NAMED_WITHIN_S of the rank stalling."""
    began = (job.tmp / "stalled").stat().st_mtime
    seen: list[str] = []

    def said() -> bool:
        try:
            status = job.status()
        except OSError:  # the status page, busy on a loaded machine
            return False
        seen.append(status.get("stall", ""))
        text = status["stall"]
        return status.get("stall_kind") == kind and all(re.search(p, text) for p in patterns)

    job.wait_until(f"a {kind} stall named as {patterns}", said)
    took = time.time() - began
    assert took < NAMED_WITHIN_S, f"named after {took:.1f}s: {seen[-1]}"
    return job.status()


def assert_recovered_in_memory(text: str) -> None:
    """The survivors rolled back from their replicas, not restarted (a replacement of
    the dropped rank may have started meanwhile)."""
    assert "recovered" in text, text[-4000:]
    registered = re.findall(r"membership: registered (\S+)", text)
    assert len(registered) - len(set(registered)) == 0, registered


def assert_matches_reference(tmp: Path) -> None:
    got = torch.load(tmp / "final.pt", weights_only=True)
    want = reference(STEPS)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst < 1e-5, f"the job differs from one process by {worst:.3g}"


@pytest.mark.timeout(300)
def test_a_rank_stuck_in_its_script_is_named_dropped_and_the_job_goes_on(stalling) -> None:
    job = stalling("stuck", stage=3, world=2, bound=10.0)
    status = named(
        job,
        "stuck",
        "rank 1 runs outside any collective",
        r"rank 0 waits in all-gather #\d+ on ranks 0,1, unit a",
    )
    stuck = next(w for w in status["workers"] if w["rank"] == 1)
    assert stuck["where"]["state"] == "running" and stuck["where"]["phase"] == ""
    # zeroplane status says it too, with where each rank is
    cli = [sys.executable, "-m", "coordinator.cli", "status", "--http", f"127.0.0.1:{job.port}"]
    text = subprocess.run(cli, capture_output=True, text=True, timeout=60, cwd=ROOT).stdout
    assert "stall (stuck): " in text, text
    rows: dict[str, str] = {}  # the members' table, the first with a rank column
    for line in text.splitlines():
        if line[:2] in ("0 ", "1 "):
            rows.setdefault(line[0], line)
    assert re.search(r"all-gather #\d+ \(a\) \d+s", rows["0"]), text
    assert re.search(r"running \d+s", rows["1"]), text
    job.wait_until("the survivor recovered", lambda: "recovered as rank 0 of 1" in job.text())
    text = job.finish()
    # whichever comes first: its own heartbeat, or its launcher
    said = "dropped this worker in a stall" in text or "dropped it as stuck" in text
    assert said, text[-4000:]
    assert_recovered_in_memory(text)
    assert_matches_reference(job.tmp)


@pytest.mark.timeout(300)
def test_a_stopped_rank_is_named_silent_and_the_survivors_go_on(stalling) -> None:
    job = stalling("stop", stage=2, world=2)
    named(job, "silent", r"rank 1 \(\S+\) has sent no heartbeat for \d+s")
    job.wait_until("the survivor recovered", lambda: "recovered as rank 0 of 1" in job.text())
    text = job.finish()
    assert "releasing it" in text, text[-4000:]  # not a wait for the collective timeout
    assert_recovered_in_memory(text)
    assert_matches_reference(job.tmp)


@pytest.mark.timeout(300)
def test_diverged_collectives_stop_the_job_naming_them(stalling) -> None:
    job = stalling("diverge", stage=3, world=3)
    named(
        job,
        "mismatch",
        r"ranks 0-1 wait in all-gather #\d+ on ranks 0-2, unit a for",
        "rank 2 waits in all-reduce #1 on ranks 1,2",
        "rank 2 issued other collectives than the rest of their group",
    )
    job.proc.wait(timeout=60)
    text = job.text()
    assert job.proc.returncode != 0, text[-4000:]
    assert "stopped the job in a stall" in text, text[-4000:]
