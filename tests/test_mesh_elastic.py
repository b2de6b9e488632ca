"""Elastic mesh jobs under ``zeroplane run`` (worker/elastic/rings.py
[Note: elastic by whole groups]; coordinator/core/meshplan.py [Note: arranging whole
groups]): a tp=2 job grows by a whole group and shrinks back, and a SIGKILLed rank
of a tp or a pp job recovers from its dp neighbour's replica, each ending equal to
one process training the same batches with torch alone."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from coordinator.control.membership import Membership
from coordinator.core.conversions import worker_from_proto, worker_to_proto
from coordinator.core.layout import ParamSpec
from coordinator.core.meshplan import MeshCoords, MeshShape, arrange_groups
from coordinator.core.messages import Generation
from coordinator.core.settings import MembershipConfig, PlanConfig
from coordinator.launchers.local import find_free_port
from tests.coordinator_util import Clock, launched_workers, worker
from tests.scripts.mesh_elastic_train import batches, build
from worker.live.restore_plan import (
    Holding,
    RestoreSource,
    current_rings,
    plan_rings,
    ring_lost,
)
from worker.pipeline import lm_loss

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "mesh_elastic_train.py"
STEPS = 24


def reference(steps: int) -> dict[str, torch.Tensor]:
    """One process, torch alone: the same model, SGD and batches."""
    model, opt = build()
    for x in batches(steps):
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


# ---------------------------------------------------------------- the plan, pure


def _c(dp: int, tp: int, pp: int = 0) -> MeshCoords:
    return MeshCoords(pp=pp, dp=dp, tp=tp)


def test_a_scale_up_keeps_every_members_coordinates() -> None:
    old = {f"m{d}{t}": _c(d, t) for d in range(2) for t in range(2)}
    got = arrange_groups(tp=2, pp=1, survivors=old, joiners=["x", "y", "z"], max_world=6)
    assert got.order == ("m00", "m01", "m10", "m11", "x", "y")
    assert got.admitted == ("x", "y") and got.standby == ()


def test_a_broken_group_is_completed_by_a_newcomer_in_the_lost_position() -> None:
    # dp=1's tp=1 rank was lost: its tp=0 peer keeps position tp=0, the newcomer takes tp=1
    old = {"a": _c(0, 0), "b": _c(0, 1), "c": _c(1, 0)}
    got = arrange_groups(tp=2, pp=1, survivors=old, joiners=["x"], max_world=4)
    assert got.order == ("a", "b", "c", "x")
    # without a newcomer the broken group's survivor stands by
    alone = arrange_groups(tp=2, pp=1, survivors=old, joiners=[], max_world=4)
    assert alone.order == ("a", "b") and alone.standby == ("c",)


def test_survivors_of_broken_groups_in_complementary_positions_form_one() -> None:
    old = {"a": _c(0, 0), "b": _c(0, 1), "c": _c(2, 0), "d": _c(1, 1)}
    got = arrange_groups(tp=2, pp=1, survivors=old, joiners=[], max_world=8)
    assert got.order == ("a", "b", "c", "d") and got.standby == ()


def test_a_survivor_holding_state_is_kept_before_newcomers_that_hold_none() -> None:
    """A scale-up's generation replaced before it formed: its newcomers (dp 1) hold
    nothing, the old group's survivor (dp 0, tp 1) holds what tp 1 trained. The
    newcomers' group is the more complete, but the holder must not stand by: a newcomer
    completes its group instead."""
    old = {"held": _c(0, 1), "n0": _c(1, 0), "n1": _c(1, 1)}
    got = arrange_groups(
        tp=2, pp=1, survivors=old, joiners=[], max_world=4, holders={"held"}
    )  # fmt: skip
    assert got.order == ("n0", "held") and got.standby == ("n1",)
    # (every survivor a holder: the most complete group stays together)
    got = arrange_groups(tp=2, pp=1, survivors=old, joiners=[], max_world=4)
    assert got.order == ("n0", "n1") and got.standby == ("held",)
    # a survivor asked to leave goes last at its position: its group's peers stay whole
    old = {"a0": _c(0, 0), "b0": _c(1, 0), "b1": _c(1, 1), "c0": _c(2, 0), "c1": _c(2, 1)}
    got = arrange_groups(tp=2, pp=1, survivors=old, joiners=[], max_world=6, leaving={"a0"})
    assert got.order == ("b0", "b1", "c0", "c1") and got.standby == ("a0",)


def test_groups_of_a_pipeline_and_tensor_mesh_follow_the_rank_order() -> None:
    got = arrange_groups(tp=2, pp=2, survivors={}, joiners=list("abcdefghi"), max_world=8)
    shape = MeshShape(pp=2, dp=2, tp=2)
    # group d holds the joiners 4d..4d+3, one per (pp, tp) position
    by_group = {}
    for rank, wid in enumerate(got.order):
        by_group.setdefault(shape.coords(rank).dp, set()).add(wid)
    assert by_group == {0: set("abcd"), 1: set("efgh")}


def _membership(low: int, high: int, names: list[str], mesh: tuple[int, int]) -> Membership:
    """A coordinator's membership with ``names`` registered for an elastic ``mesh``
    (tp, pp)."""
    clock = Clock()
    m = Membership(
        MembershipConfig(min_workers=low, max_workers=high, join_window_s=0.0),
        PlanConfig(stage=1, bucket_numel=1 << 16, align=2),
        clock=clock,
        wall_clock=clock,
    )
    for name in names:
        m.register(dataclasses.replace(worker(name), mesh=mesh), INVENTORY)
    return m


INVENTORY = [ParamSpec(name="w", shape=(64, 64), dtype="float32")]


def test_the_coordinator_forms_whole_groups_and_stands_a_broken_ones_survivor_by() -> None:
    m = _membership(2, 4, ["w0", "w1", "w2", "w3", "w4"], (2, 1))
    gen = m.maybe_form()
    assert gen is not None and gen.mesh == MeshShape(dp=2, tp=2)
    assert [mb.worker_id for mb in gen.members] == ["w0", "w1", "w2", "w3"]  # w4 waits
    m.process_exited("w3", "was killed by SIGKILL")  # dp=1 tp=1
    gen = m.maybe_form()
    assert gen is not None
    # w4 takes the lost position; w2 keeps dp's group and its tp index
    assert {mb.worker_id: gen.coords(mb.rank) for mb in gen.members} == {
        "w0": _c(0, 0), "w1": _c(0, 1), "w2": _c(1, 0), "w4": _c(1, 1),
    }  # fmt: skip
    m.process_exited("w1", "was killed by SIGKILL")
    gen = m.maybe_form()
    assert gen is not None and [mb.worker_id for mb in gen.members] == ["w2", "w4"]
    assert m.status().worker("w0").state == "standby"


def test_only_workers_whole_groups_can_hold_count_towards_the_minimum() -> None:
    """What the launcher counts against --min-nproc (coordinator/commands/keeping.py
    ``keep_minimum``): two survivors at one tp position make no group; at
    complementary positions they make one; a worker not registered yet fills a gap."""
    m = _membership(2, 4, ["w0", "w1", "w2", "w3"], (2, 1))
    gen = m.maybe_form()
    assert gen is not None
    at = {mb.worker_id: gen.coords(mb.rank) for mb in gen.members}
    tp0 = sorted(w for w, c in at.items() if c.tp == 0)
    tp1 = sorted(w for w, c in at.items() if c.tp == 1)
    assert m.placeable(tp1) == 0  # both at tp 1
    assert m.placeable([tp0[0], tp1[1]]) == 2  # complementary: one group
    assert m.placeable([*tp1, "not-yet-registered"]) == 2
    assert m.placeable([*tp0, *tp1]) == 4
    # a data-parallel job counts workers
    dp = _membership(2, 4, ["a", "b", "c"], (1, 1))
    assert dp.maybe_form() is not None and dp.placeable(["a", "b", "x"]) == 3


def _one_group_broken() -> tuple[Membership, dict[str, MeshCoords], list[str], Generation]:
    """pp=2 x tp=2 at dp=2, then dp 0's rank at (pp 1, tp 0) lost: (the membership, every
    worker's coordinates before, that group's three standbys, the generation without
    them)."""
    m = _membership(4, 8, [f"w{i}" for i in range(8)], (2, 2))
    gen = m.maybe_form()
    assert gen is not None and gen.mesh == MeshShape(pp=2, dp=2, tp=2)
    before = {mb.worker_id: gen.coords(mb.rank) for mb in gen.members}
    group = sorted((w for w, c in before.items() if c.dp == 0), key=lambda w: before[w].pp)
    lost = next(w for w in group if (before[w].pp, before[w].tp) == (1, 0))
    m.process_exited(lost, "was killed by SIGKILL")
    gen = m.maybe_form()
    assert gen is not None and gen.world_size == 4
    return m, before, [w for w in group if w != lost], gen


def _placed_back(gen: Generation | None, before: dict[str, MeshCoords], standbys: list[str]):
    """Each standby in its own (pp, tp) position, the newcomer "new" in the lost one."""
    assert gen is not None and gen.world_size == 8
    after = {mb.worker_id: gen.coords(mb.rank) for mb in gen.members}
    for w in standbys:
        assert (after[w].pp, after[w].tp) == (before[w].pp, before[w].tp), (w, after)
    assert (after["new"].pp, after["new"].tp) == (1, 0)
    return after


def test_a_standby_fills_only_the_position_its_engine_was_built_for() -> None:
    """pp=2 x tp=2: a rank of one group is lost, its three peers stand by; with a
    newcomer the group is whole again, each standby back in its own (pp, tp)
    position (its engine holds that stage and that slice) and the newcomer in the
    lost one, whatever their registration order."""
    m, before, standbys, _ = _one_group_broken()
    assert all(m.status().worker(w).state == "standby" for w in standbys)
    m.register(dataclasses.replace(worker("new"), mesh=(2, 2)), INVENTORY)
    after = _placed_back(m.maybe_form(), before, standbys)
    # every position of every dp index is filled once
    assert sorted((c.pp, c.dp, c.tp) for c in after.values()) == [
        (p, d, t) for p in range(2) for d in range(2) for t in range(2)
    ]


def test_after_a_coordinator_restart_a_standby_is_placed_where_its_engine_says() -> None:
    """The coordinator keeps standbys' positions in memory only; after a restart from
    its state file the standbys register again, each with the position its engine
    holds (``WorkerInfo.held``, set by the worker), and go back there: registered
    after a newcomer, in reverse order, and through the wire format."""
    m, before, standbys, gen = _one_group_broken()
    restarted = _membership(4, 8, [], (2, 2))
    restarted.restore(m.snapshot())
    for mb in gen.members:
        restarted.heartbeat(mb.worker_id, gen.id)
    restarted.register(dataclasses.replace(worker("new"), mesh=(2, 2)), INVENTORY)
    for w in reversed(standbys):
        info = dataclasses.replace(worker(w), mesh=(2, 2), held=before[w])
        restarted.register(worker_from_proto(worker_to_proto(info)), INVENTORY)
    _placed_back(restarted.maybe_form(), before, standbys)


def test_a_held_position_must_fit_the_mesh_asked_for() -> None:
    with pytest.raises(ValueError, match=r"WorkerInfo\.held is a mesh position"):
        dataclasses.replace(worker("a"), held=_c(0, 0))
    with pytest.raises(ValueError, match=r"WorkerInfo.held.tp must be in \[0, 1\], got 2"):
        dataclasses.replace(worker("a"), mesh=(2, 1), held=_c(0, 2))
    with pytest.raises(ValueError, match=r"WorkerInfo.held.pp must be in \[0, 2\], got 3"):
        dataclasses.replace(worker("a"), mesh=(2, 3), held=_c(0, 0, pp=3))
    # a degree left to the coordinator (0, --mesh auto) bounds nothing
    assert dataclasses.replace(worker("a"), mesh=(0, 0), held=_c(5, 3, pp=2)).held == _c(5, 3, 2)


def _held(live=None, step=-1, replicas=()) -> Holding:
    return Holding(live=live, replicas=tuple(replicas), holds_state=True, checkpoint=None,
                   live_step=step)  # fmt: skip


def test_every_ring_restores_the_same_step() -> None:
    # a scale-up: every ring whole and live at one step
    rings = [[_held((3, d, 2), 9) for d in range(2)] for _ in range(2)]
    assert plan_rings(rings).source is RestoreSource.LIVE
    # tp=1's dp=1 rank was lost: both rings roll back to the newest replica step
    # they all hold (ring 0 could go on live, it must not)
    both = [(3, 8, 0, 2)], [(3, 7, 0, 2), (3, 8, 0, 2)]
    rings = [
        [_held((3, 0, 2), 9, both[1]), _held((3, 1, 2), 9, [(3, 8, 1, 2)])],
        [_held((3, 0, 2), 9, both[0])],
    ]
    plan = plan_rings(rings)
    assert (plan.source, plan.generation, plan.step) == (RestoreSource.REPLICA, 3, 8)
    assert ring_lost(rings[1], 3, 8) == {1} and ring_lost(rings[0], 3, 8) == frozenset()


def test_a_rank_that_stood_by_brings_nothing() -> None:
    stale = _held((1, 1, 2), 4, [(1, 3, 1, 2)])
    rings = [[_held((2, 0, 1), 7, [(2, 6, 0, 1)]), stale], [_held((2, 0, 1), 7, [(2, 6, 0, 1)])]]
    current = current_rings(rings)
    assert not current[0][1].holds_state
    assert plan_rings(current).source is RestoreSource.LIVE


def test_a_ring_nobody_holds_is_not_covered() -> None:
    rings = [[_held((2, 0, 1), 7)], [Holding(None, (), False, None)]]
    with pytest.raises(RuntimeError, match="neither in-memory replicas nor a checkpoint"):
        plan_rings(rings)


# ---------------------------------------------------------------- zeroplane run


class MeshRun:
    """`zeroplane run --tp 2` of the script in the background, its output in a file."""

    def __init__(
        self,
        tmp: Path,
        *flags: str,
        stage: int,
        mesh: tuple[str, ...],
        step_sleep: float = 0.4,
        script: Path = SCRIPT,
        steps: int = STEPS,
        script_flags: tuple[str, ...] = (),
    ) -> None:
        self.tmp, self.port = tmp, find_free_port()
        cmd = [
            sys.executable, "-m", "coordinator.cli", "run", *mesh, *flags,
            "--progress", "off", "--http-port", str(self.port),
            str(script), str(tmp), "--steps", str(steps), "--stage", str(stage),
            "--step-sleep", str(step_sleep), *script_flags,
        ]  # fmt: skip
        self.log_path = tmp / "run.log"
        self.log = self.log_path.open("w+")
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=_env()
        )

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def pace(self, seconds: float) -> None:
        """Seconds between steps from now on (tests/scripts/elastic_loop.py): a grow
        test slows the job while its newcomers start, which on a loaded machine takes
        tens of seconds."""
        (self.tmp / "pace").write_text(str(seconds))

    def step(self) -> int:
        try:
            return int((self.tmp / "step").read_text() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def status(self) -> dict:
        url = f"http://127.0.0.1:{self.port}/api/status"
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.load(r)

    def world(self) -> int:
        try:
            return int(self.status().get("world_size", 0))
        except OSError:
            return 0

    def wait_until(self, what: str, ok: Callable[[], bool], timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            assert self.proc.poll() is None, f"the job ended before {what}:\n{self.text()[-4000:]}"
            assert time.monotonic() < deadline, f"no {what}:\n{self.text()[-4000:]}"
            time.sleep(0.1)

    def workers(self) -> list[int]:
        """The launcher's worker processes, oldest first."""
        return launched_workers(self.proc.pid)

    def finish(self, timeout: float = 180) -> str:
        (self.tmp / "hurry").touch()
        try:
            self.proc.wait(timeout=timeout)
        finally:
            self.close()
        text = self.text()
        assert self.proc.returncode == 0, text[-4000:]
        return text

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def assert_matches_reference(tmp: Path, steps: int = STEPS) -> None:
    got = torch.load(tmp / "final.pt", weights_only=True)
    want = reference(steps)
    assert set(got) == set(want)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst < 1e-5, f"the elastic mesh job differs from one process by {worst:.3g}"


