"""Elastic jobs with real worker processes and a real coordinator.

The invariant: data-parallel training on a constant global batch with the same
samples is the same computation at any world size, so a run that grows,
shrinks, or loses a worker and rolls back must end with the parameters of an
uninterrupted single-process run (within 1e-5 in fp32).

These runs use SGD with momentum. With Adam the comparison is not meaningful
past a few dozen steps: Adam divides by the root of tiny second moments, so
the last-bit differences of summing a batch in two halves instead of one grow
chaotically (measured on this model, single process, whole batch vs halves:
1e-5 after 20 steps, 2e-3 after 60). Adam's state moving between world sizes
is checked by tests/test_elastic_engine.py and tests/test_checkpoint.py over
fewer steps.
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from coordinator.control.server import CoordinatorServer, create_server
from coordinator.core.settings import CoordinatorConfig, MembershipConfig, PlanConfig, ServerConfig
from coordinator.launchers.spawner import ForkedProcess, ForkServer
from tests.coordinator_util import launched_workers
from tests.test_run_e2e import EXAMPLE, ROOT, reference

STEPS = 60
# the workers sleep --step-sleep after each step until this file (beside the logs)
# exists: slow while a test changes the membership, fast for the steps after that
HURRY = "hurry"


class Job:
    """A coordinator in this process and worker processes of examples/train_gpt.py."""

    def __init__(
        self,
        tmp: Path,
        stage: int,
        fork_server: ForkServer,
        *,
        max_workers: int = 4,
        join_window_s: float = 0.5,
        lease_s: float = 3.0,
        disconnect_grace_s: float | None = None,
    ) -> None:
        self.tmp, self.fork_server = tmp, fork_server
        self.token = secrets.token_urlsafe(16)
        self.config = config = CoordinatorConfig(
            server=ServerConfig(token=self.token, state_file=tmp / "coordinator.state"),
            membership=MembershipConfig(
                min_workers=2,
                max_workers=max_workers,
                join_window_s=join_window_s,
                lease_timeout_s=lease_s,
                heartbeat_interval_s=0.5,
                disconnect_grace_s=disconnect_grace_s,
            ),
            plan=PlanConfig(stage=stage, precision="fp32"),
        )
        self.server: CoordinatorServer
        self.server, _ = create_server(config)
        self.server.start()
        self.workers: dict[str, ForkedProcess] = {}

    def spawn(self, name: str, *extra: str, script: Path = EXAMPLE) -> ForkedProcess:
        env = {
            **os.environ,
            "ZEROPLANE_COORDINATOR": self.server.address,
            "ZEROPLANE_TOKEN": self.token,
            "ZEROPLANE_WORKER_ID": name,
            "ZEROPLANE_COLLECTIVE_TIMEOUT_S": "15",
            "OMP_NUM_THREADS": "1",
        }
        cmd = [
            sys.executable,
            str(script),
            "--steps",
            str(STEPS),
            "--step-sleep",
            "0.25",
            "--optimizer",
            "sgd",
            "--out",
            str(self.tmp / "final.pt"),
            "--step-sleep-until",
            str(self.tmp / HURRY),
            *extra,
        ]
        with (self.tmp / f"{name}.log").open("w") as log:
            proc = self.fork_server.fork(cmd, env, cwd=ROOT, output=log)
        self.workers[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()

    def wait_until(self, what: str, cond: Callable[[], bool], timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {n}\n{self.log(n)[-2000:]}" for n in self.workers)
                raise AssertionError(f"timed out waiting for {what}\n{logs}")
            time.sleep(0.1)

    def step(self) -> int:
        """The step every member has reached (0 while one has not reported yet)."""
        members = self.server.status().members
        return min((0 if w.report is None else w.report.step for w in members), default=0)

    def state_of(self, name: str) -> str | None:
        """The coordinator's word for worker ``name`` (member, standby, lost), or None."""
        row = self.server.status().worker(name)
        return None if row is None else row.state

    def world_size(self) -> int:
        return self.server.status().world_size

    def finish(self, timeout: float = 120) -> dict[str, int]:
        """Wait for every worker to exit, letting the job's remaining steps run at
        full speed (the test has done what it needed the slow steps for)."""
        (self.tmp / HURRY).touch()
        codes = {}
        for name, proc in self.workers.items():
            try:
                codes[name] = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{name} did not finish:\n{self.log(name)[-3000:]}") from None
        return codes

    def restart_coordinator(self, downtime_s: float) -> None:
        """Stop the coordinator, leave it down a while, start a new one on the same
        port from its state file."""
        port = int(self.server.address.rsplit(":", 1)[1])
        self.server.stop()
        time.sleep(downtime_s)
        server = dataclasses.replace(self.config.server, port=port)
        self.server, _ = create_server(dataclasses.replace(self.config, server=server))
        self.server.start()

    def close(self) -> None:
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        self.server.stop()


