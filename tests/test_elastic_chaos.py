"""Random sequences of membership events on a 3-worker `zeroplane run`: SIGKILL
of any worker (the launcher replaces it), SIGTERM of any worker from outside the
launcher (it hands over and leaves; below --min-nproc the launcher replaces it),
scale-down (SIGUSR2: the newest hands over and leaves), scale-up (SIGUSR1), at
random moments, at stages 1-3, under a warmup-then-cosine learning rate, some
seeds with one-sample micro-batches (the accumulation follows the world size)
or the optimizer offloaded. Every run must end with exit 0 and the parameters
of the uninterrupted reference.

Each job takes ``SEQUENCES`` sequences of three events one after another (a
later sequence starts on whatever the earlier left: replacements still joining,
replicas just refreshed), so the default seeds run 6 sequences in 3 jobs
(tests/test_mesh_chaos.py runs the meshes').

Seeded and replayable: ZEROPLANE_CHAOS_SEEDS=7,8 runs those seeds (the events
and their spacing come from the seed; the machine decides the rest).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from pathlib import Path

import pytest

from tests.test_elastic_e2e import LauncherRun, assert_matches_reference

SEEDS = [int(s) for s in os.environ.get("ZEROPLANE_CHAOS_SEEDS", "0,1,2").split(",")]
SEQUENCES = 2
EVENTS = ("kill", "term", "scale_down", "scale_up")
# the learning rate warms up, then decays: every worker, newcomers and survivors of
# a rollback included, must step with the uninterrupted run's rate
WARMUP = 15


def plan(seed: int) -> tuple[int, tuple[str, ...], list[tuple[float, str, float]]]:
    """The stage, the script's flags and the events: (delay before it in seconds, kind,
    victim pick). Every other triple of seeds rolls a crash back to the replicas
    instead of bringing the lost rank forward with the gradient log."""
    rng = random.Random(seed)
    stage = (1, 2, 3)[seed % 3]
    replicas = ("--replica-every", str(rng.choice((2, 5))))
    if (seed // 3) % 2:
        replicas += ("--no-gradient-log",)
    events = [
        (rng.uniform(0.3, 2.5), rng.choice(EVENTS), rng.random()) for _ in range(3 * SEQUENCES)
    ]
    # drawn last, so the events of a seed stay those of earlier versions: micro-batches
    # of one sample (the accumulation then follows the world size: 6, 4 or 3 per step)
    # and the optimizer offloaded to the host (crashes then roll back to the replicas)
    if rng.random() < 0.5:
        replicas += ("--micro-batch", "1")
    if rng.random() < 0.3:
        replicas += ("--offload", "optimizer")
    # a global batch that some or all of the world sizes 2-4 do not divide
    # (worker/data/sampler.py [Note: uneven shares])
    replicas += ("--global-batch", str(rng.choice((7, 10, 12))))
    return stage, replicas, events


@pytest.mark.timeout(360)
@pytest.mark.parametrize("seed", SEEDS)
def test_random_membership_events_end_as_the_reference(tmp_path: Path, seed: int) -> None:
    stage, replicas, events = plan(seed)
    run = LauncherRun(
        tmp_path, "--nproc", "3", "--min-nproc", "2", "--max-nproc", "4", "--max-restarts", "10",
        stage=stage,
        script_flags=(
            *replicas, "--checkpoint", str(tmp_path / "ckpt"), "--save-every", "10",
            "--warmup", str(WARMUP),
        ),
        step_sleep=0.4,  # room for six events before the job's 60 steps are done
    )  # fmt: skip
    done = []
    try:
        run.wait_for("step 10 loss")
        for delay, kind, pick in events:
            time.sleep(delay)
            if kind in ("kill", "term"):
                workers = run.workers()
                if not workers:
                    break  # the job has finished
                victim = workers[int(pick * len(workers))]
                with contextlib.suppress(ProcessLookupError):  # it may have just left
                    os.kill(victim, signal.SIGKILL if kind == "kill" else signal.SIGTERM)
                done.append(f"{kind} pid {victim} of {len(workers)}")
            else:
                if run.proc.poll() is not None:
                    break
                run.proc.send_signal(signal.SIGUSR2 if kind == "scale_down" else signal.SIGUSR1)
                done.append(kind)
    finally:
        code = run.wait(timeout=240)
    assert code == 0, f"seed {seed}, stage {stage}, {replicas}, events {done}:\n{run.story()}"
    batch = int(replicas[replicas.index("--global-batch") + 1])
    assert_matches_reference(run.out, warmup=WARMUP, global_batch=batch)
