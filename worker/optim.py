"""The user's optimizer, run on this rank's fp32 shard.

[Note: per-parameter shard views]
The optimizer does not run on one flat tensor. Each parameter's piece of this
rank's master shard is a view (a leaf tensor that shares the flat storage),
and the user's optimizer class is re-instantiated over those views with the
same param groups and hyperparameters. That keeps torch.optim's semantics
exactly: a parameter that got no gradient anywhere this step has its view's
``grad`` set to ``None`` and is skipped, its state untouched, and Adam's step
count stays per parameter. Only elementwise optimizers are correct on pieces
of parameters; others are refused.

[Note: fused optimizer on the host]
With offload the optimizer steps host tensors (worker/offload.py). torch picks
its slow per-tensor loop for CPU tensors unless told otherwise; its fused CPU
Adam/AdamW kernel is about 6.5x faster than even foreach (AdamW over 10M
elements on one core here: 57 ms fused, 371 ms foreach). So where the user's
Adam or AdamW left ``fused`` and ``foreach`` unset, the host optimizer runs
fused; an explicit choice is kept. (torch's fused SGD is not used: it fails
when a parameter gets its first gradient after others have momentum.)
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

__all__ = ["ELEMENTWISE_OPTIMIZERS", "ShardOptimizer", "rebuild_optimizer"]

logger = logging.getLogger(__name__)

ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = tuple(
    cls
    for cls in (
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adamax,
        torch.optim.Adagrad,
        torch.optim.Adadelta,
        torch.optim.RMSprop,
        torch.optim.Rprop,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.ASGD,
    )
)

OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]


# classes whose fused CPU kernel keeps torch.optim's per-parameter semantics when a
# parameter gets its first gradient after others (torch's fused SGD does not: it
# fails on a momentum buffer list that is partly empty)
_FUSED_ON_HOST: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW)


def fused_default(template: torch.optim.Optimizer) -> dict:
    """``{"fused": True}`` where ``template``'s class has a fused implementation and its
    user chose none ([Note: fused optimizer on the host]); otherwise nothing."""
    if type(template) not in _FUSED_ON_HOST:
        return {}
    defaults = template.defaults
    unset = defaults.get("fused") is None and not defaults.get("foreach")
    if unset and not defaults.get("differentiable") and not defaults.get("capturable"):
        return {"fused": True}
    return {}


def rebuild_optimizer(template: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    """A new optimizer of ``template``'s class and defaults over ``groups``."""
    cls = type(template)
    if not (
        issubclass(cls, ELEMENTWISE_OPTIMIZERS) or getattr(cls, "zeroplane_elementwise", False)
    ):
        raise TypeError(
            f"optimizer {cls.__name__} is not known to be elementwise, so it cannot run on "
            "shards of parameters; use one of "
            + ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
            + " or set the class attribute zeroplane_elementwise = True"
        )
    # Every group carries all of its hyperparameters; the constructor only needs
    # the defaults it accepts (torch adds internal ones it does not).
    accepted = inspect.signature(cls.__init__).parameters
    impl = {k: groups[0][k] for k in ("fused", "foreach") if groups and k in groups[0]}
    defaults = {**template.defaults, **impl}
    return cls(groups, **{k: v for k, v in defaults.items() if k in accepted})


def group_hyperparams(group: dict) -> dict:
    """A param group's hyperparameters: everything but its parameters."""
    return {k: v for k, v in group.items() if k != "params"}


@dataclass
class Piece:
    """A parameter's elements on this rank: a view of the master shard."""

    param_index: int
    view: torch.Tensor
    bucket: int
    grad_offset: int
    name: str
    param_start: int


class ShardOptimizer:
    """Runs the user's optimizer class over this rank's pieces of the master shard.

    ``pieces_by_group[g]`` lists the pieces whose parameter is in the user's
    param group ``g``. Hyperparameters are read from the user's optimizer
    before every step, so an LR scheduler attached to it keeps working.
    ``on_host``: the pieces are host tensors (offload); the optimizer runs
    fused where the user did not choose ([Note: fused optimizer on the host]).
    """

    def __init__(
        self,
        user: torch.optim.Optimizer,
        pieces_by_group: list[list[Piece]],
        *,
        on_host: bool = False,
    ) -> None:
        self.user = user
        self.pieces = [p for group in pieces_by_group for p in group]
        self.impl = fused_default(user) if on_host else {}
        groups = [
            {"params": [p.view for p in pieces], **group_hyperparams(ug), **self.impl}
            for pieces, ug in zip(pieces_by_group, user.param_groups, strict=True)
        ]
        self.inner = rebuild_optimizer(user, groups)

    def piece_grads(
        self, grads: Sequence[torch.Tensor], used: Sequence[int]
    ) -> list[torch.Tensor | None]:
        """Each piece's gradient, sliced from its bucket's partition gradient in
        ``grads``; ``None`` for a parameter no rank used (``used[param_index]``)."""
        return [
            grads[p.bucket][p.grad_offset : p.grad_offset + p.view.numel()]
            if used[p.param_index]
            else None
            for p in self.pieces
        ]

    def hyperparams(self) -> list[dict]:
        """The user's param groups' hyperparameters now, as the next step reads them
        (copies: a scheduler that changes them later does not change these)."""
        return [
            {
                k: v.clone() if isinstance(v, torch.Tensor) else v
                for k, v in group_hyperparams(ug).items()
                if k not in self.impl
            }
            for ug in self.user.param_groups
        ]

    def step(
        self,
        grads: Sequence[torch.Tensor | None],
        *,
        buckets: Collection[int] | None = None,
        groups: Sequence[dict] | None = None,
    ) -> None:
        """One step; ``grads[i]`` is piece i's fp32 gradient, ``None`` if unused.

        ``buckets``: update only the pieces of these buckets (the others are
        skipped as torch.optim skips a parameter without a gradient), so the
        caller can publish one part while the next is updated. ``groups``: the
        hyperparameters to step with (:meth:`hyperparams` of an earlier step);
        by default the user's param groups as they are now.
        """
        if groups is None:
            groups = self.user.param_groups
        for ug, ig in zip(groups, self.inner.param_groups, strict=True):
            for key, value in ug.items():
                if key != "params" and key not in self.impl:
                    ig[key] = value
        for piece, grad in zip(self.pieces, grads, strict=True):
            if buckets is None or piece.bucket in buckets:
                piece.view.grad = grad
        self.inner.step()
        for piece in self.pieces:
            piece.view.grad = None

    def state_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for state in self.inner.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor)
        )