@pytest.fixture
def job_factory(tmp_path: Path, fork_server: ForkServer) -> Iterator[Callable[..., Job]]:
    jobs: list[Job] = []

    def make(stage: int, **kw) -> Job:
        jobs.append(Job(tmp_path, stage, fork_server, **kw))
        return jobs[-1]

    yield make
    for job in jobs:
        job.close()


def assert_matches_reference(path: Path, warmup: int = 0, global_batch: int = 12) -> None:
    got = torch.load(path, weights_only=True)
    want = reference(STEPS, global_batch, optimizer="sgd", warmup=warmup)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst < 1e-5, f"elastic run differs from the uninterrupted reference by {worst:.3g}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("stage", "flags"),
    [(1, ("--global-batch", "10", "--micro-batch", "2")), (3, ("--replica-every", "1"))],
)
def test_grow_2_to_3_then_sigterm_back_to_2(job_factory, stage: int, flags) -> None:
    """With a replica refreshed at every step, both changes come at a boundary that
    would refresh ([Note: a refresh overlaps a step]: the change refreshes instead).
    At stage 1 the global batch is 10, which 3 ranks do not divide: shares of 4, 3
    and 3 in two micro-batches each (worker/data/sampler.py [Note: uneven shares])."""
    job = job_factory(stage)
    job.spawn("w0", *flags)
    job.spawn("w1", *flags)
    job.wait_until("two ranks training", lambda: job.world_size() == 2 and job.step() >= 4)
    pids = {n: p.pid for n, p in job.workers.items()}
    job.spawn("w2", *flags)
    job.wait_until("three ranks", lambda: job.world_size() == 3)
    joined = job.step()

    def newcomer_step() -> int:
        report = job.server.status().worker("w2").report
        return 0 if report is None else report.step

    # w2's own report: it has timed its steps, so it announces its leave
    job.wait_until("three ranks training", lambda: newcomer_step() >= joined + 3)
    assert job.step() < STEPS - 10, "the job is too fast for this test to resize it"
    job.workers["w2"].send_signal(signal.SIGTERM)
    job.wait_until("back to two", lambda: job.world_size() == 2)
    codes = job.finish()
    assert codes == {"w0": 0, "w1": 0, "w2": 0}, codes
    # survivors never restarted: same processes from start to end
    assert {n: job.workers[n].pid for n in ("w0", "w1")} == pids
    assert "grew to 3 ranks" in job.log("w0")
    assert "handed over" in job.log("w2")
    # announced first, then handed over once the survivors wrote their buffers
    # (worker/elastic/change.py [Note: a leave prepared ahead])
    for name in ("w0", "w1"):
        assert "of 2 (prepared ahead)" in job.log(name), job.log(name)[-3000:]
    batch = int(flags[flags.index("--global-batch") + 1]) if "--global-batch" in flags else 12
    assert_matches_reference(job.tmp / "final.pt", global_batch=batch)


@pytest.mark.timeout(240)
def test_sigterm_while_joining_is_a_graceful_leave(job_factory) -> None:
    """A pod deleted while it starts: the SIGTERM lands while the newcomer forms the
    group and is handed its shards; it must hand them back at its first step
    boundary and exit 0."""
    job = job_factory(2)
    job.spawn("w0")
    job.spawn("w1")
    job.wait_until("two ranks training", lambda: job.world_size() == 2 and job.step() >= 4)
    job.spawn("w2")
    # admitted, and now forming the group or being handed its shards
    job.wait_until("w2 admitted", lambda: "joining generation" in job.log("w2"))
    job.workers["w2"].send_signal(signal.SIGTERM)
    codes = job.finish()
    assert codes == {"w0": 0, "w1": 0, "w2": 0}, codes
    assert "handed over" in job.log("w2")
    assert_matches_reference(job.tmp / "final.pt")


@pytest.mark.timeout(240)
def test_sigterm_while_standing_by_leaves_without_joining(job_factory) -> None:
    """A worker waiting for a place in a full job (max_workers reached) is told to
    stop: it leaves the coordinator and exits 0; the members never see it."""
    job = job_factory(2, max_workers=2)
    # long enough to outlast w2's start-up however slow: the workers are killed at the end
    job.spawn("w0", "--steps", "2000")
    job.spawn("w1", "--steps", "2000")
    job.wait_until("two ranks training", lambda: job.world_size() == 2 and job.step() >= 2)
    generation = job.server.status().generation_id
    standby = job.spawn("w2", "--steps", "2000")
    job.wait_until("w2 standing by", lambda: job.state_of("w2") == "standby")
    standby.send_signal(signal.SIGTERM)
    assert standby.wait(timeout=30) == 0, job.log("w2")
    assert "left the job" in job.log("w2")
    assert job.state_of("w2") is None
    assert job.server.status().generation_id == generation
    assert all(p.poll() is None for n, p in job.workers.items() if n != "w2")


