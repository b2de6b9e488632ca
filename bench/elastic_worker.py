"""One worker of bench/elastic.py and bench/goodput.py: a ≈20M-parameter GPT on zeroplane.

Two ways to start, chosen by the environment:

* elastic: ``ZEROPLANE_COORDINATOR`` (+ ``ZEROPLANE_TOKEN``, ``ZEROPLANE_WORKER_ID``) is
  set; the coordinator assigns the rank and changes the membership live;
* static (what torchrun sets): ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``.
  SIGTERM then means "save a checkpoint at the next step boundary and exit 0", which
  is what a careful torchrun job does before its agent restarts it at a new size.

Every event goes as one JSON line (``time.time()`` stamps, flushed at once) to
``--events``; the engine's own log lines go to stderr with a timestamp.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

# Run from a checkout without installing the package.
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import worker  # noqa: E402
from worker.data import GlobalBatchSampler, share_of  # noqa: E402
from worker.demo import load_corpus  # noqa: E402
from worker.models import GPT, GPTConfig  # noqa: E402

# 19.08M parameters (tied embeddings): 6 blocks of 12·512² plus the embeddings
MODEL = GPTConfig(vocab_size=256, block_size=64, n_layer=6, n_head=8, n_embd=512)
# --model: the default above, or a 0.44M one for quick runs of the harnesses
MODELS = {
    "20m": MODEL,
    "small": GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128),
}


class Events:
    """Append-only JSON lines, one per event, flushed so the harness sees them at once."""

    def __init__(self, path: Path) -> None:
        self._f: TextIO = path.open("a", buffering=1)

    def __call__(self, ev: str, **fields: Any) -> None:
        self._f.write(json.dumps({"ev": ev, "t": time.time(), **fields}) + "\n")
        self._f.flush()


def save(engine: worker.ZeroEngine, path: Path, emit: Events, why: str) -> None:
    t0 = time.time()
    engine.save_checkpoint(path)
    emit("saved", t0=t0, step=engine.global_steps, world=engine.world_size, why=why)
    if engine.rank == 0:
        # only the newest is ever loaded again; older ones would fill the disk
        latest = (path / "latest").read_text().strip()
        for old in path.glob("step-*"):
            if old.name != latest:
                shutil.rmtree(old, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--events", type=Path, required=True, help="'{pid}' in it becomes this process's id"
    )
    p.add_argument("--model", choices=sorted(MODELS), default="20m")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--global-batch", type=int, default=6)
    p.add_argument("--seq", type=int, default=16, help="tokens per sequence (≤ 64)")
    p.add_argument("--bucket-numel", type=int, default=1 << 24)
    p.add_argument("--checkpoint", type=Path)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--resume", action="store_true", help="load the checkpoint's latest first")
    p.add_argument("--collective-timeout", type=float, default=15.0)
    p.add_argument(
        "--replica-every",
        type=int,
        default=0,
        help="elastic: in-memory replicas every this many steps (ZeroConfig.replica_interval)",
    )
    p.add_argument(
        "--no-gradient-log",
        action="store_true",
        help="a crash rolls back to the replicas (ZeroConfig.replica_gradient_log=False)",
    )
    args = p.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(created).3f %(levelname)s %(name)s: %(message)s"
    )
    torch.set_num_threads(1)
    # several workers of one launcher run the same command: one file each
    emit = Events(Path(str(args.events).replace("{pid}", str(os.getpid()))))
    emit("imported", pid=os.getpid())

    data = load_corpus()
    t = args.seq
    sampler = GlobalBatchSampler((len(data) - 1) // t, args.global_batch, seed=0)
    torch.manual_seed(0)
    model = GPT(MODELS[args.model])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    config = worker.ZeroConfig(
        stage=args.stage,
        bucket_numel=args.bucket_numel,
        replica_interval=args.replica_every,
        replica_gradient_log=not args.no_gradient_log,
    )

    stop = False
    elastic = bool(os.environ.get("ZEROPLANE_COORDINATOR"))
    if not elastic:
        # torchrun-style: the group comes from the environment; no coordinator
        dist.init_process_group(
            "gloo", timeout=timedelta(seconds=args.collective_timeout), init_method="env://"
        )

        def on_sigterm(signum: int, frame: Any) -> None:
            nonlocal stop
            stop = True

        signal.signal(signal.SIGTERM, on_sigterm)
    engine = worker.initialize(model, opt, config=config)
    emit(
        "initialized",
        step=engine.global_steps,
        world=engine.world_size,
        rank=engine.rank,
        params=sum(p.numel() for p in model.parameters()),
    )
    if args.resume:
        t0 = time.time()
        engine.load_checkpoint(args.checkpoint)
        emit("loaded", t0=t0, step=engine.global_steps, world=engine.world_size)

    # The engine calls stats.end_step() once the optimizer step is done and before it
    # applies a membership change inside engine.step(); stamp that moment, so a step's
    # completion is not confused with the reshard that follows it.
    done = [0.0]
    end_step = engine.stats.end_step

    def end_step_stamped() -> None:
        done[0] = time.time()
        end_step()

    engine.stats.end_step = end_step_stamped

    # Saves and stops happen at the top of the loop, not after engine.step(): a worker
    # that joins a running job (inside initialize()) starts here at the same step
    # boundary as the members that just grew, so it takes part in the same save.
    # A fresh or resumed job does not save the step it starts at; a newcomer must.
    saved = engine.global_steps if args.resume or engine.global_steps == 0 else -1
    flag = torch.zeros(1, dtype=torch.int32)
    while engine.global_steps < args.steps:
        due = engine.global_steps % args.save_every == 0 and engine.global_steps != saved
        if args.checkpoint and due:
            try:
                save(engine, args.checkpoint, emit, "periodic")
            except worker.StepAborted:
                # a peer died during the save; the engine re-formed the job (elastic)
                emit("aborted", step=engine.global_steps, world=engine.world_size, rank=engine.rank)
                continue
            saved = engine.global_steps
        if not elastic:
            # every rank must stop at the same boundary: agree on the flag (one tiny all-reduce)
            flag.fill_(int(stop))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                if saved != engine.global_steps:
                    save(engine, args.checkpoint, emit, "stop")
                emit("exit", step=engine.global_steps)
                dist.destroy_process_group()
                return

        t0 = time.time()
        world = engine.world_size
        batch = sampler.batch_at(engine.global_steps)
        (mine,) = share_of(batch, engine)
        rows = torch.stack([data[i * t : i * t + t + 1] for i in mine]).long()
        try:
            loss = engine(rows[:, :-1], rows[:, 1:])
            forward_done = time.time()
            engine.backward(loss)
            backward_done = time.time()
            engine.step()
        except worker.StepAborted:
            # a peer died; the engine re-formed the job and rolled back to its checkpoint
            emit("aborted", step=engine.global_steps, world=engine.world_size, rank=engine.rank)
            continue
        except SystemExit:
            # after SIGTERM (elastic) the engine hands this rank's shards over and exits 0
            emit("left", step=engine.global_steps)
            raise
        # world: the world size the step was computed at; after: once engine.step() returned;
        # fwd/bwd: when the forward and the backward returned (where a slow step went)
        emit(
            "step",
            t0=t0,
            fwd=forward_done,
            bwd=backward_done,
            done=done[0],
            step=engine.global_steps,
            world=world,
            after=engine.world_size,
            rank=engine.rank,
            loss=round(loss.item(), 4),
        )
    engine.close()


if __name__ == "__main__":
    main()
