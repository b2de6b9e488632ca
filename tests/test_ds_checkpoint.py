"""DeepSpeed ZeRO checkpoints into zeroplane (worker/ds_checkpoint.py [Note: reading
DeepSpeed's checkpoints]): directories DeepSpeed 0.19.8 wrote at stages 2 and 3 over two
ranks (tests/data/deepspeed/checkpoints, made by tests/scripts/ds_train.py under
``torchrun``), read whole and equal to what one process with torch holds after the
same steps, optimizer state included; loaded by a zeroplane engine at another world
size and stage and trained on, equal to one uninterrupted torch run; converted ahead
of time by ``zeroplane checkpoint convert``; what cannot be read refused by name.
Where DeepSpeed is installed, fresh checkpoints of stages 1-3 are made and read too."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import worker
from coordinator.core.manifest import CheckpointError
from coordinator.launchers.local import find_free_port
from worker.ds_checkpoint import _load, is_deepspeed_checkpoint, read_deepspeed

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "data" / "deepspeed" / "checkpoints"
SCRIPT = ROOT / "tests" / "scripts" / "ds_train.py"
_spec = importlib.util.spec_from_file_location("ds_train", SCRIPT)
ds_train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ds_train)
SAVED_AT = 5  # the fixtures' step


def reference(
    phases: list[tuple[int, int]], halve_head_at: int = -1
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """One process, torch alone: ``(world, steps)`` phases of the script's global batches
    (the mean over the ranks' micro-batches), clipped at 1, AdamW over its two groups;
    the head's weight halved before step ``halve_head_at``."""
    model = ds_train.build()
    opt = torch.optim.AdamW(ds_train.groups(model), lr=ds_train.LR)
    step = 0
    micro = ds_train.MICRO
    for world, steps in phases:
        for _ in range(steps):
            if step == halve_head_at:
                with torch.no_grad():
                    model.head.weight.mul_(0.5)
            x, y = ds_train.batch(step, world)
            parts = [slice(r * micro, (r + 1) * micro) for r in range(world)]
            loss = sum(torch.nn.functional.mse_loss(model(x[p]), y[p]) for p in parts) / world
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            step += 1
    return model, opt


def worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    return max((got[k].float() - want[k].float()).abs().max().item() for k in want)


def trained(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def trained_of(engine: worker.ZeroEngine) -> dict[str, torch.Tensor]:
    full = engine.full_state_dict()
    return {n: full[n] for n, p in engine.module.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("stage", [2, 3])
def test_a_deepspeed_checkpoint_reads_as_one_process_holds_it(stage: int) -> None:
    ds = read_deepspeed(FIXTURES / f"stage{stage}")
    model, opt = reference([(2, SAVED_AT)])
    params = dict(model.named_parameters())
    trainable = {n: p.detach() for n, p in params.items() if p.requires_grad}
    assert (ds.stage, ds.global_steps) == (stage, SAVED_AT)
    assert ds.source == f"deepspeed global_step5, 2 ranks, stage {stage}"
    assert worst(ds.master, trainable) < 1e-6
    for name in trainable:
        state = opt.state[params[name]]
        for key in ("exp_avg", "exp_avg_sq"):
            assert (ds.state[name][key] - state[key].reshape(-1)).abs().max() < 1e-6, (name, key)
        assert float(ds.state[name]["step"]) == float(state["step"]) == SAVED_AT
    frozen = {n: p.detach() for n, p in params.items() if not p.requires_grad}
    assert worst(ds.frozen, frozen) == 0.0
    assert worst(ds.buffers, dict(model.named_buffers())) == 0.0
    assert [g["weight_decay"] for g in ds.param_groups] == [0.1, 0.0]


def zp_engine(stage: int) -> worker.ZeroEngine:
    model = ds_train.build()
    optimizer = torch.optim.AdamW(ds_train.groups(model), lr=ds_train.LR)
    config = worker.ZeroConfig(stage=stage, gradient_clipping=1.0)
    return worker.initialize(model, optimizer, config=config)


def zp_train(engine: worker.ZeroEngine, start: int, stop: int) -> None:
    for step in range(start, stop):
        x, y = ds_train.batch(step, 1)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()


@pytest.mark.parametrize(("saved", "stage"), [(2, 1), (3, 3)])
def test_training_goes_on_from_a_deepspeed_checkpoint(saved: int, stage: int) -> None:
    # saved by two DeepSpeed ranks, loaded by one zeroplane process at another stage
    engine = zp_engine(stage)
    assert engine.load_checkpoint(FIXTURES / f"stage{saved}") == {}
    assert engine.global_steps == SAVED_AT
    zp_train(engine, SAVED_AT, 2 * SAVED_AT)
    model, _ = reference([(2, SAVED_AT), (1, SAVED_AT)])
    assert worst(trained_of(engine), trained(model)) < 1e-5
    engine.close()


def going_on(whole, start: int, stop: int) -> dict[str, torch.Tensor]:
    """One process, torch alone, from the state ``whole`` holds (fp32 masters, AdamW's
    state, the frozen parameters as saved) on through steps ``[start, stop)``."""
    model = ds_train.build()
    opt = torch.optim.AdamW(ds_train.groups(model), lr=ds_train.LR)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in {**whole.master, **whole.frozen}.items():
            params[name].copy_(value)
    for name, held in whole.state.items():
        p = params[name]
        opt.state[p] = {k: v.reshape(p.shape).clone() if v.numel() == p.numel() else v.clone()
                        for k, v in held.items()}  # fmt: skip
    for step in range(start, stop):
        x, y = ds_train.batch(step, 1)
        torch.nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return trained(model)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_bf16_deepspeed_checkpoint_reads_its_fp32_masters_and_goes_on(stage: int) -> None:
    """DeepSpeed's bf16 runs name their optimizer states ``bf16_zero_pp_rank_*``: their
    fp32 masters, not the bf16 copies the model trained with, are read; rounded, they
    are DeepSpeed's own bf16 parameters. A zeroplane engine (fp32, one process,
    another stage) goes on from them as torch does."""
    saved = FIXTURES / f"bf16_stage{stage}"
    whole = read_deepspeed(saved)
    if stage == 1:
        copies = _load(saved / "global_step5" / "mp_rank_00_model_states.pt")["module"]
    else:  # DeepSpeed's run gathered them (ds_train.py --out)
        copies = torch.load(FIXTURES / "bf16_stage3_params.pt", weights_only=True)
    for name, master in whole.master.items():
        assert master.dtype == torch.float32
        assert torch.equal(master.to(torch.bfloat16), copies[name].to(torch.bfloat16)), name
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in whole.master.values())
    assert {float(s["step"]) for s in whole.state.values()} == {float(SAVED_AT)}
    engine = zp_engine(3 if stage == 1 else 2)
    engine.load_checkpoint(saved)
    zp_train(engine, SAVED_AT, 2 * SAVED_AT)
    assert worst(trained_of(engine), going_on(whole, SAVED_AT, 2 * SAVED_AT)) < 1e-5
    engine.close()


@pytest.mark.timeout(120)
def test_two_ranks_go_on_from_it_through_the_drop_in(tmp_path: Path) -> None:
    """The script itself under ``zeroplane run``, ``import worker.deepspeed as deepspeed``
    its only difference from DeepSpeed's run: stage 3 checkpoint, stage 3 continuation,
    and rank 0's write in ``zero.GatheredParameters(modifier_rank=0)`` kept on both
    ranks' shards (rank 1's discarded)."""
    out = tmp_path / "final.pt"
    cmd = [sys.executable, "-m", "coordinator.cli", "run", "--nproc", "2", "--stage", "3"]
    cmd += [str(SCRIPT), "--system", "zeroplane", "--stage", "3", "--steps", "10"]
    cmd += ["--load", str(FIXTURES / "stage3"), "--out", str(out), "--halve-head-at", "7"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    model, _ = reference([(2, 2 * SAVED_AT)], halve_head_at=7)
    assert worst(torch.load(out, weights_only=True), dict(model.named_parameters())) < 1e-5


def test_convert_ahead_of_time_then_load(tmp_path: Path) -> None:
    out = tmp_path / "zp"
    cli = [sys.executable, "-m", "coordinator.cli", "checkpoint"]
    run = subprocess.run(
        [*cli, "convert", str(FIXTURES / "stage2"), str(out), "--optimizer", "AdamW"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "step-00000005" in run.stdout
    assert not is_deepspeed_checkpoint(out)
    shown = subprocess.run(
        [*cli, "inspect", str(out)], capture_output=True, text=True, timeout=60
    )  # the converted checkpoint is an ordinary one
    assert shown.returncode == 0, shown.stderr
    engine = zp_engine(2)
    engine.load_checkpoint(out)
    model, _ = reference([(2, SAVED_AT)])
    assert worst(trained_of(engine), trained(model)) < 1e-6
    engine.close()


def test_a_tied_parameter_loads_under_both_names(tmp_path: Path) -> None:
    """DeepSpeed saves a tied parameter (an output layer sharing the embedding's weight)
    under each of its names in the module state dict, and maps the later name to the
    first in ``shared_params``: the later one is an alias, not a frozen parameter the
    model lacks (HF BERT's ``cls.predictions.decoder.weight`` was refused so)."""
    from worker.ds_checkpoint import _load

    ckpt = _copy(tmp_path, 2)
    states = ckpt / "global_step5" / "mp_rank_00_model_states.pt"
    saved = _load(states)
    saved["module"]["tied.weight"] = saved["module"]["head.weight"]
    saved["shared_params"] = {"tied.weight": "head.weight"}
    torch.save(saved, states)

    model = ds_train.build()
    holder = torch.nn.Module()
    holder.weight = model.head.weight  # a second name for the head's weight
    model.tied = holder
    optimizer = torch.optim.AdamW(ds_train.groups(model), lr=ds_train.LR)
    engine = worker.initialize(
        model, optimizer, config=worker.ZeroConfig(stage=2, gradient_clipping=1.0)
    )
    engine.load_checkpoint(ckpt)
    zp_train(engine, SAVED_AT, 2 * SAVED_AT)
    want, _ = reference([(2, SAVED_AT), (1, SAVED_AT)])
    assert worst(trained_of(engine), trained(want)) < 1e-5
    engine.close()


def _copy(tmp_path: Path, stage: int) -> Path:
    return Path(shutil.copytree(FIXTURES / f"stage{stage}", tmp_path / f"stage{stage}"))


def test_what_cannot_be_read_is_refused_by_name(tmp_path: Path) -> None:
    ckpt = _copy(tmp_path, 2)
    tag = ckpt / "global_step5"
    optim = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    optim.rename(tag / "zero_pp_rank_1_mp_rank_01_optim_states.pt")
    with pytest.raises(CheckpointError, match="tensor-parallel"):
        read_deepspeed(ckpt)
    (tag / "zero_pp_rank_1_mp_rank_01_optim_states.pt").rename(tag / f"bf16_{optim.name}")
    with pytest.raises(CheckpointError, match="both bf16_zero_pp_rank_"):
        read_deepspeed(ckpt)
    with pytest.raises(CheckpointError, match="without ZeRO"):
        read_deepspeed(FIXTURES / "bf16_stage0")
    (tag / f"bf16_{optim.name}").rename(optim)
    optim.write_bytes(optim.read_bytes()[:1000])  # cut short
    with pytest.raises(CheckpointError, match="cannot read it"):
        read_deepspeed(ckpt)
    optim.unlink()
    with pytest.raises(CheckpointError, match="saved by 2 ranks but holds 1"):
        read_deepspeed(ckpt)
    # a model that is not the checkpoint's: named, and nothing changes
    model = ds_train.build()
    model.head = torch.nn.Linear(16, 4)
    optimizer = torch.optim.AdamW(ds_train.groups(model), lr=ds_train.LR)
    engine = worker.initialize(model, optimizer, config=worker.ZeroConfig(stage=2))
    before = engine.full_state_dict()
    with pytest.raises(CheckpointError, match=r"head\.weight.*shape"):
        engine.load_checkpoint(FIXTURES / "stage3")
    assert worst(engine.full_state_dict(), before) == 0.0
    engine.close()


def _deepspeed_run(tmp_path: Path, stage: int) -> Path:
    save = tmp_path / f"ds{stage}"
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(find_free_port()), str(SCRIPT), "--system", "deepspeed"]
    cmd += ["--stage", str(stage), "--steps", str(SAVED_AT), "--save", str(save)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return save


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_fresh_deepspeed_checkpoint_goes_on_in_zeroplane(tmp_path: Path, stage: int) -> None:
    pytest.importorskip("deepspeed")
    saved = _deepspeed_run(tmp_path, stage)
    engine = zp_engine(3 if stage < 3 else 1)
    engine.load_checkpoint(saved)
    zp_train(engine, SAVED_AT, 2 * SAVED_AT)
    model, _ = reference([(2, SAVED_AT), (1, SAVED_AT)])
    assert worst(trained_of(engine), trained(model)) < 1e-5
    engine.close()
