"""``ZeroConfig``: every switch of the engine, validated at construction."""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from coordinator.core.dsjson import to_deepspeed

__all__ = ["Precision", "ZeroConfig"]

logger = logging.getLogger(__name__)

Precision = Literal["fp32", "bf16", "fp16"]
_PRECISIONS = ("fp32", "bf16", "fp16")


class _FieldError(ValueError):
    """A ZeroConfig field's bad value; ``field`` names it (from_deepspeed adds its key)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return not isinstance(value, float) or math.isfinite(value)


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
        stage3_max_reuse_distance: a stage-3 gather unit whose backward comes
            within this many parameter elements (of the units whose forward ends
            after its own) stays gathered from its forward into its backward,
            saving one all-gather per step for more memory held during the
            step (see worker/stages.py [Note: units kept gathered into
            backward]). 0: only the root and the last unit to finish, whose
            backward comes first; DeepSpeed's default 1e9 keeps every unit of a
            model under a billion parameters.
        stage3_max_live_parameters: a prefetch starts only while the parameter
            elements gathered (and gathering) stay within this many; the unit
            needed now is always gathered. DeepSpeed's key and default (1e9);
            0 prefetches nothing.
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
        replica_gradient_log: with replicas (stages 1-3, optimizer not offloaded),
            each rank also sends its final gradient partition to the neighbour
            that keeps its replica at every step, so a recovery brings a lost
            rank's replica forward to the survivors' step instead of rolling
            everyone back and training the steps again. Costs 4 bytes per
            parameter / world size sent per step, and held per step since the
            last refresh (see worker/elastic.py [Note: rolling a lost rank forward]).
        metrics_port: serve Prometheus metrics on this port (0: a free one;
            see worker/metrics.py); None: as ``$ZEROPLANE_METRICS_PORT`` says,
            which launchers set, and off when it is unset.
        activation_checkpointing: which modules' activations are recomputed in
            backward instead of kept (see worker/activations.py). ``"none"``:
            off. ``"units"``: every gather unit's module (the blocks of an
            ``nn.ModuleList``/``nn.Sequential`` and modules of at least
            ``stage3_min_unit_numel`` parameters; never the root), each run
            under torch's non-reentrant ``checkpoint``. An int ``k >= 1``:
            every k-th of those units (1 = all of them). A callable
            ``policy(module) -> bool``: each module for which it is True.
        offload_optimizer: ``"cpu"`` keeps this rank's fp32 master partition and
            optimizer state in host memory and runs the optimizer there
            (ZeRO-Offload; stages 1-3). Reduced gradient shards are copied to
            the host as each bucket finishes, the updated partition comes back
            in the compute dtype (see worker/offload.py). ``"none"``: off.
        offload_params: ``"cpu"`` keeps this rank's stage-3 parameter shards in
            host memory; each gather unit's shard is copied to the device for
            its all-gather, the next unit's prefetched (stage 3 only).
        pin_memory: page-lock the host buffers offload copies through (CUDA
            only; makes the copies asynchronous). Ignored without offload or
            without a GPU.
    """

    stage: Literal[0, 1, 2, 3] = 0
    dtype: Precision = "fp32"
    reduce_dtype: Precision | None = None
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0
    bucket_numel: int = 2**22
    overlap_comm: bool = True
    stage3_prefetch: int = 1
    stage3_max_reuse_distance: int = 0
    stage3_max_live_parameters: int = 10**9
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
    replica_gradient_log: bool = True
    # torch-free annotation: the callable takes an nn.Module
    activation_checkpointing: Literal["none", "units"] | int | Callable[[Any], bool] = "none"
    offload_optimizer: Literal["none", "cpu"] = "none"
    offload_params: Literal["none", "cpu"] = "none"
    pin_memory: bool = True

    def __post_init__(self) -> None:
        # Types are checked before values: a bool is not a number, a float is not
        # an int, and NaN/inf are no numbers either (NaN passes every `<` test).
        def bad(name: str, want: str) -> _FieldError:
            return _FieldError(
                f"ZeroConfig.{name} must be {want}, got {getattr(self, name)!r}", name
            )

        def one_of(value: Any, choices: tuple[Any, ...]) -> bool:
            return isinstance(value, str) and value in choices

        if not _is_int(self.stage) or self.stage not in (0, 1, 2, 3):
            raise bad("stage", "0, 1, 2 or 3")
        if not one_of(self.dtype, _PRECISIONS):
            raise bad("dtype", f"one of {_PRECISIONS}")
        if self.reduce_dtype is not None and not one_of(self.reduce_dtype, _PRECISIONS):
            raise bad("reduce_dtype", f"None or one of {_PRECISIONS}")
        for name in (
            "gradient_accumulation_steps",
            "bucket_numel",
            "loss_scale_window",
            "hysteresis",
            "compression_block",
        ):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise bad(name, "an integer >= 1")
        for name in (
            "stage3_prefetch",
            "stage3_max_reuse_distance",
            "stage3_max_live_parameters",
            "stage3_min_unit_numel",
            "compression_warmup_steps",
            "replica_interval",
        ):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise bad(name, "an integer >= 0")
        if not _is_int(self.initial_scale_power) or not 0 <= self.initial_scale_power <= 64:
            raise bad("initial_scale_power", "an integer between 0 and 64")
        for name in ("gradient_clipping", "loss_scale"):
            value = getattr(self, name)
            if not _is_finite_number(value) or value < 0:
                raise bad(name, "a finite number >= 0")
        if not _is_finite_number(self.min_loss_scale) or not self.min_loss_scale > 0:
            raise bad("min_loss_scale", "a finite number > 0")
        for name in ("overlap_comm", "error_feedback", "pin_memory", "replica_gradient_log"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "a bool")
        if not one_of(self.compression, ("none", "bf16", "fp16", "int8", "onebit")):
            raise bad("compression", "one of none, bf16, fp16, int8, onebit")
        if not one_of(self.stage3_gather_compression, ("none", "int8")):
            raise bad("stage3_gather_compression", "none or int8")
        if self.stage3_gather_compression != "none" and self.stage != 3:
            raise bad("stage3_gather_compression", "'none' unless stage is 3")
        for name in ("offload_optimizer", "offload_params"):
            value = getattr(self, name)
            if value == "nvme":
                raise _FieldError(
                    f"ZeroConfig.{name}='nvme' is not supported: zeroplane offloads to host "
                    "memory only ('cpu'); NVMe offload (ZeRO-Infinity) is not implemented",
                    name,
                )
            if not one_of(value, ("none", "cpu")):
                raise bad(name, "'none' or 'cpu'")
        if self.offload_optimizer != "none" and self.stage == 0:
            raise bad("offload_optimizer", "'none' at stage 0 (offload needs stage 1, 2 or 3)")
        if self.offload_params != "none" and self.stage != 3:
            raise bad("offload_params", "'none' unless stage is 3 (only stage 3 shards parameters)")
        if self.metrics_port is not None and (
            not _is_int(self.metrics_port) or not 0 <= self.metrics_port <= 65535
        ):
            raise bad("metrics_port", "None or an integer in [0, 65535]")
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
            raise bad(
                "activation_checkpointing",
                "'none', 'units', an integer >= 1 or a callable policy(module) -> bool",
            )

    @property
    def mixed_precision(self) -> bool:
        return self.dtype != "fp32"

    @classmethod
    def from_deepspeed(
        cls,
        ds: Mapping[str, Any],
        *,
        hidden_size: int | None = None,
        fp16: bool | None = None,
        bf16: bool | None = None,
        **overrides: Any,
    ) -> ZeroConfig:
        """Read the ZeRO-related keys of a DeepSpeed JSON config.

        Keys that would change what training computes and that zeroplane does
        not implement (NVMe offload, for example) raise ``ValueError``
        naming them.

        ``zero_optimization.offload_optimizer`` and ``offload_param`` with
        ``device: "cpu"`` set ``offload_optimizer="cpu"`` /
        ``offload_params="cpu"`` (and the legacy ``cpu_offload: true`` the
        former); ``"none"`` or null leaves them off; ``"nvme"`` is refused.
        ``pin_memory`` (DeepSpeed's default: false) sets ``pin_memory``, true
        if either offloading section says so. As in DeepSpeed, ``offload_param``
        is ignored (with a warning) unless the stage is 3. Their NVMe and buffer-tuning
        keys are logged as ignored. Known DeepSpeed keys that belong to other parts of a
        training script (optimizer, scheduler, batch sizes, logging) are
        logged as ignored, ``"auto"`` or not. Unknown keys raise.

        ``"auto"`` values (Hugging Face Trainer's templates) are resolved from
        keywords, as ``HfTrainerDeepSpeedConfig`` resolves them from
        ``TrainingArguments`` and the model's config:

        - ``**overrides``: ZeroConfig field names. Each sets that field,
          whatever the file says, and so also resolves an ``"auto"`` of the
          DeepSpeed key the field is read from: ``gradient_accumulation_steps``,
          ``gradient_clipping``, ``stage`` (``zero_optimization.stage``),
          ``bucket_numel`` (``zero_optimization.reduce_bucket_size``),
          ``overlap_comm``, ``stage3_prefetch``
          (``zero_optimization.stage3_prefetch_bucket_size``), ``loss_scale``,
          ``initial_scale_power``, ``loss_scale_window``, ``hysteresis``,
          ``min_loss_scale`` (``fp16.*``) and ``dtype`` (``fp16.enabled`` and
          ``bf16.enabled``: ``dtype="bf16"`` reads as bf16 on, fp16 off).
        - ``hidden_size``: the model's hidden size (the largest of
          ``hidden_sizes`` where a model has several), as HF's trainer uses
          it: ``reduce_bucket_size = hidden_size**2`` and
          ``stage3_prefetch_bucket_size = 0.9 * hidden_size**2`` when they are
          ``"auto"`` (the latter only says whether to prefetch: zeroplane
          prefetches whole units). ``stage3_param_persistence_threshold`` is
          ignored, ``"auto"`` or not; ``stage3_max_reuse_distance`` and
          ``stage3_max_live_parameters`` set the fields of those names
          (``"auto"`` leaves the latter at DeepSpeed's default).
        - ``fp16``, ``bf16``: ``TrainingArguments``-style booleans for
          ``fp16.enabled`` / ``bf16.enabled``; giving one makes the other
          False unless given too. Like HF, a file value that is not ``"auto"``
          and disagrees with the keyword raises. They must agree with
          ``dtype`` when both are given.

        A key mapped to a ZeroConfig field that is still ``"auto"`` after that
        raises ``ValueError`` naming the key and the keyword that resolves it
        (all such keys at once).

        Values are converted as DeepSpeed 0.19 converts them, or refused with
        the key in the error (the notes above ``_ds_bool`` say why): in
        ``zero_optimization``, ``fp16`` and ``bf16`` a boolean may be
        true/false, 0/1 or a string such as ``"false"``, and an integer an
        integral number (``5e8``) or a decimal string (``"500000000"``), not
        ``"5e8"`` or ``1.5``; top-level ``gradient_accumulation_steps`` and
        ``gradient_clipping`` and the ``activation_checkpointing`` section take
        JSON numbers and booleans only. ``null`` is refused, except where
        DeepSpeed's own default is null (``gradient_accumulation_steps``,
        ``zero_optimization.overlap_comm``): there it means unset.

        A top-level ``"zeroplane"`` dict (what :meth:`to_deepspeed` writes for fields
        DeepSpeed has no key for, such as ``compression``; DeepSpeed does not read
        it) sets those ZeroConfig fields by name; a name that is not a field raises.

        A top-level ``activation_checkpointing`` dict sets
        ``activation_checkpointing="units"``; its keys that tune DeepSpeed's
        own implementation are logged as ignored, and ``cpu_checkpointing:
        true`` is refused.
        """
        if not isinstance(ds, Mapping):
            raise TypeError(f"from_deepspeed expects a dict, got {type(ds).__name__}")
        unknown = sorted(set(overrides) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(
                f"from_deepspeed() got unexpected keyword arguments {unknown}: it takes "
                "ZeroConfig field names, hidden_size, fp16 and bf16"
            )
        reader = _DeepSpeedReader(overrides, hidden_size=hidden_size, fp16=fp16, bf16=bf16)
        kw = reader.read(ds)
        kw.update(overrides)
        if (
            kw.get("offload_params", "none") != "none"
            and kw.get("stage", 0) != 3
            and "offload_params" not in overrides
        ):
            # DeepSpeed reads offload_param only at stage 3 and ignores it elsewhere
            logger.warning(
                "DeepSpeed key 'zero_optimization.offload_param' ignored: parameters are "
                "offloaded at stage 3 only, this config runs stage %s",
                kw.get("stage", 0),
            )
            del kw["offload_params"]
        try:
            return cls(**kw)
        except _FieldError as error:
            source = reader.sources.get(error.field)
            if source is None or error.field in overrides:
                raise
            raise ValueError(f"{error} (read from DeepSpeed key {source!r})") from None

    def as_dict(self, *, changed_only: bool = False) -> dict[str, Any]:
        """The fields by name (``ZeroConfig(**d)`` rebuilds it): JSON-ready unless
        ``activation_checkpointing`` is a callable. ``changed_only``: only fields that
        differ from the defaults."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        if changed_only:
            values = {k: v for k, v in values.items() if v != _DEFAULTS[k]}
        return values

    def to_deepspeed(
        self, *, micro_batch: int | None = None, world_size: int | None = None
    ) -> dict[str, Any]:
        """This config as a DeepSpeed JSON config; ``from_deepspeed`` reads it back to
        an equal ZeroConfig. Fields DeepSpeed has no key for (compression, ...) go in
        a ``"zeroplane"`` section that DeepSpeed does not read (coordinator/core/dsjson.py).
        ``micro_batch`` (and ``world_size``) add DeepSpeed's batch-size keys."""
        fields_ = {"stage": self.stage, "dtype": self.dtype} | self.as_dict(changed_only=True)
        return to_deepspeed(fields_, micro_batch=micro_batch, world_size=world_size)

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
        "stage3_param_persistence_threshold",
        "stage3_gather_16bit_weights_on_model_save",
        "sub_group_size",
        "memory_efficient_linear",
        "load_from_fp32_weights",
        "elastic_checkpoint",
    }
)

