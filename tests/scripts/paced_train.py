"""A light training job that stays up to be observed (metrics, status page tests).

    zeroplane run --nproc 2 --stage 2 tests/scripts/paced_train.py --seconds 20

Trains a small GPT on the shipped corpus at about ``--rate`` optimizer steps per
second for ``--seconds``, reporting samples and tokens to the engine, then
leaves the job. Slow on purpose: the point is to be scraped, not to train.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch

import worker
from worker.demo import load_corpus
from worker.models import GPT, GPTConfig

MODEL = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument(
        "--stop-file", type=Path, help="stop at the first step boundary after this file exists"
    )
    p.add_argument("--rate", type=float, default=4.0, help="optimizer steps per second")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    torch.manual_seed(0)

    data = load_corpus()
    model = GPT(MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = worker.initialize(model, opt, config=worker.ZeroConfig(dtype=args.dtype))
    gen = torch.Generator().manual_seed(engine.rank)
    t = MODEL.block_size
    end = time.monotonic() + args.seconds
    next_step = time.monotonic()
    while time.monotonic() < end and not (args.stop_file and args.stop_file.exists()):
        starts = torch.randint(0, len(data) - t - 1, (args.batch,), generator=gen)
        rows = torch.stack([data[s : s + t + 1] for s in starts.tolist()]).long()
        loss = engine(rows[:, :-1], rows[:, 1:])
        engine.backward(loss)
        engine.step(samples=args.batch, tokens=args.batch * t)
        next_step += 1.0 / args.rate
        time.sleep(max(0.0, next_step - time.monotonic()))
    logging.info("rank %d done after %d steps", engine.rank, engine.global_steps)
    engine.close()


if __name__ == "__main__":
    main()