@pytest.mark.timeout(240)
def test_a_finishing_job_admits_nobody(job_factory, tmp_path, monkeypatch) -> None:
    """Workers added while the members are past their last step (saving, say): one
    admitted into a generation the members will never form, one standing by. When
    the members end, both are told the job is done and exit 0; nothing re-forms."""
    release = tmp_path / "release"
    monkeypatch.setenv("LINGER_UNTIL", str(release))
    job = job_factory(2, max_workers=3)
    lingering = ROOT / "tests" / "scripts" / "linger_after_training.py"
    for name in ("w0", "w1"):
        job.spawn(name, "--step-sleep", "0", script=lingering)
    job.wait_until(
        "both members past their last step",
        lambda: all("lingering" in job.log(n) for n in ("w0", "w1")),
        timeout=120,
    )
    job.spawn("w2")
    job.wait_until("w2 admitted", lambda: job.state_of("w2") == "member")
    job.spawn("w3")
    job.wait_until("w3 standing by", lambda: job.state_of("w3") == "standby")
    formed = job.server.status().generation_id
    release.touch()
    codes = job.finish()
    assert codes == {"w0": 0, "w1": 0, "w2": 0, "w3": 0}, codes
    for name in ("w2", "w3"):
        assert "the job finished before this worker joined" in job.log(name), job.log(name)
    status = job.server.status()
    assert status.generation_id == formed, "a generation formed after the job finished"
    assert "finished" in [e.kind for e in status.events]
    assert_matches_reference(job.tmp / "final.pt")


@pytest.mark.timeout(240)
def test_a_leave_and_a_join_in_one_generation(job_factory) -> None:
    """The job is full and a worker stands by when a member is told to stop: the next
    generation both drops the leaver and admits the standby. The leaver hands its
    shards to the survivors, which pass the newcomer its share over the new group."""
    job = job_factory(1, max_workers=3)
    for name in ("w0", "w1", "w2"):
        job.spawn(name)
    job.wait_until("three ranks training", lambda: job.world_size() == 3 and job.step() >= 4)
    job.spawn("w3")
    job.wait_until("w3 standing by", lambda: job.state_of("w3") == "standby")
    assert job.step() < STEPS - 10, "the job is too fast for this test to resize it"
    leaver = job.server.status().worker("w2").rank
    job.workers["w2"].send_signal(signal.SIGTERM)
    codes = job.finish()
    assert codes == {"w0": 0, "w1": 0, "w2": 0, "w3": 0}, codes
    assert "handed over" in job.log("w2")
    assert "joined at step" in job.log("w3")
    logs = job.log("w0") + job.log("w1")
    # under load the workers join in any order: w2's rank is the one that left
    assert "recovered" not in logs and logs.count(f"rank {leaver} left; now rank") == 2, logs[
        -3000:
    ]
    assert_matches_reference(job.tmp / "final.pt")


@pytest.mark.timeout(240)
def test_a_leave_while_a_scale_up_is_pending_goes_first(job_factory, monkeypatch) -> None:
    """A newcomer was admitted and the members train on until it is ready to switch
    (worker/rendezvous.py [Note: meeting ahead]) when a member is told to stop. The
    leave goes first (worker/elastic/change.py [Note: a leave prepared ahead]). The
    generation the newcomer was admitted to still holds the leaver, so the survivor
    waits for the next one, which the newcomer joins. Nothing is recovered."""
    job = job_factory(1, max_workers=3)
    job.spawn("w0")
    job.spawn("w1")
    job.wait_until("two ranks training", lambda: job.world_size() == 2 and job.step() >= 4)
    proceed = job.tmp / "proceed"
    monkeypatch.setenv("ZEROPLANE_TEST_PROCEED", str(proceed))
    job.spawn("w2", script=ROOT / "tests" / "scripts" / "slow_to_prepare.py")
    job.wait_until("w2 admitted", lambda: job.world_size() == 3)
    assert job.step() < STEPS - 10, "the job is too fast for this test to resize it"
    leaver = job.server.status().worker("w1").rank
    job.workers["w1"].send_signal(signal.SIGTERM)
    job.wait_until("w1 gone", lambda: job.workers["w1"].poll() is not None)
    proceed.touch()
    codes = job.finish()
    assert codes == {"w0": 0, "w1": 0, "w2": 0}, codes
    assert "handed over" in job.log("w1")
    assert "joined at step" in job.log("w2")
    log = job.log("w0")
    assert "recovered" not in log, log[-3000:]
    assert f"rank {leaver} left; now rank 0 of 2 (prepared ahead)" in log, log[-3000:]
    assert_matches_reference(job.tmp / "final.pt")


