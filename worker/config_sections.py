"""The sections of :class:`~worker.config.ZeroConfig`: one frozen dataclass per concern,
each checking its own fields in its ``__post_init__``.

``ZeroConfig`` stays the one flat dataclass a script constructs, and its docstring
says what each field means. Its ``__post_init__`` builds every section of
:data:`SECTIONS` from its fields, which validates them, and then checks the rules
that tie fields of different sections together (``ZeroConfig._check_across_sections``
in worker/config.py); ``config.precision``, ``config.stage3`` and the like return
them. A section's fields have ``ZeroConfig``'s names and no defaults of their own:
``ZeroConfig``'s are the only ones. A bad value raises :class:`FieldError` naming the
field and the value: ``ZeroConfig.<field> must be <what>, got <value>``.

Types are checked before values: a bool is not a number, a float is not an int, and
NaN/inf are no numbers either (NaN passes every `<` test).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "SECTIONS",
    "ActivationSection",
    "CompressionSection",
    "FieldError",
    "LossScaling",
    "MetricsSection",
    "OffloadSection",
    "Precision",
    "PrecisionSection",
    "ReplicaSection",
    "ShardingSection",
    "Stage3Section",
    "StepSection",
    "is_finite_number",
    "is_int",
]

Precision = Literal["fp32", "bf16", "fp16"]
_PRECISIONS = ("fp32", "bf16", "fp16")


class FieldError(ValueError):
    """A ZeroConfig field's bad value; ``field`` names it (from_deepspeed adds its key)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return not isinstance(value, float) or math.isfinite(value)


def _bad(section: object, name: str, want: str) -> FieldError:
    return FieldError(f"ZeroConfig.{name} must be {want}, got {getattr(section, name)!r}", name)


def _one_of(value: Any, choices: tuple[Any, ...]) -> bool:
    return isinstance(value, str) and value in choices