# offload_optimizer / offload_param keys -> the ZeroConfig field each section sets
_DS_OFFLOAD_FIELDS = {"offload_optimizer": "offload_optimizer", "offload_param": "offload_params"}

# offload keys that tune DeepSpeed's own buffers (NVMe paths, AIO pipelining,
# buffer counts, the fraction of the optimizer stepped on the CPU): where the
# bytes are is zeroplane's, what is computed is the same.
_DS_OFFLOAD_IGNORED = frozenset(
    {
        "nvme_path",
        "buffer_count",
        "buffer_size",
        "max_in_cpu",
        "fast_init",
        "pipeline",
        "pipeline_read",
        "pipeline_write",
        "ratio",
    }
)

# activation_checkpointing keys that tune DeepSpeed's own implementation.
_DS_ACTIVATION_IGNORED = frozenset(
    {
        "partition_activations",
        "contiguous_memory_optimization",
        "number_checkpoints",
        "synchronize_checkpoint_boundary",
        "profile",
    }
)

# ---------------------------------------------------------------- value conversion
#
# DeepSpeed 0.19 reads a config two ways (deepspeed/runtime/config.py):
# - zero_optimization, fp16 and bf16 are pydantic models (DeepSpeedZeroConfig in
#   runtime/zero/config.py, DeepSpeedFP16Config/DeepSpeedBF16Config in
#   runtime/precision_config.py) validated in pydantic v2's lax mode: a bool
#   field takes true/false, 0/1 and the strings below; an int field takes ints,
#   integral floats (5e8 as a JSON number) and decimal strings ("500000000",
#   "5.0"), not "5e8" or 1.5; fields that are not Optional refuse null.
# - top-level gradient_accumulation_steps / gradient_clipping and the whole
#   activation_checkpointing section are read raw (config_utils.get_scalar_param)
#   and used as they are: `clip > 0.0` and `micro * steps == batch` fail on a
#   string, and `if CPU_CHECKPOINT:` treats "false" as on. There only JSON
#   numbers and booleans mean what they say, so only they are accepted.
# "auto" is the one string DeepSpeed itself drops (DeepSpeedConfigModel's
# non-strict __init__); here it is resolved or refused (from_deepspeed).
# Bools are refused where a number is wanted even where pydantic would read
# true as 1: "stage": true is a mistake, not a stage.

