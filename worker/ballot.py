"""The step-boundary ballot: which parameters were used, and the membership vote.

[Note: the step-boundary ballot]
Once per optimizer step every rank contributes one small int32 vector to a
MAX all-reduce, started when the last micro-batch's backward starts and
waited on in ``step()``, so it overlaps backward:

* one flag per trainable parameter: whether this rank's graphs used it in any
  micro-step of the window. A parameter no rank used keeps its value and
  optimizer state, as in torch.optim (worker/engine.py [Note: unused
  parameters]);
* four slots for the membership vote (:class:`BoundaryVote`): the newest
  generation id any rank has heard of, 1 + the rank of a worker asking to
  leave (0: none), 1 if this rank stays (so the maximum says whether
  anyone does: when every rank was told to leave, nobody is left to hand
  over to), and 1 if this rank knows of a newer generation whose ranks are
  not all ready for it yet (so the maximum says whether anyone waits: the
  switch waits for the slowest, worker/rendezvous.py [Note: meeting ahead]).
  Every rank thus learns the same thing at the same step boundary and
  changes membership together (worker/elastic/session.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.collectives import Collectives, Handle

__all__ = ["Ballot", "BoundaryVote"]


@dataclass(frozen=True)
class BoundaryVote:
    """What a rank proposes for membership at a step boundary; after the
    all-reduce, what the ranks agreed (the maximum of each field).

    ``staying``: this rank was not asked to leave; agreed, whether any rank
    stays. A rank asking to leave proposes itself as ``leaving_rank``.
    ``waiting``: this rank knows of a newer generation that is not ready to
    switch to; agreed, whether any rank does."""

    generation: int = 0
    leaving_rank: int | None = None
    staying: bool = True
    waiting: bool = False

    SLOTS = 4

    @property
    def everyone_leaving(self) -> bool:
        """Every rank was asked to leave at this boundary: nobody can take a hand-over."""
        return self.leaving_rank is not None and not self.staying

    def encode(self) -> tuple[int, int, int, int]:
        leaving = 0 if self.leaving_rank is None else self.leaving_rank + 1
        return self.generation, leaving, int(self.staying), int(self.waiting)

    @classmethod
    def decode(cls, generation: int, leaving: int, staying: int, waiting: int) -> BoundaryVote:
        return cls(generation, None if leaving == 0 else leaving - 1, bool(staying), bool(waiting))

    def switches_to_newer(self, current: int) -> bool:
        """Agreed: move to the newest generation at this boundary (every rank that
        knows of it is ready)."""
        return self.generation > current and not self.waiting


class Ballot:
    """The used-parameter flags and the vote, as one tensor and one collective."""

    def __init__(self, n_params: int, device: torch.device) -> None:
        self._n = n_params
        self._flags = torch.zeros(n_params + BoundaryVote.SLOTS, dtype=torch.int32, device=device)
        self._handle: Handle | None = None

    def mark_used(self, param_index: int) -> None:
        self._flags[param_index] = 1

    def start(self, comm: Collectives, vote: BoundaryVote) -> None:
        """Cast this rank's ballot (asynchronously, overlapping backward)."""
        self._flags[self._n :] = torch.tensor(vote.encode(), dtype=torch.int32)
        if comm.distributed:
            self._handle = comm.all_reduce(self._flags, op="max", async_op=True, control=True)

    def wait(self) -> None:
        if self._handle is not None:
            self._handle.wait()
            self._handle = None

    def used(self) -> list[int]:
        """Per trainable parameter, 1 if any rank used it this step."""
        return self._flags[: self._n].tolist()

    def agreed(self) -> BoundaryVote:
        return BoundaryVote.decode(*self._flags[self._n :].tolist())

    def clear(self) -> None:
        """Forget this step's ballot (after the step, or a step abandoned mid-way)."""
        self._handle = None
        self._flags.zero_()
