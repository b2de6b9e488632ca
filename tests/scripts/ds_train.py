"""A DeepSpeed training script, as DeepSpeed's users write one, that runs under DeepSpeed
itself or under zeroplane's drop-in (worker/deepspeed), the import line the only
difference:

    torchrun --nproc-per-node 2 tests/scripts/ds_train.py --system deepspeed --stage 3 \\
        --steps 5 --save ckpt                    # DeepSpeed's checkpoint directory
    zeroplane run --nproc 2 tests/scripts/ds_train.py --system zeroplane --stage 2 \\
        --load ckpt --steps 10 --out final.pt    # continued under zeroplane

A small MLP with a frozen input projection and a persistent buffer, two optimizer
param groups (weight decay on the weights only) of a client ``torch.optim.AdamW``,
gradient clipping, ``train_micro_batch_size_per_gpu`` samples a rank each step: the
global batch of step s is ``batch(s, world)``, each rank its slice, so that one
process with torch on the whole batch takes the same steps (tests/test_ds_checkpoint.py).
``--out``: the full parameters by name after training, read through
``deepspeed.zero.GatheredParameters`` (at any stage); ``--halve-head-at S``: before
step S rank 0 halves the head's weight in ``GatheredParameters(modifier_rank=0)``
(the other ranks' writes there are discarded).
"""

from __future__ import annotations

import argparse
import importlib
import os

import torch
import torch.distributed as dist
from torch import nn

MICRO = 4
LR = 1e-2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)  # frozen
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 3))
        self.embed.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(x))) * self.scale


def build() -> Net:
    torch.manual_seed(0)
    return Net()


def groups(model: nn.Module) -> list[dict]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
        {"params": [p for n, p in named if not n.endswith("weight")], "weight_decay": 0.0},
    ]


def batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ``MICRO * world`` samples."""
    g = torch.Generator().manual_seed(1000 + step)
    n = MICRO * world
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def config(stage: int, bf16: bool = False) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bf16},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--system", choices=["deepspeed", "zeroplane"], required=True)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--save", help="engine.save_checkpoint(DIR) after the last step")
    p.add_argument("--load", help="engine.load_checkpoint(DIR) before the first")
    p.add_argument("--out", help="the full parameters by name (torch.save), rank 0")
    p.add_argument(
        "--halve-head-at",
        type=int,
        default=-1,
        help="rank 0 halves head.weight before this step (GatheredParameters, modifier_rank=0)",
    )
    p.add_argument("--bf16", action="store_true", help="bf16 training (fp32 master weights)")
    args = p.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    deepspeed = importlib.import_module(
        "deepspeed" if args.system == "deepspeed" else "worker.deepspeed"
    )

    deepspeed.init_distributed(dist_backend="gloo")
    model = build()
    optimizer = torch.optim.AdamW(groups(model), lr=LR)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config(args.stage, args.bf16)
    )
    start = 0
    if args.load:
        engine.load_checkpoint(args.load)
        start = engine.global_steps
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(start, args.steps):
        if step == args.halve_head_at:
            head = model.head.weight
            with deepspeed.zero.GatheredParameters([head], modifier_rank=0), torch.no_grad():
                if rank == 0:
                    head.mul_(0.5)
                else:
                    head.zero_()  # not the modifier: discarded
        x, y = batch(step, world)
        mine = slice(rank * MICRO, (rank + 1) * MICRO)
        inputs = x[mine].to(torch.bfloat16) if args.bf16 else x[mine]
        loss = nn.functional.mse_loss(engine(inputs).float(), y[mine])
        engine.backward(loss)
        engine.step()
    if args.save:
        engine.save_checkpoint(args.save)
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        full = {n: p.detach().clone().float() for n, p in model.named_parameters()}
    if args.out and rank == 0:
        torch.save(full, args.out)


if __name__ == "__main__":
    main()
