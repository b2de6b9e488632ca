"""Random membership events on elastic mesh jobs under ``zeroplane run`` (worker/elastic/
rings.py [Note: elastic by whole groups]): tp = 2, pp = 2 and tp = 2 x pp = 2, at
stages 1-3, with replicas every step and a checkpoint every few steps; SIGKILL of
any worker (the launcher replaces it), SIGTERM of any worker from outside the
launcher (its group leaves, or the launcher replaces it below --min-nproc), a whole
group added (SIGUSR1) or retired (SIGUSR2), at random moments. Every run must end
with exit 0 and the parameters of one process training the same batches with torch.

Seeded and replayable: ZEROPLANE_MESH_CHAOS_SEEDS=3,17 runs those seeds (the layout,
the stage, the events and their spacing come from the seed; the machine decides the
rest). ``python -m tests.test_mesh_chaos FIRST COUNT`` runs COUNT seeds from FIRST
outside pytest, one after another, and prints each outcome (the long soak).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.test_mesh_elastic import MeshRun, assert_matches_reference

SEEDS = [int(s) for s in os.environ.get("ZEROPLANE_MESH_CHAOS_SEEDS", "0").split(",") if s]
STEPS = 40
EVENTS = ("kill", "term", "add", "retire")
# (mesh flags, workers at the start, min, max): a job of whole groups
LAYOUTS = (
    (("--tp", "2"), 4, 2, 6),
    (("--pp", "2"), 4, 2, 6),
    (("--pp", "2", "--tp", "2"), 4, 4, 8),
)


@dataclass(frozen=True)
class Trial:
    seed: int
    mesh: tuple[str, ...]
    sizes: tuple[int, int, int]
    stage: int
    # (seconds before it, kind, which worker: a fraction of the launcher's children)
    events: tuple[tuple[float, str, float], ...]

    def flags(self) -> tuple[str, ...]:
        nproc, low, high = self.sizes
        return (
            "--nproc", str(nproc), "--min-nproc", str(low), "--max-nproc", str(high),
            "--max-restarts", "20",
        )  # fmt: skip


def plan(seed: int) -> Trial:
    rng = random.Random(seed)
    mesh, *sizes = LAYOUTS[seed % len(LAYOUTS)]
    stage = rng.choice((1, 2, 3))
    events = tuple((rng.uniform(0.5, 4.0), rng.choice(EVENTS), rng.random()) for _ in range(3))
    return Trial(seed, mesh, tuple(sizes), stage, events)  # type: ignore[arg-type]


def run_trial(trial: Trial, tmp: Path) -> list[str]:
    """One job under ``trial``'s events (returned: those sent before the job ended);
    raises AssertionError naming the trial where it fails or differs from torch."""
    run = MeshRun(
        tmp, *trial.flags(), stage=trial.stage, mesh=trial.mesh, steps=STEPS,
        script_flags=("--checkpoint", str(tmp / "ckpt"), "--save-every", "4"),
    )  # fmt: skip
    done: list[str] = []
    try:
        run.wait_until("the first steps", lambda: run.step() >= 3, timeout=180)
        for delay, kind, pick in trial.events:
            time.sleep(delay)
            if run.proc.poll() is not None or run.step() >= STEPS - 2:
                break
            if kind in ("kill", "term"):
                workers = run.workers()
                if not workers:
                    break
                victim = workers[int(pick * len(workers))]
                with contextlib.suppress(ProcessLookupError):  # it may have just left
                    os.kill(victim, signal.SIGKILL if kind == "kill" else signal.SIGTERM)
                done.append(f"{kind} {workers.index(victim)} of {len(workers)}")
            else:
                run.proc.send_signal(signal.SIGUSR1 if kind == "add" else signal.SIGUSR2)
                done.append(kind)
        run.finish(timeout=300)
    except AssertionError as exc:
        raise AssertionError(f"{trial}, done {done}: {exc}") from None
    finally:
        run.close()
    try:
        assert_matches_reference(tmp, STEPS)
    except AssertionError as exc:
        raise AssertionError(f"{trial}, done {done}: {exc}") from None
    return done


@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", SEEDS)
def test_random_events_on_an_elastic_mesh_end_as_torch(tmp_path: Path, seed: int) -> None:
    run_trial(plan(seed), tmp_path)


def main(first: int, count: int) -> int:
    failed = 0
    for seed in range(first, first + count):
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"mesh-chaos-{seed}-") as tmp:
            try:
                trial = plan(seed)
                done = run_trial(trial, Path(tmp))
                outcome = f"passed {' '.join(trial.mesh)} stage {trial.stage}: {done}"
            except AssertionError as exc:
                failed += 1
                outcome = f"FAILED {str(exc)[:6000]}"
                keep = Path(tempfile.gettempdir()) / f"mesh-chaos-{seed}.log"
                keep.write_text((Path(tmp) / "run.log").read_text(errors="replace"))
                outcome += f"\n(log kept in {keep})"
        print(f"seed {seed} {time.monotonic() - start:.0f}s {outcome}", flush=True)
    print(f"{count - failed} of {count} passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