_AUTO = "auto"
_SKIP = object()

# pydantic v2's lax str -> bool table (matched case-insensitively, not stripped)
_BOOL_STRINGS = {
    **dict.fromkeys(("0", "off", "f", "false", "n", "no"), False),
    **dict.fromkeys(("1", "on", "t", "true", "y", "yes"), True),
}
# pydantic v2's lax str -> int: optional sign, digits with single underscores
# between them, optionally a fraction of zeros; surrounding whitespace allowed
_INT_STRING = re.compile(r"\s*([+-]?[0-9]+(?:_[0-9]+)*)(?:\.0+)?\s*", re.ASCII)


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == _AUTO


def _ds_error(key: str, want: str, value: Any) -> ValueError:
    return ValueError(f"DeepSpeed key {key!r} must be {want}, got {value!r}")


def _ds_bool(key: str, value: Any) -> bool:
    """A pydantic-read bool (zero_optimization, fp16, bf16)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _BOOL_STRINGS:
        return _BOOL_STRINGS[value.lower()]
    raise _ds_error(key, "true or false", value)


def _raw_bool(key: str, value: Any) -> bool:
    """A raw-read bool: DeepSpeed tests it by truthiness, so only a JSON bool is clear."""
    if isinstance(value, bool):
        return value
    raise _ds_error(key, "a JSON boolean (true or false, without quotes)", value)


def _ds_int(key: str, value: Any) -> int:
    """A pydantic-read int (zero_optimization, fp16)."""
    if _is_int(value):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, str) and (match := _INT_STRING.fullmatch(value)):
        return int(match.group(1))
    hint = ""
    if isinstance(value, str):
        hint = " (DeepSpeed refuses numbers in exponent notation as strings: unquote it)"
    raise _ds_error(key, "an integer (such as 500000000 or 5e8)" + hint, value)


def _raw_int(key: str, value: Any) -> int:
    """A raw-read int: a JSON number with no fraction."""
    if _is_int(value):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    raise _ds_error(key, "an integer JSON number", value)


def _raw_number(key: str, value: Any) -> float:
    """A raw-read number (gradient_clipping): a finite JSON number."""
    if _is_finite_number(value):
        return float(value)
    raise _ds_error(key, "a finite JSON number", value)


def _ds_loss_scale(key: str, value: Any) -> float:
    """fp16.loss_scale, as DeepSpeedFP16Config._validate_loss_scale reads it."""
    if not isinstance(value, bool):
        try:
            number = float(value)
        except (TypeError, ValueError):
            pass
        else:
            if math.isfinite(number):
                return number
    raise _ds_error(key, "a finite number", value)


def _ds_min_loss_scale(key: str, value: Any) -> float:
    # DeepSpeedFP16Config declares min_loss_scale an int: 0.5 is refused there too
    return float(_ds_int(key, value))


# fp16 keys read into ZeroConfig fields, with their conversion
_FP16_FIELDS: dict[str, Callable[[str, Any], Any]] = {
    "loss_scale": _ds_loss_scale,
    "initial_scale_power": _ds_int,
    "loss_scale_window": _ds_int,
    "hysteresis": _ds_int,
    "min_loss_scale": _ds_min_loss_scale,
}


class _DeepSpeedReader:
    """One from_deepspeed call: the fields read, where from, and what is wrong."""

    def __init__(
        self,
        overrides: Mapping[str, Any],
        *,
        hidden_size: int | None,
        fp16: bool | None,
        bf16: bool | None,
    ) -> None:
        if hidden_size is not None and (not _is_int(hidden_size) or hidden_size < 1):
            raise ValueError(
                f"from_deepspeed hidden_size must be an integer >= 1, got {hidden_size!r}"
            )
        self.overrides = overrides
        self.hidden_size = hidden_size
        self.explicit = {"fp16": fp16, "bf16": bf16}
        self.precision = _precision_choice(overrides, fp16, bf16)
        self.kw: dict[str, Any] = {}
        self.sources: dict[str, str] = {}
        self.unsupported: list[str] = []
        self.ignored: list[str] = []
        self.unresolved: list[str] = []
        # pin_memory of each section that offloads (one ZeroConfig.pin_memory for both)
        self.offload_pins: list[bool] = []

    def read(self, ds: Mapping[str, Any]) -> dict[str, Any]:
        for key, value in ds.items():
            if key == "zero_optimization":
                self.zero_section(value)
            elif key in ("bf16", "fp16"):
                self.precision_section(key, value)
            elif key == "gradient_accumulation_steps":
                # DeepSpeed's default is null: null means unset there, as here
                if value is not None:
                    value = self.resolve(key, value, key)
                    if value is not _SKIP:
                        self.set(key, key, _raw_int(key, value))
            elif key == "gradient_clipping":
                value = self.resolve(key, value, key)
                if value is not _SKIP:
                    self.set(key, key, _raw_number(key, value))
            elif key == "activation_checkpointing":
                self.activation_section(value)
            elif key == "zeroplane":
                self.zeroplane_section(value)
            elif key in _DS_IGNORED_TOP:
                self.ignored.append(key)
            else:
                self.unsupported.append(key)
        if self.unsupported:
            raise ValueError(
                "DeepSpeed config keys zeroplane does not support: " + ", ".join(self.unsupported)
            )
        if self.offload_pins and "pin_memory" not in self.overrides:
            if len(set(self.offload_pins)) > 1:
                logger.warning(
                    "DeepSpeed offload sections disagree on pin_memory; pinning host "
                    "buffers for both (zeroplane has one pin_memory switch)"
                )
            self.set("pin_memory", "zero_optimization.offload_*.pin_memory", any(self.offload_pins))
        if self.unresolved:
            raise ValueError("; ".join(self.unresolved))
        if self.ignored:
            built = [k for k in self.ignored if k in ("optimizer", "scheduler")]
            logger.warning(
                "DeepSpeed config keys ignored (not part of ZeroConfig): %s%s",
                ", ".join(self.ignored),
                f" ({' and '.join(built)}: worker.initialize(model, config=ds_config) "
                "builds them, as deepspeed.initialize does)"
                if built
                else "",
            )
        return self.kw

    def set(self, field: str, key: str, value: Any) -> None:
        self.kw[field] = value
        self.sources[field] = key

    def resolve(
        self,
        key: str,
        value: Any,
        field: str,
        from_hidden: Callable[[int], int] | None = None,
    ) -> Any:
        """``value``, or for "auto" what resolves it; _SKIP where an override will."""
        if not _is_auto(value):
            return value
        if field in self.overrides:
            return _SKIP
        if from_hidden is not None and self.hidden_size is not None:
            return from_hidden(self.hidden_size)
        hint = f"{field}=..." + (" or hidden_size=..." if from_hidden else "")
        self.unresolved.append(f'DeepSpeed key {key!r} is "auto": pass {hint} to from_deepspeed')
        return _SKIP

    def zero_section(self, zero: Any) -> None:
        if not isinstance(zero, Mapping):
            raise ValueError(f"DeepSpeed 'zero_optimization' must be a dict, got {zero!r}")
        for sub, value in zero.items():
            key = f"zero_optimization.{sub}"
            if sub == "stage":
                value = self.resolve(key, value, "stage")
                if value is not _SKIP:
                    self.set("stage", key, _ds_int(key, value))
            elif sub == "reduce_bucket_size":
                value = self.resolve(key, value, "bucket_numel", lambda h: h * h)
                if value is not _SKIP:
                    self.set("bucket_numel", key, _ds_int(key, value))
            elif sub == "overlap_comm":
                # Optional[bool] in DeepSpeed: null means its default, as absent does
                if value is not None:
                    value = self.resolve(key, value, "overlap_comm")
                    if value is not _SKIP:
                        self.set("overlap_comm", key, _ds_bool(key, value))
            elif sub == "stage3_prefetch_bucket_size":
                value = self.resolve(key, value, "stage3_prefetch", lambda h: int(0.9 * h * h))
                if value is not _SKIP:
                    numel = _ds_int(key, value)
                    if numel < 0:  # Field(ge=0) in DeepSpeed
                        raise _ds_error(key, "an integer >= 0", value)
                    # DeepSpeed counts elements; zeroplane prefetches whole units.
                    self.set("stage3_prefetch", key, 1 if numel > 0 else 0)
            elif sub in ("stage3_max_reuse_distance", "stage3_max_live_parameters"):
                # HF's trainer fills in neither: "auto" for max_live keeps the default,
                # as it did while the key was ignored
                if sub == "stage3_max_live_parameters" and _is_auto(value):
                    continue
                value = self.resolve(key, value, sub)
                if value is not _SKIP:
                    numel = _ds_int(key, value)
                    if numel < 0:  # Field(ge=0) in DeepSpeed
                        raise _ds_error(key, "an integer >= 0", value)
                    self.set(sub, key, numel)
            elif sub in ("offload_optimizer", "offload_param"):
                # Optional in DeepSpeed: null means no offload, as absent does
                if value is not None:
                    self.offload_section(key, value, _DS_OFFLOAD_FIELDS[sub])
            elif sub == "cpu_offload":
                # DeepSpeed's legacy spelling of offload_optimizer.device = "cpu"
                if _ds_bool(key, value):
                    self.set("offload_optimizer", key, "cpu")
                    self.offload_pins.append(False)
            elif sub in ("reduce_scatter", "allgather_partitions") and not _is_auto(value):
                # "auto" is dropped by DeepSpeed, leaving its default true
                if _ds_bool(key, value):
                    self.ignored.append(key)
                else:
                    self.unsupported.append(f"{key}=false")
            elif sub in _DS_ZERO_IGNORED:
                self.ignored.append(key)
            else:
                self.unsupported.append(key)

    def offload_section(self, key: str, section: Any, field: str) -> None:
        """``offload_optimizer`` / ``offload_param``: device ``cpu`` or ``none``
        (``nvme`` is refused), ``pin_memory``; NVMe and buffer tuning keys are
        ignored (they tune DeepSpeed's own buffers, not what is computed)."""
        if not isinstance(section, Mapping):
            raise ValueError(f"DeepSpeed {key!r} must be a dict, got {section!r}")
        device_key = f"{key}.device"
        device = self.resolve(device_key, section.get("device", "none"), field)
        if device is _SKIP:
            return
        if device is None:
            device = "none"  # Optional in DeepSpeed, meaning its default
        if not isinstance(device, str) or device.lower() not in ("none", "cpu", "nvme"):
            raise _ds_error(device_key, '"cpu" or "none" ("nvme" is not supported)', device)
        device = device.lower()
        if device == "nvme":
            raise ValueError(
                f'DeepSpeed key {device_key!r} is "nvme": zeroplane offloads to host memory '
                'only; set it to "cpu" (or "none"). NVMe offload (ZeRO-Infinity) is not '
                "implemented"
            )
        self.set(field, device_key, device)
        pin = False  # DeepSpeed's default
        for sub, value in section.items():
            sub_key = f"{key}.{sub}"
            if sub == "device":
                continue
            if sub == "pin_memory":
                pin = _ds_bool(sub_key, value)
            elif sub in _DS_OFFLOAD_IGNORED:
                self.ignored.append(sub_key)
            else:
                self.unsupported.append(sub_key)
        if device == "cpu":
            self.offload_pins.append(pin)

    def precision_section(self, section_key: str, section: Any) -> None:
        if not isinstance(section, Mapping):
            raise ValueError(f"DeepSpeed '{section_key}' must be a dict, got {section!r}")
        key = f"{section_key}.enabled"
        raw = section.get("enabled", False)
        if _is_auto(raw):
            if self.precision is None:
                self.unresolved.append(
                    f'DeepSpeed key {key!r} is "auto": pass dtype=... '
                    f"(or {section_key}=True/False) to from_deepspeed"
                )
                return
            enabled = self.precision[section_key]
        else:
            enabled = _ds_bool(key, raw)
            explicit = self.explicit[section_key]
            if explicit is not None and explicit != enabled:
                raise ValueError(
                    f"DeepSpeed key {key!r} is {raw!r} but from_deepspeed got "
                    f'{section_key}={explicit}; make the key "auto" or pass the same'
                )
        if not enabled:
            return
        if self.kw.get("dtype") not in (None, section_key):
            raise ValueError("DeepSpeed config enables both 'bf16' and 'fp16'")
        self.set("dtype", key, section_key)
        for sub, value in section.items():
            if sub == "enabled":
                continue
            key = f"{section_key}.{sub}"
            if section_key == "fp16" and sub in _FP16_FIELDS:
                value = self.resolve(key, value, sub)
                if value is not _SKIP:
                    self.set(sub, key, _FP16_FIELDS[sub](key, value))
            elif sub in ("auto_cast", "immediate_grad_update", "consecutive_hysteresis"):
                self.ignored.append(key)
            else:
                self.unsupported.append(key)

    def zeroplane_section(self, section: Any) -> None:
        """ZeroConfig fields DeepSpeed has no key for, as ``to_deepspeed`` writes them."""
        if not isinstance(section, Mapping):
            raise ValueError(f"DeepSpeed config 'zeroplane' must be a dict, got {section!r}")
        names = {f.name for f in fields(ZeroConfig)}
        for sub, value in section.items():
            if sub not in names:
                self.unsupported.append(f"zeroplane.{sub}")
            elif sub not in self.overrides:
                self.set(sub, f"zeroplane.{sub}", value)

    def activation_section(self, section: Any) -> None:
        if not isinstance(section, Mapping):
            raise ValueError(
                f"DeepSpeed 'activation_checkpointing' must be a dict, got {section!r}"
            )
        self.set("activation_checkpointing", "activation_checkpointing", "units")
        for sub, value in section.items():
            key = f"activation_checkpointing.{sub}"
            if sub == "cpu_checkpointing":
                if _raw_bool(key, value):
                    self.unsupported.append(key)
            elif sub in _DS_ACTIVATION_IGNORED:
                self.ignored.append(key)
            else:
                self.unsupported.append(key)


_DEFAULTS = {f.name: f.default for f in fields(ZeroConfig)}


def _precision_choice(
    overrides: Mapping[str, Any], fp16: bool | None, bf16: bool | None
) -> dict[str, bool] | None:
    """What "auto" in fp16.enabled / bf16.enabled reads as; None: nothing says."""
    for name, flag in (("fp16", fp16), ("bf16", bf16)):
        if flag is not None and not isinstance(flag, bool):
            raise ValueError(f"from_deepspeed {name} must be True, False or None, got {flag!r}")
    if "dtype" in overrides:
        dtype = overrides["dtype"]
        choice = {"fp16": dtype == "fp16", "bf16": dtype == "bf16"}
        for name, flag in (("fp16", fp16), ("bf16", bf16)):
            if flag is not None and flag != choice[name]:
                raise ValueError(
                    f"from_deepspeed got dtype={dtype!r} and {name}={flag}, which disagree"
                )
        return choice
    if fp16 is None and bf16 is None:
        return None
    return {"fp16": bool(fp16), "bf16": bool(bf16)}


def stage_from_env(default: int) -> int:
    """``$ZEROPLANE_STAGE`` (set by ``zeroplane run --stage``) as a script's default
    stage; ``auto`` or unset gives ``default`` (the coordinator then plans it)."""
    raw = os.environ.get("ZEROPLANE_STAGE", "auto")
    if raw == "auto":
        return default
    if raw not in ("0", "1", "2", "3"):
        raise ValueError(f"$ZEROPLANE_STAGE must be 0-3 or auto, got {raw!r}")
    return int(raw)
