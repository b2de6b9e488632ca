"""``ZeroConfig``: every switch of the engine, validated at construction."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

__all__ = ["Precision", "ZeroConfig"]

logger = logging.getLogger(__name__)

Precision = Literal["fp32", "bf16", "fp16"]
_PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """How the engine shards, reduces and steps.

    Attributes:
        stage: 0 = replicated (DDP); 1 = shard optimizer state and fp32 master
            weights; 2 = also shard gradients; 3 = also shard parameters.
        dtype: compute dtype of parameters and gradients. With ``bf16`` or
            ``fp16`` the optimizer runs on fp32 master weights.
        reduce_dtype: dtype gradients are reduced in; ``None`` = ``dtype``.
        gradient_accumulation_steps: micro-batches per optimizer step. The
            engine scales each micro-batch loss by its inverse, as DeepSpeed does.
        gradient_clipping: clip the global gradient norm to this value; 0 = off.
        bucket_numel: elements per gradient bucket (stages 0–2).
        overlap_comm: reduce buckets during backward as they fill; otherwise
            all reductions run after backward.
        stage3_prefetch: how many gather units to fetch ahead (0 = none).
        stage3_min_unit_numel: a module whose not-yet-assigned parameters
            reach this many elements becomes its own gather unit. Modules held
            in an ``nn.ModuleList`` or ``nn.Sequential`` are units regardless.
        loss_scale: fp16 only; 0 = dynamic loss scaling, otherwise a static scale.
        initial_scale_power: fp16 dynamic scaling starts at 2**this.
        loss_scale_window: good steps before the dynamic scale doubles.
        hysteresis: consecutive overflows before the scale halves (1 = on every
            overflow, as torch's GradScaler; DeepSpeed's default is 2).
        min_loss_scale: the dynamic scale never drops below this.
        compression: how gradients travel: ``none``; ``bf16``/``fp16`` (2×);
            ``int8`` blockwise (≈3.9×); ``onebit`` signs with a scale per block
            (≈28×). Reductions still sum in fp32 (see worker/compression.py).
        compression_block: elements per scale block for ``int8``/``onebit``.
        compression_warmup_steps: optimizer steps exchanged uncompressed first.
        error_feedback: carry each step's compression error into the next.
        stage3_gather_compression: ``int8`` sends stage-3 parameter all-gathers
            as blockwise int8; the fp32 master weights stay exact.
        replica_interval: with a coordinator, every this many optimizer steps each
            rank keeps a copy of its state and of its neighbour's, so a crashed
            rank's shards are restored from memory (0 = off: checkpoints only).
        metrics_port: serve Prometheus metrics on this port (0: a free one;
            see worker/metrics.py); None: as ``$ZEROPLANE_METRICS_PORT`` says,
            which launchers set, and off when it is unset.
    """

    stage: Literal[0, 1, 2, 3] = 0
    dtype: Precision = "fp32"
    reduce_dtype: Precision | None = None
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0
    bucket_numel: int = 2**22
    overlap_comm: bool = True
    stage3_prefetch: int = 1
    stage3_min_unit_numel: int = 2**20
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 1
    min_loss_scale: float = 1.0
    compression: Literal["none", "bf16", "fp16", "int8", "onebit"] = "none"
    compression_block: int = 256
    compression_warmup_steps: int = 0
    error_feedback: bool = True
    stage3_gather_compression: Literal["none", "int8"] = "none"
    metrics_port: int | None = None
    replica_interval: int = 0

    def __post_init__(self) -> None:
        def bad(name: str, want: str) -> ValueError:
            return ValueError(f"ZeroConfig.{name} must be {want}, got {getattr(self, name)!r}")

        if self.stage not in (0, 1, 2, 3) or isinstance(self.stage, bool):
            raise bad("stage", "0, 1, 2 or 3")
        if self.dtype not in _PRECISIONS:
            raise bad("dtype", f"one of {_PRECISIONS}")
        if self.reduce_dtype is not None and self.reduce_dtype not in _PRECISIONS:
            raise bad("reduce_dtype", f"None or one of {_PRECISIONS}")
        for name in (
            "gradient_accumulation_steps",
            "bucket_numel",
            "loss_scale_window",
            "hysteresis",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(name, "an integer >= 1")
        for name in (
            "stage3_prefetch",
            "stage3_min_unit_numel",
            "compression_warmup_steps",
            "replica_interval",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise bad(name, "an integer >= 0")
        if not 0 <= self.initial_scale_power <= 64:
            raise bad("initial_scale_power", "between 0 and 64")
        for name in ("gradient_clipping", "loss_scale"):
            if not isinstance(getattr(self, name), int | float) or getattr(self, name) < 0:
                raise bad(name, "a number >= 0")
        if not self.min_loss_scale > 0:
            raise bad("min_loss_scale", "> 0")
        for name in ("overlap_comm", "error_feedback"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "a bool")
        if self.compression not in ("none", "bf16", "fp16", "int8", "onebit"):
            raise bad("compression", "one of none, bf16, fp16, int8, onebit")
        if self.stage3_gather_compression not in ("none", "int8"):
            raise bad("stage3_gather_compression", "none or int8")
        if self.stage3_gather_compression != "none" and self.stage != 3:
            raise bad("stage3_gather_compression", "'none' unless stage is 3")
        if self.metrics_port is not None and (
            not isinstance(self.metrics_port, int)
            or isinstance(self.metrics_port, bool)
            or not 0 <= self.metrics_port <= 65535
        ):
            raise bad("metrics_port", "None or an integer in [0, 65535]")

    @property
    def mixed_precision(self) -> bool:
        return self.dtype != "fp32"

    @classmethod
    def from_deepspeed(cls, ds: Mapping[str, Any], **overrides: Any) -> ZeroConfig:
        """Read the ZeRO-related keys of a DeepSpeed JSON config.

        Keys that would change what training computes and that zeroplane does
        not implement (CPU/NVMe offload, for example) raise ``ValueError``
        naming them. Known DeepSpeed keys that belong to other parts of a
        training script (optimizer, scheduler, batch sizes, logging) are
        logged as ignored. Unknown keys raise.
        """
        if not isinstance(ds, Mapping):
            raise TypeError(f"from_deepspeed expects a dict, got {type(ds).__name__}")
        kw: dict[str, Any] = {}
        unsupported: list[str] = []
        ignored: list[str] = []

        for key, value in ds.items():
            if key == "zero_optimization":
                _read_zero_section(value, kw, unsupported, ignored)
            elif key in ("bf16", "fp16"):
                _read_precision_section(key, value, kw, unsupported, ignored)
            elif key == "gradient_accumulation_steps":
                kw["gradient_accumulation_steps"] = value
            elif key == "gradient_clipping":
                kw["gradient_clipping"] = value
            elif key in _DS_IGNORED_TOP:
                ignored.append(key)
            else:
                unsupported.append(key)
        if kw.get("dtype") is None:
            kw.pop("dtype", None)
        if unsupported:
            raise ValueError(
                "DeepSpeed config keys zeroplane does not support: " + ", ".join(unsupported)
            )
        if ignored:
            logger.warning(
                "DeepSpeed config keys ignored (not part of ZeroConfig): %s", ", ".join(ignored)
            )
        kw.update(overrides)
        return cls(**kw)

    def replace(self, **changes: Any) -> ZeroConfig:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return ZeroConfig(**values)


# Top-level DeepSpeed keys that configure other parts of a training script.
_DS_IGNORED_TOP = frozenset(
    {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "optimizer",
        "scheduler",
        "steps_per_print",
        "wall_clock_breakdown",
        "dump_state",
        "prescale_gradients",
        "gradient_predivide_factor",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "flops_profiler",
        "memory_breakdown",
        "comms_logger",
    }
)

# zero_optimization keys with no effect on what zeroplane computes: its
# gradients are always contiguous flat buckets and reduce-scattered.
_DS_ZERO_IGNORED = frozenset(
    {
        "contiguous_gradients",
        "allgather_partitions",
        "reduce_scatter",
        "allgather_bucket_size",
        "round_robin_gradients",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
        "stage3_param_persistence_threshold",
        "stage3_gather_16bit_weights_on_model_save",
        "sub_group_size",
        "memory_efficient_linear",
        "load_from_fp32_weights",
        "elastic_checkpoint",
    }
)


def _read_zero_section(
    zero: Any, kw: dict[str, Any], unsupported: list[str], ignored: list[str]
) -> None:
    if not isinstance(zero, Mapping):
        raise ValueError(f"DeepSpeed 'zero_optimization' must be a dict, got {zero!r}")
    for key, value in zero.items():
        name = f"zero_optimization.{key}"
        if key == "stage":
            kw["stage"] = value
        elif key == "reduce_bucket_size":
            kw["bucket_numel"] = int(value)
        elif key == "overlap_comm":
            kw["overlap_comm"] = bool(value)
        elif key == "stage3_prefetch_bucket_size":
            # DeepSpeed counts elements; zeroplane prefetches whole units.
            kw["stage3_prefetch"] = 1 if value else 0
        elif key in ("offload_optimizer", "offload_param", "cpu_offload"):
            device = value.get("device", "none") if isinstance(value, Mapping) else value
            if device not in ("none", None, False):
                unsupported.append(name)
        elif key in ("reduce_scatter", "allgather_partitions") and value is False:
            unsupported.append(f"{name}=false")
        elif key in _DS_ZERO_IGNORED:
            ignored.append(name)
        else:
            unsupported.append(name)


def _read_precision_section(
    key: str, section: Any, kw: dict[str, Any], unsupported: list[str], ignored: list[str]
) -> None:
    if not isinstance(section, Mapping):
        raise ValueError(f"DeepSpeed '{key}' must be a dict, got {section!r}")
    if not section.get("enabled", False):
        return
    if kw.get("dtype") not in (None, key):
        raise ValueError("DeepSpeed config enables both 'bf16' and 'fp16'")
    kw["dtype"] = key
    mapping = {
        "loss_scale": "loss_scale",
        "initial_scale_power": "initial_scale_power",
        "loss_scale_window": "loss_scale_window",
        "hysteresis": "hysteresis",
        "min_loss_scale": "min_loss_scale",
    }
    for sub, value in section.items():
        if sub == "enabled":
            continue
        if key == "fp16" and sub in mapping:
            kw[mapping[sub]] = value
        elif sub in ("auto_cast", "immediate_grad_update", "consecutive_hysteresis"):
            ignored.append(f"{key}.{sub}")
        else:
            unsupported.append(f"{key}.{sub}")
