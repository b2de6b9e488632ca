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

import sys
from pathlib import Path

import torch

import worker
from examples.train_long import batch, build_model
from worker.parallel import ParallelConfig

# the loop beside this script (a pod or the fork server runs it without the repository
# on the path)
sys.path.insert(0, str(Path(__file__).resolve().parent))
import elastic_loop

SHARES, LR = 6, 0.5


def global_batch(step: int) -> dict[str, torch.Tensor]:
    parts = [batch(step, s, rows=1, seq=32) for s in range(SHARES)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def main() -> None:
    args = elastic_loop.parser(__doc__.splitlines()[0], stage=3)
    model = build_model()
    engine = worker.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=LR),
        config=worker.ZeroConfig(stage=args.stage, replica_interval=1),
        parallel=ParallelConfig.from_env(),
    )

    def step(s: int, share: int, shares: int) -> None:
        rows = slice(share * SHARES // shares, (share + 1) * SHARES // shares)
        engine.backward(engine(**{k: v[rows] for k, v in global_batch(s).items()}).loss)
        engine.step()

    elastic_loop.train(engine, args, step)


if __name__ == "__main__":
    main()
