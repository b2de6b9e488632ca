"""The DeepSpeed JSON reader behind ``ZeroConfig.from_deepspeed``: a DeepSpeed
config's ZeRO-related keys as ZeroConfig keyword arguments.

``ZeroConfig.from_deepspeed`` (worker/config.py, whose docstring says what is read
and how) calls :func:`read_deepspeed` and constructs the config from what it
returns; this module never imports ``ZeroConfig``, so the two stay acyclic (the
field names it needs come in as an argument). The way back, ``to_deepspeed``, is
coordinator/core/dsjson.py.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Collection, Mapping
from typing import Any

from worker.config_sections import is_finite_number, is_int

__all__ = ["read_deepspeed"]

logger = logging.getLogger(__name__)


def read_deepspeed(
    ds: Mapping[str, Any],
    overrides: Mapping[str, Any],
    *,
    field_names: Collection[str],
    hidden_size: int | None,
    fp16: bool | None,
    bf16: bool | None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """``ZeroConfig.from_deepspeed``'s reading: the ZeroConfig keyword arguments
    ``ds`` and ``overrides`` give (``field_names`` are ZeroConfig's fields), and the
    DeepSpeed key each field read from ``ds`` came from (for the error a bad value
    raises when the config is constructed)."""
    if not isinstance(ds, Mapping):
        raise TypeError(f"from_deepspeed expects a dict, got {type(ds).__name__}")
    unknown = sorted(set(overrides) - set(field_names))
    if unknown:
        raise TypeError(
            f"from_deepspeed() got unexpected keyword arguments {unknown}: it takes "
            "ZeroConfig field names, hidden_size, fp16 and bf16"
        )
    reader = _DeepSpeedReader(
        overrides, field_names=field_names, hidden_size=hidden_size, fp16=fp16, bf16=bf16
    )
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
    if (
        reader.sources.get("stage3_gather_compression") == _QWZ_KEY
        and kw.get("stage", 0) == 0
        and "stage3_gather_compression" not in overrides
    ):
        # DeepSpeed ignores it below stage 3; zeroplane runs it at stages 1-3
        logger.warning(
            "DeepSpeed key %r ignored: stage 0 gathers no parameters (quantized "
            "gathers run at stages 1-3)",
            _QWZ_KEY,
        )
        del kw["stage3_gather_compression"]
    if reader.sources.get("compression") == _QGZ_KEY and "compression" not in overrides:
        if kw.get("stage", 0) not in (2, 3):
            # DeepSpeed runs qgZ at stage 3 only; zeroplane at stages 2-3
            logger.warning(
                "DeepSpeed key %r ignored: quantized gradient reduce-scatters (qgZ) run "
                "at stages 2-3, this config runs stage %s",
                _QGZ_KEY,
                kw.get("stage", 0),
            )
            del kw["compression"]
        elif "hierarchical_reduce" not in overrides and "hierarchical_reduce" not in kw:
            # the ranks per node are hpZ's; read here before a stage below 3 drops them
            kw["hierarchical_reduce"] = kw.get("hpz_partition_size", 1)
            reader.sources["hierarchical_reduce"] = _QGZ_KEY
    if (
        reader.sources.get("hpz_partition_size") == _HPZ_KEY
        and kw.get("stage", 0) != 3
        and "hpz_partition_size" not in overrides
    ):
        # as DeepSpeed, which builds hpZ's secondary partitions at stage 3 only
        if kw["hpz_partition_size"] != 1:
            logger.warning(
                "DeepSpeed key %r ignored: only stage 3 gathers parameters for its "
                "backward (hpZ), this config runs stage %s%s",
                _HPZ_KEY,
                kw.get("stage", 0),
                " (qgZ takes it as the ranks per node)"
                if reader.sources.get("hierarchical_reduce") == _QGZ_KEY
                else "",
            )
        del kw["hpz_partition_size"]
    return kw, reader.sources


_QWZ_KEY = "zero_optimization.zero_quantized_weights"
_HPZ_KEY = "zero_optimization.zero_hpz_partition_size"
_QGZ_KEY = "zero_optimization.zero_quantized_gradients"


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

# DeepSpeed-only top-level keys accepted at DeepSpeed's own default (a config that
# writes its defaults out means nothing by them); any other value is refused
_DS_DEFAULTS_TOP: dict[str, Any] = {
    "fp16_master_weights_and_grads": False,
    "sparse_gradients": False,
    "communication_data_type": None,
    "disable_allgather": False,
    "amp": {"enabled": False},
}

# where a refused DeepSpeed feature's user goes instead
_DS_INSTEAD = {
    "autotuning": "run `zeroplane tune` (docs/guides/autotune.md)",
}

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
    if is_int(value):
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
    if is_int(value):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    raise _ds_error(key, "an integer JSON number", value)


def _raw_number(key: str, value: Any) -> float:
    """A raw-read number (gradient_clipping): a finite JSON number."""
    if is_finite_number(value):
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
        field_names: Collection[str],
        hidden_size: int | None,
        fp16: bool | None,
        bf16: bool | None,
    ) -> None:
        if hidden_size is not None and (not is_int(hidden_size) or hidden_size < 1):
            raise ValueError(
                f"from_deepspeed hidden_size must be an integer >= 1, got {hidden_size!r}"
            )
        self.overrides = overrides
        self.field_names = field_names
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
            elif key == "compile":
                self.compile_section(value)
            elif key == "zeroplane":
                self.zeroplane_section(value)
            elif key in _DS_IGNORED_TOP or _DS_DEFAULTS_TOP.get(key, _SKIP) == value:
                self.ignored.append(key)
            elif isinstance(value, Mapping) and value.get("enabled") is False:
                self.ignored.append(key)  # a DeepSpeed feature switched off configures nothing
            else:
                self.unsupported.append(key)
        if self.unsupported:
            instead = [f"{k}: {_DS_INSTEAD[k]}" for k in self.unsupported if k in _DS_INSTEAD]
            raise ValueError(
                "DeepSpeed config keys zeroplane does not support: "
                + ", ".join(self.unsupported)
                + (f" ({'; '.join(instead)})" if instead else "")
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
            elif sub == "zero_quantized_weights":
                # ZeRO++'s qwZ; false is DeepSpeed's default and leaves the field alone
                value = self.resolve(key, value, "stage3_gather_compression")
                if value is not _SKIP and _ds_bool(key, value):
                    self.set("stage3_gather_compression", key, "int8")
            elif sub == "zero_quantized_gradients":
                # ZeRO++'s qgZ: int8, hierarchical over hpZ's node size (read_deepspeed
                # sets hierarchical_reduce once every key is read); false leaves it off
                value = self.resolve(key, value, "compression")
                if value is not _SKIP and _ds_bool(key, value):
                    self.set("compression", key, "int8")
            elif sub == "zero_hpz_partition_size":
                # ZeRO++'s hpZ: the ranks per node (1, DeepSpeed's default, is off)
                value = self.resolve(key, value, "hpz_partition_size")
                if value is not _SKIP:
                    size = _ds_int(key, value)
                    if size < 1:
                        raise _ds_error(key, "an integer >= 1", value)
                    self.set("hpz_partition_size", key, size)
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
        for sub, value in section.items():
            if sub not in self.field_names:
                self.unsupported.append(f"zeroplane.{sub}")
            elif sub not in self.overrides:
                self.set(sub, f"zeroplane.{sub}", value)

    def compile_section(self, section: Any) -> None:
        """DeepSpeed's ``compile``: ``deepcompile`` compiles the model (zeroplane's
        ``compile``: each stage-3 unit's forward between its gathers); the other keys
        tune DeepCompile's own passes."""
        if not isinstance(section, Mapping):
            raise ValueError(f"DeepSpeed 'compile' must be a dict, got {section!r}")
        for sub, value in section.items():
            key = f"compile.{sub}"
            if sub == "deepcompile":
                self.set("compile", key, _raw_bool(key, value))
            else:
                self.ignored.append(key)

    def activation_section(self, section: Any) -> None:
        if not isinstance(section, Mapping):
            raise ValueError(
                f"DeepSpeed 'activation_checkpointing' must be a dict, got {section!r}"
            )
        self.set("activation_checkpointing", "activation_checkpointing", "units")
        for sub, value in section.items():
            key = f"activation_checkpointing.{sub}"
            if sub == "cpu_checkpointing":
                self.set("offload_activations", key, _raw_bool(key, value))
            elif sub in _DS_ACTIVATION_IGNORED:
                self.ignored.append(key)
            else:
                self.unsupported.append(key)


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
