"""The Hugging Face ``Trainer`` on zeroplane (worker/hf_trainer.py): two ranks under
``zeroplane run`` at stages 3 and 1 against one-process torch on the same global
batches, ``save_model`` output loaded strictly by ``from_pretrained``, a DeepSpeed
config with "auto" values, a model loaded by range from a directory, bad inputs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from worker.config import ZeroConfig  # noqa: E402
from worker.data import GlobalBatchSampler  # noqa: E402
from worker.hf_trainer import ZeroplaneTrainer, resolve_zeroplane_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_hf_trainer.py"
STEPS = 5
# the example's TrainingArguments: 2 per device x 2 ranks x 2 accumulated
GLOBAL_BATCH = 8

# Hugging Face's DeepSpeed template, "auto" wherever TrainingArguments or the model decide
AUTO_CONFIG = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "zero_optimization": {
        "stage": 1,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
}


def load_example():
    spec = importlib.util.spec_from_file_location("train_hf_trainer", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ex = load_example()


def reference(
    model: torch.nn.Module, steps: int, global_batch: int, *, decay_all: bool
) -> dict[str, torch.Tensor]:
    """One process, plain torch: what the example's TrainingArguments ask for, each
    step on the whole global batch. ``decay_all``: a DeepSpeed ``optimizer`` section
    decays every parameter; the Trainer's own optimizer spares the norms."""
    data = ex.dataset()
    sampler = GlobalBatchSampler(len(data), global_batch, seed=0)
    params = dict(model.named_parameters())
    decay = [p for n, p in params.items() if decay_all or "norm" not in n]
    rest = [p for n, p in params.items() if not decay_all and "norm" in n]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
        lr=3e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
    )
    sched = transformers.get_linear_schedule_with_warmup(opt, 2, steps)
    model.train()
    for step in range(steps):
        ids = torch.stack([data[i]["input_ids"] for i in sampler.batch_at(step)])
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def load_strictly(path: Path) -> dict[str, torch.Tensor]:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, output_loading_info=True, local_files_only=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return {n: p.detach() for n, p in model.named_parameters()}


def worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    return max((got[n] - want[n]).abs().max().item() for n in want)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", ["3", "1-auto-json"])
def test_two_ranks_match_one_process_torch(tmp_path: Path, stage: str) -> None:
    save, out = tmp_path / "saved", tmp_path / "final.pt"
    script = [str(EXAMPLE), "--steps", str(STEPS), "--output-dir", str(tmp_path / "run")]
    script += ["--save-dir", str(save), "--out", str(out)]
    run = ["run", "--nproc", "2"]
    if stage == "3":
        run += ["--stage", "3"]
    else:
        config = tmp_path / "ds_config.json"
        config.write_text(json.dumps(AUTO_CONFIG))
        script += ["--config", str(config)]
    cmd = [sys.executable, "-m", "coordinator.cli", *run, *script]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "world size 2" in log
    assert f"stage {stage[0]} over 2 ranks" in log  # the trainer's engine, as configured

    want = reference(ex.build(), STEPS, GLOBAL_BATCH, decay_all=stage != "3")
    got = torch.load(out, weights_only=True)
    assert worst(got, want) < 1e-5
    # save_model: consolidated safetensors that from_pretrained loads strictly
    assert (save / "model.safetensors").is_file() and (save / "config.json").is_file()
    assert worst(load_strictly(save), want) < 1e-5