@pytest.mark.timeout(300)
def test_a_tp_job_grows_by_a_group_and_shrinks_back(mesh_job) -> None:
    job = mesh_job("--nproc", "4", "--min-nproc", "4", "--max-nproc", "6", stage=1)
    job.wait_until("four ranks training", lambda: job.world() == 4 and job.step() >= 3)
    first = job.workers()
    assert len(first) == 4
    job.pace(3.0)  # while the newcomers start (a loaded machine takes tens of seconds)
    job.proc.send_signal(signal.SIGUSR1)  # a whole group: two workers
    job.wait_until("six ranks", lambda: job.world() == 6)
    grown = job.step()
    job.pace(0.4)
    doc = job.status()
    assert doc["mesh"] == {"pp": 1, "dp": 3, "tp": 2}
    coords = sorted((w["mesh"]["dp"], w["mesh"]["tp"]) for w in doc["workers"] if w.get("mesh"))
    assert coords == [(d, t) for d in range(3) for t in range(2)], doc["workers"]
    job.wait_until("six ranks training", lambda: job.step() >= grown + 3)
    assert job.step() < STEPS - 4, "the job is too fast for this test to resize it"
    job.proc.send_signal(signal.SIGUSR2)  # the newest group leaves
    job.wait_until("back to four", lambda: job.world() == 4)
    text = job.finish()
    # the first four were never restarted: four registrations, then the group's two
    assert text.count("INFO coordinator.control.membership: registered") == 6, text[-4000:]
    assert "restored from live" in text  # the scale-up keeps everyone's state
    assert "restored from replica" in text  # the leave: replicas of that very step
    assert "recovered" not in text  # no step was abandoned
    assert_matches_reference(job.tmp)


