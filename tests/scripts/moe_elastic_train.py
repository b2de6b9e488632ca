"""An expert-parallel job that an elastic test grows and shrinks by whole ep groups.

    zeroplane run --ep 2 --nproc 4 --min-nproc 4 --max-nproc 6 \
        tests/scripts/moe_elastic_train.py OUT_DIR --steps 24

A small mixture of experts (two layers of four experts behind ``worker.moe.Experts``,
top-2 routing by a learned router) with SGD on fixed random batches: step s trains
``batches[s]`` (12 sequences, which every world of 2, 4 or 6 ranks divides), each
rank its share by its rank and the world size at that step, so that the result
equals one process training the same batches (tests/test_moe_elastic.py). The
first rank writes ``OUT_DIR/step`` as it goes; steps are paced until
``OUT_DIR/hurry`` exists; ``OUT_DIR/final.pt`` gets the full parameters.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import worker
from worker.moe import Experts
from worker.parallel import ParallelConfig

# the loop beside this script (a pod or the fork server runs it without the repository
# on the path)
sys.path.insert(0, str(Path(__file__).resolve().parent))
import elastic_loop

VOCAB, D, EXPERTS, TOP_K, SEQ = 32, 16, 4, 2, 8
GLOBAL_BATCH = 12
LR = 0.1


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.router = nn.Linear(D, EXPERTS, bias=False)
        self.experts = Experts(Expert() for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.norm(x).reshape(-1, D)
        weights, chosen = F.softmax(self.router(flat), dim=-1).topk(TOP_K, dim=-1)
        return x + self.experts(flat, chosen, weights).view_as(x)


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def batches(steps: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (steps, GLOBAL_BATCH, SEQ + 1), generator=g)


def build() -> tuple[MoE, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = MoE()
    return model, torch.optim.SGD(model.parameters(), lr=LR)


def main() -> None:
    args = elastic_loop.parser(__doc__.splitlines()[0], stage=3)
    data = batches(args.steps)
    model, opt = build()
    engine = worker.initialize(
        model,
        opt,
        config=worker.ZeroConfig(stage=args.stage, replica_interval=1),
        parallel=ParallelConfig.from_env(),
    )

    def step(s: int, share: int, shares: int) -> None:
        x = data[s][share * GLOBAL_BATCH // shares : (share + 1) * GLOBAL_BATCH // shares]
        engine.backward(engine(x[:, :-1], x[:, 1:]))
        engine.step()

    elastic_loop.train(engine, args, step)


if __name__ == "__main__":
    main()