@pytest.mark.timeout(120)
def test_torchrun_style_environment(tmp_path: Path) -> None:
    """Two processes with torchrun's environment and no coordinator, at stage 2."""
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "final.pt"
    script = [str(EXAMPLE), "--steps", str(STEPS), "--stage", "2", "--out", str(out)]
    script += ["--output-dir", str(tmp_path / "run")]
    base = {k: v for k, v in os.environ.items() if not k.startswith("ZEROPLANE_")}
    base.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port), OMP_NUM_THREADS="1")  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, *script],
            cwd=ROOT,
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    try:
        logs = [p.communicate(timeout=100)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    assert "stage 2 over 2 ranks" in logs[0]
    want = reference(ex.build(), STEPS, GLOBAL_BATCH, decay_all=False)
    assert worst(torch.load(out, weights_only=True), want) < 1e-5


@pytest.mark.timeout(120)
def test_pretrained_directory_loads_by_range_and_saves(tmp_path: Path) -> None:
    """One process: ``model=<directory>`` builds on meta and reads weights by range;
    the trained model saved and loaded back equals torch from the same weights."""
    pre = tmp_path / "pretrained"
    ex.build(seed=3).save_pretrained(pre)
    trainer = ZeroplaneTrainer(
        model=str(pre),
        args=ex.training_arguments(tmp_path / "run", 2),
        train_dataset=ex.dataset(),
        zeroplane_config=ZeroConfig(stage=3, stage3_min_unit_numel=0),
    )
    try:
        result = trainer.train()
        assert result.global_step == 2
        trainer.save_model(str(tmp_path / "saved"))
        evaluated = trainer.evaluate(eval_dataset=ex.dataset(limit=8))  # one batch of 8
    finally:
        trainer.engine.close()
    start = transformers.AutoModelForCausalLM.from_pretrained(pre, local_files_only=True)
    want = reference(start, 2, 4, decay_all=False)  # one rank: 2 x 1 x 2 samples a step
    assert worst(load_strictly(tmp_path / "saved"), want) < 1e-5
    assert (tmp_path / "saved" / "training_args.bin").is_file()
    ids = torch.stack([d["input_ids"] for d in ex.dataset(limit=8)])
    with torch.no_grad():
        start.eval()
        assert evaluated["eval_loss"] == pytest.approx(start(input_ids=ids, labels=ids).loss.item())


@pytest.mark.timeout(120)
def test_checkpoint_resume_continues_the_same_run(tmp_path: Path) -> None:
    """One process: checkpoint-N/ every 2 steps; resuming from checkpoint-2 ends where
    the uninterrupted run ended, from a model built with other values."""
    args = ex.training_arguments(tmp_path / "run", 4)
    args.save_strategy, args.save_steps = "steps", 2

    def trainer(seed: int) -> ZeroplaneTrainer:
        return ZeroplaneTrainer(
            model=ex.build(seed),
            args=args,
            train_dataset=ex.dataset(),
            zeroplane_config=ZeroConfig(stage=2),
        )

    whole = trainer(0)
    whole.train()
    want = whole.engine.full_state_dict()
    whole.engine.close()
    first = tmp_path / "run" / "checkpoint-2"
    assert (first / "zeroplane").is_dir() and (first / "trainer_state.json").is_file()
    load_strictly(first)  # the model as save_model writes it
    resumed = trainer(seed=9)  # other initial values: the checkpoint's must replace them
    result = resumed.train(resume_from_checkpoint=str(first))
    try:
        assert result.global_step == 4
        assert worst(resumed.engine.full_state_dict(), want) == 0
    finally:
        resumed.engine.close()


def test_auto_values_resolve_from_training_arguments(tmp_path: Path) -> None:
    args = ex.training_arguments(tmp_path, 10)
    zero, opt, sched = resolve_zeroplane_config(AUTO_CONFIG, args, model=ex.build(), max_steps=10)
    assert zero.stage == 1
    assert zero.gradient_accumulation_steps == 2
    assert zero.gradient_clipping == 0.5
    assert zero.dtype == "fp32"
    assert zero.bucket_numel == 16 * 16  # reduce_bucket_size "auto": hidden_size ** 2
    assert opt["params"] == {"lr": 3e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    assert sched is None
    keys = ["warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps"]
    warmup = {"type": "WarmupDecayLR", "params": dict.fromkeys(keys, "auto")}
    _, _, sched = resolve_zeroplane_config({"scheduler": warmup}, args, max_steps=10)
    assert sched["params"] == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 3e-3,
        "warmup_num_steps": 2,
        "total_num_steps": 10,
    }
    # no config: TrainingArguments alone; a ZeroConfig takes their accumulation and clipping
    zero, _, _ = resolve_zeroplane_config(None, args)
    assert (zero.gradient_accumulation_steps, zero.gradient_clipping) == (2, 0.5)
    zero, _, _ = resolve_zeroplane_config(ZeroConfig(stage=2), args)
    assert (zero.stage, zero.gradient_accumulation_steps, zero.gradient_clipping) == (2, 2, 0.5)


@pytest.mark.parametrize(
    ("config", "error", "match"),
    [
        ({"gradient_accumulation_steps": 4}, ValueError, "gradient_accumulation_steps.*4.*2"),
        ({"gradient_clipping": 1.0}, ValueError, "max_grad_norm"),
        ({"train_micro_batch_size_per_gpu": 8}, ValueError, "per_device_train_batch_size"),
        ({"bf16": {"enabled": True}}, ValueError, "bf16"),
        ({"optimizer": {"type": "AdamW", "params": {"foo": "auto"}}}, ValueError, "foo"),
        ({"zero_optimization": {"stage": 1, "nvme": 1}}, ValueError, "nvme"),
        (ZeroConfig(gradient_clipping=2.0), ValueError, "max_grad_norm"),
        (42, TypeError, "zeroplane_config"),
        ("/nonexistent/ds_config.json", ValueError, "cannot read"),
    ],
    ids=lambda v: None if not isinstance(v, str) else v[:20],
)
def test_bad_configs_say_what_is_wrong(tmp_path: Path, config, error, match) -> None:
    with pytest.raises(error, match=match):
        resolve_zeroplane_config(config, ex.training_arguments(tmp_path, 10), model=ex.build())


def test_bad_trainer_inputs_say_what_is_wrong(tmp_path: Path) -> None:
    args = ex.training_arguments(tmp_path, 2)
    with pytest.raises(TypeError, match="zeroplane_config"):
        ZeroplaneTrainer(model=ex.build(), args=args, zeroplane_config=3.5)
    with pytest.raises(ValueError, match="model_class"):
        ZeroplaneTrainer(model=ex.build(), args=args, model_class=object)
    trainer = ZeroplaneTrainer(model=ex.build(), args=args, train_dataset=ex.dataset(limit=3))
    with pytest.raises(ValueError, match="fewer than one global batch of 4"):
        trainer.train()
    assert trainer.engine is None
    opt = torch.optim.SGD(ex.build().parameters(), lr=0.1)
    trainer = ZeroplaneTrainer(
        model=ex.build(),
        args=args,
        train_dataset=ex.dataset(),
        optimizers=(opt, None),
        zeroplane_config={"optimizer": AUTO_CONFIG["optimizer"]},
    )
    with pytest.raises(ValueError, match="give one of them"):
        trainer.train()


@pytest.mark.timeout(180)
def test_lora_saves_as_peft_does_and_merged(tmp_path: Path) -> None:
    """LoRA (PEFT) on the tiny Llama at stage 3 over two ranks: ``save_model`` writes
    the adapters as PEFT does (``PeftModel.from_pretrained`` loads them onto a fresh
    base model equal to one-process PEFT training), the merged model loads strictly
    and equals PEFT's own ``merge_and_unload``, and neither directory passes for the
    other's kind: loading one where the other belongs is an error, not random weights."""
    peft = pytest.importorskip("peft")
    save, merged, out = tmp_path / "adapters", tmp_path / "merged", tmp_path / "final.pt"
    script = [str(EXAMPLE), "--lora", "--steps", str(STEPS), "--out", str(out)]
    script += ["--output-dir", str(tmp_path / "run"), "--save-dir", str(save)]
    script += ["--merged-dir", str(merged)]
    cmd = [sys.executable, "-m", "coordinator.cli", "run", "--nproc", "2", "--stage", "3"]
    proc = subprocess.run([*cmd, *script], cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]

    trained = ex.build_lora()
    want = reference(trained, STEPS, GLOBAL_BATCH, decay_all=False)
    assert worst(torch.load(out, weights_only=True), want) < 1e-5
    # the adapters, as PEFT writes them: its config, its names, no base weights
    assert sorted(p.name for p in save.iterdir() if p.suffix != ".md") == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "training_args.bin",
    ]
    loaded = peft.PeftModel.from_pretrained(ex.build(), save)
    got = {n: p.detach() for n, p in loaded.named_parameters()}
    assert worst(got, want) < 1e-5
    # the merged model: what merge_and_unload would save, loaded strictly
    assert worst(load_strictly(merged), dict(trained.merge_and_unload().named_parameters())) < 1e-5
    # an adapter directory where a model belongs: an error naming it, not random weights
    from worker.hf import from_pretrained
    from worker.pretrained import WeightsError

    with pytest.raises(WeightsError, match="PEFT adapters"):
        from_pretrained(save)
