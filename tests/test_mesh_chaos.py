"""Random membership events on elastic mesh jobs under ``zeroplane run`` (worker/elastic/
rings.py [Note: elastic by whole groups], worker/elastic/blocks.py [Note: elastic
blocks]): tp = 2, pp = 2, tp = 2 x pp = 2, ep = 2 and cp = 2, at stages 1-3, with
replicas every step and a checkpoint every few steps; SIGKILL of any worker (the
launcher replaces it), SIGTERM of any worker from outside the launcher (its group
leaves, or the launcher replaces it below --min-nproc), a whole group added (SIGUSR1)
or retired (SIGUSR2), at random moments. Every run must end with exit 0 and the
parameters of one process training the same batches with torch. A SIGKILLed rank of
an ep or cp job breaks its group: the others restore from replicas a group away
(worker/elastic/blocks.py [Note: a lost block]).

Seeded and replayable: ZEROPLANE_MESH_CHAOS_SEEDS=3,17 runs those seeds (the layout,
the stage, the events and their spacing come from the seed; the machine decides the
rest). ``python -m tests.test_mesh_chaos FIRST COUNT`` runs COUNT seeds from FIRST
outside pytest, one after another, and prints each outcome (the long soak).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.test_mesh_elastic import MeshRun

ROOT = Path(__file__).resolve().parent.parent
SEEDS = [int(s) for s in os.environ.get("ZEROPLANE_MESH_CHAOS_SEEDS", "140").split(",") if s]
STEPS = 40
EVENTS = ("kill", "term", "add", "retire")


@dataclass(frozen=True)
class Layout:
    """A job of whole groups: its mesh flags, (workers at the start, min, max), the
    test script it runs (tests/scripts/) and the module whose ``reference(steps)`` is
    that script's one-process torch run, and the events it takes."""

    mesh: tuple[str, ...]
    sizes: tuple[int, int, int]
    script: str
    reference: str
    events: tuple[str, ...] = EVENTS


LAYOUTS = (
    Layout(("--tp", "2"), (4, 2, 6), "mesh_elastic_train.py", "tests.test_mesh_elastic"),
    Layout(("--pp", "2"), (4, 2, 6), "mesh_elastic_train.py", "tests.test_mesh_elastic"),
    Layout(
        ("--pp", "2", "--tp", "2"), (4, 4, 8), "mesh_elastic_train.py", "tests.test_mesh_elastic"
    ),
    Layout(
        ("--ep", "2"),
        (4, 2, 6),
        "moe_elastic_train.py",
        "tests.test_moe_elastic",
    ),
    Layout(
        ("--cp", "2", "--cp-kind", "ring"),
        (4, 2, 6),
        "context_elastic_train.py",
        "tests.test_context_job",
    ),
)


@dataclass(frozen=True)
class Trial:
    seed: int
    layout: Layout
    stage: int
    # (seconds before it, kind, which worker: a fraction of the launcher's children)
    events: tuple[tuple[float, str, float], ...]

    def flags(self) -> tuple[str, ...]:
        nproc, low, high = self.layout.sizes
        return (
            "--nproc", str(nproc), "--min-nproc", str(low), "--max-nproc", str(high),
            "--max-restarts", "20",
        )  # fmt: skip

    def __str__(self) -> str:
        return f"seed {self.seed}: {' '.join(self.layout.mesh)} stage {self.stage}"


def plan(seed: int) -> Trial:
    rng = random.Random(seed)
    layout = LAYOUTS[seed % len(LAYOUTS)]
    # (a pipeline runs with stages 0-2: worker/pipeline_engine.py)
    stage = rng.choice((1, 2) if "--pp" in layout.mesh else (1, 2, 3))
    events = tuple(
        (rng.uniform(0.5, 4.0), rng.choice(layout.events), rng.random()) for _ in range(3)
    )
    return Trial(seed, layout, stage, events)


def _assert_matches_reference(trial: Trial, tmp: Path) -> None:
    want = importlib.import_module(trial.layout.reference).reference(STEPS)
    got = torch.load(tmp / "final.pt", weights_only=True)
    assert set(got) == set(want)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst < 1e-5, f"the job differs from one process by {worst:.3g}"


def run_trial(trial: Trial, tmp: Path) -> list[str]:
    """One job under ``trial``'s events (returned: those sent before the job ended);
    raises AssertionError naming the trial where it fails or differs from torch."""
    run = MeshRun(
        tmp, *trial.flags(), stage=trial.stage, mesh=trial.layout.mesh, steps=STEPS,
        script=ROOT / "tests" / "scripts" / trial.layout.script,
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
        _assert_matches_reference(trial, tmp)
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
                outcome = f"passed {trial}: {done}"
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