@pytest.mark.timeout(300)
def test_a_sigkilled_rank_of_a_tp_job_recovers_from_replicas(mesh_job) -> None:
    """Its tp peer stands by (its group is broken), the survivors train on as one
    group, and the launcher's replacement makes two groups again."""
    job = mesh_job("--nproc", "4", "--min-nproc", "2", "--max-nproc", "4", stage=3)
    job.wait_until("four ranks training", lambda: job.world() == 4 and job.step() >= 4)
    victim = job.workers()[-1]
    os.kill(victim, signal.SIGKILL)
    job.wait_until("the recovery", lambda: "recovered as" in job.text())
    job.wait_until("four ranks again", lambda: job.world() == 4)
    text = job.finish()
    assert "restored from replica" in text, text[-4000:]
    assert "its model-parallel or ep group is not whole" in text
    assert_matches_reference(job.tmp)


@pytest.mark.timeout(300)
def test_a_sigkilled_stage_of_a_pipeline_recovers_from_replicas(mesh_job) -> None:
    """pp=2 x dp=2 at stage 2: a rank of the last stage is lost; its stage's dp ring
    restores it from its neighbour's replica, the first stage's rolls back with it,
    and the pipeline's stages and schedule are rebuilt over the new pp groups."""
    job = mesh_job(
        "--nproc", "4", "--min-nproc", "2", "--max-nproc", "4", stage=2, mesh=("--pp", "2")
    )
    job.wait_until("four ranks training", lambda: job.world() == 4 and job.step() >= 4)
    os.kill(job.workers()[-1], signal.SIGKILL)
    job.wait_until("the recovery", lambda: "recovered as" in job.text())
    job.wait_until("four ranks again", lambda: job.world() == 4)
    text = job.finish()
    assert "restored from replica" in text, text[-4000:]
    assert_matches_reference(job.tmp)


