"""ZeroConfig validation and the DeepSpeed config reader."""

from __future__ import annotations

import logging

import pytest

from worker import ZeroConfig


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stage", 4),
        ("stage", True),
        ("dtype", "fp8"),
        ("reduce_dtype", "int8"),
        ("gradient_accumulation_steps", 0),
        ("bucket_numel", -1),
        ("gradient_clipping", -1.0),
        ("stage3_prefetch", -1),
        ("stage3_max_live_parameters", -1),
        ("hysteresis", 0),
        ("min_loss_scale", 0),
    ],
)
def test_bad_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"ZeroConfig\.{field} must be"):
        ZeroConfig(**{field: value})


def test_config_is_frozen_and_keyword_only() -> None:
    cfg = ZeroConfig(stage=2)
    with pytest.raises(AttributeError):
        cfg.stage = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        ZeroConfig(2)  # type: ignore[misc]


def test_from_deepspeed_reads_zero_precision_and_accumulation(caplog) -> None:
    ds = {
        "train_batch_size": 32,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "hysteresis": 2},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": False,
            "reduce_bucket_size": 5e7,
            "contiguous_gradients": True,
            "stage3_prefetch_bucket_size": 0,
        },
    }
    with caplog.at_level(logging.WARNING):
        cfg = ZeroConfig.from_deepspeed(ds)
    assert cfg == ZeroConfig(
        stage=3,
        dtype="fp16",
        gradient_accumulation_steps=4,
        gradient_clipping=1.0,
        bucket_numel=50_000_000,
        overlap_comm=False,
        stage3_prefetch=0,
        initial_scale_power=12,
        hysteresis=2,
    )
    ignored = caplog.text
    for key in ("train_batch_size", "optimizer", "zero_optimization.contiguous_gradients"):
        assert key in ignored


def test_from_deepspeed_bf16() -> None:
    cfg = ZeroConfig.from_deepspeed({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    assert (cfg.stage, cfg.dtype) == (2, "bf16")


@pytest.mark.parametrize(
    ("ds", "named"),
    [
        ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}, "nvme"),
        ({"zero_optimization": {"stage": 2, "made_up": 1}}, "zero_optimization.made_up"),
        ({"not_a_deepspeed_key": 1}, "not_a_deepspeed_key"),
        ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, "fp16.fp16_master"),
    ],
)
def test_from_deepspeed_rejects_what_it_cannot_honour(ds: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ZeroConfig.from_deepspeed(ds)


def test_from_deepspeed_bad_stage_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"ZeroConfig\.stage"):
        ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 5}})


def test_from_deepspeed_both_precisions() -> None:
    with pytest.raises(ValueError, match="both"):
        ZeroConfig.from_deepspeed({"bf16": {"enabled": True}, "fp16": {"enabled": True}})


def test_sections_hold_every_field_once_and_check_it() -> None:
    from dataclasses import fields

    from worker.config_sections import SECTIONS

    held = [f.name for section in SECTIONS for f in fields(section)]
    assert sorted(held) == sorted(f.name for f in fields(ZeroConfig))
    assert len(held) == len(set(held))
    cfg = ZeroConfig(stage=3, dtype="fp16", hysteresis=2, offload_params="cpu")
    assert cfg.stage3.stage3_prefetch == 1
    assert cfg.loss_scaling.hysteresis == 2
    assert cfg.offload.offload_params == "cpu"
    assert (cfg.precision.dtype, cfg.sharding.stage) == ("fp16", 3)
    with pytest.raises(ValueError, match=r"ZeroConfig\.hysteresis must be an integer >= 1"):
        type(cfg.loss_scaling)(**{**vars(cfg.loss_scaling), "hysteresis": 0})


def test_with_plan_turns_off_what_the_planned_stage_does_not_run() -> None:
    cfg = ZeroConfig(
        stage=3,
        stage3_gather_compression="int8",
        offload_params="cpu",
        offload_optimizer="cpu",
        compression="int8",
    )
    two = cfg.with_plan(stage=2, bucket_numel=1024)
    # stage 2 gathers its parameters after the step too: qwZ stays on
    assert two == cfg.replace(stage=2, bucket_numel=1024, offload_params="none")
    assert two.offload_optimizer == "cpu" and two.compression == "int8"
    zero = cfg.with_plan(stage=0, bucket_numel=1024)
    assert zero == ZeroConfig(stage=0, bucket_numel=1024, compression="int8")
    # the same stage: only the bucket size changes
    assert cfg.with_plan(stage=3, bucket_numel=1024) == cfg.replace(bucket_numel=1024)
    # planned up, nothing is turned on or off
    low = ZeroConfig(stage=1, offload_optimizer="cpu")
    assert low.with_plan(stage=3, bucket_numel=64) == low.replace(stage=3, bucket_numel=64)
    with pytest.raises(ValueError, match=r"ZeroConfig\.bucket_numel must be"):
        cfg.with_plan(stage=2, bucket_numel=0)
