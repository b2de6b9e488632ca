"""ZeroConfig fields as a DeepSpeed JSON config: the inverse of ``ZeroConfig.from_deepspeed``.

One mapping, used by ``ZeroConfig.to_deepspeed()`` (worker/config.py) and by
``zeroplane tune``, which writes its best configuration as both JSONs and is
torch-free (so the mapping lives here, on the coordinator's side).

Fields with a DeepSpeed key go under it (``zero_optimization.stage``,
``reduce_bucket_size``, ``overlap_comm``, ``stage3_prefetch_bucket_size``,
``stage3_max_reuse_distance``, ``stage3_max_live_parameters``,
``zero_hpz_partition_size`` (``hpz_partition_size``), ``zero_quantized_weights``
(``stage3_gather_compression="int8"`` at stage 3), ``bf16``/``fp16``
with the loss-scale settings, ``gradient_accumulation_steps``, ``gradient_clipping``,
``activation_checkpointing``).
Fields DeepSpeed has no key for (``compression``, ``reduce_dtype``, ``replica_interval``, ...) go
under a top-level ``"zeroplane"`` section, which DeepSpeed does not read and
``from_deepspeed`` reads back, so a round trip gives the same ZeroConfig.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["DS_PREFETCH_BUCKET", "to_deepspeed"]

# what stage3_prefetch=1 is written as: DeepSpeed's own default (elements)
DS_PREFETCH_BUCKET = 50_000_000

_FP16_KEYS = (
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "min_loss_scale",
)


def to_deepspeed(
    zero: Mapping[str, Any],
    *,
    micro_batch: int | None = None,
    world_size: int | None = None,
) -> dict[str, Any]:
    """A DeepSpeed config for the ZeroConfig fields in ``zero`` (those not given are
    ZeroConfig's defaults). ``micro_batch`` (and ``world_size``) add
    ``train_micro_batch_size_per_gpu`` (and ``train_batch_size``)."""
    rest = dict(zero)
    ds: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    if micro_batch is not None:
        ds["train_micro_batch_size_per_gpu"] = micro_batch
        if world_size is not None:
            accum = rest.get("gradient_accumulation_steps", 1)
            ds["train_batch_size"] = micro_batch * accum * world_size
    for key in ("gradient_accumulation_steps", "gradient_clipping"):
        if key in rest:
            ds[key] = rest.pop(key)
    zo: dict[str, Any] = {"stage": rest.pop("stage", 0)}
    if "bucket_numel" in rest:
        zo["reduce_bucket_size"] = rest.pop("bucket_numel")
    if "overlap_comm" in rest:
        zo["overlap_comm"] = rest.pop("overlap_comm")
    if "stage3_prefetch" in rest:
        prefetch = rest.pop("stage3_prefetch")
        if prefetch in (0, 1):
            zo["stage3_prefetch_bucket_size"] = DS_PREFETCH_BUCKET if prefetch else 0
        else:  # DeepSpeed counts elements, not units: only on/off maps
            extra["stage3_prefetch"] = prefetch
    reuse = rest.pop("stage3_max_reuse_distance", 0)
    if zo["stage"] == 3 or reuse:
        # written even at zeroplane's default: DeepSpeed's own (1e9) keeps every unit
        zo["stage3_max_reuse_distance"] = reuse
    if "stage3_max_live_parameters" in rest:  # the same default as DeepSpeed's
        zo["stage3_max_live_parameters"] = rest.pop("stage3_max_live_parameters")
    if "hpz_partition_size" in rest:  # ZeRO++'s hpZ; the same default (1) as DeepSpeed's
        zo["zero_hpz_partition_size"] = rest.pop("hpz_partition_size")
    if zo["stage"] == 3 and rest.get("stage3_gather_compression") == "int8":
        # ZeRO++'s qwZ: DeepSpeed's key means int8 gathers at stage 3 only (zeroplane
        # also quantizes stages 1-2's, which stay in the "zeroplane" section)
        del rest["stage3_gather_compression"]
        zo["zero_quantized_weights"] = True
    ds["zero_optimization"] = zo
    dtype = rest.pop("dtype", "fp32")
    ds["bf16"] = {"enabled": dtype == "bf16"}
    ds["fp16"] = {"enabled": dtype == "fp16"}
    for key in _FP16_KEYS:
        if key in rest:
            value = rest.pop(key)
            # from_deepspeed reads the fp16 section's settings only when it is enabled
            (ds["fp16"] if dtype == "fp16" else extra)[key] = value
    policy = rest.pop("activation_checkpointing", "none")
    if policy == "units":
        ds["activation_checkpointing"] = {}
    elif isinstance(policy, int) and not isinstance(policy, bool):
        extra["activation_checkpointing"] = policy
    elif policy != "none":
        raise ValueError(
            "ZeroConfig.activation_checkpointing is a callable policy, which no JSON "
            "can hold: give 'units' or an integer to write a DeepSpeed config"
        )
    extra.update(rest)
    if extra:
        ds["zeroplane"] = extra
    return ds
