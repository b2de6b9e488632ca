"""Context-parallel jobs under ``zeroplane run --cp``: examples/train_long.py (a
transformers Llama as it comes, packed documents) against one process with torch
alone, and an elastic job grown and shrunk by whole cp groups
(worker/elastic/blocks.py [Note: elastic blocks])."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.reference import max_diff
from tests.test_mesh_elastic import STEPS

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_long.py"
SCRIPT = ROOT / "tests" / "scripts" / "context_elastic_train.py"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", [1, 2], ids=["cp", "tp-x-cp"])
def test_the_long_sequence_example_under_zeroplane_run_trains_like_torch(tmp_path, tp) -> None:
    """At tp = 2 a cp group is two dp indices at one tp position: the job's four ranks
    are one data-parallel share (the Llama's 4 query and 2 key/value heads split by tp,
    each rank's sequence shard by the ring)."""
    from examples.train_long import batch, build_model

    out, steps, world, cp = tmp_path / "final.pt", 3, 4, 2
    cmd = [
        sys.executable, "-m", "coordinator.cli", "run", "--nproc", str(world), "--cp", str(cp),
        "--tp", str(tp), "--cp-kind", "ring", "--no-http", str(EXAMPLE), "--steps", str(steps),
        "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "context parallel: cp=2 (ring)" in done.stdout + done.stderr
    if tp > 1:
        assert "mesh pp=1 dp=2 tp=2" in done.stdout + done.stderr

    ref = build_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for step in range(steps):
        parts = [batch(step, share) for share in range(world // (cp * tp))]
        whole = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        ref(**whole).loss.backward()
        opt.step()
        opt.zero_grad()
    diff, name = max_diff(torch.load(out, weights_only=True), dict(ref.named_parameters()))
    assert diff < 1e-5, f"{name} differs from torch by {diff:.3g}"


def test_run_refuses_a_cp_that_does_not_divide_the_job(capsys) -> None:
    from coordinator.cli import main

    assert main(["run", "--nproc", "3", "--cp", "2", str(EXAMPLE)]) == 2
    assert main(["run", "--nproc", "4", "--cp", "2", "--max-nproc", "5", str(EXAMPLE)]) == 2
    assert main(["run", "--nproc", "6", "--cp", "2", "--tp", "2", str(EXAMPLE)]) == 2
    assert (
        main(["run", "--nproc", "4", "--cp", "2", "--tp", "2", "--max-nproc", "8", str(EXAMPLE)])
        == 2
    )
    assert main(["run", "--nproc", "4", "--cp", "2", "--pp", "2", str(EXAMPLE)]) == 2
    # with --ep as well the job's block is lcm(ep, cp) ranks
    assert main(["run", "--nproc", "6", "--cp", "2", "--ep", "4", str(EXAMPLE)]) == 2
    assert "not a multiple of 4 (--ep 4 and --cp 2)" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_a_cp_job_grows_by_a_cp_group_shrinks_back_and_survives_a_lost_rank(
    tmp_path, mesh_job
) -> None:
    """Grown by a whole cp group, shrunk back, then a rank SIGKILLed: at the job's
    minimum the coordinator waits for the launcher's replacement, and the lost rank's
    cp peer and the others restore from the replicas, the replacement with them
    (worker/elastic/blocks.py [Note: a lost block])."""
    steps = STEPS + 6
    job = mesh_job(
        "--nproc", "4", "--min-nproc", "4", "--max-nproc", "6", stage=3,
        mesh=("--cp", "2", "--cp-kind", "ring"), script=SCRIPT, steps=steps,
    )  # fmt: skip
    job.wait_until("four ranks training", lambda: job.world() == 4 and job.step() >= 3)
    job.pace(3.0)  # while the newcomers start (a loaded machine takes tens of seconds)
    job.proc.send_signal(signal.SIGUSR1)  # a whole cp group: two workers
    job.wait_until("six ranks", lambda: job.world() == 6)
    grown = job.step()
    job.pace(0.4)
    job.wait_until("six ranks training", lambda: job.step() >= grown + 3)
    assert job.step() < STEPS - 4, "the job is too fast for this test to resize it"
    job.proc.send_signal(signal.SIGUSR2)  # the newest cp group leaves
    job.wait_until("back to four", lambda: "with its group, ranks [4, 5]" in job.text())
    text = job.text()
    assert text.count("INFO coordinator.control.membership: registered") == 6, text[-4000:]
    assert "grew to 6 ranks" in text and "recovered" not in text
    # (a loss in the step after a leave may find no replica of the leavers: those of
    # the new membership are confirmed at its first step boundary; worker/elastic/
    # blocks.py [Note: a lost block])
    shrunk = job.step()
    job.wait_until("four ranks training", lambda: job.step() >= shrunk + 2)
    assert job.step() < steps - 4, "the job is too fast for this test to kill a rank"
    job.pace(2.0)  # while the replacement starts
    os.kill(job.workers()[0], signal.SIGKILL)
    job.wait_until("the recovery", lambda: "recovered as" in job.text())
    job.pace(0.4)
    text = job.finish()
    assert "(from in-memory replicas" in text, text[-4000:]

    got = torch.load(tmp_path / "final.pt", weights_only=True)
    diff, name = max_diff(got, reference(steps))
    assert diff < 1e-5, f"{name} differs from torch by {diff:.3g}"


def reference(steps: int) -> dict[str, torch.Tensor]:
    """tests/scripts/context_elastic_train.py's model and batches, one process, torch alone."""
    from examples.train_long import build_model
    from tests.scripts.context_elastic_train import LR, global_batch

    ref = build_model()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(steps):
        ref(**global_batch(step)).loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in ref.named_parameters()}


@pytest.mark.timeout(300)
def test_sigterms_to_every_member_one_after_another_hand_over_to_the_replacements(
    tmp_path, mesh_job
) -> None:
    """A job of one cp group at its minimum: one member is asked to leave (the leave
    waits, its group being the whole job, and the launcher starts a group in its
    place), then the other. Every member is now leaving, but workers are on their way:
    the members train on, grow into the newcomers' generation and hand over to them,
    rather than stop the job (worker/elastic/change.py [Note: leaving with nobody to
    hand over to])."""
    steps = STEPS + 16  # (room for the replacements' start on a loaded machine)
    job = mesh_job(
        "--nproc", "2", "--min-nproc", "2", "--max-nproc", "4", stage=2,
        mesh=("--cp", "2", "--cp-kind", "ring"), script=SCRIPT, steps=steps,
    )  # fmt: skip
    job.wait_until("two ranks training", lambda: job.world() == 2 and job.step() >= 3)
    job.pace(1.0)  # while the replacements start
    first, second = job.workers()[:2]
    os.kill(first, signal.SIGTERM)
    job.wait_until("the leave waits", lambda: "waits until another group joins" in job.text())
    # (SIGTERMs to every member before the launcher saw one stay stop the job)
    job.wait_until("the replacements", lambda: job.text().count("in its place") == 2)
    os.kill(second, signal.SIGTERM)
    job.wait_until("both leavers gone", lambda: job.text().count("handed over at step") == 2)
    job.pace(0.0)  # (the rest of the job at its own pace)
    text = job.finish()
    assert "workers are on their way" in text and "grew to 4 ranks" in text, text[-4000:]
    assert "nobody to hand the shards over to" not in text
    assert "recovered" not in text

    got = torch.load(tmp_path / "final.pt", weights_only=True)
    diff, name = max_diff(got, reference(steps))
    assert diff < 1e-5, f"{name} differs from torch by {diff:.3g}"
