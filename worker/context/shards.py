"""How a sequence splits over the ranks of a context-parallel group, and what the
attention of one batch needs to know of the whole sequence.

[Note: sequence shards]
Under context parallelism (``ParallelConfig(context_parallel=k)``) the k ranks of a
cp group hold the same batch, each a shard of every sequence along its length:

* ``"ulysses"`` (all-to-all) shards contiguously: rank r holds tokens
  ``[r·S/k, (r+1)·S/k)``; attention exchanges heads for sequence, so every rank
  attends over the whole sequence for H/k heads, and the order of the gathered
  sequence is the rank order (worker/context/ulysses.py);
* ``"ring"`` shards in zig-zag: the sequence is cut into 2k chunks and rank r
  holds chunks r and 2k-1-r, so that under a causal mask every rank has the same
  work (an early chunk attends to little, a late one to much), as torchtitan and
  Megatron balance it (worker/context/ring.py).

Masks follow the tokens, not the shard: token i attends to token j when j <= i
in the whole sequence (and j > i - w under a sliding window of w) and both are of
one document, documents being found from
position ids as transformers finds packed sequences (a position that does not
follow its predecessor by one starts a document). Position ids themselves are the
whole sequence's, sliced with the tokens, so rotary embeddings see true positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["Kind", "SequenceBatch", "documents", "shard_index"]

Kind = Literal["ulysses", "ring"]


def shard_index(length: int, rank: int, size: int, kind: Kind) -> torch.Tensor:
    """The positions in the whole sequence of the tokens rank ``rank`` of ``size``
    holds, in its order ([Note: sequence shards])."""
    chunks = size if kind == "ulysses" else 2 * size
    if length % chunks:
        raise ValueError(
            f"context parallelism ({kind}, cp={size}) needs a sequence length divisible by "
            f"{chunks}, got {length}: pad the batch to a multiple of {chunks}"
        )
    c = length // chunks
    if kind == "ulysses":
        return torch.arange(rank * c, (rank + 1) * c)
    late = chunks - 1 - rank
    return torch.cat(
        [torch.arange(rank * c, (rank + 1) * c), torch.arange(late * c, (late + 1) * c)]
    )


def documents(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Each token's document (B x S) by transformers' rule for packed sequences; None
    when every row is one document."""
    first = position_ids[:, :1] - 1
    starts = torch.diff(position_ids, prepend=first, dim=-1) != 1
    docs = starts.cumsum(-1)
    return None if bool((docs[:, -1] == docs[:, 0]).all()) else docs


@dataclass
class SequenceBatch:
    """What attention needs of the whole sequences of one batch: their length, the
    positions this rank holds (``index``), and each token's document (None: one a
    row). Set by :meth:`~worker.context.parallel.ContextParallel.split`, read by every
    attention call of the forward (and of its recomputation in the backward)."""

    length: int
    index: torch.Tensor
    docs: torch.Tensor | None

    def mask(
        self, q_index: torch.Tensor, k_index: torch.Tensor, window: int | None = None
    ) -> torch.Tensor:
        """Which keys (at ``k_index`` of the whole sequence) each query (at
        ``q_index``) attends to: causal, within its document, and within ``window``
        tokens back where a sliding window is given (transformers' rule: key > query
        - window) (B' x 1 x q x k, B' = 1 without documents)."""
        causal = k_index[None, :] <= q_index[:, None]
        if window is not None:
            causal = causal & (k_index[None, :] > q_index[:, None] - window)
        if self.docs is None:
            return causal[None, None]
        same = self.docs[:, q_index, None] == self.docs[:, None, k_index]
        return (causal[None] & same)[:, None]