@pytest.mark.timeout(300)
def test_a_tp_x_pp_job_grows_by_a_group_and_shrinks_back(mesh_job) -> None:
    """pp=2 x tp=2: groups of four; each stage's schedule and each tp group re-form."""
    # four workers start at once to grow it: on 2 cores that takes the job 20 steps
    # of 0.4 s, so its steps are slower here, for room to resize before it ends
    job = mesh_job("--nproc", "4", "--min-nproc", "4", "--max-nproc", "8", stage=1,
              mesh=("--pp", "2", "--tp", "2"), step_sleep=0.8)  # fmt: skip
    job.wait_until("four ranks training", lambda: job.world() == 4 and job.step() >= 3)
    job.pace(2.0)  # while the newcomers start
    job.proc.send_signal(signal.SIGUSR1)
    job.wait_until("eight ranks", lambda: job.world() == 8)
    assert job.status()["mesh"] == {"pp": 2, "dp": 2, "tp": 2}
    grown = job.step()
    job.pace(0.8)
    job.wait_until("eight ranks training", lambda: job.step() >= grown + 3)
    assert job.step() < STEPS - 4, "the job is too fast for this test to resize it"
    job.proc.send_signal(signal.SIGUSR2)
    job.wait_until("back to four", lambda: job.world() == 4)
    text = job.finish()
    assert "recovered" not in text
    assert_matches_reference(job.tmp)


