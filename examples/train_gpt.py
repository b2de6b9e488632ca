"""Train a small GPT on the shipped corpus with zeroplane.

    zeroplane run --nproc 2 --stage 2 examples/train_gpt.py --steps 50

The corpus is tokenized (bytes) and packed into sequences once, cached in
``--data-cache``; a ``StepLoader`` prepares each step's batch ahead in a
background thread. Each step takes the same global batch at any world size
(the loader's batches are a function of the global step), so the result does
not depend on how many workers ran it, or on a change of them mid-run.
``--out FILE`` writes the final fp32 parameters (rank 0); ``--checkpoint
DIR`` saves there every ``--save-every`` steps (the loader's position with
it) and resumes from it if it already holds one.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
from pathlib import Path

import torch

import worker
from worker.config import stage_from_env
from worker.data import (
    GlobalBatchSampler,
    LoaderConfig,
    PackedTokens,
    StepLoader,
    byte_tokenizer,
    pack_text_files,
)
from worker.demo import corpus_path
from worker.models import GPT, GPTConfig

MODEL = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)


def build(seed: int = 0, optimizer: str = "adamw") -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = GPT(MODEL)
    if optimizer == "sgd":
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def schedule(
    opt: torch.optim.Optimizer, warmup: int, total: int
) -> torch.optim.lr_scheduler.LambdaLR | None:
    """A linear warmup over ``warmup`` steps, then a cosine decay to a tenth of the
    rate by step ``total`` (none for ``warmup`` 0)."""
    if not warmup:
        return None

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(os.environ.get("ZEROPLANE_DATA_CACHE") or Path(base) / "zeroplane" / "packed")


def packed_corpus(cache_dir: Path) -> PackedTokens:
    """The corpus as bytes packed into samples of block_size + 1 (sample i starts at
    byte i * block_size), tokenized once and cached."""
    return pack_text_files(
        [corpus_path()], byte_tokenizer(), seq_len=MODEL.block_size, cache_dir=cache_dir
    )


def samples(data: torch.Tensor, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample i is the window of the corpus starting at i * block_size (the reference's
    batches, built without the loader)."""
    t = MODEL.block_size
    rows = torch.stack([data[i * t : i * t + t + 1] for i in indices]).long()
    return rows[:, :-1], rows[:, 1:]


def make_sampler(data: torch.Tensor, global_batch: int) -> GlobalBatchSampler:
    return GlobalBatchSampler((len(data) - 1) // MODEL.block_size, global_batch, seed=0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--global-batch", type=int, default=12)
    # samples per micro-batch on a rank (default: its whole share of the global batch)
    p.add_argument("--micro-batch", type=int)
    p.add_argument("--stage", type=int, default=stage_from_env(0))
    # the Kubernetes manifests pass the job spec's compression this way
    p.add_argument("--compression", default=os.environ.get("ZEROPLANE_COMPRESSION", "none"))
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    # the learning rate warms up over this many steps, then decays (0: constant)
    p.add_argument("--warmup", type=int, default=0)
    # ZeRO-Offload: the optimizer in host memory (stages 1-3), or also the parameters (3)
    p.add_argument("--offload", choices=("none", "optimizer", "all"), default="none")
    p.add_argument("--out", type=Path)
    p.add_argument("--checkpoint", type=Path)
    p.add_argument("--save-every", type=int, default=10)
    # keep in-memory replicas of the neighbour's shards every K steps (crash recovery)
    p.add_argument("--replica-every", type=int, default=0)
    # roll a crash back to the replicas instead of bringing the lost rank forward
    p.add_argument("--no-gradient-log", action="store_true")
    # slows the loop down so tests can change the membership while it runs; with
    # --step-sleep-until, only until that file exists (the test has done its part)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--step-sleep-until", type=Path)
    p.add_argument("--data-cache", type=Path, default=default_cache())
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)

    dataset = packed_corpus(args.data_cache)
    model, opt = build(optimizer=args.optimizer)
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    model.to(device)  # in place: the optimizer keeps the same parameters
    config = worker.ZeroConfig(
        stage=args.stage,
        compression=args.compression,
        replica_interval=args.replica_every,
        replica_gradient_log=not args.no_gradient_log,
        offload_optimizer="none" if args.offload == "none" else "cpu",
        offload_params="cpu" if args.offload == "all" else "none",
    )
    # the engine steps the scheduler and keeps it at its step when workers come and go
    scheduler = schedule(opt, args.warmup, args.steps)
    engine = worker.initialize(model, opt, config=config, lr_scheduler=scheduler)
    # the loader's position is saved in checkpoints and checked when one is loaded
    loader = StepLoader(
        dataset,
        LoaderConfig(global_batch=args.global_batch, micro_batch=args.micro_batch, seed=0),
        device=device,
    ).attach(engine)
    engine.progress(total=args.steps)  # zeroplane run shows step / total and an ETA
    # A worker that joined a running job got its shards from the members (global_steps
    # > 0); loading the checkpoint alone would be a collective the others are not in.
    if args.checkpoint and (args.checkpoint / "latest").exists() and engine.global_steps == 0:
        engine.load_checkpoint(args.checkpoint)

    while True:
        # Saved at the top of the loop, not after step(): a worker that joins at this
        # step boundary starts here, so it takes part in the same save as the members.
        if args.checkpoint and engine.checkpoint_due(args.save_every):
            try:
                engine.save_checkpoint(args.checkpoint)
            except worker.StepAborted:
                continue  # a peer was lost while saving; the engine rolled back
        if engine.global_steps >= args.steps:
            break
        # the batch is a function of the step: after a membership change or a
        # rollback the job continues at exactly the samples it would have used; the
        # engine accumulates over the micro-batches, however many this world makes
        try:
            for x, y in loader.current():
                loss = engine(x, y)
                engine.backward(loss)
                engine.step(samples=x.shape[0], tokens=x.numel())  # for the throughput metrics
        except worker.StepAborted:
            continue  # a peer was lost; the engine re-formed the job at global_steps
        if engine.rank == 0 and engine.global_steps % 10 == 0:
            # the last step's loss averaged over every rank (not a collective)
            logging.info("step %d loss %.4f", engine.global_steps, engine.mean_loss())
        if args.step_sleep and not (args.step_sleep_until and args.step_sleep_until.exists()):
            time.sleep(args.step_sleep)

    state = engine.full_state_dict()
    if args.out and engine.rank == 0:
        torch.save(state, args.out)
    loader.close()
    engine.close()


if __name__ == "__main__":
    main()
