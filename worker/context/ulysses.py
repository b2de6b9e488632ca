"""All-to-all (Ulysses) attention: sequence shards exchanged for head shards.

[Note: all-to-all attention]
Each rank of a cp group of k holds S/k tokens of every head ([Note: sequence
shards] in worker/context/shards.py). Before attention one all-to-all gives each
rank the whole sequence of H/k heads (rank j gets head group j of every rank's
tokens, in rank order, which is sequence order); attention then runs as in one
process, causal and within documents; a second all-to-all gives each rank its
tokens of every head back. Both are one equal-split all-to-all whose backward is
the same exchange of the gradients. Grouped-query attention: the key and value
heads travel as they are when k divides their number (each head group's queries
use only that group's keys), else they are repeated to the query heads first.
The heads must divide by k: where they do not, the ring kind works
(worker/context/ring.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from worker.collectives import Collectives
from worker.context.shards import SequenceBatch

__all__ = ["ulysses_attention"]


class _Swap(torch.autograd.Function):
    """Chunk ``i`` of dim 0 to rank ``i``, chunk ``i`` received from it; the backward
    is the same exchange of the gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Collectives) -> torch.Tensor:
        ctx.comm = comm
        return _swap(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _swap(grad, ctx.comm), None


def _swap(x: torch.Tensor, comm: Collectives) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    comm.all_to_all(out, x)
    return out


def _heads_to_sequence(x: torch.Tensor, comm: Collectives) -> torch.Tensor:
    """B x H x S/k x D here → B x H/k x S x D: head group j of every rank's tokens to rank j."""
    b, h, s, d = x.shape
    k = comm.world_size
    send = x.reshape(b, k, h // k, s, d).transpose(0, 1)
    got = _Swap.apply(send, comm)  # k (the tokens' rank) x B x H/k x S/k x D
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // k, k * s, d)


def _sequence_to_heads(x: torch.Tensor, comm: Collectives) -> torch.Tensor:
    """B x H/k x S x D → B x H x S/k x D: the tokens of rank r back to it, every head group."""
    b, h, n, d = x.shape
    k = comm.world_size
    send = x.reshape(b, h, k, n // k, d).permute(2, 0, 1, 3, 4)
    got = _Swap.apply(send, comm)  # k (the head group) x B x H/k x S/k x D
    return got.transpose(0, 1).reshape(b, k * h, n // k, d)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    comm: Collectives,
    batch: SequenceBatch,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's tokens (B x H x S/k x D queries, B x H_kv x S/k x D
    keys and values) over the whole sequence ([Note: all-to-all attention]); ``window``:
    a sliding window's tokens."""
    heads, kv_heads, n = q.shape[1], k.shape[1], comm.world_size
    if heads % n:
        raise ValueError(
            f"all-to-all context parallelism splits the {heads} attention heads over "
            f"cp={n} ranks, which does not divide them: use context_parallel_kind='ring'"
        )
    if kv_heads % n:  # repeated to the query heads: each head group then has its own
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    q, k, v = (_heads_to_sequence(t, comm) for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if batch.docs is None and window is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        whole = torch.arange(batch.length, device=q.device)
        mask = batch.mask(whole, whole, window).to(q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return _sequence_to_heads(out, comm)