def _check_ints(section: object, minimum: int, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if not is_int(value) or value < minimum:
            raise _bad(section, name, f"an integer >= {minimum}")


def _check_bools(section: object, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(section, name), bool):
            raise _bad(section, name, "a bool")


@dataclass(frozen=True, kw_only=True)
class ShardingSection:
    """What is sharded, and how gradients are bucketed and reduced."""

    stage: Literal[0, 1, 2, 3]
    bucket_numel: int
    overlap_comm: bool

    def __post_init__(self) -> None:
        if not is_int(self.stage) or self.stage not in (0, 1, 2, 3):
            raise _bad(self, "stage", "0, 1, 2 or 3")
        _check_ints(self, 1, "bucket_numel")
        _check_bools(self, "overlap_comm")


@dataclass(frozen=True, kw_only=True)
class PrecisionSection:
    """The compute dtype and the dtype gradients are reduced in."""

    dtype: Precision
    reduce_dtype: Precision | None

    def __post_init__(self) -> None:
        if not _one_of(self.dtype, _PRECISIONS):
            raise _bad(self, "dtype", f"one of {_PRECISIONS}")
        if self.reduce_dtype is not None and not _one_of(self.reduce_dtype, _PRECISIONS):
            raise _bad(self, "reduce_dtype", f"None or one of {_PRECISIONS}")


@dataclass(frozen=True, kw_only=True)
class StepSection:
    """What an optimizer step does with the gradients: accumulation and clipping."""

    gradient_accumulation_steps: int
    gradient_clipping: float

    def __post_init__(self) -> None:
        _check_ints(self, 1, "gradient_accumulation_steps")
        if not is_finite_number(self.gradient_clipping) or self.gradient_clipping < 0:
            raise _bad(self, "gradient_clipping", "a finite number >= 0")


@dataclass(frozen=True, kw_only=True)
class LossScaling:
    """fp16 loss scaling: a static scale, or the dynamic scale's start, window,
    hysteresis and floor."""

    loss_scale: float
    initial_scale_power: int
    loss_scale_window: int
    hysteresis: int
    min_loss_scale: float

    def __post_init__(self) -> None:
        _check_ints(self, 1, "loss_scale_window", "hysteresis")
        if not is_int(self.initial_scale_power) or not 0 <= self.initial_scale_power <= 64:
            raise _bad(self, "initial_scale_power", "an integer between 0 and 64")
        if not is_finite_number(self.loss_scale) or self.loss_scale < 0:
            raise _bad(self, "loss_scale", "a finite number >= 0")
        if not is_finite_number(self.min_loss_scale) or not self.min_loss_scale > 0:
            raise _bad(self, "min_loss_scale", "a finite number > 0")


@dataclass(frozen=True, kw_only=True)
class CompressionSection:
    """How gradients travel: the codec, its block, warmup, error feedback and qgZ's
    ranks per node."""

    compression: Literal["none", "bf16", "fp16", "int8", "onebit"]
    compression_block: int
    compression_warmup_steps: int
    error_feedback: bool
    hierarchical_reduce: int

    def __post_init__(self) -> None:
        _check_ints(self, 1, "compression_block", "hierarchical_reduce")
        _check_ints(self, 0, "compression_warmup_steps")
        _check_bools(self, "error_feedback")
        if not _one_of(self.compression, ("none", "bf16", "fp16", "int8", "onebit")):
            raise _bad(self, "compression", "one of none, bf16, fp16, int8, onebit")


@dataclass(frozen=True, kw_only=True)
class Stage3Section:
    """Stage 3's gather units: prefetch, reuse, the live-parameter bound, the unit
    size and hpZ's node groups; and the parameter all-gathers' compression, which
    stages 1–2 use too (ZeroConfig refuses it at stage 0)."""

    stage3_prefetch: int
    stage3_max_reuse_distance: int
    stage3_max_live_parameters: int
    stage3_min_unit_numel: int
    stage3_check_gathers: bool | Literal["first"]
    stage3_gather_compression: Literal["none", "bf16", "int8", "float8"]
    hpz_partition_size: int

    def __post_init__(self) -> None:
        _check_ints(
            self,
            0,
            "stage3_prefetch",
            "stage3_max_reuse_distance",
            "stage3_max_live_parameters",
            "stage3_min_unit_numel",
        )
        _check_ints(self, 1, "hpz_partition_size")
        if self.stage3_check_gathers != "first":
            _check_bools(self, "stage3_check_gathers")
        if not _one_of(self.stage3_gather_compression, ("none", "bf16", "int8", "float8")):
            raise _bad(self, "stage3_gather_compression", "one of none, bf16, int8, float8")


@dataclass(frozen=True, kw_only=True)
class ReplicaSection:
    """In-memory replicas of a neighbour's state, and the gradient log that rolls a
    lost rank's replica forward."""

    replica_interval: int
    replica_gradient_log: bool

    def __post_init__(self) -> None:
        _check_ints(self, 0, "replica_interval")
        _check_bools(self, "replica_gradient_log")


@dataclass(frozen=True, kw_only=True)
class OffloadSection:
    """ZeRO-Offload: the optimizer partition and stage-3 shards in host memory."""

    offload_optimizer: Literal["none", "cpu"]
    offload_params: Literal["none", "cpu"]
    pin_memory: bool

    def __post_init__(self) -> None:
        _check_bools(self, "pin_memory")
        for name in ("offload_optimizer", "offload_params"):
            value = getattr(self, name)
            if value == "nvme":
                raise FieldError(
                    f"ZeroConfig.{name}='nvme' is not supported: zeroplane offloads to host "
                    "memory only ('cpu'); NVMe offload (ZeRO-Infinity) is not implemented",
                    name,
                )
            if not _one_of(value, ("none", "cpu")):
                raise _bad(self, name, "'none' or 'cpu'")


@dataclass(frozen=True, kw_only=True)
class MetricsSection:
    """Where Prometheus metrics are served."""

    metrics_port: int | None

    def __post_init__(self) -> None:
        if self.metrics_port is not None and (
            not is_int(self.metrics_port) or not 0 <= self.metrics_port <= 65535
        ):
            raise _bad(self, "metrics_port", "None or an integer in [0, 65535]")


@dataclass(frozen=True, kw_only=True)
class ActivationSection:
    """The forward's activations: which modules recompute theirs in backward, where
    saved ones wait, the tiles of the loss and MLPs, and whether it is compiled."""

    # torch-free annotation: the callable takes an nn.Module
    activation_checkpointing: Literal["none", "units"] | int | Callable[[Any], bool]
    offload_activations: bool
    tiled_loss: int
    tiled_mlp: int
    compile: bool

    def __post_init__(self) -> None:
        for flag in ("offload_activations", "compile"):
            if not isinstance(getattr(self, flag), bool):
                raise _bad(self, flag, "True or False")
        for name in ("tiled_loss", "tiled_mlp"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise _bad(self, name, "an integer >= 0 (tokens per tile; 0: off)")
        policy = self.activation_checkpointing
        if isinstance(policy, str):
            ok = policy in ("none", "units")
        elif isinstance(policy, bool):
            ok = False
        elif isinstance(policy, int):
            ok = policy >= 1
        else:
            ok = callable(policy)
        if not ok:
            raise _bad(
                self,
                "activation_checkpointing",
                "'none', 'units', an integer >= 1 or a callable policy(module) -> bool",
            )


# Every section, in the order ZeroConfig builds (and so checks) them; together they
# hold each ZeroConfig field exactly once (tests/test_config.py).
SECTIONS: tuple[type, ...] = (
    ShardingSection,
    PrecisionSection,
    StepSection,
    LossScaling,
    CompressionSection,
    Stage3Section,
    ReplicaSection,
    OffloadSection,
    MetricsSection,
    ActivationSection,
)
