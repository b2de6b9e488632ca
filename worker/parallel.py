"""The model-parallel layout a script asks for beside ZeRO (:class:`ParallelConfig`),
what composes with what, and torch's DeviceMesh for it.

The mesh's rank order is coordinator/core/meshplan.py's [Note: mesh rank order].
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from coordinator.core.meshplan import CP_ENV, CP_KIND_ENV, EP_ENV, PP_ENV, TP_ENV, MeshShape
from worker.config import ZeroConfig

__all__ = ["ParallelConfig", "Schedule", "build_mesh", "check_combination", "check_heads"]

Schedule = Literal["gpipe", "1f1b"]
ContextKind = Literal["ulysses", "ring"]


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Model parallelism beside ZeRO (which runs over the data-parallel rest).

    Attributes:
        tensor_parallel: ranks that split each planned layer (tp); 1 = off.
        pipeline_parallel: pipeline stages (pp), split by layer index; 1 = off.
        pipeline_schedule: ``"gpipe"`` (all forwards, then all backwards) or
            ``"1f1b"`` (one forward, one backward: fewer micro-batches in flight).
        microbatches: micro-batches per pipeline step (>= pipeline_parallel).
        expert_parallel: ranks that split each mixture-of-experts layer's experts
            (ep): each holds E/ep whole experts, tokens reach them by all-to-all,
            their ZeRO state is sharded over the ranks holding the same experts
            (worker/moe/dispatch.py [Note: expert parallelism]); 1 = off.
        capacity_factor: with expert parallelism, at most ``ceil(factor * T * K / E)``
            tokens per expert per call, the rest dropped; None: dropless.
        context_parallel: ranks that split each sequence (cp): each computes a
            shard of every sequence of its group's batch, attention exchanging
            what it needs (worker/context/parallel.py [Note: context parallelism]);
            1 = off.
        context_parallel_kind: ``"ulysses"`` (all-to-all: heads for sequence, the
            heads divisible by cp) or ``"ring"`` (key/value blocks round the
            ring, zig-zag shards for causal balance; any heads).
    """

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    pipeline_schedule: Schedule = "gpipe"
    microbatches: int = 4
    expert_parallel: int = 1
    capacity_factor: float | None = None
    context_parallel: int = 1
    context_parallel_kind: ContextKind = "ulysses"

    def __post_init__(self) -> None:
        for name in (
            "tensor_parallel",
            "pipeline_parallel",
            "microbatches",
            "expert_parallel",
            "context_parallel",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelConfig.{name} must be an integer >= 1, got {value!r}")
        cap = self.capacity_factor
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int | float)
                                or not cap > 0):  # fmt: skip
            raise ValueError(
                f"ParallelConfig.capacity_factor must be a number > 0 or None, got {cap!r}"
            )
        if self.context_parallel_kind not in ("ulysses", "ring"):
            raise ValueError(
                "ParallelConfig.context_parallel_kind must be 'ulysses' or 'ring', "
                f"got {self.context_parallel_kind!r}"
            )
        if self.pipeline_schedule not in ("gpipe", "1f1b"):
            raise ValueError(
                f"ParallelConfig.pipeline_schedule must be 'gpipe' or '1f1b', "
                f"got {self.pipeline_schedule!r}"
            )
        if self.pipeline_parallel > 1 and self.microbatches < self.pipeline_parallel:
            raise ValueError(
                f"ParallelConfig.microbatches ({self.microbatches}) must be >= "
                f"pipeline_parallel ({self.pipeline_parallel}) to fill the pipeline"
            )

    @classmethod
    def from_env(cls, **overrides: Any) -> ParallelConfig:
        """tp, pp, ep and cp as the launcher set them (``zeroplane run --tp/--pp/--ep/--cp``,
        the job spec: ``$ZEROPLANE_TP``/``$ZEROPLANE_PP``/``$ZEROPLANE_EP``/
        ``$ZEROPLANE_CP``, ``$ZEROPLANE_CP_KIND``); 1 where unset."""
        values: dict[str, Any] = {}
        kind = os.environ.get(CP_KIND_ENV)
        if kind:
            values["context_parallel_kind"] = kind
        for field_name, env in (
            ("tensor_parallel", TP_ENV),
            ("pipeline_parallel", PP_ENV),
            ("expert_parallel", EP_ENV),
            ("context_parallel", CP_ENV),
        ):
            raw = os.environ.get(env)
            if raw is not None:
                if not raw.isdigit():
                    raise ValueError(f"${env} must be an integer >= 1, got {raw!r}")
                values[field_name] = int(raw)
        return cls(**{**values, **overrides})

    def shape(self, world_size: int) -> MeshShape:
        return MeshShape.for_world(world_size, tp=self.tensor_parallel, pp=self.pipeline_parallel)


def check_combination(config: ZeroConfig, parallel: ParallelConfig) -> None:
    """Refuse, with the reason, what this composition does not do (README, "The mesh")."""
    pp = parallel.pipeline_parallel
    cp = parallel.context_parallel
    if cp > 1 and pp > 1:
        raise ValueError(
            f"context_parallel={cp} runs with data, tensor and expert parallelism only for "
            f"now, not with pipeline_parallel={pp} (docs/guides/long-sequences.md)"
        )
    if pp > 1 and config.stage > 2:
        raise ValueError(
            f"pipeline_parallel > 1 runs with ZeRO stages 0-2, got stage {config.stage}: "
            "stage 3 gathers each unit per forward and backward, which the pipeline "
            "schedule interleaves over micro-batches (worker/pipeline_engine.py [Note: pipeline "
            "gradients into ZeRO])"
        )
    if pp > 1 and config.gradient_accumulation_steps != 1:
        raise ValueError(
            "with pipeline_parallel > 1 the pipeline's micro-batches are the accumulation: "
            "set ParallelConfig.microbatches, and gradient_accumulation_steps=1"
        )


def build_mesh(shape: MeshShape, device_type: str = "cpu") -> DeviceMesh:
    """torch's DeviceMesh over the default group, dims named ``pp``, ``dp``, ``tp``."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("build_mesh needs torch.distributed initialized (all ranks)")
    world = dist.get_world_size()
    if world != shape.world_size:
        raise ValueError(
            f"mesh pp={shape.pp} x dp={shape.dp} x tp={shape.tp} needs {shape.world_size} "
            f"ranks, the process group has {world}"
        )
    return init_device_mesh(
        device_type, (shape.pp, shape.dp, shape.tp), mesh_dim_names=("pp", "dp", "tp")
    )


def check_heads(model: nn.Module, tp: int) -> None:
    """Attention heads must split evenly over tp (worker.models GPT, HF configs)."""
    configs = [getattr(model, "cfg", None), getattr(model, "config", None)]
    for cfg in configs:
        for key in ("n_head", "num_attention_heads", "num_key_value_heads"):
            heads = getattr(cfg, key, None)
            if isinstance(heads, int) and heads % tp:
                raise ValueError(
                    f"the model's {key}={heads} cannot be split over tensor_parallel={tp}"
                )