@pytest.mark.timeout(240)
def test_a_newcomer_lost_in_a_leave_and_join_rolls_nothing_back(job_factory) -> None:
    """As above, but the newcomer dies as the survivors start passing it its share:
    the leaver's hand-over already made the survivors whole, so they re-form from
    that live state, with no replica or checkpoint and no step replayed."""
    job = job_factory(1, max_workers=3)
    for name in ("w0", "w1", "w2"):
        job.spawn(name)
    job.wait_until("three ranks training", lambda: job.world_size() == 3 and job.step() >= 4)
    newcomer = job.spawn("w3", script=ROOT / "tests" / "scripts" / "die_while_joining.py")
    job.wait_until("w3 standing by", lambda: job.state_of("w3") == "standby")
    assert job.step() < STEPS - 10, "the job is too fast for this test to resize it"
    job.workers["w2"].send_signal(signal.SIGTERM)
    assert newcomer.wait(timeout=90) == -signal.SIGKILL, job.log("w3")
    job.workers.pop("w3")
    codes = job.finish()
    assert codes == {"w0": 0, "w1": 0, "w2": 0}, codes
    assert "handed over" in job.log("w2")
    logs = job.log("w0") + job.log("w1")
    assert logs.count("from live state, nothing rolled back") == 2, logs[-3000:]
    assert_matches_reference(job.tmp / "final.pt")


@pytest.mark.timeout(240)
def test_below_min_workers_the_survivor_waits_for_a_newcomer(job_factory) -> None:
    """min_workers is 2 and one of the two leaves: the survivor holds the whole job
    and waits until a newcomer arrives, then passes it its share and carries on."""
    job = job_factory(2)
    job.spawn("w0")
    job.spawn("w1")
    job.wait_until("two ranks training", lambda: job.world_size() == 2 and job.step() >= 4)
    job.workers["w1"].send_signal(signal.SIGTERM)
    job.wait_until("w1 gone", lambda: job.workers["w1"].poll() is not None)
    assert "at least 2" in job.server.status().waiting_reason
    job.spawn("w2")
    codes = job.finish()
    assert codes == {"w0": 0, "w1": 0, "w2": 0}, codes
    assert "rank 1 left; now rank 0 of 2" in job.log("w0")
    assert "joined at step" in job.log("w2")
    assert_matches_reference(job.tmp / "final.pt")


@pytest.mark.timeout(240)
def test_newcomer_lost_while_joining_rolls_nothing_back(job_factory) -> None:
    """The members hold the whole job while a newcomer is being given its shards: if
    it dies then, they carry on from their own state, with no checkpoint or replica."""
    job = job_factory(3)
    job.spawn("w0")
    job.spawn("w1")
    job.wait_until("two ranks training", lambda: job.world_size() == 2 and job.step() >= 4)
    newcomer = job.spawn("w2", script=ROOT / "tests" / "scripts" / "die_while_joining.py")
    assert newcomer.wait(timeout=90) == -signal.SIGKILL, job.log("w2")
    job.workers.pop("w2")
    codes = job.finish()
    assert codes == {"w0": 0, "w1": 0}, codes
    logs = job.log("w0") + job.log("w1")
    assert logs.count("from live state, nothing rolled back") == 2, logs[-3000:]
    assert_matches_reference(job.tmp / "final.pt")


@pytest.mark.timeout(240)
def test_two_sigterms_at_once_scale_4_to_2(job_factory) -> None:
    """``kubectl scale --replicas=2`` from 4: both pods get SIGTERM together; they
    hand over one generation at a time and the job carries on at 2."""
    # the first generation forms when all four are there (max_workers), however slow
    job = job_factory(2, join_window_s=60.0)
    for name in ("w0", "w1", "w2", "w3"):
        job.spawn(name)
    job.wait_until("four ranks training", lambda: job.world_size() == 4 and job.step() >= 4)
    assert job.step() < STEPS - 15, "the job is too fast for this test to resize it"
    job.workers["w2"].send_signal(signal.SIGTERM)
    job.workers["w3"].send_signal(signal.SIGTERM)
    codes = job.finish()
    assert codes == {"w0": 0, "w1": 0, "w2": 0, "w3": 0}, codes
    assert "handed over" in job.log("w2") and "handed over" in job.log("w3")
    assert "now rank 0 of 2" in job.log("w0")
    assert_matches_reference(job.tmp / "final.pt")


