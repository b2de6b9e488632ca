"""A context-parallel job that an elastic test grows and shrinks by whole cp groups.

    zeroplane run --cp 2 --nproc 4 --min-nproc 4 --max-nproc 6 \
        tests/scripts/context_elastic_train.py OUT_DIR --steps 24

examples/train_long.py's Llama with SGD: step s trains the global batch of
``examples.train_long.batch(s, share)`` for every data-parallel share of a fixed
count (6, which 2 and 3 shares divide), each cp group its shares by its index and
the number of groups at that step, so that the result equals one process training
the same batches (tests/test_context_job.py). The first rank writes
``OUT_DIR/step``; steps are paced until ``OUT_DIR/hurry`` exists;
``OUT_DIR/final.pt`` gets the full parameters.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

import worker
from examples.train_long import batch, build_model
from worker.parallel import ParallelConfig

SHARES, LR = 6, 0.5


def global_batch(step: int) -> dict[str, torch.Tensor]:
    parts = [batch(step, s, rows=1, seq=32) for s in range(SHARES)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--step-sleep", type=float, default=0.4)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    model = build_model()
    engine = worker.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=LR),
        config=worker.ZeroConfig(stage=args.stage),
        parallel=ParallelConfig.from_env(),
    )
    while engine.global_steps < args.steps:
        share, shares = engine.data_rank
        whole = global_batch(engine.global_steps)
        rows = slice(share * SHARES // shares, (share + 1) * SHARES // shares)
        try:
            engine.backward(engine(**{k: v[rows] for k, v in whole.items()}).loss)
            engine.step()
        except worker.StepAborted:
            continue
        if dist.get_rank() == 0:
            (args.out / "step").write_text(str(engine.global_steps))
        if not (args.out / "hurry").exists():
            time.sleep(args.step_sleep)
    full = engine.full_state_dict()
    if dist.get_rank() == 0:
        torch.save(full, args.out / "final.pt")
    engine.close()


if __name__ == "__main__":
    main()
