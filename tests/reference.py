"""Models, data and the single-process torch reference the engine is checked against."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 11


class ParityNet(nn.Module):
    """Small, but with every case the engine must get right.

    Uneven parameter sizes (so buckets straddle ranks and need padding), a
    weight tied between the embedding and the head, a frozen layer, a branch
    used only on some steps, and a module called twice in one forward.
    """

    def __init__(self, d: int = 6, hidden: int = 13) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, d)) for _ in range(2)
        )
        self.twice = nn.Linear(d, d)
        self.extra = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, use_extra: bool) -> torch.Tensor:
        x = self.frozen(self.emb(idx))
        for block in self.blocks:
            x = x + block(x)
        x = x + self.twice(torch.tanh(self.twice(x)))
        if use_extra:
            x = x + self.extra(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def param_groups(model: nn.Module) -> list[dict]:
    """Decay / no-decay groups, as GPT training scripts build them."""
    decay, no_decay = [], []
    for p in dict.fromkeys(model.parameters()):
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "adamw": lambda m: torch.optim.AdamW(param_groups(m), lr=1e-2, betas=(0.9, 0.95)),
    "sgd": lambda m: torch.optim.SGD(param_groups(m), lr=5e-2, momentum=0.9),
}


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """What every rank sees at every step: the same global batch as the reference."""

    steps: int = 20
    accum: int = 1
    micro_batch: int = 3
    seq: int = 5
    world_size: int = 1
    extra_on_all_ranks: bool = False

    def batch(self, step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
        idx = torch.randint(0, VOCAB, (self.micro_batch, self.seq), generator=g)
        return idx, torch.roll(idx, 1, dims=1)

    def use_extra(self, step: int, micro: int, rank: int) -> bool:
        """The extra branch is unused on most steps; on some only by some ranks."""
        if step % 4 == 1:
            return False
        if self.extra_on_all_ranks:
            return step % 4 == 3
        return (step + micro + rank) % 3 == 0


def seeded_model(seed: int = 0) -> ParityNet:
    torch.manual_seed(seed)
    return ParityNet()


def reference_run(
    schedule: Schedule,
    optimizer: str,
    clip: float = 0.0,
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, plain torch: the whole global batch per step (and ``scheduler``,
    built on the optimizer, stepped after each optimizer step)."""
    model = seeded_model()
    opt = OPTIMIZERS[optimizer](model)
    sched = None if scheduler is None else scheduler(opt)
    losses = []
    n = schedule.accum * schedule.world_size
    for step in range(schedule.steps):
        total = 0.0
        for micro in range(schedule.accum):
            for rank in range(schedule.world_size):
                idx, tgt = schedule.batch(step, micro, rank)
                loss = model(idx, tgt, schedule.use_extra(step, micro, rank)) / n
                loss.backward()
                total += loss.item()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    final = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return final, losses


def train_beside_torch(
    engine: Any,
    ref: nn.Module,
    ref_opt: torch.optim.Optimizer,
    batch: Callable[[int, int], tuple],
    *,
    steps: int,
    accum: int = 1,
    clip: float = 0.0,
) -> None:
    """``steps`` optimizer steps of ``engine`` on this rank's micro-batches
    ``batch(micro, rank)`` and of the one-process ``ref`` on every rank's, each
    weighted 1/(world * accum), clipped to ``clip`` as the engine's config says;
    ``rank`` and ``world`` are the engine's data-parallel share and shares (the tp
    ranks of a share train the same batch)."""
    rank, world = engine.data_rank
    for step in range(steps):
        for micro in range(step * accum, (step + 1) * accum):
            engine.backward(engine(*batch(micro, rank)))
            engine.step()
            for r in range(world):
                (ref(*batch(micro, r)) / (world * accum)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert a.keys() == b.keys(), f"parameter names differ: {sorted(a.keys() ^ b.keys())}"
    worst = max(a, key=lambda k: (a[k].float() - b[k].float()).abs().max().item())
    return (a[worst].float() - b[worst].float()).abs().max().item(), worst


def tiny_llama(*, vocab: int, seq: int, intermediate: int = 32, tie: bool = False) -> nn.Module:
    """A two-layer Llama-style causal LM with grouped-query attention (4 heads, 2 kv),
    built from a config: no download."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq,
        tie_word_embeddings=tie,
    )
    return transformers.LlamaForCausalLM(cfg)


def tiny_gpt2(*, vocab: int, seq: int, heads: int = 2) -> nn.Module:
    """A two-layer GPT-2 (HF ``Conv1D`` layers, tied head), dropout off."""
    import transformers

    cfg = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=seq,
        n_embd=16,
        n_layer=2,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def walk_batch(g: torch.Generator, rows: int, vocab: int, length: int) -> torch.Tensor:
    """``rows`` token sequences of ``length``, each a random walk of steps 1-2 modulo
    ``vocab`` (learnable, so a loss curve falls): the compression tests' data."""
    start = torch.randint(0, vocab, (rows, 1), generator=g)
    return (start + torch.randint(1, 3, (rows, length), generator=g).cumsum(1)) % vocab
