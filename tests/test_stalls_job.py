"""The coordinator of a real ``zeroplane run`` job names each kind of stall within
seconds and handles it within the bound the user set (coordinator/control/stalls.py,
worker/whereabouts.py [Note: naming a stall]): a rank stuck in its script and a
stopped rank are dropped and the job goes on, equal to one process training the same
batches with torch alone; ranks whose collectives diverged stop the job with words
that name the modules."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

from tests.scripts.stall_train import batches, build

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "stall_train.py"
STEPS = 24
AT = 4  # the step the last rank stalls at
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
    """``start(kind, stage)``: a 3-worker job (2 at least) whose last rank stalls at step
    ``AT``, named after 2 s and handled after 6."""

    def start(kind: str, stage: int):
        monkeypatch.setenv("ZEROPLANE_TEST_STALL", kind)
        monkeypatch.setenv("ZEROPLANE_TEST_STALL_AT", str(AT))
        monkeypatch.setenv("ZEROPLANE_STALL_AFTER_S", "2")
        monkeypatch.setenv("ZEROPLANE_STALL_TIMEOUT_S", "6")
        job = mesh_job("--nproc", "3", "--min-nproc", "2", stage=stage, mesh=(), script=SCRIPT)
        job.wait_until("the stall", (job.tmp / "stalled").exists, timeout=180)
        return job

    return start


def named(job, kind: str, *patterns: str) -> dict:
    """The job's status once the coordinator names a stall of ``kind`` in words that
    match every one of ``patterns``; within NAMED_WITHIN_S of the rank stalling."""
    began = (job.tmp / "stalled").stat().st_mtime
    seen: list[str] = []

    def said() -> bool:
        status = job.status()
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
    job = stalling("stuck", stage=3)
    status = named(
        job,
        "stuck",
        "rank 2 runs outside any collective",
        r"ranks 0-1 wait in all-gather #\d+ on ranks 0-2",
    )
    stuck = next(w for w in status["workers"] if w["rank"] == 2)
    assert stuck["where"]["state"] == "running" and stuck["where"]["phase"] == ""
    job.wait_until("the job re-formed without it", lambda: job.world() == 2)
    text = job.finish()
    # whichever comes first: its own heartbeat, or its launcher
    said = "dropped this worker in a stall" in text or "dropped it as stuck" in text
    assert said, text[-4000:]
    assert_recovered_in_memory(text)
    assert_matches_reference(job.tmp)


@pytest.mark.timeout(300)
def test_a_stopped_rank_is_named_silent_and_the_survivors_go_on(stalling) -> None:
    job = stalling("stop", stage=2)
    named(job, "silent", r"rank 2 \(\S+\) has sent no heartbeat for \d+s")
    job.wait_until("the job re-formed without it", lambda: job.world() == 2)
    text = job.finish()
    assert "releasing it" in text, text[-4000:]  # not a wait for the collective timeout
    assert_recovered_in_memory(text)
    assert_matches_reference(job.tmp)


@pytest.mark.timeout(300)
def test_diverged_collectives_stop_the_job_naming_them(stalling) -> None:
    job = stalling("diverge", stage=3)
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
