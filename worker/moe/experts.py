"""A layer's experts: :class:`Experts` (modules of their own, called the way
transformers 5.x calls its fused experts), how either kind runs its tokens, and how
either keeps only a range of its experts (expert parallelism, worker/moe/dispatch.py).

Two kinds of experts module are known ([Note: routed experts] in worker/moe/routing.py
for the call both answer):

* :class:`Experts`: one ``nn.Module`` per expert, children named by expert index
  (a research MoE's ``nn.ModuleList`` of experts, moved behind the call);
* a *fused* experts module, transformers 5.x's layout (``MixtralExperts``,
  ``Qwen2MoeExperts``, ``Qwen3MoeExperts``, DeepSeek-V3's, gpt-oss's): every
  parameter of the module itself holds all ``num_experts`` experts along its
  first dimension, one at least is a stack of matrices (a router's E x H weight
  is not), and it has no parameters below it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from worker.moe.routing import combine, route

__all__ = ["Experts", "expert_count", "is_experts", "keep_experts", "run_rows"]


class Experts(nn.Module):
    """The experts of one mixture-of-experts layer, each a module of its own (named
    ``"0"``, ``"1"``, ... as in an ``nn.ModuleList``), called as transformers 5.x
    calls its experts: ``experts(hidden, top_k_index, top_k_weights)`` for ``hidden``
    of T x H tokens, ``top_k_index`` and ``top_k_weights`` of T x K, returning the
    T x H weighted sum of each token's K experts' outputs.

    Every expert runs on every call, on the rows routed to it (none, for an expert
    no token chose), so which experts run never depends on the data: at ZeRO stage 3
    every rank gathers the same experts, and with expert parallelism
    (``ParallelConfig(expert_parallel=k)``) the layer's experts split over k ranks
    and tokens reach them by all-to-all. ``capacity_factor``: at most
    ``ceil(capacity_factor * T * K / E)`` tokens per expert, the rest dropped (None:
    dropless)."""

    def __init__(self, experts: Iterable[nn.Module], *, capacity_factor: float | None = None):
        super().__init__()
        for i, expert in enumerate(experts):
            self.add_module(str(i), expert)
        self.num_experts = len(self._modules)
        if self.num_experts < 1:
            raise ValueError("Experts needs at least one expert module")
        self.capacity_factor = capacity_factor

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        routed = route(top_k_index, self.num_experts, self.capacity_factor)
        out = self.run(hidden[routed.rows], routed.counts)
        return combine(out, routed, top_k_weights, hidden.shape[0])

    def run(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each expert (in order) on its run of ``rows``: ``counts[j]`` rows for the
        j-th expert this module holds."""
        pieces = torch.split(rows, counts.tolist())
        outs = [expert(x) for expert, x in zip(self._modules.values(), pieces, strict=True)]
        # an expert returning (output, bias), as Megatron-style MLPs do: its output
        outs = [out[0] if isinstance(out, tuple) else out for out in outs]
        return torch.cat(outs) if outs else rows


def is_experts(module: nn.Module) -> bool:
    """Whether ``module`` is an experts module of a known kind (the module notes)."""
    if isinstance(module, Experts):
        return True
    count = getattr(module, "num_experts", None)
    own = list(module.parameters(recurse=False))
    return (
        isinstance(count, int) and not isinstance(count, bool) and count >= 1
        and any(p.dim() >= 3 for p in own)  # a router's (E x H) weight is not experts
        and all(p.dim() >= 1 and p.shape[0] == count for p in own)
        and not any(True for c in module.children() for _ in c.parameters())
    )  # fmt: skip


def expert_count(module: nn.Module) -> int:
    return int(module.num_experts)


def run_rows(
    module: nn.Module, base: type[nn.Module], rows: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """``module``'s experts (those it holds, in order) on their runs of ``rows``, as
    ``base``, the module's own class, computes them."""
    if isinstance(module, Experts):
        return Experts.run(module, rows, counts)
    # a fused module computes what its own call asks: each row for its one expert,
    # with weight 1 (the weights are applied where the rows come back)
    local = torch.repeat_interleave(torch.arange(counts.numel(), device=rows.device), counts)
    ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
    return base.forward(module, rows, local.unsqueeze(1), ones)


def keep_experts(module: nn.Module, lo: int, hi: int) -> None:
    """Keep experts ``[lo, hi)`` of ``module`` only, under the names they had (the
    others' parameters are dropped): this rank's share under expert parallelism."""
    count = expert_count(module)
    if not 0 <= lo < hi <= count:
        raise ValueError(f"experts [{lo}, {hi}) are not a range of the layer's {count}")
    if isinstance(module, Experts):
        for name in list(module._modules):
            if not lo <= int(name) < hi:
                del module._modules[name]
    else:
        for name, p in list(module.named_parameters(recurse=False)):
            kept = nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad)
            setattr(module, name, kept)
    module.num_experts = hi - lo
