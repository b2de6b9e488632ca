"""The step's global gradient norm: clipping to ``ZeroConfig.gradient_clipping``, and
the fp16 step skipped on an overflow (worker/precision.py :class:`LossScaler`). Beyond
the dp group (tensor or pipeline parallelism) the norm spans the model-parallel ranks
through a :class:`NormScope` (worker/mesh.py sets the engine's)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from worker.config import ZeroConfig
from worker.state import ShardState

if TYPE_CHECKING:
    from worker.moe.shards import ExpertShards

__all__ = ["NormScope", "clip_or_skip"]


class NormScope(Protocol):
    """The global gradient norm beyond the dp group (tensor/pipeline parallelism):
    each element's square counts ``weight(name)`` times on this rank (1/tp for a
    parameter replicated over tp), and ``reduce`` sums over the other ranks.
    ``replica_weight``: the weight of a parameter whole on every tp rank outside
    the engine's own state (an expert under expert parallelism)."""

    def weight(self, name: str) -> float: ...

    @property
    def replica_weight(self) -> float: ...

    def reduce(self, sumsq: torch.Tensor) -> None: ...


def clip_or_skip(
    grads: list[torch.Tensor],
    state: ShardState,
    config: ZeroConfig,
    scope: NormScope | None,
    experts: ExpertShards | None = None,
    expert_grads: Sequence[torch.Tensor] = (),
) -> tuple[bool, float | None]:
    """Clip ``grads`` (this rank's fp32 partition gradients, unscaled, in bucket order)
    in place by their global norm over the group (and ``scope``), and update the fp16
    loss scale. Returns whether the optimizer steps (False: an fp16 overflow) and the
    norm, None where neither clipping nor fp16 needs one. ``experts``: an
    expert-parallel model's experts, whose gradients ``expert_grads`` are part of the
    norm and clipped with the rest (worker/moe/shards.py [Note: two shard states])."""
    clip = config.gradient_clipping
    fp16 = config.dtype == "fp16"
    if not clip and not fp16:
        return True, None
    sumsq = torch.zeros((), dtype=torch.float32, device=state.device)
    if scope is None:
        for g in grads:
            sumsq += g.pow(2).sum()
    else:
        for piece in state.optimizer.pieces:
            g = grads[piece.bucket][piece.grad_offset : piece.grad_offset + piece.view.numel()]
            sumsq += scope.weight(piece.name) * g.pow(2).sum()
    sharded = state.stage.optimizer_sharded
    if experts is not None:
        weight = 1.0 if scope is None else scope.replica_weight
        sumsq += weight * experts.sumsq(expert_grads, world_reduces=sharded)
    if sharded:
        state.comm.all_reduce(sumsq, control=True)
    if scope is not None:
        scope.reduce(sumsq)
    norm = math.sqrt(sumsq.item()) if math.isfinite(sumsq.item()) else math.inf
    overflow = not math.isfinite(norm)
    state.scaler.update(overflow)
    if fp16 and overflow:
        return False, norm
    if clip:
        coef = clip / (norm + 1e-6)
        if coef < 1.0:
            for g in (*grads, *expert_grads):
                g.mul_(coef)
    return True, norm
