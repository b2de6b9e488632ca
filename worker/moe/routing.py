"""Tokens to their experts and back: the routing arithmetic every experts module of
this package shares, with or without expert parallelism.

[Note: routed experts]
A mixture-of-experts layer routes each of its T tokens to K of its E experts
(``top_k_index``, T x K) with weights (``top_k_weights``), and its output for a
token is the weighted sum of its K experts' outputs: transformers 5.x's experts
call, ``experts(hidden, top_k_index, top_k_weights)``, which this package takes
as the interface. The T·K assignments are sorted by expert (stably, so a
token's order within its expert is its order in the batch), each expert runs
once on its contiguous rows (none, for an expert no token chose: it still
runs, so every rank calls every expert the same way and a stage-3 gather
never depends on the data), and the rows go back to their tokens weighted.
With expert parallelism the sorted rows cross ranks between the sort and the
experts (worker/moe/parallel.py). ``capacity_factor``, when set, keeps at most
``ceil(factor · T·K / E)`` assignments per expert, the first in batch order;
the rest are dropped (their tokens get nothing from that expert: the
residual carries them), counted in :class:`Routed`. Without it routing is
dropless. An assignment to expert -1 is one a router dropped itself (DeepSpeed's
gates over capacity, worker/deepspeed/moe/sharded_moe.py): it reaches no expert
and is counted as dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Routed", "combine", "route"]


@dataclass
class Routed:
    """The assignments of one layer's tokens, sorted by expert.

    ``rows``: the token of each kept assignment, in expert order; ``slots``:
    its place in the flattened T x K weights; ``counts``: kept assignments per
    expert (length E); ``dropped``: assignments over capacity."""

    rows: torch.Tensor
    slots: torch.Tensor
    counts: torch.Tensor
    dropped: int


def route(
    top_k_index: torch.Tensor, num_experts: int, capacity_factor: float | None = None
) -> Routed:
    """Sort the T x K assignments of ``top_k_index`` by expert ([Note: routed experts])."""
    if top_k_index.dim() != 2:
        raise ValueError(f"top_k_index must be tokens x k, got shape {tuple(top_k_index.shape)}")
    flat = top_k_index.reshape(-1)
    if flat.numel() and (int(flat.min()) < -1 or int(flat.max()) >= num_experts):
        raise ValueError(
            f"top_k_index holds expert {int(flat.max())} or {int(flat.min())}, outside the "
            f"layer's {num_experts} experts (-1: dropped by the router)"
        )
    slots = torch.sort(flat, stable=True).indices
    valid = flat >= 0
    counts = torch.bincount(flat[valid], minlength=num_experts)
    dropped = flat.numel() - int(counts.sum())
    slots = slots[dropped:]  # the router's drops sort first
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * flat.numel() / num_experts)
        starts = torch.cumsum(counts, 0) - counts
        place = torch.arange(slots.numel(), device=flat.device) - torch.repeat_interleave(
            starts, counts
        )
        keep = place < capacity
        dropped += int((~keep).sum())
        slots = slots[keep]
        counts = counts.clamp(max=capacity)
    k = top_k_index.shape[1]
    return Routed(rows=slots // k, slots=slots, counts=counts, dropped=dropped)


def combine(
    out: torch.Tensor, routed: Routed, top_k_weights: torch.Tensor, tokens: int
) -> torch.Tensor:
    """The experts' rows ``out`` (in ``routed``'s order) back to their ``tokens``
    tokens, each weighted by its router weight and summed over its experts."""
    weights = top_k_weights.reshape(-1)[routed.slots].unsqueeze(-1)
    weighted = out * weights.to(out.dtype)
    result = out.new_zeros(tokens, out.shape[-1])
    return result.index_add(0, routed.rows, weighted)
