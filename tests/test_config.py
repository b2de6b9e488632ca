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
