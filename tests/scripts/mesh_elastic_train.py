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

import argparse
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

import worker
from worker.mesh import ParallelConfig
from worker.models import GPT, GPTConfig
from worker.pipeline import lm_loss

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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--step-sleep", type=float, default=0.4)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    data = batches(args.steps)
    model, opt = build()
    config = worker.ZeroConfig(stage=args.stage, replica_interval=1)
    engine = worker.initialize(
        model, opt, config=config, parallel=ParallelConfig.from_env(), loss_fn=lm_loss
    )
    while engine.global_steps < args.steps:
        step, n, r = engine.global_steps, engine.world_size, engine.rank
        x = data[step][r * GLOBAL_BATCH // n : (r + 1) * GLOBAL_BATCH // n]
        try:
            engine.train_batch([(x[:, :-1], x[:, 1:])])
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
