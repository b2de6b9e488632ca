"""Train a small GPT on a (pp, dp, tp) mesh: tensor or pipeline parallel, ZeRO over dp.

    zeroplane run --tp 2 --nproc 4 examples/train_mesh.py --steps 20
    zeroplane run --pp 2 --nproc 4 examples/train_mesh.py --stage 1

tp and pp come from the launcher ($ZEROPLANE_TP, $ZEROPLANE_PP); the process
group from torchrun's environment, which `zeroplane run` also sets (a mesh job
forms its own group: see README, "The device mesh"). Each step takes the same
global batch whatever the mesh.
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.distributed as dist

import worker
from worker.config import stage_from_env
from worker.mesh import ParallelConfig, parallelize
from worker.models import GPT, GPTConfig
from worker.pipeline import pipeline

MODEL = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=64, tie_weights=False)
GLOBAL_BATCH = 16


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--stage", type=int, default=None)
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    parallel = ParallelConfig.from_env(pipeline_schedule=args.schedule)
    config = worker.ZeroConfig(stage=args.stage if args.stage is not None else stage_from_env(1))
    torch.manual_seed(0)
    model = GPT(MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if parallel.pipeline_parallel > 1:
        engine = pipeline(model, opt, config=config, parallel=parallel)
    else:
        engine = parallelize(model, opt, config=config, parallel=parallel)
    dp, d = engine.shape.dp, engine.coords.dp
    rows = GLOBAL_BATCH // dp
    print(f"rank {dist.get_rank()}: mesh position {engine.coords}", flush=True)
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, MODEL.vocab_size, (GLOBAL_BATCH, MODEL.block_size), generator=g)
        idx = idx[rows * d : rows * (d + 1)]
        tgt = torch.roll(idx, 1, 1)
        if parallel.pipeline_parallel > 1:
            loss = engine.train_step(idx, tgt)
        else:
            out = engine(idx, tgt)
            engine.backward(out)
            engine.step()
            loss = out.item()
        if loss is not None and d == 0 and step % 5 == 0:
            print(f"step {step}: loss {loss:.4f}", flush=True)
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
