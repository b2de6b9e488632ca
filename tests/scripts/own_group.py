"""The README's torchrun-style script: it forms the process group itself.

    zeroplane run --nproc 2 [--stage N] tests/scripts/own_group.py OUT_DIR SCRIPT_STAGE
    torchrun --nproc-per-node 2 tests/scripts/own_group.py OUT_DIR SCRIPT_STAGE no-init

No logging configuration, on purpose: zeroplane's warnings must still show.
Each rank trains a few steps of a small GPT with ``ZeroConfig(stage=SCRIPT_STAGE)``,
writes what its engine ran as (OUT_DIR/rank<R>.json) and the final fp32
parameters (rank 0, OUT_DIR/final.pt), then waits for OUT_DIR/release (up to
60 s) so a test can look at the coordinator while the job is up. With
``no-init`` it leaves forming the group to ``worker.initialize`` (as
``deepspeed.initialize`` does under torchrun).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import worker
from worker.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
STEPS = 4


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.randint(
        0,
        CFG.vocab_size,
        (2, CFG.block_size + 1),
        generator=torch.Generator().manual_seed(100 * step + rank),
    )
    return seq[:, :-1], seq[:, 1:]


def main() -> None:
    out, stage = Path(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    if sys.argv[3:] != ["no-init"]:
        dist.init_process_group("gloo")  # env:// as the launcher (or torchrun) sets it
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = worker.initialize(model, opt, config=worker.ZeroConfig(stage=stage))
    rank = dist.get_rank()
    for step in range(STEPS):
        loss = engine(*batch(step, rank))
        engine.backward(loss)
        engine.step(samples=2, tokens=2 * CFG.block_size)
    mean_loss = engine.mean_loss()
    full = engine.full_state_dict()
    control = engine.membership.control if engine.membership is not None else None
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "stage": engine.config.stage,
                "world": engine.world_size,
                "generation": None if control is None else control.generation.id,
                "mean_loss": mean_loss,
            }
        )
    )
    if rank == 0:
        torch.save(full, out / "final.pt")
    deadline = time.monotonic() + 60
    while not (out / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