@pytest.mark.timeout(300)
def test_a_sigkilled_rank_of_a_tp_x_pp_job_comes_back_whole(mesh_job) -> None:
    """pp=2 x dp=2 x tp=2 at stage 2: a rank is lost, its group's three others stand
    by (unless its replacement registers first) and the other group trains on from
    replicas; the launcher's replacement makes
    the group whole again, each standby back in its own stage and tp slice (the
    coordinator keeps their positions), and DTensor's cached decisions from the
    mesh of an earlier generation are forgotten (worker/compat.py forget_meshes)."""
    job = mesh_job("--nproc", "8", "--min-nproc", "4", "--max-nproc", "8", stage=2,
              mesh=("--pp", "2", "--tp", "2"))  # fmt: skip
    job.wait_until("eight ranks training", lambda: job.world() == 8 and job.step() >= 4)
    os.kill(job.workers()[2], signal.SIGKILL)
    job.wait_until("the recovery", lambda: "recovered as" in job.text())
    job.wait_until("eight ranks again", lambda: job.world() == 8)
    text = job.finish()
    assert "restored from replica" in text, text[-4000:]
    # (whether the three stood by depends on when the replacement registered)
    assert_matches_reference(job.tmp)


@pytest.mark.timeout(300)
def test_sigterms_to_a_whole_ring_keep_its_last_copy_until_a_newcomer_takes_it(mesh_job) -> None:
    """tp=2 x dp=2: both tp-0 ranks are asked to leave at once, from outside
    (worker/elastic/rings.py [Note: the last copy of a ring]). One leaves at a step
    boundary (every replica refreshed there, so nothing is trained again); the
    other holds the last copy of its ring and stays; the two tp-1 survivors make no
    group, so the launcher replaces the leavers (coordinator/commands/keeping.py,
    counting whole groups, as soon as they say they leave); a newcomer takes the
    tp-0 position and the deferred leaver goes. (A survivor without a group stands
    by, when the newcomers come late: the SIGKILL test asserts that.)"""
    job = mesh_job("--nproc", "4", "--min-nproc", "2", "--max-nproc", "4", stage=2)
    job.wait_until("four ranks", lambda: job.world() == 4)
    at = job.step()  # (a loaded machine may start with two and grow)
    job.wait_until("four ranks training", lambda: job.step() >= at + 2)
    pids = job.workers()
    tp0 = [
        int(w["worker_id"].rsplit("-", 1)[1])
        for w in job.status()["workers"]
        if (w.get("mesh") or {}).get("tp") == 0
    ]
    assert len(tp0) == 2, job.status()["workers"]
    job.pace(1.0)  # room for the replacement to start
    for index in tp0:
        os.kill(pids[index], signal.SIGTERM)
    job.wait_until("both leavers gone", lambda: job.text().count("left the job: asked to") == 2)
    job.pace(0.4)
    text = job.finish()
    assert "holds the last copy of its ring (pp 0, tp 0)" in text, text[-4000:]
    assert "in its place" in text  # the launcher replaced the leavers
    assert text.count("left the job: asked to leave") == 2
    assert "restored from replica" in text
    assert "restored from module" not in text and "recovered" not in text
    assert_matches_reference(job.tmp)
