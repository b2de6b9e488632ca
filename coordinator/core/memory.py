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

ZeRO++'s hpZ (``hpz_partition_size`` k > 1, stage 3) adds to the parameters a
secondary copy of 1/k of each, p·Ψ/k (worker/stages.py [Note: hierarchical
partitioning]).

[Note: offloaded state bytes]
With offload (worker/offload.py) part of that moves to host memory
(:func:`offloaded_state_bytes`):

* ``optimizer`` offload (stages 1–3): the fp32 master partition (4·Ψ/N, a
  tensor of its own even in fp32), the optimizer state (4·k·Ψ/N) and a reused
  fp32 host copy of the gradient partition (4·Ψ/N) live on the host; the
  device keeps the compute parameters and the gradients the stage keeps.
* ``params`` offload (stage 3): the parameter shards (p·Ψ/N) live on the
  host; the device holds only the gather units in flight (not counted here,
  like activations). Without optimizer offload the master partition is then
  apart from the shard on the device (4·Ψ/N, also in fp32).

Per step each rank moves over PCIe (:func:`offload_transfer_bytes`): with
optimizer offload its gradient partition to the host and the updated
partition back, both as fp32 (4·Ψ/N each way: torch casts on the GPU side of
an asynchronous copy between dtypes); with parameter offload every shard to
the device twice (forward and backward gathers, 2·p·Ψ/N).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "DTYPE_BYTES",
    "OFFLOADS",
    "BirthBytes",
    "ModelStateBytes",
    "Offload",
    "birth_bytes",
    "model_state_bytes",
    "offload_transfer_bytes",
    "offloaded_state_bytes",
]

Precision = Literal["fp32", "bf16", "fp16"]
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}

# what is offloaded to host memory: ZeroConfig.offload_optimizer / offload_params
Offload = Literal["none", "optimizer", "params", "optimizer+params"]
OFFLOADS: tuple[Offload, ...] = ("none", "optimizer", "params", "optimizer+params")


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
    hpz_partition_size: int = 1,
) -> ModelStateBytes:
    """Bytes of model state one rank holds, by the formulas above (no padding);
    ``hpz_partition_size``: hpZ's ranks per node at stage 3 (1: off)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    if optimizer_states < 0:
        raise ValueError(f"optimizer_states must be >= 0, got {optimizer_states}")
    if hpz_partition_size < 1 or (hpz_partition_size > 1 and stage != 3):
        raise ValueError(
            "hpz_partition_size must be an integer >= 1, and 1 below stage 3, "
            f"got {hpz_partition_size} at stage {stage}"
        )
    p = DTYPE_BYTES[dtype]
    shard = numel / world_size
    secondary = numel / hpz_partition_size if hpz_partition_size > 1 else 0
    return ModelStateBytes(
        params=p * (shard + secondary if stage >= 3 else numel),
        grads=p * (shard if stage >= 2 else numel),
        master=0 if dtype == "fp32" else 4 * (shard if stage >= 1 else numel),
        optimizer=4 * optimizer_states * (shard if stage >= 1 else numel),
    )


@dataclass(frozen=True)
class BirthBytes:
    """Peak bytes one rank holds while its engine is built, before the first step
    ([Note: birth peak]): from an ordinary construction, and from the meta device."""

    ordinary: float
    meta: float


def birth_bytes(
    numel: int,
    *,
    stage: int,
    world_size: int,
    dtype: Precision = "bf16",
    unit_numel: int = 0,
) -> BirthBytes:
    """[Note: birth peak]
    The build allocates the model state of :func:`model_state_bytes` but the
    optimizer's own states (made at the first step). An ordinary construction
    also holds the whole model as the script built it, in fp32 (4Ψ), until the
    build has taken its values: a floor that does not fall with N. A model built
    on the meta device (worker/birth.py) holds, beside the build, at most a gather
    unit's fp32 values and the buffer that broadcasts rank 0's (2 · 4 · unit);
    ``unit_numel`` is the largest unit's elements (0: not known, not counted)."""
    states = model_state_bytes(
        numel, stage=stage, world_size=world_size, dtype=dtype, optimizer_states=0
    )
    return BirthBytes(ordinary=states.total + 4 * numel, meta=states.total + 8 * unit_numel)


def _check_offload(offload: str, stage: int) -> tuple[bool, bool]:
    if offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {OFFLOADS}, got {offload!r}")
    optimizer, params = "optimizer" in offload, "params" in offload
    if optimizer and stage < 1:
        raise ValueError("optimizer offload needs stage 1, 2 or 3")
    if params and stage != 3:
        raise ValueError("parameter offload needs stage 3")
    return optimizer, params


def offloaded_state_bytes(
    numel: int,
    *,
    stage: int,
    world_size: int,
    dtype: Precision = "bf16",
    optimizer_states: int = 2,
    offload: Offload = "none",
) -> tuple[ModelStateBytes, ModelStateBytes]:
    """(device, host) bytes of model state one rank holds with ``offload``
    ([Note: offloaded state bytes]); with ``"none"`` the host part is zero."""
    device = model_state_bytes(
        numel,
        stage=stage,
        world_size=world_size,
        dtype=dtype,
        optimizer_states=optimizer_states,
    )
    optimizer, params = _check_offload(offload, stage)
    shard = numel / world_size
    p = DTYPE_BYTES[dtype]
    host = ModelStateBytes(
        params=p * shard if params else 0,
        grads=4 * shard if optimizer else 0,
        master=4 * shard if optimizer else 0,
        optimizer=4 * optimizer_states * shard if optimizer else 0,
    )
    master = device.master
    if optimizer:
        master = 0
    elif params:
        master = 4 * shard  # apart from the (host) shard, even in fp32
    device = ModelStateBytes(
        params=0 if params else device.params,
        grads=device.grads,
        master=master,
        optimizer=0 if optimizer else device.optimizer,
    )
    return device, host


def offload_transfer_bytes(
    numel: int,
    *,
    stage: int,
    world_size: int,
    dtype: Precision = "bf16",
    offload: Offload = "none",
) -> float:
    """Bytes one rank moves between device and host per optimizer step
    ([Note: offloaded state bytes])."""
    optimizer, params = _check_offload(offload, stage)
    shard = numel / world_size
    return 8 * shard * optimizer + 2 * DTYPE_BYTES[dtype] * shard * params


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
