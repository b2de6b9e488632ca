"""Model-state bytes per rank for each ZeRO stage (the ZeRO paper's formulas).

For Ψ trainable parameters on N ranks, with compute dtype of ``p`` bytes and an
optimizer that keeps ``k`` fp32 tensors per element (Adam: k = 2):

* parameters: p·Ψ, sharded at stage 3;
* gradients: p·Ψ, sharded at stages 2 and 3;
* fp32 master weights (mixed precision only; in fp32 the parameters are the
  master): 4·Ψ, sharded at stages 1–3;
* optimizer state: 4·k·Ψ, sharded at stages 1–3.

With bf16 and Adam that is 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N and 16Ψ/N for stages
0–3, the paper's Table 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["DTYPE_BYTES", "ModelStateBytes", "model_state_bytes"]

Precision = Literal["fp32", "bf16", "fp16"]
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class ModelStateBytes:
    params: float
    grads: float
    master: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.master + self.optimizer

    def as_dict(self) -> dict[str, float]:
        return {
            "params": self.params,
            "grads": self.grads,
            "master": self.master,
            "optimizer": self.optimizer,
            "total": self.total,
        }


def model_state_bytes(
    numel: int,
    *,
    stage: int,
    world_size: int,
    dtype: Precision = "bf16",
    optimizer_states: int = 2,
) -> ModelStateBytes:
    """Bytes of model state one rank holds, by the formulas above (no padding)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    if optimizer_states < 0:
        raise ValueError(f"optimizer_states must be >= 0, got {optimizer_states}")
    p = DTYPE_BYTES[dtype]
    shard = numel / world_size
    return ModelStateBytes(
        params=p * (shard if stage >= 3 else numel),
        grads=p * (shard if stage >= 2 else numel),
        master=0 if dtype == "fp32" else 4 * (shard if stage >= 1 else numel),
        optimizer=4 * optimizer_states * (shard if stage >= 1 else numel),
    )


def model_parallel_numel(numel: int, *, sharded_numel: int, tp: int = 1, pp: int = 1) -> float:
    """Trainable elements one rank's ZeRO holds under tensor and pipeline parallelism.

    Tensor parallelism splits the ``sharded_numel`` elements of its planned layers
    over ``tp`` ranks and replicates the rest (norms, embeddings here); a pipeline
    splits the whole by layer over ``pp`` stages (evenly, to first order: the first
    and last stages also hold the embeddings and head). ZeRO then applies the
    formulas above to this count over the dp ranks:
    ``Ψ_rank = ((Ψ - Ψ_tp) + Ψ_tp / tp) / pp``.
    """
    if not 0 <= sharded_numel <= numel:
        raise ValueError(f"sharded_numel must be in [0, {numel}], got {sharded_numel}")
    if tp < 1 or pp < 1:
        raise ValueError(f"tp and pp must be >= 1, got tp={tp}, pp={pp}")
    return ((numel - sharded_numel) + sharded_numel / tp) / pp
