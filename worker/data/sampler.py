"""A sampler whose global batches do not depend on the world size.

Data-parallel training on a constant global batch with the same samples is
the same computation at any world size. :class:`GlobalBatchSampler` fixes
the sample order by (seed, epoch) alone and counts its position in samples,
so a job that resumes, or changes its world size, continues at exactly the
next sample: rank r of N takes its slice of the same global batch.

[Note: uneven shares]
A world size need not divide the global batch: an elastic job may grow or
shrink to any size in ``[min, max]`` and must compute the same step there.
Rank r of N takes ``B // N`` samples, one more when ``r < B % N``, as a
contiguous slice in rank order. Every rank runs the same number of
micro-batches, ``ceil(largest share / micro)``, because stage 3 gathers
parameters in each forward and stage 2 reduces in each backward: a rank with
fewer steps would leave the others waiting in a collective. Each share is cut
into that many pieces as evenly as it goes (none larger than ``micro``); a
rank whose share is smaller than the count (or empty, when N > B) fills the
rest with padding micro-batches that repeat a sample and count 0.

The engine then weighs micro-batch j of rank r by ``N · count_j / B`` instead
of ``1 / accumulation`` (``ZeroEngine.set_micro_batches``): with the sum over
ranks divided by N, the step's gradient is the mean over the B samples, the
single-process step on the whole batch, at any N. A padding micro-batch
weighs 0. With even shares the weight is ``1 / accumulation`` to the bit, so
a world that divides the batch runs exactly as before. The loss a job logs
(``mean_loss``) is weighted the same way. What this costs: the padding
micro-batches' compute, only at sizes that do not divide the batch; and a
model whose forward changes state (BatchNorm's running statistics) sees the
padding samples too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

__all__ = [
    "BatchPlan",
    "GlobalBatchSampler",
    "micro_batch_counts",
    "share_of",
    "split_global_batch",
]


class BatchPlan(Protocol):
    """What a loader needs of a sampler: the global batch of any step, as a pure function."""

    def batch_at(self, step: int) -> list[int]: ...

    def state_dict(self) -> dict[str, int]: ...


def micro_batch_counts(
    global_batch: int, rank: int, world_size: int, micro: int | None = None
) -> list[int]:
    """How many samples of a ``global_batch`` each of rank ``rank``'s micro-batches
    takes (0: a padding micro-batch); see [Note: uneven shares]."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if global_batch < 1:
        raise ValueError(f"the global batch must hold a sample, got {global_batch}")
    if micro is not None and micro < 1:
        raise ValueError(f"micro-batches must hold at least one sample, got {micro}")
    base, rest = divmod(global_batch, world_size)
    largest = base + (rest > 0)
    n = 1 if micro is None else -(-largest // micro)
    share = base + (rank < rest)
    each, more = divmod(share, n)
    return [each + (i < more) for i in range(n)]


def split_global_batch(
    batch: list[int], rank: int, world_size: int, micro: int | None = None
) -> list[list[int]]:
    """Rank ``rank``'s micro-batches of ``batch``: its contiguous share, cut into
    pieces of at most ``micro`` samples (one piece when ``micro`` is None), as many
    on every rank ([Note: uneven shares]). A padding micro-batch repeats one
    sample; the engine weighs it 0 (``micro_batch_counts`` says which)."""
    counts = micro_batch_counts(len(batch), rank, world_size, micro)
    base, rest = divmod(len(batch), world_size)
    start = rank * base + min(rank, rest)
    out = []
    for count in counts:
        if count:
            out.append(batch[start : start + count])
            start += count
        else:
            out.append([batch[min(start, len(batch) - 1)]])
    return out


def share_of(batch: list[int], engine: Any, micro: int | None = None) -> list[list[int]]:
    """``engine``'s rank's micro-batches of ``batch`` (``split_global_batch`` at its
    data-parallel rank and width, ``engine.data_rank``), after telling the engine how
    many samples each holds (``engine.set_micro_batches``): what a loop that slices its
    global batches itself calls at every step, so that any world size computes the
    whole batch's step."""
    rank, world = engine.data_rank  # (a context-parallel group shares one batch)
    engine.set_micro_batches(micro_batch_counts(len(batch), rank, world, micro), len(batch))
    return split_global_batch(batch, rank, world, micro)


@dataclass
class GlobalBatchSampler:
    num_samples: int
    global_batch: int
    seed: int = 0
    epoch: int = 0
    offset: int = 0
    # the last epoch's order: a loader asks for every step of an epoch in turn
    _cached: tuple[int, torch.Tensor] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.global_batch > self.num_samples:
            raise ValueError(
                f"global_batch must be between 1 and num_samples ({self.num_samples}), "
                f"got {self.global_batch}"
            )

    def _order(self, epoch: int) -> torch.Tensor:
        # read once: loader threads ask for other epochs' orders at the same time
        cached = self._cached
        if cached is None or cached[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            cached = (epoch, torch.randperm(self.num_samples, generator=g))
            self._cached = cached
        return cached[1]

    def batch_at(self, step: int) -> list[int]:
        """The global batch of optimizer step ``step``, without moving the sampler.

        A pure function of (seed, step): an elastic job that rolls back or
        changes its world size asks for ``batch_at(engine.global_steps)``
        and gets exactly the samples an uninterrupted run would have used.
        """
        epoch, k = divmod(step, self.steps_per_epoch)
        order = self._order(epoch)
        return order[k * self.global_batch : (k + 1) * self.global_batch].tolist()

    @property
    def steps_per_epoch(self) -> int:
        """Global batches in an epoch; the last ``num_samples % global_batch`` samples
        of each epoch's order are left out (a different few each epoch)."""
        return self.num_samples // self.global_batch

    def next_global_batch(self) -> list[int]:
        """The next global batch's sample indices; an incomplete tail starts the next epoch."""
        if self.offset + self.global_batch > self.num_samples:
            self.epoch, self.offset = self.epoch + 1, 0
        batch = self._order(self.epoch)[self.offset : self.offset + self.global_batch]
        self.offset += self.global_batch
        return batch.tolist()

    def micro_batches(
        self, batch: list[int], rank: int, world_size: int, micro: int
    ) -> list[list[int]]:
        """Rank ``rank``'s micro-batches of ``batch``: ``global_batch / (world_size * micro)``
        of them, which is the gradient accumulation that keeps the global batch constant."""
        return split_global_batch(batch, rank, world_size, micro)

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"sampler seed {self.seed} differs from the saved {state['seed']}")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
