"""Train a small Mixtral-style mixture of experts, its experts split over ranks.

    zeroplane run --nproc 4 --ep 2 examples/train_moe.py --steps 20    # 4 of 8 experts a rank
    zeroplane run --nproc 4 --ep 4 examples/train_moe.py --stage 3     # 2 of 8, ZeRO-3 dense
    zeroplane run --nproc 4 --ep 2 --tp 2 examples/train_moe.py        # attention split by tp
    zeroplane run --nproc 4 --ep 2 --pp 2 examples/train_moe.py        # layers in 2 stages
    torchrun --nproc-per-node 2 examples/train_moe.py --ep 2           # torchrun, the same

The model is transformers' ``MixtralForCausalLM`` as it comes (5.x: each layer's
experts are one fused module): ``worker.initialize`` reads ep from the launcher
($ZEROPLANE_EP, or ``--ep`` here), keeps this rank's experts of every layer,
exchanges tokens with the other ranks of its ep group by all-to-all, and shards
the experts' ZeRO state over the ranks holding the same experts and the rest over
the whole job (docs/guides/moe.md). The batches are made from the step and the
rank, so a one-process run can replay them (tests/test_moe_job.py); each step
trains the next-token loss through ``engine.train_batch``, which runs under every
layout (a pipeline's schedule included). ``--out FILE`` writes the final fp32
parameters.
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
from worker.pipeline import lm_loss

VOCAB, EXPERTS = 128, 8


def build_model():
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
        num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return MixtralForCausalLM(config)


def batch(step: int, rank: int, rows: int = 2, seq: int = 17) -> torch.Tensor:
    """Token ids of one share: ``seq - 1`` tokens predict the next (16, a length
    context parallelism's chunks divide)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (rows, seq), generator=g)


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--stage", type=int, default=stage_from_env(2))
    p.add_argument("--ep", type=int, help="expert parallelism (default: the launcher's)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    model = build_model()
    parallel = ParallelConfig.from_env(**({} if args.ep is None else {"expert_parallel": args.ep}))
    engine = worker.initialize(
        model, optimizer(model), config=worker.ZeroConfig(stage=args.stage), parallel=parallel,
        loss_fn=lm_loss,
    )  # fmt: skip
    rank = dist.get_rank() if dist.is_initialized() else 0
    share, _ = engine.data_rank  # the tp ranks and stages of a share (--tp, --pp) train its batch
    for step in range(args.steps):
        ids = batch(step, share)
        engine.train_batch([(ids[:, :-1], ids[:, 1:])])  # each token predicts the next
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step}: loss {engine.mean_loss():.4f}", flush=True)
    full = engine.full_state_dict()
    if args.out is not None and rank == 0:
        torch.save(full, args.out)
    engine.close()


if __name__ == "__main__":
    main()
