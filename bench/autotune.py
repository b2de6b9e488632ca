"""The autotuner against the exhaustive grid, on real measured runs.

    python bench/autotune.py                       # 2 ranks, the tiny GPT, ~2 min on 2 idle cores
    python bench/autotune.py --gpt 2,64,2,32 --micro-batches 1,2,4,8,16 --json out/tune.json

One pool of ranks (coordinator/tuning/trial_pool.py) measures every candidate of the
space that the memory model lets fit (the grid, ``--repeat`` times, keeping
each candidate's median), then the tuner searches the same space twice: on
the grid's recorded measurements (the search logic on real numbers, no new
noise) and live, on fresh runs. Printed: the runs each took, and the best each
found as a ratio of the grid's best (by the grid's recorded throughput, so all
three are judged on the same numbers).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.commands.tune import profile_model
from coordinator.core.planner import parse_bytes
from coordinator.tuning.autotune import Candidate, Measurement, MemoryModel, TuneSpace, tune
from coordinator.tuning.trial_pool import TrialPool, TrialSettings


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--gpt", default="2,64,2,32", help="LAYERS,HIDDEN,HEADS,SEQ")
    p.add_argument("--stages", type=_ints, default=(0, 1, 2, 3))
    p.add_argument("--micro-batches", type=_ints, default=(1, 2, 4, 8, 16))
    p.add_argument("--buckets", type=_ints, default=(2**14, 2**18))
    p.add_argument("--compression", default="none,bf16")
    p.add_argument("--device-memory", type=parse_bytes, default=None)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeat", type=int, default=1, help="grid measurements per candidate")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    space = TuneSpace(
        stages=args.stages,
        micro_batches=args.micro_batches,
        activation_checkpointing=(False, True),
        bucket_numels=args.buckets,
        compressions=tuple(args.compression.split(",")),
    )
    settings = TrialSettings(model_args=("--gpt", args.gpt), warmup=1, steps=args.steps)
    started = time.monotonic()
    with TrialPool(args.nproc, settings) as pool:
        profile, seeds = profile_model(
            pool.measure,
            space,
            world_size=args.nproc,
            dtype="fp32",
            device_memory=args.device_memory,
        )
        memory = MemoryModel(profile)
        recorded: dict[Candidate, list[float]] = {}

        def measure_grid(c: Candidate) -> Measurement:
            runs = [pool.measure(c) for _ in range(args.repeat)]
            ok = [m.samples_per_s for m in runs if m.error is None]
            recorded[c] = ok
            if not ok:
                return runs[0]
            return Measurement(samples_per_s=statistics.median(ok))

        grid = tune(space, memory, measure_grid, strategy="grid")
        table = {c: statistics.median(v) for c, v in recorded.items() if v}

        def replay(c: Candidate) -> Measurement:
            if c not in table:
                return Measurement(error="not measured in the grid")
            return Measurement(samples_per_s=table[c])

        replayed = tune(space, memory, replay)
        live = tune(space, memory, pool.measure, seed_measurements=seeds)
    best = max(table.values())

    def judged(c: Candidate | None) -> float:
        return 0.0 if c is None else table.get(c, 0.0) / best

    rows = [
        ("grid", grid.trials, 1.0),
        ("coordinate, on the grid's numbers", replayed.trials, judged(replayed.best)),
        ("coordinate, live", live.trials, judged(live.best)),
    ]
    print(
        f"{args.nproc} ranks, GPT {args.gpt}, {profile.numel:,} parameters; "
        f"{grid.grid_size} candidates, {grid.pruned} pruned by the memory model; "
        f"{time.monotonic() - started:.0f}s"
    )
    print(f"{'search':<36}{'runs':>6}  best / grid's best")
    for name, runs, ratio in rows:
        print(f"{name:<36}{runs:>6}  {ratio:.3f}")
    print(f"grid's best: {grid.best.label() if grid.best else '-'} ({best:,.1f} samples/s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "grid": grid.as_dict(),
                    "replayed": replayed.as_dict(),
                    "live": live.as_dict(),
                    "rows": rows,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
