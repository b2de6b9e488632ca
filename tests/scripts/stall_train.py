"""A data-parallel job whose one rank stalls once, as a test asks, for the coordinator
to name (coordinator/control/stalls.py).

    ZEROPLANE_TEST_STALL=stuck ZEROPLANE_TEST_STALL_AT=4 \\
        zeroplane run --nproc 3 --min-nproc 2 tests/scripts/stall_train.py OUT_DIR

Three linear blocks with SGD on fixed random batches: step s trains ``batches[s]``
(12 rows, which every world of 1-4 ranks divides), each rank its share, so that the
result equals one process training the same batches (tests/test_stalls_job.py).
At step ``$ZEROPLANE_TEST_STALL_AT`` or the first after it with all
``$ZEROPLANE_TEST_STALL_WORLD`` ranks (default 3), the last rank, once
(``OUT_DIR/stalled`` says it did):

- ``stuck``: sleeps in the script, outside any collective;
- ``stop``: stops itself (SIGSTOP);
- ``diverge`` (three ranks): waits in a collective on a group of ranks 1 and 2,
  which rank 1, waiting in the step's first collective with rank 0, never joins:
  the ranks' collectives diverged, as a branch some ranks take makes them.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import worker
from worker.collectives import Collectives

sys.path.insert(0, str(Path(__file__).resolve().parent))
import elastic_loop

D, ROWS, LR = 12, 12, 0.1


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(D, D), nn.Linear(D, 2 * D), nn.Linear(2 * D, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return ((self.c(h).squeeze(-1) - y) ** 2).mean()


def build() -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    return model, torch.optim.SGD(model.parameters(), lr=LR)


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(ROWS, D, generator=g), torch.randn(ROWS, generator=g)) for _ in range(steps)
    ]


def main() -> None:
    args = elastic_loop.parser(__doc__.splitlines()[0], stage=3)
    kind = os.environ.get("ZEROPLANE_TEST_STALL", "")
    at = int(os.environ.get("ZEROPLANE_TEST_STALL_AT", "4"))
    world = int(os.environ.get("ZEROPLANE_TEST_STALL_WORLD", "3"))
    model, opt = build()
    # recovery in memory; every block its own stage-3 gather unit
    config = worker.ZeroConfig(stage=args.stage, replica_interval=1, stage3_min_unit_numel=16)
    engine = worker.initialize(model, opt, config=config)
    data = batches(args.steps)
    marker = args.out / "stalled"

    def step(s: int, share: int, shares: int) -> None:
        full = dist.get_world_size() == world
        last = dist.get_rank() == world - 1
        if kind == "diverge" and s >= at and full and not marker.exists():
            pair = dist.new_group([1, 2])  # every rank forms it
            if dist.get_rank() == 2:
                marker.write_text(kind)
                Collectives(pair).all_reduce(torch.ones(1))
        elif s >= at and full and last and not marker.exists():
            marker.write_text(kind)
            if kind == "stuck":
                time.sleep(3600)
            elif kind == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
        x, y = data[s]
        rows = slice(share * ROWS // shares, (share + 1) * ROWS // shares)
        # the mean over this rank's rows, weighted to the mean over the global batch
        loss = engine(x[rows], y[rows]) * (shares * (rows.stop - rows.start) / ROWS)
        engine.backward(loss)
        engine.step()

    elastic_loop.train(engine, args, step)


if __name__ == "__main__":
    main()
