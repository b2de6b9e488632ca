"""`zeroplane run --launcher ray`: workers as Ray actors on a local Ray cluster.

Ray is an optional extra (`pip install -e '.[ray]'`); these tests skip without it,
except in CI (`$CI` set), where .ci/run installs it and a missing Ray is a failure.
Each run is compared with the single-process torch reference.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.test_run_e2e import EXAMPLE, ROOT, reference

if importlib.util.find_spec("ray") is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI must run the Ray tests: pip install -e '.[test,ray]'")
    pytest.skip("ray is not installed (pip install -e '.[ray]')", allow_module_level=True)

# A local Ray writes no auth token under ~/.ray this way.
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def worst(path: Path, steps: int, optimizer: str = "adamw") -> float:
    got = torch.load(path, weights_only=True)
    want = reference(steps, 12, optimizer=optimizer)
    assert got.keys() == want.keys()
    return max((got[k] - want[k]).abs().max().item() for k in want)


def worker_pids(launcher: int) -> list[int]:
    """The worker processes of the example script (not the launcher's own)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == launcher:
            continue
        with contextlib.suppress(OSError):
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if str(EXAMPLE).encode() in argv and b"coordinator.cli" not in argv:
                pids.append(int(proc.name))
    return pids


@pytest.mark.timeout(240)
def test_ray_launcher_scales_on_signals_and_matches_single_process(tmp_path: Path) -> None:
    # As tests/test_elastic_e2e.py's test_zeroplane_run_scales_on_signals, on Ray actors;
    # then a worker leaves on a SIGTERM from outside at --min-nproc, and the launcher
    # starts it again (as test_a_worker_leaving_from_outside_below_the_minimum_is_replaced)
    out, log_path = tmp_path / "final.pt", tmp_path / "run.log"
    total = 70
    cmd = [
        sys.executable, "-m", "coordinator.cli", "run", "--launcher", "ray", "--nproc", "2",
        "--min-nproc", "2", "--max-nproc", "3", "--stage", "2", str(EXAMPLE),
        "--steps", str(total), "--step-sleep", "0.25", "--optimizer", "sgd", "--out", str(out),
        "--step-sleep-until", str(tmp_path / "hurry"),
    ]  # fmt: skip
    env = {**os.environ, **RAY_ENV, "RAY_DEDUP_LOGS": "0"}
    with log_path.open("w+") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:

            def wait_for(text: str) -> None:
                deadline = time.monotonic() + 120
                while text not in log_path.read_text():
                    assert proc.poll() is None and time.monotonic() < deadline, (
                        f"no {text!r}:\n{log_path.read_text()[-4000:]}"
                    )
                    time.sleep(0.2)

            wait_for("step 10 loss")
            proc.send_signal(signal.SIGUSR1)  # one more actor joins
            wait_for("grew to 3 ranks")
            time.sleep(2)  # a few steps on three ranks
            proc.send_signal(signal.SIGUSR2)  # the newest hands over and leaves
            wait_for("now rank 0 of 2")
            deadline = time.monotonic() + 30  # the one that left may still be exiting
            while len(pids := worker_pids(proc.pid)) != 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert len(pids) == 2, pids
            os.kill(pids[0], signal.SIGTERM)
            wait_for("left the job without being asked")
            (tmp_path / "hurry").touch()  # the steps left at full speed
            code = proc.wait(timeout=150)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log_path.read_text()
    assert code == 0, text[-4000:]
    assert "[ray-2]" in text and "handed over" in text  # the actors' output reached the driver
    assert worst(out, total, "sgd") < 1e-5


@pytest.fixture
def ray_job(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., object]]:
    from coordinator.launchers.ray_cluster import RayJob, RaySpec

    for k, v in RAY_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(ROOT)
    jobs: list[RayJob] = []

    def make(*args: str, **kw: object) -> RayJob:
        spec = RaySpec(command=(sys.executable, str(EXAMPLE), *args), **kw)
        jobs.append(RayJob(spec).start())
        return jobs[-1]

    yield make
    for job in jobs:
        job.stop()


def wait_until(what: str, cond: Callable[[], bool], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def steps(job: object) -> int:
    """The slowest member's step (0 for one that has not reported yet)."""
    reports = [0 if w.report is None else w.report.step for w in job.status().members]
    return min(reports, default=0)


@pytest.mark.timeout(300)
def test_ray_crash_recovery(ray_job, tmp_path: Path) -> None:
    # As tests/test_elastic_e2e.py does with local processes (SGD: see there why).
    total = 70
    job = ray_job(
        *("--steps", str(total), "--step-sleep", "0.25", "--optimizer", "sgd"),
        *("--step-sleep-until", str(tmp_path / "hurry")),
        *("--checkpoint", str(tmp_path / "ckpt"), "--save-every", "5"),
        *("--out", str(tmp_path / "final.pt")),
        nproc=2,
        min_workers=1,
        max_workers=2,
        stage=1,
        max_restarts=2,
        lease_timeout_s=3.0,
        grace_s=20,
        # as tests/test_elastic_e2e.py: a lost peer fails a collective in seconds
        env={"ZEROPLANE_COLLECTIVE_TIMEOUT_S": "15", "OMP_NUM_THREADS": "1"},
    )

    def training(world: int) -> None:
        def reporting() -> bool:
            report = job.status()
            return report.world_size == world and all(w.report for w in report.members)

        wait_until(f"{world} ranks reporting", reporting)
        start = steps(job)
        wait_until(f"{world} ranks training", lambda: steps(job) >= start + 3)

    training(2)
    wait_until("a checkpoint written", lambda: steps(job) >= 7)
    # a crashed worker process: the survivor recovers from the last checkpoint, the
    # actor starts the worker again, and it joins anew
    pid = job.worker_pid("ray-1")
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    training(1)
    training(2)
    assert job.worker_pid("ray-1") not in (None, pid)
    (tmp_path / "hurry").touch()  # the steps left at full speed
    result = job.wait(timeout=200)
    assert result.ok, result.message
    assert result.restarts == {"ray-0": 0, "ray-1": 1}
    assert worst(tmp_path / "final.pt", total, "sgd") < 1e-5


@pytest.mark.timeout(120)
def test_ray_job_fails_after_its_restarts_and_tears_down(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    from coordinator.launchers.ray_cluster import RayJob, RaySpec

    for k, v in RAY_ENV.items():
        monkeypatch.setenv(k, v)
    spec = RaySpec(
        command=(sys.executable, "-c", "import sys; sys.exit(3)"), nproc=2, max_restarts=1
    )
    with RayJob(spec) as job:
        result = job.wait(timeout=90)
        assert ray.is_initialized()
    assert result.returncode == 3 and "no restarts left (1)" in result.message
    assert max(result.restarts.values()) == 1
    assert not ray.is_initialized()  # the Ray instance it started is gone
