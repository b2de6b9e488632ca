"""The planner against the ZeRO paper's Table 1, the stage choice, and `zeroplane plan`."""

from __future__ import annotations

import json
import textwrap

import pytest

from coordinator.cli import main
from coordinator.core.planner import (
    ActivationShape,
    PlanConfig,
    choose_stage,
    estimate_memory,
    format_bytes,
    parse_bytes,
    parse_count,
)

pytestmark = pytest.mark.timeout(60)

PSI = 7_500_000_000
# Rajbhandari et al. 2019, Table 1: 7.5B parameters, mixed-precision Adam (K = 12), GB = 1e9.
# N -> (stage 1, stage 2, stage 3), as printed.
TABLE_1 = {
    1: ("120", "120", "120"),
    4: ("52.5", "41.3", "30"),
    16: ("35.6", "21.6", "7.5"),
    64: ("31.4", "16.6", "1.88"),
    1024: ("30.1", "15.1", "0.12"),
}


@pytest.mark.parametrize("world_size", sorted(TABLE_1))
def test_estimates_match_zero_paper_table_1(world_size: int) -> None:
    config = PlanConfig(precision="bf16", optimizer_states=2)
    baseline = estimate_memory(PSI, stage=0, world_size=world_size, config=config)
    assert baseline.total == 120e9  # DDP: 16 bytes per parameter on every rank
    for stage, printed in zip((1, 2, 3), TABLE_1[world_size], strict=True):
        got = estimate_memory(PSI, stage=stage, world_size=world_size, config=config).total / 1e9
        decimals = len(printed.partition(".")[2])
        # Equal to the printed value within half a unit of its last digit.
        assert abs(got - float(printed)) <= 0.5 * 10**-decimals + 1e-9, (stage, got, printed)


def test_activation_term_is_added_to_every_stage() -> None:
    config = PlanConfig(activation_bytes=3_000_000_000)
    for stage in range(4):
        e = estimate_memory(PSI, stage=stage, world_size=4, config=config)
        assert e.total == e.model_states.total + 3e9


def test_one_rank_is_stage_0_and_says_why() -> None:
    choice = choose_stage(1_000_000, world_size=1, device_memory_bytes=80 * 10**9)
    assert choice.stage == 0 and "one rank" in choice.reason and choice.fits


def test_lowest_stage_that_fits_the_smallest_worker() -> None:
    # 80 GB less 10% headroom = 72 GB usable.
    assert choose_stage(PSI, world_size=4, device_memory_bytes=80 * 10**9).stage == 1
    # 40 GB -> 36 usable: stage 1 needs 52.5, stage 2 41.25, stage 3 30.
    choice = choose_stage(PSI, world_size=4, device_memory_bytes=40 * 10**9)
    assert choice.stage == 3 and "lowest that fits" in choice.reason
    # Nothing fits (offload not allowed; tests/test_offload.py has it): stage 3, saying so.
    no_offload = PlanConfig(offload=False)
    choice = choose_stage(PSI, world_size=2, device_memory_bytes=16 * 10**9, config=no_offload)
    assert choice.stage == 3 and not choice.fits and "no stage fits" in choice.reason
    small = choose_stage(1000, world_size=8, device_memory_bytes=10**9)
    assert small.stage == 0 and small.fits


def test_forced_stage_on_one_rank_warns(caplog: pytest.LogCaptureFixture) -> None:
    choice = choose_stage(1000, world_size=1, device_memory_bytes=0, config=PlanConfig(stage=2))
    assert choice.stage == 2 and "configuration" in choice.reason
    assert "saves no memory" in caplog.text


def test_parsers() -> None:
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("16GiB") == 16 * 2**30
    assert parse_bytes("1e9") == 10**9
    assert parse_count("7.5e9") == parse_count("7.5B") == PSI
    assert parse_count("350M") == 350_000_000
    assert format_bytes(41.25e9) == "41.25 GB"
    with pytest.raises(ValueError, match="not a byte size"):
        parse_bytes("80 parsecs")
    with pytest.raises(ValueError, match=r"PlanConfig\.headroom"):
        PlanConfig(headroom=1.5)


