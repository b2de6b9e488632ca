"""An expert-parallel job under ``zeroplane run`` grows and shrinks by whole ep groups
(worker/elastic/blocks.py [Note: elastic expert parallelism]): every survivor keeps
its place and its experts, the experts' shards re-shard over each place's ring and the
rest over the world, and the job ends equal to one process training the same batches
with torch alone."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from coordinator.control.arrangement import BlockArrangement, arrangement_for
from tests.coordinator_util import worker
from tests.scripts.moe_elastic_train import batches, build
from tests.test_mesh_elastic import STEPS

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "moe_elastic_train.py"
EP = ("--ep", "2")


def reference(steps: int) -> dict[str, torch.Tensor]:
    """One process, torch alone: the same model, SGD and batches."""
    model, opt = build()
    for x in batches(steps):
        model(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def test_an_expert_parallel_job_is_arranged_in_whole_ep_groups() -> None:
    assert not isinstance(arrangement_for(worker("w0")), BlockArrangement)
    ep = arrangement_for(worker("w0", experts=(2, 1000)))
    assert isinstance(ep, BlockArrangement) and (ep.tp, ep.pp) == (2, 1)
    cp = arrangement_for(worker("w0", context_parallel=4))
    assert isinstance(cp, BlockArrangement) and (cp.tp, cp.pp) == (4, 1)


def assert_matches_reference(tmp: Path) -> None:
    got = torch.load(tmp / "final.pt", weights_only=True)
    want = reference(STEPS)
    assert set(got) == set(want)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst < 1e-5, f"the elastic ep job differs from one process by {worst:.3g}"


@pytest.mark.timeout(300)
def test_an_ep_job_grows_by_an_ep_group_and_shrinks_back(mesh_job) -> None:
    job = mesh_job(
        "--nproc", "4", "--min-nproc", "4", "--max-nproc", "6", stage=3, mesh=EP, script=SCRIPT
    )
    job.wait_until("four ranks training", lambda: job.world() == 4 and job.step() >= 3)
    job.pace(3.0)  # while the newcomers start (a loaded machine takes tens of seconds)
    job.proc.send_signal(signal.SIGUSR1)  # a whole ep group: two workers
    job.wait_until("six ranks", lambda: job.world() == 6)
    grown = job.step()
    job.pace(0.4)
    job.wait_until("six ranks training", lambda: job.step() >= grown + 3)
    assert job.step() < STEPS - 4, "the job is too fast for this test to resize it"
    job.proc.send_signal(signal.SIGUSR2)  # the newest ep group leaves
    job.wait_until("back to four", lambda: job.world() == 4)
    text = job.finish()
    # the first four were never restarted: four registrations, then the group's two
    assert text.count("INFO coordinator.control.membership: registered") == 6, text[-4000:]
    assert "grew to 6 ranks" in text and "joined at step" in text
    assert "with its group, ranks [4, 5]" in text
    assert "recovered" not in text  # no step was abandoned
    assert_matches_reference(job.tmp)


@pytest.mark.timeout(300)
def test_a_leave_takes_its_ep_group_out_and_a_lost_rank_is_restored(mesh_job) -> None:
    """A SIGTERM from outside to one worker of the first ep group: it and its ep peer
    hand their shards over and leave; the survivors, renumbered, keep their places.
    Then a rank SIGKILLed: its ep peer stands by (their group is broken), the other
    group trains on from the replicas (each rank keeps a copy of the rank one group
    to its left: the same place, so the same experts), and the launcher's
    replacement completes the group again with the peer, which rejoins holding
    nothing (worker/elastic/blocks.py [Note: a lost block])."""
    job = mesh_job(
        "--nproc", "6", "--min-nproc", "2", "--max-nproc", "6", stage=1, mesh=EP, script=SCRIPT
    )
    job.wait_until("six ranks training", lambda: job.world() == 6 and job.step() >= 3)
    os.kill(job.workers()[0], signal.SIGTERM)
    job.wait_until("two ep groups", lambda: "with its group, ranks [0, 1]" in job.text())
    text = job.text()
    assert "leaving with rank" in text and "recovered" not in text, text[-4000:]
    # (a loss in the step after a leave may find no replica of the leavers: those of
    # the new membership are confirmed at its first step boundary; worker/elastic/
    # blocks.py [Note: a lost block])
    left = job.step()
    job.wait_until("four ranks training", lambda: job.step() >= left + 2)
    assert job.step() < STEPS - 6, "the job is too fast for this test to kill a rank"
    job.pace(2.0)  # while the replacement starts
    os.kill(job.workers()[-1], signal.SIGKILL)
    job.wait_until("the recovery", lambda: "recovered as" in job.text())
    job.wait_until("the group whole again", lambda: "rejoined as rank" in job.text())
    job.pace(0.4)
    text = job.finish()
    assert "(from in-memory replicas" in text, text[-4000:]
    assert_matches_reference(job.tmp)
