"""Mixtures of experts whose experts are modules of their own, each called only for
the tokens routed to it (worker/leaves.py [Note: data-dependent modules at stage
3]): under skewed routing (a rank with no token for an expert another rank uses,
an expert no rank uses) every stage trains like one-process torch, and stage 3
does not hang."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import worker
from tests.reference import max_diff, train_beside_torch
from worker.inventory import build_inventory
from worker.leaves import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules

VOCAB, D, EXPERTS, STEPS = 16, 8, 4, 5


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class SparseMoE(nn.Module):
    """Top-1 routing by the token (so a test chooses who uses which expert), each
    expert weighted by the router's probability (so the router learns)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(D, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x), dim=-1)
        choice = idx % EXPERTS
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            hit = choice == e
            if hit.any():  # data-dependent: only the experts this batch routes to run
                out[hit] = expert(x[hit]) * probs[hit][:, e : e + 1]
        return out


class MoENet(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.moes = nn.ModuleList(SparseMoE() for _ in range(layers))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for moe in self.moes:
            x = x + moe(x, idx)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def skewed_batch(step: int, rank: int, rows: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0's tokens go to experts 0 and 1, rank 1's to 1 and 2 (at odd steps to
    2 alone); no token ever goes to expert 3."""
    g = torch.Generator().manual_seed(100 * step + rank)
    experts = [(0, 1), (1, 2) if step % 2 == 0 else (2,)][rank]
    choice = torch.tensor(experts)[torch.randint(0, len(experts), (rows, 6), generator=g)]
    idx = choice + EXPERTS * torch.randint(0, VOCAB // EXPERTS, (rows, 6), generator=g)
    return idx, torch.roll(idx, 1, dims=1)


def train_moe_against_torch(stage: int, accum: int, clip: float) -> None:
    torch.manual_seed(0)
    model = MoENet()
    torch.manual_seed(0)
    ref = MoENet()

    def opt(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(m.parameters(), lr=1e-2)

    config = worker.ZeroConfig(
        stage=stage,
        gradient_accumulation_steps=accum,
        gradient_clipping=clip,
        bucket_numel=97,
        stage3_min_unit_numel=1,
    )
    engine = worker.initialize(model, opt(model), config=config)
    train_beside_torch(engine, ref, opt(ref), skewed_batch, steps=STEPS, accum=accum, clip=clip)
    want = {n: p.detach() for n, p in ref.named_parameters()}
    diff, name = max_diff(engine.full_state_dict(), want)
    assert diff < 1e-5, f"{name} differs from torch by {diff:.3g}"
    # the expert no rank used is untouched, its optimizer state as it was
    unused = engine.full_state_dict()["moes.0.experts.3.up.weight"]
    torch.manual_seed(0)
    assert torch.equal(unused, MoENet().moes[0].experts[3].up.weight.detach())
    engine.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("stage", "accum", "clip"), [(1, 1, 0.0), (2, 2, 0.0), (3, 1, 0.05), (3, 2, 0.0)]
)
def test_an_moe_under_skewed_routing_trains_like_torch(pools, stage: int, accum: int, clip: float):
    pools(2).run(train_moe_against_torch, stage, accum, clip)


def _unit_modules(model: nn.Module) -> list[str]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inv = build_inventory(model, opt.param_groups, compute_dtype=torch.float32, min_unit_numel=1)
    names = {m: n for n, m in model.named_modules()}
    return sorted(names[m] for i, m in inv.unit_modules.items() if i != 0)


def test_a_block_holding_its_experts_is_one_unit() -> None:
    model = MoENet()
    assert get_z3_leaf_modules(model) == list(model.moes)
    units = _unit_modules(model)
    assert "moes.0" in units and not any(".experts" in u for u in units), units
    # a script that knows its experts run everywhere takes them apart again
    unset_z3_leaf_modules(model, [SparseMoE])
    assert get_z3_leaf_modules(model) == []
    assert any(u.startswith("moes.0.experts.3") for u in _unit_modules(model))


def test_set_z3_leaf_modules_takes_classes_and_names() -> None:
    model = MoENet()
    assert set_z3_leaf_modules(model, ["Expert"]) == [e for moe in model.moes for e in moe.experts]
    with pytest.raises(ValueError, match="no module of the model is of the classes given"):
        set_z3_leaf_modules(model, ["MixtralSparseMoeBlock"])


class Gated(nn.Module):
    """A block with a module behind a data-dependent branch, not a list of experts:
    no automatic leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Linear(D, D)
        self.extra = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        y = self.main(x)
        if bool((idx % 4 == 0).any()):  # only where the batch holds such a token
            y = y + self.extra(x)
        return y


class GatedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Gated() for _ in range(2))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = x + block(x, idx)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def gated_batch(step: int, rank: int, apart: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """From step ``apart`` on, rank 0's tokens include multiples of 4 and rank 1's never
    do; before it, every rank's do."""
    g = torch.Generator().manual_seed(10 * step + rank)
    idx = torch.randint(0, VOCAB // 4, (2, 6), generator=g) * 4
    return idx + (1 if rank and step >= apart else 0), torch.roll(idx, 1, dims=1)


def gated_run(leaf: bool, apart: int = 0, check: bool | str = "first") -> str | None:
    """Without a leaf every rank raises at the first gather out of step, naming the
    module; with the block a leaf the job trains like one-process torch."""
    import time

    from worker.gather_check import GatherMismatch

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = GatedNet()
    torch.manual_seed(0)
    ref = GatedNet()
    if leaf:
        set_z3_leaf_modules(model, [Gated])
    config = worker.ZeroConfig(
        stage=3, stage3_min_unit_numel=1, bucket_numel=97, stage3_check_gathers=check
    )
    engine = worker.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    try:
        for step in range(3):
            start = time.monotonic()
            engine.backward(engine(*gated_batch(step, rank, apart)))
            engine.step()
            for r in range(world):
                (ref(*gated_batch(step, r, apart)) / world).backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        diff, name = max_diff(engine.full_state_dict(), dict(ref.named_parameters()))
        assert diff < 1e-5, f"{name} differs from torch by {diff:.3g}"
    except GatherMismatch as exc:
        assert time.monotonic() - start < 20, "the mismatch took too long to find"
        return str(exc)
    finally:
        engine.close()
    return None


@pytest.mark.timeout(120)
def _spent(pool) -> None:
    """After the ranks' gathers fell out of step their process group may hold
    collectives issued before the check (a backward's reductions): the job ends
    there, and so does this pool."""
    pool.close(kill=True)


def test_a_module_run_on_some_ranks_only_raises_on_every_rank_naming_it(pools):
    pool = pools(2)
    messages = pool.run(gated_run, False)
    _spent(pool)
    for message in messages:
        assert message is not None and "'blocks.0.extra'" in message, message
        assert "rank 0 is gathering" in message and "rank 1 is" in message, message
        assert "set_z3_leaf_modules" in message
    # the remedy the message names: the block gathered whole trains like torch
    assert pools(2).run(gated_run, True) == [None, None]


@pytest.mark.timeout(120)
def test_gathers_checked_at_every_step_find_a_branch_that_parts_later(pools):
    # the ranks agree through step 1 and part at step 2, after the default's first step
    pool = pools(2)
    messages = pool.run(gated_run, False, 2, True)
    _spent(pool)
    assert len(messages) == 2 and messages[0] == messages[1], messages
    assert messages[0] is not None and ".extra'" in messages[0], messages
