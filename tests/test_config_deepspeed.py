"""ZeroConfig.from_deepspeed on real-shaped DeepSpeed configs, "auto" resolution,
value conversion, and ZeroConfig's own type checks. Pure config: no torch.distributed."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import pytest

from worker import ZeroConfig

DATA = Path(__file__).parent / "data" / "deepspeed"

HF_RESOLVE = {"gradient_accumulation_steps": 4, "gradient_clipping": 1.0}


def named(*keys: str) -> set[str]:
    return set(keys)


# file -> (from_deepspeed keywords, the ZeroConfig it reads as, or the keys its error names)
FILES: dict[str, tuple[dict[str, Any], ZeroConfig | set[str]]] = {
    "zero1_fp16.json": (
        {},
        ZeroConfig(
            stage=1,
            dtype="fp16",
            gradient_accumulation_steps=2,
            gradient_clipping=1.0,
            bucket_numel=100_000_000,
            loss_scale=0.0,
            initial_scale_power=12,
            loss_scale_window=500,
            hysteresis=2,
            min_loss_scale=1.0,
        ),
    ),
    "zero2_bf16.json": (
        {},
        ZeroConfig(
            stage=2,
            dtype="bf16",
            gradient_accumulation_steps=8,
            gradient_clipping=0.5,
            bucket_numel=500_000_000,
            overlap_comm=True,
        ),
    ),
    "zero3_bf16.json": (
        {},
        ZeroConfig(
            stage=3,
            dtype="bf16",
            gradient_clipping=1.0,
            overlap_comm=False,
            bucket_numel=200_000_000,
            stage3_prefetch=1,
            stage3_max_reuse_distance=1_000_000_000,
        ),
    ),
    # HF's zero2 template, offload_optimizer set to "none" (HF's way to turn it off)
    "hf_zero2_auto.json": (
        {**HF_RESOLVE, "dtype": "bf16"},
        ZeroConfig(
            stage=2,
            dtype="bf16",
            gradient_accumulation_steps=4,
            gradient_clipping=1.0,
            bucket_numel=200_000_000,
            overlap_comm=True,
        ),
    ),
    # HF's zero3 template without offload; fp16 on, so its loss-scale keys are read
    "hf_zero3_auto.json": (
        {**HF_RESOLVE, "fp16": True, "hidden_size": 1024},
        ZeroConfig(
            stage=3,
            dtype="fp16",
            gradient_accumulation_steps=4,
            gradient_clipping=1.0,
            bucket_numel=1024 * 1024,
            overlap_comm=True,
            stage3_prefetch=1,
            stage3_max_reuse_distance=1_000_000_000,
            loss_scale=0.0,
            initial_scale_power=16,
            loss_scale_window=1000,
            hysteresis=2,
            min_loss_scale=1.0,
        ),
    ),
    # HF's zero3 template as HF ships it: CPU offload of both, pinned
    "hf_zero3_offload.json": (
        {**HF_RESOLVE, "bf16": True, "hidden_size": 1024},
        ZeroConfig(
            stage=3,
            dtype="bf16",
            gradient_accumulation_steps=4,
            gradient_clipping=1.0,
            bucket_numel=1024 * 1024,
            overlap_comm=True,
            stage3_prefetch=1,
            stage3_max_reuse_distance=1_000_000_000,
            offload_optimizer="cpu",
            offload_params="cpu",
            pin_memory=True,
        ),
    ),
    "activation_checkpointing.json": (
        {},
        ZeroConfig(
            stage=3,
            dtype="bf16",
            gradient_accumulation_steps=16,
            stage3_prefetch=0,
            activation_checkpointing="units",
        ),
    ),
    "activation_checkpointing_cpu.json": (
        {},
        ZeroConfig(stage=2, activation_checkpointing="units", offload_activations=True),
    ),
}


def load(name: str) -> dict[str, Any]:
    return json.loads((DATA / name).read_text())


def test_every_file_has_an_expectation() -> None:
    assert sorted(p.name for p in DATA.glob("*.json")) == sorted(FILES)


@pytest.mark.parametrize("name", sorted(FILES))
def test_deepspeed_files(name: str) -> None:
    keywords, expected = FILES[name]
    if isinstance(expected, ZeroConfig):
        assert ZeroConfig.from_deepspeed(load(name), **keywords) == expected
    else:
        with pytest.raises(ValueError) as error:
            ZeroConfig.from_deepspeed(load(name), **keywords)
        for key in expected:
            assert key in str(error.value)


def auto_keys(error: pytest.ExceptionInfo[ValueError]) -> list[str]:
    return re.findall(r"DeepSpeed key '([^']+)' is \"auto\"", str(error.value))


@pytest.mark.parametrize(
    ("name", "keys"),
    [
        (
            "hf_zero2_auto.json",
            ["fp16.enabled", "bf16.enabled", "gradient_accumulation_steps", "gradient_clipping"],
        ),
        (
            "hf_zero3_auto.json",
            [
                "fp16.enabled",
                "bf16.enabled",
                "zero_optimization.reduce_bucket_size",
                "zero_optimization.stage3_prefetch_bucket_size",
                "gradient_accumulation_steps",
                "gradient_clipping",
            ],
        ),
    ],
)
def test_hf_templates_unresolved_name_every_auto_key(name: str, keys: list[str]) -> None:
    # Before: "enables both 'bf16' and 'fp16'" because "auto" is truthy
    with pytest.raises(ValueError) as error:
        ZeroConfig.from_deepspeed(load(name))
    assert auto_keys(error) == keys
    assert "both" not in str(error.value)


def test_hf_template_logs_auto_optimizer_and_batch_sizes_as_ignored(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="worker.ds_config"):
        ZeroConfig.from_deepspeed(
            load("hf_zero3_auto.json"), **HF_RESOLVE, dtype="bf16", hidden_size=64
        )
    for key in (
        "optimizer",
        "scheduler",
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "zero_optimization.stage3_param_persistence_threshold",
    ):
        assert key in caplog.text


# ---------------------------------------------------------------- 1. "auto"


def test_auto_message_names_key_and_keyword() -> None:
    with pytest.raises(ValueError) as error:
        ZeroConfig.from_deepspeed({"gradient_accumulation_steps": "auto"})
    assert str(error.value) == (
        "DeepSpeed key 'gradient_accumulation_steps' is \"auto\": "
        "pass gradient_accumulation_steps=... to from_deepspeed"
    )


@pytest.mark.parametrize(
    ("ds", "key", "keyword"),
    [
        ({"gradient_clipping": "auto"}, "gradient_clipping", "gradient_clipping="),
        ({"zero_optimization": {"stage": "auto"}}, "zero_optimization.stage", "stage="),
        (
            {"zero_optimization": {"reduce_bucket_size": "auto"}},
            "zero_optimization.reduce_bucket_size",
            "bucket_numel=... or hidden_size=",
        ),
        (
            {"zero_optimization": {"stage3_prefetch_bucket_size": "auto"}},
            "zero_optimization.stage3_prefetch_bucket_size",
            "stage3_prefetch=... or hidden_size=",
        ),
        (
            {"zero_optimization": {"overlap_comm": "auto"}},
            "zero_optimization.overlap_comm",
            "overlap_comm=",
        ),
        ({"bf16": {"enabled": "auto"}}, "bf16.enabled", "dtype="),
        ({"fp16": {"enabled": True, "hysteresis": "auto"}}, "fp16.hysteresis", "hysteresis="),
        ({"fp16": {"enabled": True, "loss_scale": "auto"}}, "fp16.loss_scale", "loss_scale="),
    ],
)
def test_unresolved_auto_names_key_and_keyword(ds: dict, key: str, keyword: str) -> None:
    with pytest.raises(ValueError) as error:
        ZeroConfig.from_deepspeed(ds)
    assert auto_keys(error) == [key]
    assert f"pass {keyword}" in str(error.value)


def test_field_keywords_resolve_auto() -> None:
    ds = {
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "fp16": {"enabled": True, "hysteresis": "auto", "loss_scale": "auto"},
        "zero_optimization": {
            "stage": "auto",
            "overlap_comm": "auto",
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
        },
    }
    cfg = ZeroConfig.from_deepspeed(
        ds,
        gradient_accumulation_steps=3,
        gradient_clipping=0.25,
        hysteresis=4,
        loss_scale=128.0,
        stage=3,
        overlap_comm=False,
        bucket_numel=12345,
        stage3_prefetch=2,
    )
    assert cfg == ZeroConfig(
        stage=3,
        dtype="fp16",
        gradient_accumulation_steps=3,
        gradient_clipping=0.25,
        hysteresis=4,
        loss_scale=128.0,
        overlap_comm=False,
        bucket_numel=12345,
        stage3_prefetch=2,
    )


def test_hidden_size_resolves_bucket_sizes_as_hf_does() -> None:
    ds = {
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        }
    }
    cfg = ZeroConfig.from_deepspeed(ds, hidden_size=768)
    assert (cfg.bucket_numel, cfg.stage3_prefetch) == (768 * 768, 1)
    # a field keyword wins over hidden_size; concrete values are not touched
    assert ZeroConfig.from_deepspeed(ds, hidden_size=768, bucket_numel=999).bucket_numel == 999
    fixed = {"zero_optimization": {"reduce_bucket_size": 5e8}}
    assert ZeroConfig.from_deepspeed(fixed, hidden_size=768).bucket_numel == 500_000_000


@pytest.mark.parametrize("value", [0, -4, True, 1.5, "768"])
def test_bad_hidden_size_is_named(value: object) -> None:
    with pytest.raises(ValueError, match="hidden_size"):
        ZeroConfig.from_deepspeed({}, hidden_size=value)


HF_PRECISION = {
    "fp16": {"enabled": "auto", "hysteresis": 2},
    "bf16": {"enabled": "auto"},
}


@pytest.mark.parametrize(
    ("keywords", "dtype", "hysteresis"),
    [
        ({"dtype": "bf16"}, "bf16", 1),
        ({"dtype": "fp16"}, "fp16", 2),
        ({"dtype": "fp32"}, "fp32", 1),
        ({"bf16": True}, "bf16", 1),
        ({"fp16": True}, "fp16", 2),
        ({"fp16": True, "bf16": False}, "fp16", 2),
        ({"fp16": False}, "fp32", 1),
        ({"dtype": "bf16", "bf16": True, "fp16": False}, "bf16", 1),
    ],
)
def test_precision_auto_resolves(keywords: dict, dtype: str, hysteresis: int) -> None:
    cfg = ZeroConfig.from_deepspeed(HF_PRECISION, **keywords)
    assert (cfg.dtype, cfg.hysteresis) == (dtype, hysteresis)


def test_precision_keywords_both_true_is_both() -> None:
    with pytest.raises(ValueError, match="enables both 'bf16' and 'fp16'"):
        ZeroConfig.from_deepspeed(HF_PRECISION, fp16=True, bf16=True)


def test_precision_keyword_disagreeing_with_file_names_key() -> None:
    with pytest.raises(ValueError, match=r"'fp16\.enabled' is True but .*fp16=False"):
        ZeroConfig.from_deepspeed({"fp16": {"enabled": True}}, fp16=False)
    with pytest.raises(ValueError, match="dtype='bf16' and fp16=True"):
        ZeroConfig.from_deepspeed(HF_PRECISION, dtype="bf16", fp16=True)
    with pytest.raises(ValueError, match="fp16 must be True, False or None"):
        ZeroConfig.from_deepspeed(HF_PRECISION, fp16="yes")


def test_auto_in_ignored_keys_is_fine() -> None:
    ds = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
        "zero_optimization": {
            "stage": 2,
            "stage3_param_persistence_threshold": "auto",
            "sub_group_size": "auto",
            "reduce_scatter": "auto",
            "allgather_partitions": "auto",
        },
    }
    assert ZeroConfig.from_deepspeed(ds) == ZeroConfig(stage=2)


def test_unknown_keyword_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="max_grad_norm"):
        ZeroConfig.from_deepspeed({}, max_grad_norm=1.0)


# ---------------------------------------------------------------- 2. conversion


def overlap(value: object) -> bool:
    return ZeroConfig.from_deepspeed({"zero_optimization": {"overlap_comm": value}}).overlap_comm


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (True, True),
        (False, False),
        ("false", False),
        ("False", False),
        ("true", True),
        ("no", False),
        ("on", True),
        (0, False),
        (1, True),
    ],
)
def test_pydantic_read_bools_convert_as_deepspeed(value: object, want: bool) -> None:
    assert overlap(value) is want


@pytest.mark.parametrize("value", ["maybe", " true", "", 2, 0.5, [], {}])
def test_bad_bools_name_the_key(value: object) -> None:
    with pytest.raises(
        ValueError, match=r"'zero_optimization\.overlap_comm' must be true or false"
    ):
        overlap(value)


def test_null_overlap_comm_is_its_default() -> None:
    # Optional[bool] in DeepSpeed: null is "not set"
    assert overlap(None) is ZeroConfig().overlap_comm


def test_enabled_string_false_is_off_not_truthy() -> None:
    cfg = ZeroConfig.from_deepspeed({"fp16": {"enabled": "false"}, "bf16": {"enabled": "true"}})
    assert cfg.dtype == "bf16"
    with pytest.raises(ValueError, match=r"'fp16\.enabled' must be true or false, got None"):
        ZeroConfig.from_deepspeed({"fp16": {"enabled": None}})


def test_reduce_scatter_string_false_is_refused() -> None:
    with pytest.raises(ValueError, match=r"zero_optimization\.reduce_scatter=false"):
        ZeroConfig.from_deepspeed({"zero_optimization": {"reduce_scatter": "false"}})


def bucket(value: object) -> int:
    ds = {"zero_optimization": {"reduce_bucket_size": value}}
    return ZeroConfig.from_deepspeed(ds).bucket_numel


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (5e8, 500_000_000),
        (1e8, 100_000_000),
        (500_000_000, 500_000_000),
        ("500000000", 500_000_000),
        ("2_000", 2000),
        (" 64 ", 64),
        ("64.0", 64),
    ],
)
def test_pydantic_read_ints_convert_as_deepspeed(value: object, want: int) -> None:
    result = bucket(value)
    assert (result, type(result)) == (want, int)


@pytest.mark.parametrize(
    "value", ["5e8", "1e3", "64.", "0x40", 1.5, 2.5e0, True, None, math.inf, math.nan, [1]]
)
def test_bad_ints_name_the_key(value: object) -> None:
    with pytest.raises(
        ValueError,
        match=r"DeepSpeed key 'zero_optimization\.reduce_bucket_size' must be an integer",
    ):
        bucket(value)


def test_exponent_string_error_says_to_unquote() -> None:
    with pytest.raises(ValueError, match="unquote"):
        bucket("5e8")


def test_stage_converts_as_an_int() -> None:
    assert ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 2.0}}).stage == 2
    assert ZeroConfig.from_deepspeed({"zero_optimization": {"stage": "3"}}).stage == 3
    with pytest.raises(ValueError, match=r"'zero_optimization\.stage' must be an integer"):
        ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 1.5}})
    with pytest.raises(ValueError, match=r"'zero_optimization\.stage' must be an integer"):
        ZeroConfig.from_deepspeed({"zero_optimization": {"stage": True}})


def test_out_of_range_value_names_field_and_key() -> None:
    with pytest.raises(ValueError) as error:
        bucket(0)
    assert str(error.value) == (
        "ZeroConfig.bucket_numel must be an integer >= 1, got 0 "
        "(read from DeepSpeed key 'zero_optimization.reduce_bucket_size')"
    )


def test_prefetch_bucket_size() -> None:
    def prefetch(value: object) -> int:
        ds = {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": value}}
        return ZeroConfig.from_deepspeed(ds).stage3_prefetch

    assert (prefetch(5e7), prefetch(0), prefetch("0")) == (1, 0, 0)
    for value in (-1, "5e7", 0.5):
        with pytest.raises(ValueError, match=r"'zero_optimization\.stage3_prefetch_bucket_size'"):
            prefetch(value)


def test_max_live_parameters() -> None:
    def max_live(value: object) -> int:
        ds = {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": value}}
        return ZeroConfig.from_deepspeed(ds).stage3_max_live_parameters

    assert (max_live(3e6), max_live(0), max_live("auto")) == (3_000_000, 0, 10**9)
    assert ZeroConfig().stage3_max_live_parameters == 10**9  # DeepSpeed's default
    for value in (-1, "3e6", 0.5):
        with pytest.raises(ValueError, match=r"'zero_optimization\.stage3_max_live_parameters'"):
            max_live(value)


def accumulation(value: object) -> int:
    return ZeroConfig.from_deepspeed(
        {"gradient_accumulation_steps": value}
    ).gradient_accumulation_steps


def test_raw_read_accumulation_steps() -> None:
    # read raw by DeepSpeed: a JSON number; null is its default (unset)
    assert (accumulation(4), accumulation(4.0), accumulation(None)) == (4, 4, 1)
    assert type(accumulation(4.0)) is int
    for value in ("4", 4.5, True, math.inf):
        with pytest.raises(ValueError, match="DeepSpeed key 'gradient_accumulation_steps' must be"):
            accumulation(value)


def test_raw_read_gradient_clipping() -> None:
    assert ZeroConfig.from_deepspeed({"gradient_clipping": 1}).gradient_clipping == 1.0
    for value in ("1.0", None, True, math.nan, math.inf):
        with pytest.raises(ValueError, match="DeepSpeed key 'gradient_clipping' must be"):
            ZeroConfig.from_deepspeed({"gradient_clipping": value})
    with pytest.raises(ValueError, match=r"ZeroConfig\.gradient_clipping .*'gradient_clipping'"):
        ZeroConfig.from_deepspeed({"gradient_clipping": -1.0})


def fp16(**section: object) -> ZeroConfig:
    return ZeroConfig.from_deepspeed({"fp16": {"enabled": True, **section}})


def test_fp16_loss_scale_reads_as_deepspeeds_validator() -> None:
    assert fp16(loss_scale=128).loss_scale == 128.0
    assert fp16(loss_scale="1024").loss_scale == 1024.0
    for value in (True, None, "nan", math.inf, "big"):
        with pytest.raises(ValueError, match=r"'fp16\.loss_scale' must be a finite number"):
            fp16(loss_scale=value)


def test_fp16_ints_and_min_loss_scale() -> None:
    cfg = fp16(initial_scale_power=8.0, loss_scale_window="200", min_loss_scale=2)
    assert (cfg.initial_scale_power, cfg.loss_scale_window, cfg.min_loss_scale) == (8, 200, 2.0)
    # DeepSpeedFP16Config declares min_loss_scale an int
    with pytest.raises(ValueError, match=r"'fp16\.min_loss_scale' must be an integer"):
        fp16(min_loss_scale=0.5)
    with pytest.raises(ValueError, match=r"'fp16\.hysteresis' must be an integer"):
        fp16(hysteresis=None)
    with pytest.raises(ValueError, match=r"ZeroConfig\.initial_scale_power .*'fp16\.initial"):
        fp16(initial_scale_power=99)


def test_conversion_agrees_with_pydantic_lax_mode() -> None:
    """DeepSpeed validates these sections with pydantic v2; where it is installed,
    check that what it accepts is read the same here (bools for ints excepted)."""
    pydantic = pytest.importorskip("pydantic")
    as_bool, as_int = pydantic.TypeAdapter(bool), pydantic.TypeAdapter(int)
    for value in [True, False, 0, 1, 2, 0.0, 1.0, "true", "FALSE", "yes", "n", " true", "2", None]:
        try:
            want: object = as_bool.validate_python(value)
        except pydantic.ValidationError:
            want = ValueError
        try:
            got: object = overlap(value) if value is not None else ValueError
        except ValueError:
            got = ValueError
        assert got == want, value
    for value in [5, 5.0, 5e8, 1.5, "5", "5.0", " 5 ", "5e8", "5.", "1_0", math.inf, None]:
        try:
            want = as_int.validate_python(value)
        except pydantic.ValidationError:
            want = ValueError
        try:
            got = bucket(value)
        except ValueError:
            got = ValueError
        assert got == want, value


# ---------------------------------------------------------------- 3. ZeroConfig types


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("gradient_clipping", True),
        ("gradient_clipping", math.inf),
        ("gradient_clipping", "1.0"),
        ("stage", 1.0),
        ("stage", "1"),
        ("compression_block", 0),
        ("compression_block", True),
        ("loss_scale", math.nan),
        ("loss_scale", True),
        ("min_loss_scale", math.inf),
        ("min_loss_scale", math.nan),
        ("min_loss_scale", "1"),
        ("bucket_numel", "5e8"),
        ("bucket_numel", 5e8),
        ("initial_scale_power", 16.0),
        ("initial_scale_power", "16"),
        ("gradient_accumulation_steps", 2.0),
        ("stage3_prefetch", False),
        ("dtype", ["bf16"]),
        ("compression", None),
        ("metrics_port", True),
        ("overlap_comm", 1),
    ],
)
def test_wrong_types_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError) as error:
        ZeroConfig(**{field: value})
    assert re.fullmatch(
        rf"ZeroConfig\.{field} must be .+, got {re.escape(repr(value))}", str(error.value)
    )


def test_numbers_still_accepted() -> None:
    cfg = ZeroConfig(gradient_clipping=1, loss_scale=128, min_loss_scale=0.5, compression_block=1)
    assert (cfg.gradient_clipping, cfg.loss_scale, cfg.min_loss_scale) == (1, 128, 0.5)


# ---------------------------------------------------------------- 4. activation_checkpointing


def policy(module: object) -> bool:
    return type(module).__name__ == "Linear"


@pytest.mark.parametrize("value", ["none", "units", 1, 3, policy, lambda m: True])
def test_activation_checkpointing_accepts(value: object) -> None:
    assert ZeroConfig(activation_checkpointing=value).activation_checkpointing is value


def test_activation_checkpointing_default_is_off() -> None:
    assert ZeroConfig().activation_checkpointing == "none"


@pytest.mark.parametrize("value", ["all", "Units", "", 0, -1, True, False, 1.0, None, ["units"]])
def test_activation_checkpointing_rejects(value: object) -> None:
    with pytest.raises(ValueError, match=r"^ZeroConfig\.activation_checkpointing must be"):
        ZeroConfig(activation_checkpointing=value)


def test_replace_keeps_a_callable_policy() -> None:
    cfg = ZeroConfig(activation_checkpointing=policy).replace(stage=3)
    assert (cfg.stage, cfg.activation_checkpointing) == (3, policy)
    assert cfg.replace(activation_checkpointing=2).activation_checkpointing == 2
    hash(cfg)


def test_deepspeed_activation_section_turns_units_on(caplog) -> None:
    section = {
        "partition_activations": True,
        "contiguous_memory_optimization": True,
        "number_checkpoints": 4,
        "synchronize_checkpoint_boundary": True,
        "profile": False,
        "cpu_checkpointing": False,
    }
    with caplog.at_level(logging.WARNING, logger="worker.ds_config"):
        cfg = ZeroConfig.from_deepspeed({"activation_checkpointing": section})
    assert cfg == ZeroConfig(activation_checkpointing="units")
    # compile.deepcompile: the engine compiles the model; DeepCompile's own passes aside
    compiled = ZeroConfig.from_deepspeed(
        {"compile": {"deepcompile": True, "free_activation": True}}
    )
    assert compiled == ZeroConfig(compile=True)
    # cpu_checkpointing: the checkpointed activations kept in host memory
    on = ZeroConfig.from_deepspeed({"activation_checkpointing": {"cpu_checkpointing": True}})
    assert on.offload_activations and on.activation_checkpointing == "units"
    for key in section:
        if key != "cpu_checkpointing":
            assert f"activation_checkpointing.{key}" in caplog.text
    assert ZeroConfig.from_deepspeed({"activation_checkpointing": {}}).activation_checkpointing == (
        "units"
    )
    assert ZeroConfig.from_deepspeed({}).activation_checkpointing == "none"
    override = ZeroConfig.from_deepspeed(
        {"activation_checkpointing": {}}, activation_checkpointing=2
    )
    assert override.activation_checkpointing == 2


@pytest.mark.parametrize(
    ("section", "message"),
    [
        # read raw and tested by truthiness in DeepSpeed, where "false" would turn it on
        ({"cpu_checkpointing": "false"}, r"'activation_checkpointing\.cpu_checkpointing' must be"),
        ({"cpu_checkpointing": 0}, r"'activation_checkpointing\.cpu_checkpointing' must be"),
        ({"made_up": 1}, r"not support: activation_checkpointing\.made_up"),
        (True, r"'activation_checkpointing' must be a dict"),
        (None, r"'activation_checkpointing' must be a dict"),
        ("units", r"'activation_checkpointing' must be a dict"),
    ],
)
def test_deepspeed_activation_section_refusals(section: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ZeroConfig.from_deepspeed({"activation_checkpointing": section})


def test_deepspeed_defaults_written_out_and_features_switched_off_load():
    """A config as DeepSpeed accepts it loads: DeepSpeed's own defaults written out,
    and its features switched off (``enabled: false``); the same keys asking for
    something are refused by name, autotuning pointing to `zeroplane tune`."""
    cfg = ZeroConfig.from_deepspeed(
        {
            "fp16_master_weights_and_grads": False,
            "autotuning": {"enabled": False, "fast": True},
            "data_efficiency": {"enabled": False},
            "zero_optimization": {"stage": 2},
        }
    )
    assert cfg.stage == 2
    with pytest.raises(ValueError, match=r"does not support: fp16_master_weights_and_grads$"):
        ZeroConfig.from_deepspeed({"fp16_master_weights_and_grads": True})
    with pytest.raises(ValueError, match=r"autotuning \(autotuning: run `zeroplane tune`"):
        ZeroConfig.from_deepspeed({"autotuning": {"enabled": True}})
