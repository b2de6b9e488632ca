"""Stage-3 gathers the ranks agree on, or an error on every rank that names the modules.

[Note: gathers the ranks agree on]
A stage-3 gather is a collective, so every rank must gather the same units in the
same order. A module whose forward runs on some ranks and not others (an expert
no token reached, anything behind a data-dependent branch) breaks that: one rank
gathers the module's unit while another has moved on to the next one, and the
two all-gathers, paired by order and not by content, either exchange the wrong
tensors, abort the process (gloo, on sizes that differ) or wait until the
collective timeout (NCCL's is 10 to 30 minutes). Blocks that hold their experts
as a list are gathered whole and never fall out of step (worker/leaves.py [Note:
data-dependent modules at stage 3]); this is the guard for everything else.

Before a unit's all-gather is issued (for a forward, a backward, a prefetch or a
recomputation), and at the end of every forward and backward, each rank puts a
code and its negation in a MAX all-reduce of two integers on a gloo group of its
own (a CPU collective: no device synchronisation; on a group of its own, so it is
never paired with a gradient reduction; an engine on a gloo subgroup checks on that
subgroup). The code says the unit and whether it is for the forward or the
backward, or the end of either. Ranks that agree get their own pair back and carry
on. Ranks that do not all see it at once, all-gather every rank's code and raise
the same error, naming each rank's module (or its end of the pass) and the
remedy: mark the enclosing block a leaf (``worker.set_z3_leaf_modules``), so that
it is gathered whole, or run the module on every rank. A rank that skipped a unit
reaches its next check first, the next unit or the end of its pass, where the
others wait at theirs: the mismatch is found at the first gather it concerns,
within the time of one forward.

The cost is one round trip of a tiny gloo collective per unit gather and two per
step, and more than its bytes: each check makes the ranks wait for each other,
where the gathers alone let a rank run ahead (bench/zero_peers.py, a 10M GPT on 2
ranks: ``zp3c``, checked at every step, 1.20x DDP's step; ``zp3u``, never, and
``zp3``, the default, 1.07-1.08x). So by
default (``ZeroConfig(stage3_check_gathers="first")``) the ranks check through
their first forward and backward only, where a branch that differs by rank from
the start shows (and the units' order is settled); ``True`` checks every step,
for a job whose gathers fall out of step later (an MoE whose routing skews after
some steps, outside a leaf); ``False`` never. An engine on a subgroup of an NCCL job
(tensor or pipeline parallelism) has no gloo group of its own to check on, and
runs unchecked.
"""

from __future__ import annotations

import torch
from torch import nn

from worker.collectives import Collectives

__all__ = ["GatherAgreement", "GatherMismatch"]

_END_FORWARD, _END_BACKWARD = 0, 1


class GatherMismatch(RuntimeError):
    """The ranks' stage-3 gathers fell out of step ([Note: gathers the ranks agree on])."""


class GatherAgreement:
    """The checks of one stage-3 storage over ``comm``; ``units``: each unit's module."""

    def __init__(self, comm: Collectives, units: dict[int, nn.Module], *, when: bool | str) -> None:
        self.comm = comm
        self.enabled = bool(when) and comm.distributed and _checkable(comm)
        # "first": through the first backward only (ZeroConfig.stage3_check_gathers)
        self.first_only = when == "first"
        root = units.get(0)
        names = {} if root is None else {m: n for n, m in root.named_modules()}
        self.names = {i: names.get(m, type(m).__name__) or "the model" for i, m in units.items()}
        self.classes = {i: type(m).__name__ for i, m in units.items()}
        self.group: Collectives | None = None
        self._pair = torch.zeros(2, dtype=torch.int64)

    def gathering(self, unit: int, *, backward: bool) -> None:
        """Before unit ``unit``'s all-gather is issued."""
        self._agree(2 + 2 * unit + int(backward))

    def ended(self, *, backward: bool) -> None:
        """At the end of a forward (``backward=False``) or a backward."""
        self._agree(_END_BACKWARD if backward else _END_FORWARD)
        if backward and self.first_only:
            self.enabled = False

    def _agree(self, code: int) -> None:
        if not self.enabled:
            return
        if self.group is None:  # formed at the first check, where every rank is
            if self.comm.on_default_group:
                self.group = Collectives.gloo_world()
            else:  # a gloo subgroup: checked on the gathers' own group
                self.group = self.comm
        # one MAX of (code, -code): the ranks agree when it gives (code, -code) back
        self._pair[0], self._pair[1] = code, -code
        self.group.all_reduce(self._pair, op="max", control=True)
        if self._pair[0] != code or self._pair[1] != -code:
            codes = torch.empty(self.group.world_size, dtype=torch.int64)
            self.group.all_gather(codes, torch.tensor([code], dtype=torch.int64))
            raise GatherMismatch(self._message(codes.tolist()))

    def _describe(self, code: int) -> str:
        if code == _END_FORWARD:
            return "at the end of its forward"
        if code == _END_BACKWARD:
            return "at the end of its backward"
        unit, backward = divmod(code - 2, 2)
        name = self.names.get(unit, f"unit {unit}")
        what = "backward" if backward else "forward"
        return f"gathering {name!r} ({self.classes.get(unit, '?')}) for its {what}"

    def _message(self, codes: list[int]) -> str:
        by_rank = "; ".join(f"rank {r} is {self._describe(c)}" for r, c in enumerate(codes))
        return (
            f"stage 3: the ranks' parameter gathers fell out of step: {by_rank}. A module "
            "ran on some ranks and not others (an expert no token reached, a data-dependent "
            "branch): gather its enclosing block whole with "
            "worker.set_z3_leaf_modules(model, [BlockClass]), or call it on every rank "
            "(worker/gather_check.py [Note: gathers the ranks agree on])"
        )


def _checkable(comm: Collectives) -> bool:
    """Whether ``comm``'s checks have a gloo group: its own, or one formed from the
    default group (which every rank can form)."""
    return comm.on_default_group or comm.backend == "gloo"
