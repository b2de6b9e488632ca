"""A tensor-parallel job that an elastic test resizes and kills while it trains.

    zeroplane run --tp 2 --nproc 4 --min-nproc 2 --max-nproc 6 \
        tests/scripts/mesh_elastic_train.py OUT_DIR --steps 30

A tiny GPT with SGD on fixed random batches: step s trains ``batches[s]`` (12
sequences, which every dp width of 1, 2, 3 or 4 divides), each dp rank its
share by its dp rank and width at that step, so that the result equals one
process training the same batches (tests/test_mesh_elastic.py). The first rank
of the job writes ``OUT_DIR/step`` as it goes; steps are paced until
``OUT_DIR/hurry`` exists; ``OUT_DIR/final.pt`` gets the full parameters.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import worker
from worker.mesh import ParallelConfig
from worker.models import GPT, GPTConfig
from worker.pipeline import lm_loss

# the loop beside this script (a pod or the fork server runs it without the repository
# on the path)
sys.path.insert(0, str(Path(__file__).resolve().parent))
import elastic_loop

MODEL = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, tie_weights=False)
GLOBAL_BATCH = 12
LR = 0.2


def batches(steps: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(
        0, MODEL.vocab_size, (steps, GLOBAL_BATCH, MODEL.block_size + 1), generator=g
    )


def build() -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(MODEL)
    return model, torch.optim.SGD(model.parameters(), lr=LR)


def main() -> None:
    args = elastic_loop.parser(__doc__.splitlines()[0], stage=1)
    data = batches(args.steps)
    model, opt = build()
    config = worker.ZeroConfig(stage=args.stage, replica_interval=1)
    engine = worker.initialize(
        model, opt, config=config, parallel=ParallelConfig.from_env(), loss_fn=lm_loss
    )

    def step(s: int, share: int, shares: int) -> None:
        x = data[s][share * GLOBAL_BATCH // shares : (share + 1) * GLOBAL_BATCH // shares]
        engine.train_batch([(x[:, :-1], x[:, 1:])])

    elastic_loop.train(engine, args, step)


if __name__ == "__main__":
    main()