def kill_and_recover(job: Job, victim: str, *, every: int, source: str) -> None:
    """SIGKILL ``victim`` of three, then check the survivors rolled back at most
    ``every`` steps (exactly 0 for ``every=0``), to ``source``, and still end equal
    to the reference."""
    job.wait_until("three ranks training", lambda: job.world_size() == 3 and job.step() >= 12)
    assert job.step() < STEPS - 10, "the job is too fast for this test to kill a worker"
    # a lower bound only: reports ride on heartbeats and lag training
    reported = max(w.report.step for w in job.server.status().members if w.report is not None)
    job.workers[victim].kill()
    job.wait_until("recovered on two", lambda: job.world_size() == 2)
    codes = job.finish()
    assert codes.pop(victim) == -signal.SIGKILL and set(codes.values()) == {0}, codes
    # under load the workers may have joined in any order: any survivor will do
    log = "".join(job.log(name) for name in codes)
    found = re.search(
        rf"recovered as rank \d of 2 at step (\d+) \(from {source}; "
        r"this rank had reached step (\d+); [0-9.]+s for the new generation, "
        r"[0-9.]+s to form its group, [0-9.]+s to restore\)",
        log,
    )
    assert found, log[-3000:]
    recovered, reached = int(found.group(1)), int(found.group(2))
    assert reached >= reported, (reported, reached)
    if every:
        assert recovered % every == 0 and 0 <= reached - recovered <= every, (reached, recovered)
    else:
        assert recovered == reached, (reached, recovered)
    assert_matches_reference(job.tmp / "final.pt")


@pytest.mark.timeout(240)
def test_sigkill_rolls_back_to_the_last_checkpoint(job_factory) -> None:
    job = job_factory(2)
    ckpt = str(job.tmp / "ckpt")
    for name in ("w0", "w1", "w2"):
        job.spawn(name, "--checkpoint", ckpt, "--save-every", "5")
    kill_and_recover(job, "w2", every=5, source=re.escape(ckpt))


@pytest.mark.timeout(240)
def test_workers_train_through_a_coordinator_restart(job_factory) -> None:
    job = job_factory(2)
    job.spawn("w0")
    job.spawn("w1")
    job.wait_until("training", lambda: job.world_size() == 2 and job.step() >= 5)
    generation = job.server.status().generation_id
    before = job.step()
    job.restart_coordinator(downtime_s=2.0)
    status = job.server.status()
    # the restarted coordinator knows the running generation from its state file
    assert status.generation_id == generation and status.world_size == 2
    job.wait_until("re-attached and reporting progress", lambda: job.step() > before + 8)
    assert job.server.status().generation_id == generation, "the restart re-formed the job"
    codes = job.finish()
    assert codes == {"w0": 0, "w1": 0}, codes
    assert_matches_reference(job.tmp / "final.pt")


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("stage", "forward"), [(1, True), (3, False)], ids=["forward", "rollback"])
def test_sigkill_recovers_from_in_memory_replicas(job_factory, stage: int, forward: bool) -> None:
    """No checkpoint at all. With the gradient log (the default) the survivors keep
    their state and the lost rank's is rebuilt at their step from a replica up to 6
    steps older: nothing is trained again ([Note: rolling a lost rank forward]).
    Without it they roll back to the replicas' step (here up to 4 steps)."""
    job = job_factory(stage)
    flags = ("--replica-every", "7") if forward else ("--replica-every", "5", "--no-gradient-log")
    for name in ("w0", "w1", "w2"):
        job.spawn(name, *flags)
    if forward:
        try:
            source = r"live state; lost rank\(s\) \[\d\] brought forward.*?"
            kill_and_recover(job, "w1", every=0, source=source)
        except AssertionError:
            # the one fallback left: a loss inside a step's go (a tiny all-reduce) can
            # let one survivor step and not the other ([Note: rolling a lost rank
            # forward]); anything else that kept the plan from "forward" fails here
            log = "".join(job.log(name) for name in ("w0", "w2"))
            plan = re.search(r"recovery plan replica .* from (.*)", log)
            if plan is None:
                raise
            steps = {int(t) for t in re.findall(r"live \(\d+, \d, 3\) at (\d+)", plan[1])}
            assert len(steps) == 2 and max(steps) - min(steps) == 1, log[-3000:]
            assert_matches_reference(job.tmp / "final.pt")
    else:
        # a kill right at a refresh leaves nothing to roll back: the replicas are of
        # the survivors' step, and the plan keeps their state ("brought forward" by
        # no logged step at all)
        kept = (
            r"live state; lost rank\(s\) \[\d\] brought forward from their replicas "
            r"and logged gradients \(0 step\(s\) here\), nothing rolled back"
        )
        kill_and_recover(job, "w1", every=5, source=f"(?:in-memory replicas|{kept})")


