"""A model and its batches for ``zeroplane tune``: which ZeRO configuration trains it fastest?

    zeroplane tune --nproc 2 --script examples/tune_model.py --tokens-per-sample 64 \\
        --micro-batches 1,2,4,8,16 --compression none,bf16 --device-memory 16GB \\
        --max-trials 20 --out tuned/

``build()`` returns the module (the same on every rank: seeded by the tuner);
``batch(micro_batch, step, rank)`` returns the arguments of its forward, which
returns the loss. The tuner writes ``tuned/zero_config.json`` (load it with
``worker.ZeroConfig(**json.load(f))``) and ``tuned/deepspeed.json`` (the same
as a DeepSpeed config; ``ZeroConfig.from_deepspeed`` reads it back), and the
trials it ran, pruned or saw fail in ``tuned/trials.json``.
"""

from __future__ import annotations

import torch

from worker.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)


def build() -> GPT:
    return GPT(CONFIG)


def batch(micro_batch: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    # synthetic bytes: throughput does not depend on what the tokens say
    g = torch.Generator().manual_seed(step * 1009 + rank)
    x = torch.randint(0, CONFIG.vocab_size, (micro_batch, CONFIG.block_size + 1), generator=g)
    return x[:, :-1], x[:, 1:]
