"""Train a Llama on sequences split over ranks (context parallelism).

    zeroplane run --nproc 4 --cp 2 examples/train_long.py --steps 20          # all-to-all
    zeroplane run --nproc 4 --cp 4 --cp-kind ring examples/train_long.py      # ring
    torchrun --nproc-per-node 2 examples/train_long.py --cp 2

The model is transformers' ``LlamaForCausalLM`` as it comes: ``worker.initialize``
reads cp from the launcher ($ZEROPLANE_CP, $ZEROPLANE_CP_KIND, or ``--cp`` here),
switches the model's attention to zeroplane's, and every call with ``input_ids`` and
``labels`` trains this rank's shard of each sequence; the ranks of a cp group share
one batch (``engine.data_rank``), and the loss is the mean over every token of the
global batch (docs/guides/long-sequences.md). Each row packs documents of random
lengths (position ids restart at each), which attention never crosses. ``--out
FILE`` writes the final fp32 parameters.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
import torch.distributed as dist

import worker
from worker.config import stage_from_env
from worker.parallel import ParallelConfig

VOCAB = 128


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def batch(step: int, share: int, rows: int = 2, seq: int = 64) -> dict[str, torch.Tensor]:
    """Data-parallel share ``share``'s batch of step ``step``: token ids, labels and
    position ids of packed documents."""
    g = torch.Generator().manual_seed(1000 * step + share)
    ids = torch.randint(0, VOCAB, (rows, seq), generator=g)
    positions = []
    for _ in range(rows):
        cuts = sorted(torch.randperm(seq - 1, generator=g)[:3].add(1).tolist())
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, seq], strict=True)]
        positions.append(torch.cat([torch.arange(n) for n in lengths]))
    return {"input_ids": ids, "labels": ids, "position_ids": torch.stack(positions)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--stage", type=int, default=stage_from_env(3))
    p.add_argument("--cp", type=int, help="context parallelism (default: the launcher's)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    model = build_model()
    parallel = ParallelConfig.from_env(**({} if args.cp is None else {"context_parallel": args.cp}))
    engine = worker.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        config=worker.ZeroConfig(stage=args.stage),
        parallel=parallel,
    )
    share, _ = engine.data_rank
    for step in range(args.steps):
        out = engine(**batch(step, share))
        engine.backward(out.loss)
        engine.step()
        if engine.rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step}: loss {engine.mean_loss():.4f}", flush=True)
    full = engine.full_state_dict()
    if args.out is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        torch.save(full, args.out)
    engine.close()


if __name__ == "__main__":
    main()