def test_cli_plan_prints_all_stages_and_the_recommendation(capsys) -> None:
    # without offload (tests/test_offload.py plans with it)
    argv = ["plan", "--params", "7.5e9", "--world-sizes", "1,4,16,64,1024", "--no-offload"]
    assert main([*argv, "--device-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    rows = {
        line.split()[0]: line.split()[1:]
        for line in out.splitlines()
        if line.strip() and line.split()[0].isdigit()
    }
    assert rows["4"] == ["120.0", "52.5", "41.3", "30.0", "1"]
    assert rows["16"] == ["120.0", "35.6", "21.6", "7.50", "1"]
    assert rows["64"] == ["120.0", "31.4", "16.6", "1.88", "1"]
    assert rows["1024"] == ["120.0", "30.1", "15.1", "0.12", "1"]
    assert rows["1"] == ["120.0", "120.0", "120.0", "120.0", "0*"]
    assert "N=1: stage 0: one rank" in out

    assert main([*argv, "--device-memory", "80GB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [p["recommended_stage"] for p in data["plans"]] == [0, 1, 1, 1, 1]

    assert main(["plan", "--params", "lots"]) == 2
    assert "not a parameter count" in capsys.readouterr().err


def test_cli_plan_loads_a_model_factory(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "planned_model.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            def build():
                model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5))
                model[0].bias.requires_grad_(False)
                return model
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["plan", "--model", "planned_model:build", "--world-sizes", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["trainable_params"] == 10 * 20 + 20 * 5 + 5  # the frozen bias is not counted
    assert main(["plan", "--model", "planned_model:nope"]) == 2
    assert "cannot load" in capsys.readouterr().err


# ---------------------------------------------------------------- activations


def test_activation_estimate_is_korthikanti_eq1() -> None:
    # GPT-3 175B's shape (s=2048, h=12288, a=96), one sequence: the paper's eq. 1 gives
    # s*b*h*(34 + 5*a*s/h) = 2048*12288*(34 + 80) bytes per layer in 16-bit training
    shape = ActivationShape(layers=96, hidden=12288, seq=2048, micro_batch=1, heads=96)
    per_layer = 2048 * 12288 * 114
    assert shape.layer_bytes("bf16") == per_layer
    assert shape.bytes("bf16", checkpointing=False) == 96 * per_layer
    assert shape.bytes("fp32", checkpointing=False) == 2 * 96 * per_layer
    # checkpointing keeps each layer's input (2*s*b*h) and recomputes one layer at a time
    assert shape.bytes("bf16", checkpointing=True) == 96 * 2 * 2048 * 12288 + per_layer
    assert ActivationShape(layers=1, hidden=128, seq=16).layer_bytes("fp16") == 16 * 128 * (
        34 + 5 * 2 * 16 / 128
    )
    with pytest.raises(ValueError, match=r"ActivationShape\.seq"):
        ActivationShape(layers=1, hidden=8, seq=0)


def test_checkpointing_is_recommended_only_when_it_is_what_fits() -> None:
    shape = ActivationShape(layers=32, hidden=4096, seq=4096, micro_batch=4, heads=32)
    kept = shape.bytes("bf16", checkpointing=False)
    ckpt = shape.bytes("bf16", checkpointing=True)
    config = PlanConfig(activations=shape)
    # 7B on 8 ranks of 80 GB: every activation kept, nothing fits (416 GB of activations)
    choice = choose_stage(7 * 10**9, world_size=8, device_memory_bytes=80 * 10**9, config=config)
    assert choice.fits and choice.checkpointing
    assert choice.stage == 1  # stage 0 needs 16*7e9 = 112 GB of model states alone
    assert choice.estimates[1].activation_bytes == ckpt
    assert "activation checkpointing" in choice.reason and "even stage 3" in choice.reason
    # a short sequence fits without it: the plan keeps every activation
    short = PlanConfig(activations=ActivationShape(layers=32, hidden=4096, seq=128, heads=32))
    plain = choose_stage(7 * 10**9, world_size=8, device_memory_bytes=80 * 10**9, config=short)
    assert plain.fits and not plain.checkpointing
    assert kept > 72e9 > ckpt + choice.estimates[1].model_states.total
    with pytest.raises(ValueError, match="activation_bytes or activations"):
        PlanConfig(activation_bytes=1, activations=shape)


def test_cli_plan_with_a_transformer_shape(capsys) -> None:
    argv = ["plan", "--params", "7e9", "--world-sizes", "8", "--device-memory", "80GB"]
    shape = ["--seq", "4096", "--micro-batch", "4", "--layers", "32", "--hidden", "4096"]
    assert main([*argv, *shape, "--heads", "32"]) == 0
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.split()[:1] == ["8"])
    assert row[-1] == "1+ac"
    assert main([*argv, *shape, "--heads", "32", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plans"][0]
    assert plan["activation_checkpointing"] and plan["recommended_stage"] == 1
    assert main([*argv, "--seq", "4096"]) == 2
    assert "--seq needs --layers and --hidden" in capsys.readouterr().err
    assert main([*argv, "--layers", "32"]) == 2
    assert "need --seq" in capsys.readouterr().err


def test_birth_bytes_floor_the_ordinary_path_and_fall_with_n_on_the_meta_path() -> None:
    from coordinator.core.memory import birth_bytes

    psi, unit = 10_000_000, 250_000
    for n in (1, 2, 8, 64):
        b = birth_bytes(psi, stage=3, world_size=n, dtype="fp32", unit_numel=unit)
        # stage 3, fp32: parameter and gradient shards (the optimizer's states come later)
        assert b.meta == 8 * psi / n + 8 * unit
        assert b.ordinary == 8 * psi / n + 4 * psi  # the whole fp32 model, at every N
    mixed = birth_bytes(psi, stage=2, world_size=4, dtype="bf16")
    assert mixed.meta == 2 * psi + 2 * psi / 4 + 4 * psi / 4


def test_experts_left_out_of_the_inventory_are_planned_per_rank() -> None:
    """[Note: experts in the plan]: Ψ_e/ep experts over world/ep ranks, by hand."""
    dense, experts, world, ep = 1_000_000_000, 6_000_000_000, 8, 4
    config = PlanConfig(precision="bf16", optimizer_states=2, experts=(ep, experts))
    plain = PlanConfig(precision="bf16", optimizer_states=2)
    # bf16 + fp32 Adam: 2 (params) + 2 (grads) + 12 (master, two states) bytes an element
    share = experts / ep  # this rank's experts, over world / ep = 2 ranks
    per_rank = {0: 16 * share, 1: (4 + 12 / 2) * share, 2: (2 + 14 / 2) * share, 3: 16 * share / 2}
    for stage, extra in per_rank.items():
        with_experts = estimate_memory(dense, stage=stage, world_size=world, config=config)
        without = estimate_memory(dense, stage=stage, world_size=world, config=plain)
        assert with_experts.total - without.total == pytest.approx(extra), stage
    # on 16 GB (14.4 usable) the dense part alone fits at stage 1 (5.5 GB); with the
    # experts stage 1 needs 20.5 GB, stage 2 17.25, stage 3 14
    assert choose_stage(dense, world_size=world, device_memory_bytes=16 * 10**9).stage == 1
    choice = choose_stage(dense, world_size=world, device_memory_bytes=16 * 10**9, config=config)
    assert choice.stage == 3 and choice.fits, choice.reason
    with pytest.raises(ValueError, match=r"PlanConfig\.experts"):
        PlanConfig(experts=(0, 10))


def test_a_workers_experts_cross_the_wire() -> None:
    from coordinator.core.conversions import worker_from_proto, worker_to_proto
    from coordinator.core.messages import WorkerInfo

    info = WorkerInfo(worker_id="w", host="127.0.0.1", experts=(4, 6_000_000_000))
    assert worker_from_proto(worker_to_proto(info)).experts == (4, 6_000_000_000)
    plain = WorkerInfo(worker_id="v", host="127.0.0.1")
    assert worker_from_proto(worker_to_proto(plain)).experts is None


# ---------------------------------------------------------------- long sequences


def test_the_longest_sequence_grows_with_cp_and_the_cp_a_length_needs_is_the_smallest() -> None:
    from coordinator.core.planner import ActivationShape, estimate_memory
    from coordinator.core.sequences import plan_sequence

    shape = ActivationShape(layers=32, hidden=4096, seq=131072, heads=32)
    config = PlanConfig(precision="bf16", optimizer_states=2, headroom=0.1)
    plan = plan_sequence(
        8_000_000_000, shape, world_size=8, device_memory_bytes=80 * 10**9, config=config,
        vocab=128256,
    )  # fmt: skip
    # by hand: ZeRO-3 over 8 ranks holds 16 bytes per parameter / 8; per token, 32
    # layers keep their bf16 input (2·h bytes) and one layer its 34·h, plus fp32
    # logits and their log-softmax
    state = estimate_memory(8_000_000_000, stage=3, world_size=8, config=config)
    assert state.model_states.total == 16 * 8_000_000_000 / 8
    per_token = 32 * 2 * 4096 + 34 * 4096 + 8 * 128256
    tokens = int((72e9 - 16e9) // per_token)
    assert plan.longest[1] == tokens
    assert plan.longest[4] == tokens * 4 // 8 * 8
    assert plan.needs == min(cp for cp, n in plan.longest.items() if n >= 131072) == 4
    tiled = plan_sequence(
        8_000_000_000, shape, world_size=8, device_memory_bytes=80 * 10**9, config=config,
        vocab=128256, tiled_loss=True,
    )  # fmt: skip
    assert tiled.longest[1] > plan.longest[1] and tiled.needs == 1


def test_plan_seq_reports_the_cp_a_sequence_needs(capsys) -> None:
    from coordinator.cli import main

    assert main([
        "plan", "--params", "8e9", "--seq", "131072", "--layers", "32", "--hidden", "4096",
        "--vocab", "128256", "--world-sizes", "8",
    ]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "N=8: 131,072 tokens need cp >= 4; the longest sequence at cp=1:" in out


def test_plan_ep_counts_each_ranks_experts_over_their_group(capsys) -> None:
    # a Mixtral-8x7B-like job: 2e9 dense elements, 45e9 in the experts, ep=8
    assert main([
        "plan", "--params", "47e9", "--ep", "8", "--expert-params", "45e9",
        "--world-sizes", "8,16", "--json",
    ]) == 0  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert doc["experts"] == {"expert_parallel": 8, "numel": 45_000_000_000}
    by_n = {p["world_size"]: p for p in doc["plans"]}
    for n in (8, 16):
        stages = {int(k): v["total"] for k, v in by_n[n]["bytes_per_rank"].items()}
        # by hand: the dense 2e9 at 16 bytes over n ranks, the experts' 45e9/8 over n/8
        assert stages[3] == 16 * 2e9 / n + 16 * 45e9 / 8 / (n // 8)
        assert stages[0] == 16 * 2e9 + 16 * 45e9 / 8
    assert main(["plan", "--params", "47e9", "--ep", "8", "--world-sizes", "4"]) == 2
    assert "needs --expert-params" in capsys.readouterr().err
    assert main([
        "plan", "--params", "47e9", "--ep", "8", "--expert-params", "45e9", "--world-sizes", "4",
    ]) == 2  # fmt: skip
    assert "not multiples of --ep 8" in capsys.readouterr().err


def test_the_mesh_table_agrees_with_the_stage_table_where_only_offload_fits(capsys) -> None:
    # 7.5e9 parameters on one 80 GB device: only stage 1 with the optimizer offloaded
    assert main(["plan", "--params", "7.5e9", "--world-sizes", "1"]) == 0
    out = capsys.readouterr().out
    assert "1+oo" in out
    assert "N=1: no mesh fits without offload; ZeRO alone with offload does (stage 1+oo" in out
    assert "nothing fits" not in out
