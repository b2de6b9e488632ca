"""A sampler whose global batches do not depend on the world size.

Data-parallel training on a constant global batch with the same samples is
the same computation at any world size. :class:`GlobalBatchSampler` fixes
the sample order by (seed, epoch) alone and counts its position in samples,
so a job that resumes, or changes its world size, continues at exactly the
next sample: rank r of N takes its slice of the same global batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

__all__ = ["BatchPlan", "GlobalBatchSampler", "split_global_batch"]


class BatchPlan(Protocol):
    """What a loader needs of a sampler: the global batch of any step, as a pure function."""

    def batch_at(self, step: int) -> list[int]: ...

    def state_dict(self) -> dict[str, int]: ...


def split_global_batch(
    batch: list[int], rank: int, world_size: int, micro: int | None = None
) -> list[list[int]]:
    """Rank ``rank``'s micro-batches of ``batch``: its contiguous share, cut into
    ``micro``-sized pieces (one piece when ``micro`` is None)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    per_rank, rest = divmod(len(batch), world_size)
    micro = per_rank if micro is None else micro
    if rest or micro < 1 or per_rank % micro:
        raise ValueError(
            f"global batch {len(batch)} does not split into {world_size} ranks "
            f"of micro-batches of {micro}"
        )
    mine = batch[rank * per_rank : (rank + 1) * per_rank]
    return [mine[i : i + micro] for i in range(0, per_rank, micro)]


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
