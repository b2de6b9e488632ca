"""Expert parallelism (worker/moe/dispatch.py [Note: expert parallelism]): experts split
over ep ranks, tokens exchanged by all-to-all, the experts' ZeRO state sharded over
the ranks holding the same experts. Every case trains against one-process torch on
the union of the ranks' batches, under routing skewed so that a rank has no token
for some experts and one expert gets no token at all."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import worker
from tests.reference import max_diff
from worker.moe import Experts
from worker.parallel import ParallelConfig

VOCAB, D, EXPERTS, STEPS = 32, 8, 8, 4
# each token's two experts, by token % 8: expert 7 is never chosen
PAIRS = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [4, 5], [5, 6], [6, 4], [0, 4]])


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Top-2 routing chosen by the token (so a test decides who uses which expert),
    weighted by the router's probabilities (so the router learns)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(D, EXPERTS, bias=False)
        self.experts = Experts(Expert() for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, D)
        chosen = PAIRS[idx.reshape(-1) % len(PAIRS)]
        # not renormalized over the two: the other experts' logits get a gradient
        # that is not zero by cancellation (Adam would turn its rounding into steps)
        weights = F.softmax(self.gate(flat), dim=-1).gather(1, chosen)
        return self.experts(flat, chosen, weights).view_as(x)


class MoENet(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = x + block(x, idx)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def skewed_batch(step: int, rank: int, rows: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's tokens are of two of the eight classes, (r, r + 4) at even steps and
    (r + 1) alone at odd ones: each rank leaves most experts without a token."""
    g = torch.Generator().manual_seed(100 * step + rank)
    classes = torch.tensor([rank % 8, (rank + 4) % 8] if step % 2 == 0 else [(rank + 1) % 8])
    cls = classes[torch.randint(0, len(classes), (rows, 6), generator=g)]
    idx = cls + 8 * torch.randint(0, VOCAB // 8, (rows, 6), generator=g)
    return idx, torch.roll(idx, 1, dims=1)


def train_ep_against_torch(ep: int, stage: int, accum: int, clip: float) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = MoENet()
    torch.manual_seed(0)
    ref = MoENet()

    def opt(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)

    config = worker.ZeroConfig(
        stage=stage,
        gradient_accumulation_steps=accum,
        gradient_clipping=clip,
        bucket_numel=97,
        stage3_min_unit_numel=1,
    )
    engine = worker.initialize(
        model, opt(model), config=config, parallel=ParallelConfig(expert_parallel=ep)
    )
    # this rank holds its share of each layer's experts, nothing of the others'
    held = {n.split(".")[3] for n, _ in model.named_parameters() if ".experts." in n}
    place = rank % ep
    assert held == {str(e) for e in range(place * EXPERTS // ep, (place + 1) * EXPERTS // ep)}
    ref_opt = opt(ref)
    for step in range(STEPS):
        for micro in range(accum):
            idx, tgt = skewed_batch(step * accum + micro, rank)
            engine.backward(engine(idx, tgt))
            engine.step()
        for micro in range(accum):
            for r in range(world):
                idx, tgt = skewed_batch(step * accum + micro, r)
                (ref(idx, tgt) / (world * accum)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    want = {n: p.detach() for n, p in ref.named_parameters()}
    got = engine.full_state_dict()
    assert set(got) == set(want)
    diff, name = max_diff(got, want)
    assert diff < 1e-5, f"{name} differs from torch by {diff:.3g}"
    engine.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("stage", "accum", "clip"), [(1, 1, 0.05), (2, 2, 0.0), (3, 2, 0.05)])
def test_experts_split_over_two_ranks_train_like_torch(pools, stage: int, accum: int, clip: float):
    pools(2).run(train_ep_against_torch, 2, stage, accum, clip)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("ep", "stage", "accum", "clip"), [(2, 3, 1, 0.05), (4, 1, 2, 0.0), (4, 3, 2, 0.05)]
)
def test_experts_over_four_ranks_train_like_torch(pools, ep: int, stage: int, accum: int, clip):
    # ep=2: two ep groups, each expert's state sharded over the two ranks holding it
    pools(4).run(train_ep_against_torch, ep, stage, accum, clip)
