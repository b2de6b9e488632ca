"""Train a small GPT with the one loop that runs under every layout.

    zeroplane run --nproc 2 examples/train_mesh.py --steps 20             # ZeRO over 2 ranks
    zeroplane run --tp 2 --nproc 4 examples/train_mesh.py --steps 20      # tp=2 x dp=2
    zeroplane run --pp 2 --nproc 4 examples/train_mesh.py --stage 1       # pp=2 x dp=2

The script does not know its layout: ``worker.initialize`` reads tp and pp
from the launcher ($ZEROPLANE_TP, $ZEROPLANE_PP) and returns the engine for
it, a ``StepLoader`` gives each data-parallel rank its share of the global
batch, and ``engine.train_batch`` is the step under data, tensor and pipeline
parallelism alike (worker/surface.py). On a GPU machine the model goes to
``cuda:$LOCAL_RANK`` and the process group to NCCL, as with
``deepspeed.initialize``. ``--out FILE`` writes the final fp32 parameters;
``--checkpoint DIR`` saves every ``--save-every`` steps and resumes from it,
at any layout.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

import worker
from worker.config import stage_from_env
from worker.data import LoaderConfig, StepLoader, byte_tokenizer, pack_text_files
from worker.demo import corpus_path
from worker.mesh import ParallelConfig
from worker.models import GPT, GPTConfig
from worker.pipeline import lm_loss

# untied: a pipeline puts the embedding and the head on different stages
MODEL = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=64, tie_weights=False)


def first_rank() -> bool:
    """Rank 0 of the whole job (a mesh has a dp rank 0 in every tp and pp group)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--stage", type=int, default=stage_from_env(1))
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int)
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    p.add_argument("--microbatches", type=int, default=2, help="pipeline micro-batches")
    p.add_argument("--out", type=Path)
    p.add_argument("--checkpoint", type=Path)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--data-cache", type=Path, default=Path.home() / ".cache" / "zeroplane")
    p.add_argument(
        "--replica-every",
        type=int,
        default=1,
        help="in-memory replicas every this many steps (a lost rank recovers from them)",
    )
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to pause per step")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)

    data = pack_text_files(
        [corpus_path()], byte_tokenizer(), seq_len=MODEL.block_size, cache_dir=args.data_cache
    )
    torch.manual_seed(0)
    model = GPT(MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # tp and pp as the launcher asks; the schedule and micro-batches are the script's
    parallel = ParallelConfig.from_env(
        pipeline_schedule=args.schedule, microbatches=args.microbatches
    )
    config = worker.ZeroConfig(stage=args.stage, replica_interval=args.replica_every)
    engine = worker.initialize(model, opt, config=config, parallel=parallel, loss_fn=lm_loss)
    loader = StepLoader(
        data, LoaderConfig(global_batch=args.global_batch, micro_batch=args.micro_batch)
    ).attach(engine)
    engine.progress(total=args.steps)
    if args.checkpoint and (args.checkpoint / "latest").exists() and engine.global_steps == 0:
        engine.load_checkpoint(args.checkpoint)
    while True:
        if args.checkpoint and engine.checkpoint_due(args.save_every):
            engine.save_checkpoint(args.checkpoint)
        if engine.global_steps >= args.steps:
            break
        try:
            loss = engine.train_batch(loader.current())  # the global batch's mean loss
        except worker.StepAborted:
            continue  # a peer was lost; the engine re-formed the job at global_steps
        if engine.global_steps % 5 == 0 and first_rank():
            logging.info("step %d loss %.4f", engine.global_steps, loss)
        time.sleep(args.step_sleep)
    state = engine.full_state_dict()  # every rank: a collective over the whole mesh
    if args.out and first_rank():
        torch.save(state, args.out)
    loader.close()
    engine.close()


if __name__ == "__main__":
    main()
