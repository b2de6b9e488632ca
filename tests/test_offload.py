"""ZeRO-Offload on CPU (worker/offload.py): parity with the single-process torch
reference at stages 1-3 and world sizes 1-3, the same numbers as without offload
(mixed precision, fp16 skipped steps), where each tensor lives, the memory report
by location, checkpoints and live resharding with offloaded state, and the
DeepSpeed keys that turn it on."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist

import worker
from coordinator.core.memory import offload_transfer_bytes, offloaded_state_bytes
from coordinator.core.planner import PCIE_BYTES_PER_S, PlanConfig, choose_stage
from tests.reference import (
    OPTIMIZERS,
    Schedule,
    max_diff,
    param_groups,
    reference_run,
    seeded_model,
)
from worker import ZeroConfig
from worker.offload import Placement

# ---------------------------------------------------------------- parity


def _train(config: ZeroConfig, optimizer: str, schedule: Schedule, model=None) -> worker.ZeroEngine:
    rank = dist.get_rank()
    model = model or seeded_model()
    engine = worker.initialize(model, OPTIMIZERS[optimizer](model), config=config)
    for step in range(schedule.steps):
        for micro in range(schedule.accum):
            idx, tgt = schedule.batch(step, micro, rank)
            loss = engine(idx, tgt, schedule.use_extra(step, micro, rank))
            engine.backward(loss)
            engine.step()
    return engine


# (optimizer, accumulation, clip, offload_optimizer, offload_params); stage 3 adds the
# parameter offload, with and without the optimizer's
CASES = [("adamw", 1, 0.0, "cpu", "none"), ("sgd", 3, 0.05, "cpu", "none")]
STAGE3_CASES = [("adamw", 3, 0.05, "cpu", "cpu"), ("sgd", 1, 0.0, "none", "cpu")]


def parity(stage: int) -> list[float]:
    world = dist.get_world_size()
    diffs = []
    for optimizer, accum, clip, off_opt, off_params in CASES + (STAGE3_CASES if stage == 3 else []):
        schedule = Schedule(steps=8, world_size=world, accum=accum, extra_on_all_ranks=stage == 3)
        config = ZeroConfig(
            stage=stage,
            gradient_accumulation_steps=accum,
            gradient_clipping=clip,
            bucket_numel=97,  # several buckets, parameters straddling bucket and rank edges
            stage3_min_unit_numel=1,
            offload_optimizer=off_opt,
            offload_params=off_params,
        )
        engine = _train(config, optimizer, schedule)
        got = engine.full_state_dict()
        want, _ = reference_run(schedule, optimizer, clip)
        diff, name = max_diff(got, want)
        case = f"{optimizer} accum={accum} clip={clip} optimizer:{off_opt} params:{off_params}"
        assert diff < 1e-5, f"{case}: {name} differs from the torch reference by {diff:.3g}"
        assert engine.global_steps == schedule.steps
        engine.close()
        diffs.append(diff)
    return diffs


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parity_with_torch_reference(pools, stage: int, world: int) -> None:
    diffs = pools(world).run(parity, stage)
    assert len({tuple(d) for d in diffs}) == 1, f"ranks disagree: {diffs}"


def same_as_without_offload(stage: int, dtype: str, compression: str = "none") -> dict[str, Any]:
    """The same training with and without offload: identical bits, identical skips.

    Offload runs the host optimizer fused where the user chose no implementation
    (worker/optim.py [Note: fused optimizer on the host]); here both runs ask
    for fused, so the arithmetic is the same and the bits must be too."""
    rank = dist.get_rank()
    runs = []
    for offload in ("none", "cpu"):
        config = ZeroConfig(
            stage=stage,
            dtype=dtype,
            gradient_clipping=0.5,
            initial_scale_power=8,
            bucket_numel=97,
            stage3_min_unit_numel=1,
            offload_optimizer=offload,
            offload_params=offload if stage == 3 else "none",
            compression=compression,
        )
        model = seeded_model()
        opt = torch.optim.AdamW(param_groups(model), lr=1e-2, betas=(0.9, 0.95), fused=True)
        engine = worker.initialize(model, opt, config=config)
        schedule = Schedule(steps=6, world_size=dist.get_world_size(), extra_on_all_ranks=True)
        stepped = []
        for step in range(schedule.steps):
            idx, tgt = schedule.batch(step, 0, rank)
            loss = engine(idx, tgt, schedule.use_extra(step, 0, rank))
            # fp16: step 2 overflows on rank 0 only; every rank must skip it
            blow = dtype == "fp16" and step == 2 and rank == 0
            engine.backward(loss * 1e8 if blow else loss)
            stepped.append(engine.step())
        runs.append(
            {
                "state": engine.full_state_dict(),
                "stepped": stepped,
                "scale": engine.loss_scale,
                "norm": engine.last_grad_norm,
            }
        )
        engine.close()
    off, on = runs
    assert off["stepped"] == on["stepped"]
    assert off["scale"] == on["scale"] and off["norm"] == on["norm"]
    for name, value in off["state"].items():
        assert torch.equal(value, on["state"][name]), f"{name} differs with offload"
    return {"stepped": on["stepped"], "scale": on["scale"]}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_and_skipped_steps_as_without_offload(pools, stage, dtype) -> None:
    results = pools(2).run(same_as_without_offload, stage, dtype)
    if dtype == "fp16":
        for r in results:
            assert r["stepped"] == [True, True, False, True, True, True]
            assert r["scale"] == 128.0  # 2**8 halved once by the overflow


@pytest.mark.timeout(180)
def test_compressed_gradients_as_without_offload(pools) -> None:
    # the offloaded reducer wraps the compressed one (worker/state.py)
    pools(2).run(same_as_without_offload, 2, "fp32", "int8")


# ---------------------------------------------------------------- where things live


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def locations(stage: int, off_opt: str, off_params: str) -> dict[str, dict[str, int]]:
    config = ZeroConfig(
        stage=stage,
        dtype="bf16",
        bucket_numel=97,
        stage3_min_unit_numel=1,
        offload_optimizer=off_opt,
        offload_params=off_params,
    )
    schedule = Schedule(steps=2, world_size=dist.get_world_size(), extra_on_all_ranks=True)
    engine = _train(config, "adamw", schedule)
    st = engine.state
    split = engine.memory_by_location()
    report = engine.memory_report()
    # the split adds up to the report, kind by kind
    for kind, value in report.items():
        if kind != "activations":
            assert split["device"][kind] + split["host"][kind] == value, kind
    master = sum(b.master.numel() * 4 for b in engine.buckets)
    if off_opt == "cpu":
        # the fp32 master partition and every optimizer state tensor on the host;
        # the device side holds neither
        assert split["device"]["master"] == split["device"]["optimizer"] == 0
        assert split["host"]["master"] == master
        assert split["host"]["optimizer"] == engine.optimizer.state_bytes() > 0
        # reused fp32 host gradient buffers, one per bucket partition
        assert split["host"]["grads"] == master
        for b in engine.buckets:
            assert b.master.device == torch.device("cpu")
            assert _storage(b.master) != _storage(b.full)
        # torch's fused CPU kernel, as the user chose no implementation
        assert engine.optimizer.inner.param_groups[0]["fused"] is True
        for piece in engine.optimizer.pieces:
            # the optimizer steps views of the host master partition
            assert any(_storage(piece.view) == _storage(b.master) for b in engine.buckets)
            for value in engine.optimizer.inner.state[piece.view].values():
                assert value.device == torch.device("cpu")
    else:
        assert split["host"]["master"] == split["host"]["optimizer"] == 0
        assert split["device"]["master"] == master
    if off_params == "cpu":
        shards = sum(b.shard.numel() * b.shard.element_size() for b in engine.buckets)
        assert split["host"]["params"] == shards > 0
        assert split["device"]["params"] == st.frozen_bytes()
        for b in engine.buckets:
            assert _storage(b.shard) not in (_storage(b.full), _storage(b.master))
            # between steps no unit is gathered: the device holds no parameter bytes
            assert b.full.untyped_storage().size() == 0
    engine.close()
    return split


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("stage", "off_opt", "off_params"),
    [(1, "cpu", "none"), (2, "cpu", "none"), (3, "cpu", "cpu"), (3, "none", "cpu")],
)
def test_offloaded_state_lives_where_the_config_says(pools, stage, off_opt, off_params) -> None:
    splits = pools(2).run(locations, stage, off_opt, off_params)
    assert splits[0]["host"]["total"] > 0


def test_placement_puts_offloaded_buffers_on_the_host_and_fetches_to_the_device() -> None:
    # a device that is not the host: "meta" stands in for a GPU here
    meta = torch.device("meta")
    off = Placement(device=meta, optimizer_on_host=True, params_on_host=True)
    assert off.new_master(8).device == torch.device("cpu")
    shard = off.new_shard(torch.ones(8), torch.bfloat16)
    assert (shard.device, shard.dtype) == (torch.device("cpu"), torch.bfloat16)
    assert off.fetch(shard).device == meta
    plain = Placement(device=meta)
    assert plain.new_master(8).device == meta
    assert not plain.master_apart(False) and off.master_apart(False)
    cfg = ZeroConfig(stage=3, offload_optimizer="cpu", offload_params="cpu")
    # page-locked memory only beside a CUDA device
    assert not Placement.from_config(cfg, torch.device("cpu")).pin_memory


def metrics_by_location() -> dict[str, float]:
    from coordinator.control.observe import figures, parse_sample
    from worker.metrics import metrics_text

    config = ZeroConfig(stage=3, bucket_numel=97, stage3_min_unit_numel=1, offload_optimizer="cpu")
    schedule = Schedule(steps=2, world_size=dist.get_world_size(), extra_on_all_ranks=True)
    engine = _train(config, "adamw", schedule)
    text = metrics_text(engine)
    host = engine.memory_by_location()["host"]
    sample = parse_sample(text, at=0.0)
    # every kind exported, zero where nothing is offloaded
    assert sample.model_state_host == {
        k: float(v) for k, v in host.items() if k not in ("total", "replica")
    } | {"replica": 0.0}
    assert sample.model_state_host["optimizer"] > 0 and sample.model_state_host["params"] == 0
    # the status page's figure: the host part of the model state
    shown = figures("w", [sample])
    assert shown.host_total == host["master"] + host["optimizer"] + host["grads"]
    engine.close()
    return dict(sample.model_state_host)


@pytest.mark.timeout(180)
def test_metrics_and_status_page_show_the_host_part(pools) -> None:
    pools(2).run(metrics_by_location)


# ---------------------------------------------------------------- checkpoints and resharding

STEPS, SAVE_AT = 8, 4


def save_and_resume(path: str) -> float:
    world = dist.get_world_size()
    # every rank uses the extra branch on the same steps (a stage-3 need)
    schedule = Schedule(steps=STEPS, world_size=world, extra_on_all_ranks=True)
    on = ZeroConfig(stage=2, bucket_numel=97, offload_optimizer="cpu")
    first = _train(on, "adamw", Schedule(steps=SAVE_AT, world_size=world, extra_on_all_ranks=True))
    first.save_checkpoint(path)
    first.close()
    diffs = []
    # into offload off at another stage, and into offload on at another stage
    for config in (
        ZeroConfig(stage=3, bucket_numel=97, stage3_min_unit_numel=1),
        ZeroConfig(stage=3, bucket_numel=97, stage3_min_unit_numel=1, offload_optimizer="cpu"),
    ):
        model = seeded_model(seed=99)  # not the saved values: the load must set them
        engine = worker.initialize(model, OPTIMIZERS["adamw"](model), config=config)
        engine.load_checkpoint(path)
        assert engine.global_steps == SAVE_AT
        where = "host" if config.offload_optimizer == "cpu" else "device"
        assert engine.memory_by_location()[where]["optimizer"] > 0
        rank = dist.get_rank()
        for step in range(SAVE_AT, STEPS):
            idx, tgt = schedule.batch(step, 0, rank)
            engine.backward(engine(idx, tgt, schedule.use_extra(step, 0, rank)))
            engine.step()
        want, _ = reference_run(schedule, "adamw")
        diff, name = max_diff(engine.full_state_dict(), want)
        assert diff < 1e-5, f"{name} differs from the uninterrupted reference by {diff:.3g}"
        engine.close()
        diffs.append(diff)
    return max(diffs)


@pytest.mark.timeout(240)
def test_checkpoint_round_trip_with_offload_on_and_off(pools, tmp_path) -> None:
    pools(2).run(save_and_resume, str(tmp_path / "ckpt"))


def resize_with_offload() -> float:
    """Ranks 0-1 train with offload; rank 2 joins; the state moves by element range."""
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])
    config = ZeroConfig(stage=2, bucket_numel=97, offload_optimizer="cpu")
    model = seeded_model()
    engine = worker.ZeroEngine(
        model,
        OPTIMIZERS["adamw"](model),
        config=config,
        group=pair if rank < 2 else None,
        initial_state="module" if rank < 2 else "peers",
    )
    schedule2 = Schedule(steps=6, world_size=2)
    if rank < 2:
        for step in range(3):
            idx, tgt = schedule2.batch(step, 0, rank)
            engine.backward(engine(idx, tgt, schedule2.use_extra(step, 0, rank)))
            engine.step()
    engine.reconfigure(None, via=None, new_members=[0, 1, 2], holds_state=rank < 2)
    assert engine.world_size == 3 and engine.global_steps == 3
    assert engine.memory_by_location()["device"]["optimizer"] == 0
    assert engine.memory_by_location()["host"]["optimizer"] > 0
    # the reference: 3 steps of the 2-rank batches, then 3 of the 3-rank ones
    ref = seeded_model()
    opt = OPTIMIZERS["adamw"](ref)
    schedule3 = Schedule(steps=6, world_size=3)
    for step in range(6):
        sched = schedule2 if step < 3 else schedule3
        for r in range(sched.world_size):
            idx, tgt = sched.batch(step, 0, r)
            (ref(idx, tgt, sched.use_extra(step, 0, r)) / sched.world_size).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for step in range(3, 6):
        idx, tgt = schedule3.batch(step, 0, rank)
        engine.backward(engine(idx, tgt, schedule3.use_extra(step, 0, rank)))
        engine.step()
    want = {n: p.detach() for n, p in ref.named_parameters(remove_duplicate=False)}
    diff, name = max_diff(engine.full_state_dict(), want)
    assert diff < 1e-5, f"{name} differs from the reference by {diff:.3g}"
    return diff


@pytest.mark.timeout(240)
def test_live_reshard_moves_offloaded_state(pools) -> None:
    pools(3).run(resize_with_offload)


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"stage": 0, "offload_optimizer": "cpu"}, "offload_optimizer"),
        ({"stage": 2, "offload_params": "cpu"}, "offload_params"),
        ({"stage": 3, "offload_params": "nvme"}, "'nvme' is not supported"),
        ({"stage": 2, "offload_optimizer": "gpu"}, "offload_optimizer"),
        ({"stage": 2, "offload_optimizer": "cpu", "pin_memory": 1}, "pin_memory"),
    ],
)
def test_bad_offload_settings_are_named(kw: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ZeroConfig(**kw)


def zero(**section: Any) -> dict:
    return {"zero_optimization": section}


@pytest.mark.parametrize(
    ("ds", "want"),
    [
        (
            zero(stage=2, offload_optimizer={"device": "cpu", "pin_memory": True}),
            {"offload_optimizer": "cpu", "offload_params": "none", "pin_memory": True},
        ),
        # DeepSpeed's pin_memory default is false
        (
            zero(stage=3, offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"}),
            {"offload_optimizer": "cpu", "offload_params": "cpu", "pin_memory": False},
        ),
        (
            zero(
                stage=3,
                offload_optimizer={"device": "cpu", "pin_memory": False, "buffer_count": 4},
                offload_param={"device": "cpu", "pin_memory": True, "max_in_cpu": 1e9},
            ),
            {"offload_optimizer": "cpu", "offload_params": "cpu", "pin_memory": True},
        ),
        (zero(stage=1, cpu_offload=True), {"offload_optimizer": "cpu"}),
        (
            zero(stage=2, offload_optimizer={"device": "none"}, offload_param=None),
            {"offload_optimizer": "none", "offload_params": "none"},
        ),
        # DeepSpeed reads offload_param at stage 3 only
        (zero(stage=2, offload_param={"device": "cpu"}), {"offload_params": "none"}),
    ],
)
def test_from_deepspeed_reads_cpu_offload(ds: dict, want: dict) -> None:
    cfg = ZeroConfig.from_deepspeed(ds)
    assert {k: getattr(cfg, k) for k in want} == want


def test_from_deepspeed_refuses_nvme_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"offload_param\.device.*nvme.*not implemented"):
        ZeroConfig.from_deepspeed(
            zero(stage=3, offload_param={"device": "nvme", "nvme_path": "/local_nvme"})
        )
    with pytest.raises(ValueError, match=r"offload_optimizer\.made_up"):
        ZeroConfig.from_deepspeed(zero(stage=2, offload_optimizer={"device": "cpu", "made_up": 1}))
    with pytest.raises(ValueError, match=r"zero_optimization\.offload_optimizer\.device"):
        ZeroConfig.from_deepspeed(zero(stage=0, offload_optimizer={"device": "cpu"}))


def test_from_deepspeed_logs_ignored_offload_tuning(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="worker.ds_config"):
        ZeroConfig.from_deepspeed(
            zero(stage=2, offload_optimizer={"device": "cpu", "ratio": 0.3, "fast_init": False})
        )
    assert "offload_optimizer.ratio" in caplog.text


# ---------------------------------------------------------------- the planner

PSI = 7_500_000_000


def test_offloaded_state_bytes_follow_the_formulas() -> None:
    n, psi = 4, PSI
    shard = psi / n
    device, host = offloaded_state_bytes(
        psi, stage=2, world_size=n, dtype="bf16", optimizer_states=2, offload="optimizer"
    )
    # device: bf16 parameters whole, bf16 gradient shard; master and Adam state on the host
    assert device.as_dict() == {
        "params": 2 * psi,
        "grads": 2 * shard,
        "master": 0,
        "optimizer": 0,
        "total": 2 * psi + 2 * shard,
    }
    assert (host.params, host.grads, host.master, host.optimizer) == (
        0,
        4 * shard,
        4 * shard,
        8 * shard,
    )
    device, host = offloaded_state_bytes(
        psi, stage=3, world_size=n, dtype="fp32", optimizer_states=1, offload="params"
    )
    # fp32 with parameters offloaded: the master is a tensor of its own on the device
    assert (device.params, device.grads, device.master, device.optimizer) == (
        0,
        4 * shard,
        4 * shard,
        4 * shard,
    )
    assert host.as_dict()["total"] == host.params == 4 * shard
    assert offload_transfer_bytes(psi, stage=3, world_size=n, offload="optimizer+params") == (
        8 * shard + 2 * 2 * shard
    )
    with pytest.raises(ValueError, match="parameter offload needs stage 3"):
        offloaded_state_bytes(psi, stage=2, world_size=n, offload="params")


def engine_bytes_against_formula() -> dict[str, float]:
    config = ZeroConfig(stage=2, dtype="bf16", bucket_numel=97, offload_optimizer="cpu")
    schedule = Schedule(steps=1, world_size=dist.get_world_size())
    engine = _train(config, "adamw", schedule)
    padded = sum(b.spec.padded_numel for b in engine.buckets)
    device, host = offloaded_state_bytes(
        padded, stage=2, world_size=engine.world_size, dtype="bf16", offload="optimizer"
    )
    split = engine.memory_by_location()
    assert split["host"]["master"] == host.master
    assert split["host"]["grads"] == host.grads
    assert split["device"]["grads"] == device.grads
    assert split["device"]["master"] == split["device"]["optimizer"] == device.master == 0
    # Adam's two fp32 states per element, plus its step count per parameter piece
    steps = 4 * len(engine.optimizer.pieces)
    assert split["host"]["optimizer"] == host.optimizer + steps
    engine.close()
    return split["host"]


@pytest.mark.timeout(180)
def test_engine_memory_by_location_matches_the_planner_formula(pools) -> None:
    pools(2).run(engine_bytes_against_formula)


def test_planner_proposes_the_offload_that_fits() -> None:
    n = 2
    shard = PSI / n
    # 16 GB less 10% headroom: no stage fits (stage 3 needs 60 GB), nor does optimizer
    # offload at stages 1-3 (stage 3 keeps 2Ψ/N parameters and 2Ψ/N gradients on the
    # device: 15 GB); optimizer and parameter offload leaves the gradient shard: 7.5 GB
    choice = choose_stage(PSI, world_size=n, device_memory_bytes=16 * 10**9)
    assert (choice.stage, choice.offload, choice.fits) == (3, "optimizer+params", True)
    e = choice.offload_estimate
    assert e is not None and e.total == 2 * shard
    assert e.host_total == (2 + 4 + 4 + 8) * shard
    assert choice.offload_seconds == pytest.approx((8 + 4) * shard / PCIE_BYTES_PER_S)
    assert "offload_params='cpu'" in choice.reason and "host memory" in choice.reason
    # at 40 GB optimizer offload at stage 1 fits (2Ψ parameters + 2Ψ gradients = 30 GB)
    choice = choose_stage(PSI, world_size=n, device_memory_bytes=40 * 10**9)
    assert (choice.stage, choice.offload) == (1, "optimizer")
    # one rank: stage 0 does not fit; offload does
    one = choose_stage(PSI, world_size=1, device_memory_bytes=40 * 10**9)
    assert (one.stage, one.offload, one.fits) == (1, "optimizer", True)
    # too little host memory for any offload: nothing fits, as before
    short = PlanConfig(host_memory_bytes=50 * 10**9)
    choice = choose_stage(PSI, world_size=n, device_memory_bytes=16 * 10**9, config=short)
    assert (choice.stage, choice.offload, choice.fits) == (3, "none", False)
    # and a stage that fits needs no offload
    fits = choose_stage(PSI, world_size=n, device_memory_bytes=80 * 10**9)
    assert (fits.stage, fits.offload) == (2, "none")


def test_cli_plan_shows_the_offload(capsys) -> None:
    from coordinator.cli import main

    argv = ["plan", "--params", "7.5e9", "--world-sizes", "2,8", "--device-memory", "16GB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "3+oop" in out and "N=2: stage 3:" in out and "offload_params='cpu'" in out
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plans"][0]
    assert plan["offload"] == "optimizer+params"
    assert plan["offload_bytes_per_rank"]["host"] == 18 * PSI / 2
    assert main([*argv, "--no-offload"]) == 0
    assert "+oo" not in capsys.readouterr().out


def test_stage_auto_names_the_offload_but_plans_without_it() -> None:
    from coordinator.control.membership import Membership
    from coordinator.core.settings import MembershipConfig
    from tests.coordinator_util import inventory, worker

    m = Membership(
        MembershipConfig(min_workers=2, max_workers=2, join_window_s=0.0),
        PlanConfig(stage=None, bucket_numel=100, align=2),
        clock=lambda: 1000.0,
        wall_clock=lambda: 1000.0,
    )
    # 384 trainable elements (bf16, Adam): stage 3 keeps 16 * 384 / 2 = 3072 bytes per
    # rank, more than 90% of 600; optimizer offload at stage 3 still keeps the bf16
    # parameter and gradient shards (768); offloading the parameters too leaves 384
    for wid in "ab":
        m.register(worker(wid, device_memory_bytes=600), inventory())
    gen = m.maybe_form()
    assert gen is not None
    # the workers do not offload unless their ZeroConfig says so: the stage stays
    # the one that comes closest without it, and the reason names the offload
    assert gen.stage == 3
    assert "no stage fits" in gen.stage_reason
    assert "offload_optimizer='cpu', offload_params='cpu'" in gen.stage_reason