class LauncherRun:
    """`zeroplane run` of the example in the background, its output in a file."""

    def __init__(
        self,
        tmp: Path,
        *flags: str,
        stage: int = 2,
        script_flags: tuple[str, ...] = (),
        step_sleep: float = 0.25,
    ) -> None:
        self.tmp, self.out = tmp, tmp / "final.pt"
        cmd = [
            sys.executable, "-m", "coordinator.cli", "run", *flags, "--stage", str(stage),
            "--no-http", str(EXAMPLE), "--steps", str(STEPS), "--step-sleep", str(step_sleep),
            "--optimizer", "sgd", "--out", str(self.out),
            "--step-sleep-until", str(tmp / HURRY), *script_flags,
        ]  # fmt: skip
        self.log_path = tmp / "run.log"
        self.log = self.log_path.open("w+")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.log_path.read_text()

    def story(self, limit: int = 6000) -> str:
        """What happened, for a failure message: the membership, launcher and recovery
        lines (tracebacks cut to their last line), then the end of the log."""
        keep = ("coordinator.control.membership", "coordinator.launchers.local",
                "worker.rendezvous", "worker.elastic", "worker.reporting", "Error:",
                "zeroplane run:")  # fmt: skip
        lines = [ln[:240] for ln in self.text().splitlines() if any(k in ln for k in keep)]
        return "\n".join(lines)[-limit:] + "\n--- the log's end ---\n" + self.text()[-2000:]

    def wait_for(self, text: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.text():
            assert self.proc.poll() is None and time.monotonic() < deadline, (
                f"no {text!r}:\n{self.text()[-3000:]}"
            )
            time.sleep(0.1)

    def workers(self) -> list[int]:
        """The launcher's worker processes, oldest first."""
        return launched_workers(self.proc.pid)

    def wait(self, timeout: float = 120, *, hurry: bool = True) -> int:
        """The launcher's exit code; with ``hurry`` the steps left run at full speed."""
        if hurry:
            (self.tmp / HURRY).touch()
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.log.close()


@pytest.mark.timeout(240)
def test_zeroplane_run_scales_on_signals(tmp_path: Path) -> None:
    """Through a world size that does not divide the global batch (7 at 2 and 3 ranks,
    micro-batches of at most 2: padding on the ranks with the smaller share)."""
    run = LauncherRun(
        tmp_path, "--nproc", "2", "--min-nproc", "2", "--max-nproc", "3",
        script_flags=("--global-batch", "7", "--micro-batch", "2"),
    )  # fmt: skip
    try:
        run.wait_for("step 10 loss")
        run.proc.send_signal(signal.SIGUSR1)  # one more worker
        run.wait_for("grew to 3 ranks")
        run.proc.send_signal(signal.SIGUSR2)  # the newest hands over and leaves
        run.wait_for("now rank 0 of 2")
    finally:
        code = run.wait()
    assert code == 0, run.story()
    assert_matches_reference(run.out, global_batch=7)


@pytest.mark.timeout(240)
def test_a_crash_is_a_membership_event_in_an_elastic_run(tmp_path: Path) -> None:
    """Under `zeroplane run --min-nproc 2 --max-nproc 3` a SIGKILLed worker does
    not fail the job: the survivors recover from the replicas, the launcher starts
    a replacement, which joins, and the job ends as the uninterrupted reference."""
    run = LauncherRun(
        tmp_path, "--nproc", "3", "--min-nproc", "2", "--max-nproc", "3",
        script_flags=("--replica-every", "2"),
    )  # fmt: skip
    try:
        run.wait_for("step 10 loss")
        os.kill(run.workers()[1], signal.SIGKILL)
        run.wait_for("in its place (2 restart(s) left)")
        run.wait_for("joined at step")
    finally:
        code = run.wait()
    assert code == 0, run.story()
    assert "recovered as rank" in run.text()
    assert_matches_reference(run.out)


@pytest.mark.timeout(300)
def test_losing_every_holder_of_a_part_restarts_the_job_from_the_start(tmp_path: Path) -> None:
    """Two of three workers SIGKILLed at once: with one replica each, the part they
    held between them is gone and there is no checkpoint. The survivor says so and
    exits; the launcher's restarts bring fresh workers, which start again from the
    module (as a torchrun restart would) and end as the uninterrupted reference."""
    run = LauncherRun(
        tmp_path, "--nproc", "3", "--min-nproc", "2", "--max-nproc", "3", "--max-restarts", "6",
        stage=3,  # the module's values come back from under stage 3's sharded parameters
        script_flags=("--replica-every", "2"),
    )  # fmt: skip
    try:
        run.wait_for("step 10 loss")
        for pid in run.workers()[:2]:
            os.kill(pid, signal.SIGKILL)
        run.wait_for("neither in-memory replicas nor a checkpoint cover", timeout=120)
    finally:
        code = run.wait(timeout=200)
    assert code == 0, run.story()
    assert "every holder of the job's state was lost" in run.text()
    assert_matches_reference(run.out)


@pytest.mark.timeout(300)
def test_the_last_member_killed_after_a_hand_over_restarts_from_the_checkpoint(
    tmp_path: Path,
) -> None:
    """At --min-nproc 2 one worker leaves on a SIGTERM from outside (it hands its
    shards to the other) and the other is SIGKILLed as the leaver exits: nothing
    holds the job's state but the checkpoint. The leaver's exit 0 is a leave, not
    the end of training (the coordinator says so), so the launcher replaces both and
    the new workers resume from the checkpoint (found by chaos seed 6: the launcher
    took the exit for the end of training and failed the job)."""
    run = LauncherRun(
        tmp_path, "--nproc", "2", "--min-nproc", "2", "--max-nproc", "3", "--max-restarts", "4",
        script_flags=("--checkpoint", str(tmp_path / "ckpt"), "--save-every", "5"),
    )  # fmt: skip
    try:
        run.wait_for("step 10 loss")
        leaver, last = run.workers()[1], run.workers()[0]
        os.kill(leaver, signal.SIGTERM)
        run.wait_for("handed over at step")
        deadline = time.monotonic() + 30
        while Path(f"/proc/{leaver}").exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(last, signal.SIGKILL)
        run.wait_for("in its place", timeout=60)
    finally:
        code = run.wait(timeout=200)
    assert code == 0, run.story()
    assert_matches_reference(run.out)


@pytest.mark.timeout(240)
def test_a_worker_that_keeps_dying_stops_the_job(tmp_path: Path) -> None:
    """With no restarts left, a crash fails an elastic job with the worker's code."""
    run = LauncherRun(
        tmp_path, "--nproc", "2", "--min-nproc", "1", "--max-nproc", "2", "--max-restarts", "0",
    )  # fmt: skip
    try:
        run.wait_for("step 10 loss")
        os.kill(run.workers()[0], signal.SIGKILL)
    finally:
        code = run.wait()
    assert code == 128 + signal.SIGKILL, run.story()
    assert "no restarts left" in run.text()


@pytest.mark.timeout(240)
def test_retiring_a_worker_that_is_still_starting_is_a_clean_leave(tmp_path: Path) -> None:
    """SIGUSR1 then at once SIGUSR2: the new worker is told to leave while it may not
    have installed its handler yet; either way it leaves and the job ends at 0."""
    run = LauncherRun(tmp_path, "--nproc", "2", "--min-nproc", "2", "--max-nproc", "3")
    try:
        run.wait_for("step 10 loss")
        run.proc.send_signal(signal.SIGUSR1)
        run.wait_for("started worker 2")
        run.proc.send_signal(signal.SIGUSR2)
        # the job must outlast the new worker's start: at full speed once it is gone
        deadline = time.monotonic() + 90
        while len(run.workers()) > 2 and run.proc.poll() is None:
            assert time.monotonic() < deadline, run.story()
            time.sleep(0.2)
    finally:
        code = run.wait()
    assert code == 0, run.story()
    assert_matches_reference(run.out)


@pytest.mark.timeout(240)
def test_worker_restarted_under_its_old_name_rejoins(job_factory) -> None:
    """What a StatefulSet does: the crashed pod's container comes back under the same
    name before its lease runs out; the coordinator then forms one generation that
    loses the old rank and admits the new process, which must roll back with the
    survivors instead of being handed live state. (A closed connection alone would
    drop the old process sooner: the grace is as long as the lease here, so the
    new process registers first, as it does when a coordinator cannot see the
    connection close.)"""
    job = job_factory(2, lease_s=20.0, disconnect_grace_s=20.0)
    ckpt = str(job.tmp / "ckpt")
    for name in ("w0", "w1", "w2"):
        job.spawn(name, "--checkpoint", ckpt, "--save-every", "5")
    job.wait_until("three ranks training", lambda: job.world_size() == 3 and job.step() >= 8)
    job.workers["w1"].kill()
    job.workers["w1"].wait(timeout=10)
    first = job.workers.pop("w1")
    job.spawn("w1", "--checkpoint", ckpt, "--save-every", "5")
    codes = job.finish(timeout=180)
    assert first.returncode == -signal.SIGKILL
    logs = "".join(job.log(n) for n in job.workers)
    assert set(codes.values()) == {0}, f"{codes}\n{logs[-6000:]}"
    assert logs.count("recovered as rank") == 3, logs[-3000:]
    assert_matches_reference(job.tmp / "final.pt")


# ------------------------------------------- workers asked to leave from outside the launcher


@pytest.mark.timeout(240)
def test_a_worker_leaving_from_outside_below_the_minimum_is_replaced(tmp_path: Path) -> None:
    """A SIGTERM sent to a worker, not to the launcher, at --min-nproc: it hands over
    and exits 0, and the survivor cannot re-form without it. The launcher starts a
    worker in its place, as soon as the worker says it leaves or at its exit
    (coordinator/commands/keeping.py), and the job ends as the reference (before: the
    survivor waited for a generation that never formed)."""
    run = LauncherRun(tmp_path, "--nproc", "2", "--min-nproc", "2", "--max-nproc", "3")
    try:
        run.wait_for("step 10 loss")
        os.kill(run.workers()[1], signal.SIGTERM)
        run.wait_for("in its place")
    finally:
        code = run.wait(timeout=180)
    assert code == 0, run.story()
    assert "started worker 2 in its place" in run.text()
    assert_matches_reference(run.out)


@pytest.mark.timeout(240)
def test_a_worker_leaving_a_fixed_size_job_stops_it_at_once(tmp_path: Path) -> None:
    """Without --min-nproc below --nproc nothing may replace it: the job stops, saying
    why, and the survivors leave at once (before: they waited without end)."""
    run = LauncherRun(tmp_path, "--nproc", "2")
    started = time.monotonic()
    try:
        run.wait_for("step 10 loss")
        os.kill(run.workers()[1], signal.SIGTERM)
    finally:
        code = run.wait(timeout=120)
    assert code == 1, run.story()
    assert "fewer than the 2 it needs" in run.text(), run.story()
    assert "sending SIGKILL" not in run.text(), run.story()
    assert time.monotonic() - started < 100


@pytest.mark.timeout(240)
@pytest.mark.parametrize("target", ["launcher", "every worker"])
def test_every_member_asked_to_leave_stops_without_a_hand_over(tmp_path: Path, target: str) -> None:
    """SIGTERM to the launcher reaches every worker, and so does one sent to each:
    nobody is left to take a hand-over, so the members leave together (or the last
    one after the others handed it their shards), and the job says it stopped
    unfinished. Before, the members handed the state on until the last one had
    nobody to give it to and failed with a traceback."""
    run = LauncherRun(tmp_path, "--nproc", "3", "--min-nproc", "1", "--max-nproc", "3")
    try:
        run.wait_for("step 10 loss")
        if target == "launcher":
            run.proc.send_signal(signal.SIGTERM)
        else:
            for pid in run.workers():
                os.kill(pid, signal.SIGTERM)
    finally:
        code = run.wait(timeout=120)
    text = run.text()
    assert code == (128 + signal.SIGTERM if target == "launcher" else 1), run.story()
    assert "Traceback" not in text and "sending SIGKILL" not in text, run.story()
    assert "with nobody to hand the shards over to" in text, run.story()
    assert "in its place" not in text, run.story()
    if target != "launcher":
        assert "every worker left before training finished" in text, run.story()


@pytest.mark.timeout(240)
def test_a_retire_request_after_an_outside_sigterm_keeps_the_minimum(tmp_path: Path) -> None:
    """A worker SIGTERMed from outside says so at once (a heartbeat sent then), so a
    retire request (SIGUSR2) before its hand-over (steps are slow here) finds the
    job at --min-nproc members and retires nobody (before: the launcher counted it
    as a member until it had handed over, and retired a second worker)."""
    run = LauncherRun(
        tmp_path, "--nproc", "3", "--min-nproc", "2", "--max-nproc", "4", step_sleep=0.6
    )
    try:
        run.wait_for("step 10 loss")
        os.kill(run.workers()[0], signal.SIGTERM)
        run.wait_for("asked to leave; it goes at its next step boundary")
        run.proc.send_signal(signal.SIGUSR2)
        run.wait_for("already at 2 workers")
        run.wait_for(" left; now rank")  # the hand-over, then stop the job
        run.proc.send_signal(signal.SIGTERM)
    finally:
        code = run.wait(timeout=180)
    text = run.text()
    assert code == 128 + signal.SIGTERM, run.story()
    assert "asked worker" not in text and "in its place" not in text, run.story()
    assert text.count("handed over at step") == 1, run.story()
