"""The autotuner (coordinator/tuning/autotune.py, zeroplane tune).

The search is checked against deterministic synthetic cost models, where the
exhaustive grid is cheap and its best is known: the tuner must find a
configuration within 15% of the grid's best true throughput (measurements
carry up to +-5% of deterministic noise, so "best" is only known to that
much; 15% leaves room for the noise margin of each move) in at most a third
of the grid's runs. One real end-to-end run of ``zeroplane tune`` on 2 ranks
checks the pipeline: the profile, the memory model against the bytes the
engine measured, pruning, and the JSONs (no timing is asserted: a shared
2-core machine makes throughput noise larger than any difference here).
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.core.memory import model_state_bytes
from coordinator.tuning.autotune import (
    Candidate,
    Measurement,
    MemoryModel,
    ModelProfile,
    TuneSpace,
    render_trials,
    tune,
)

ROOT = Path(__file__).resolve().parents[1]

SPACE = TuneSpace(
    stages=(0, 1, 2, 3),
    micro_batches=(1, 2, 4, 8, 16, 32),
    grad_accum=(1, 2),
    activation_checkpointing=(False, True),
    bucket_numels=(2**18, 2**20, 2**22, 2**24),
    compressions=("none", "bf16", "int8"),
    keep_units=(False, True),
)


class Synthetic:
    """A cost model with the shape of the real trade-offs: per-sample and per-micro-step
    compute, a slower checkpointed forward, per-stage communication that compression
    shrinks (or not), a latency per bucket and lost overlap for big buckets."""

    def __init__(self, seed: int, noise: float = 0.05) -> None:
        rng = random.Random(seed)
        self.seed, self.noise = seed, noise
        self.world = rng.choice([2, 4])
        self.numel = rng.choice([10**6, 10**7, 5 * 10**7])
        self.fixed = rng.uniform(0.001, 0.05)
        self.per_sample = rng.uniform(0.001, 0.02)
        self.recompute = rng.uniform(1.15, 1.4)
        self.comm = rng.uniform(0.005, 0.2)
        self.stage_cost = [1, rng.uniform(1, 1.15), rng.uniform(1, 1.2), rng.uniform(1.2, 1.8)]
        self.squeeze = {"none": 1, "bf16": rng.uniform(0.5, 1.1), "int8": rng.uniform(0.3, 1.3)}
        self.latency = rng.uniform(1e-4, 3e-3)
        self.overlap = rng.uniform(0.0, 0.5)
        act = rng.uniform(1e5, 5e6)
        self.profile = ModelProfile(
            numel=self.numel,
            world_size=self.world,
            activation_bytes_per_sample=act,
            checkpointed_bytes_per_sample=act * rng.uniform(0.1, 0.3),
            device_memory_bytes=int(
                16 * self.numel * rng.uniform(0.3, 1.5) + act * rng.uniform(2, 20)
            ),
        )
        # stage 3 with its units kept into backward: one all-gather less per unit (drawn
        # last: the other draws of each seed stay what they were before it)
        self.kept_cost = rng.uniform(self.stage_cost[2], self.stage_cost[3])
        self.measured: list[Candidate] = []

    def throughput(self, c: Candidate) -> float:
        stage_cost = self.kept_cost if c.keep_units else self.stage_cost[c.stage]
        comm = self.comm * stage_cost * self.squeeze[c.compression]
        comm += self.latency * self.numel / c.bucket_numel
        comm += self.overlap * self.comm * min(1.0, c.bucket_numel / self.numel)
        compute = self.fixed + self.per_sample * c.micro_batch
        if c.activation_checkpointing:
            compute *= self.recompute
        return self.world * c.micro_batch * c.grad_accum / (c.grad_accum * compute + comm)

    def measure(self, c: Candidate) -> Measurement:
        # the memory model must have kept away everything that does not fit
        assert MemoryModel(self.profile).misfit(c) is None, c
        self.measured.append(c)
        jitter = random.Random(f"{self.seed}/{c.label()}").uniform(-self.noise, self.noise)
        return Measurement(samples_per_s=self.throughput(c) * (1 + jitter))


@pytest.mark.parametrize("seed", range(40))
def test_search_finds_the_grids_best_in_a_third_of_the_runs(seed):
    model = Synthetic(seed)
    memory = MemoryModel(model.profile)
    grid = tune(SPACE, memory, model.measure, strategy="grid")
    if grid.trials < 60:
        pytest.skip(f"only {grid.trials} configurations fit: no search to speak of")
    best_possible = max(model.throughput(r.candidate) for r in grid.records if r.samples_per_s)
    model.measured.clear()
    found = tune(SPACE, memory, model.measure)
    assert found.best is not None
    assert model.throughput(found.best) >= 0.85 * best_possible, render_trials(found)
    assert found.trials == len(model.measured) == len(set(model.measured))  # none twice
    assert found.trials <= grid.trials / 3, (found.trials, grid.trials)
    # pruned: exactly the candidates the memory model refused, each with its reason
    for r in found.records:
        if r.status == "pruned":
            assert memory.estimate(r.candidate) > memory.usable_bytes
            assert r.reason.startswith("needs ")


def test_without_noise_the_search_lands_on_or_next_to_the_optimum():
    ratios = []
    for seed in range(20):
        model = Synthetic(seed, noise=0.0)
        memory = MemoryModel(model.profile)
        grid = tune(SPACE, memory, model.measure, strategy="grid")
        if grid.best is None:
            continue
        found = tune(SPACE, memory, model.measure)
        ratios.append(found.best_samples_per_s / grid.best_samples_per_s)
    # a move needs 3% (the noise margin): what is left is at most a few percent
    assert min(ratios) >= 0.94
    assert sorted(ratios)[len(ratios) // 2] >= 0.99


def test_memory_model_is_the_planners_formula_plus_activations():
    profile = ModelProfile(
        numel=1000,
        world_size=4,
        activation_bytes_per_sample=100.0,
        checkpointed_bytes_per_sample=10.0,
        device_memory_bytes=10_000,
    )
    memory = MemoryModel(profile)
    for stage in range(4):
        states = model_state_bytes(1000, stage=stage, world_size=4, dtype="fp32").total
        assert memory.estimate(Candidate(stage=stage, micro_batch=3)) == states + 300
        ac = Candidate(stage=stage, micro_batch=3, activation_checkpointing=True)
        assert memory.estimate(ac) == states + 30
        residual = Candidate(stage=stage, micro_batch=3, compression="int8")
        assert memory.estimate(residual) == states + 300 + 4 * 1000
        # kept into backward: every unit whole (3/4 of it gathered from the others)
        kept = Candidate(stage=stage, micro_batch=3, keep_units=True)
        assert memory.estimate(kept) == states + 300 + (3000 if stage == 3 else 0)
    # 16000 bytes at stage 0 > 9000 usable; stage 3: 4000 + 300 fits
    assert "needs 16.3 KB per rank > 9 KB usable" in memory.misfit(
        Candidate(stage=0, micro_batch=3)
    )
    assert memory.misfit(Candidate(stage=3, micro_batch=3)) is None
    unknown = MemoryModel(ModelProfile(numel=10**12, world_size=1))
    assert unknown.misfit(Candidate(stage=0, micro_batch=64)) is None


def test_budget_failures_and_global_batch():
    model = Synthetic(3)
    memory = MemoryModel(model.profile)
    capped = tune(SPACE, memory, model.measure, max_trials=5)
    assert capped.trials == 5

    def flaky(c: Candidate) -> Measurement:
        if c.compression == "int8":
            raise RuntimeError("CUDA out of memory")
        return model.measure(c)

    result = tune(SPACE, memory, flaky)
    failed = [r for r in result.records if r.status == "failed"]
    assert failed and all("out of memory" in r.reason for r in failed)
    assert result.best is not None and result.best.compression != "int8"
    assert "failed: RuntimeError: CUDA out of memory" in render_trials(result)

    fixed = TuneSpace(micro_batches=(1, 2, 4, 8), grad_accum=(1, 2, 4, 8), global_batch=32)
    result = tune(fixed, MemoryModel(ModelProfile(numel=10**6, world_size=4)), model.measure)
    for r in result.records:
        c = r.candidate
        assert c.micro_batch * c.grad_accum * 4 == 32


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"stages": (4,)}, "stages"),
        ({"micro_batches": (0, 2)}, "micro_batches"),
        ({"micro_batches": (2, 2)}, "micro_batches"),
        ({"compressions": ("zip",)}, "compressions"),
        ({"activation_checkpointing": ()}, "activation_checkpointing"),
        ({"keep_units": (1,)}, "keep_units"),
        ({"global_batch": 0}, "global_batch"),
    ],
)
def test_space_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"TuneSpace\.{field}"):
        TuneSpace(**kwargs)


def test_units_are_kept_at_stage_3_only():
    assert Candidate(stage=2, micro_batch=1, keep_units=True) == Candidate(stage=2, micro_batch=1)
    kept = Candidate(stage=3, micro_batch=1, keep_units=True)
    assert kept.zero_config()["stage3_max_reuse_distance"] == 10**9
    assert "stage3_max_reuse_distance" not in Candidate(stage=3, micro_batch=1).zero_config()
    space = TuneSpace(
        stages=(2, 3),
        micro_batches=(1,),
        activation_checkpointing=(False,),
        keep_units=(False, True),
    )
    grid = space.grid(2)
    # bucket sizes x (stage 2, stage 3, stage 3 kept): no stage-2 candidate twice
    assert len(grid) == 3 * len(space.bucket_numels) == len(set(grid))
    # the search reaches the kept candidate when it is the fastest, and shows it
    result = tune(
        space,
        MemoryModel(ModelProfile(numel=1000, world_size=2)),
        lambda c: Measurement(samples_per_s=2.0 if c.keep_units else 1.0),
    )
    assert result.best is not None and result.best.keep_units
    assert "3 kept" in render_trials(result)


def test_no_combination_makes_the_global_batch():
    with pytest.raises(ValueError, match="global batch 7"):
        TuneSpace(micro_batches=(2,), global_batch=7).grid(2)


def test_deepspeed_round_trip():
    from worker.config import ZeroConfig

    configs = [
        ZeroConfig(),
        ZeroConfig(
            stage=3,
            dtype="bf16",
            compression="int8",
            bucket_numel=2**20,
            activation_checkpointing="units",
            gradient_accumulation_steps=4,
            gradient_clipping=1.0,
            stage3_prefetch=0,
        ),
        ZeroConfig(stage=2, dtype="fp16", loss_scale=128.0, hysteresis=2, stage3_prefetch=3),
        ZeroConfig(dtype="bf16", hysteresis=3, activation_checkpointing=2, replica_interval=5),
        ZeroConfig(stage=3, stage3_max_reuse_distance=10**9),
        ZeroConfig(stage=3, stage3_max_live_parameters=2**20, stage3_prefetch=1),
    ]
    for config in configs:
        ds = config.to_deepspeed(micro_batch=4, world_size=2)
        json.dumps(ds)  # plain JSON
        assert ds["train_batch_size"] == 4 * 2 * config.gradient_accumulation_steps
        assert ZeroConfig.from_deepspeed(ds) == config
    ds = configs[1].to_deepspeed()
    assert ds["zero_optimization"] == {
        "stage": 3,
        "reduce_bucket_size": 2**20,
        "stage3_prefetch_bucket_size": 0,
        "stage3_max_reuse_distance": 0,
    }
    assert ds["bf16"] == {"enabled": True} and ds["activation_checkpointing"] == {}
    assert ds["zeroplane"] == {"compression": "int8"}  # DeepSpeed has no such key
    with pytest.raises(ValueError, match="callable policy"):
        ZeroConfig(activation_checkpointing=lambda m: True).to_deepspeed()
    with pytest.raises(ValueError, match=r"zeroplane\.nonsense"):
        ZeroConfig.from_deepspeed({"zeroplane": {"nonsense": 1}})


@pytest.mark.timeout(180)
def test_zeroplane_tune_end_to_end(tmp_path):
    pytest.importorskip("torch")
    from worker.config import ZeroConfig
    from worker.models import GPT, GPTConfig

    numel = sum(
        p.numel()
        for p in GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16)).parameters()
    )
    # stage 0 (16 bytes per parameter in fp32) never fits, stage 1 on 2 ranks (12) does
    device = math.ceil(14 * numel / 0.9)
    cmd = [
        sys.executable, "-m", "coordinator.cli", "tune", "--nproc", "2", "--gpt", "1,32,2,16",
        "--stages", "0,1,2,3", "--micro-batches", "1,2,4", "--buckets", "4096",
        "--device-memory", str(device), "--max-trials", "6", "--warmup", "1", "--steps", "2",
        "--progress", "plain", "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "pruned by the memory model" in proc.stdout
    out = tmp_path / "out"
    trials = json.loads((out / "trials.json").read_text())
    records = trials["records"]
    # stages x micro-batches x checkpointing, and stage 3 again with its units kept
    assert trials["trials"] <= 6 and trials["grid_size"] == 4 * 3 * 2 + 3 * 2
    ran = [r for r in records if r["status"] == "measured"]
    pruned = [r for r in records if r["status"] == "pruned"]
    assert ran and pruned
    assert all(r["candidate"]["stage"] != 0 for r in ran)  # the memory model kept them away
    assert all(r["estimate_bytes"] > 0.9 * device for r in pruned)
    for r in ran:
        c = r["candidate"]
        # the model state the engine held is the formula's (plus bucket padding)
        states = model_state_bytes(numel, stage=c["stage"], world_size=2, dtype="fp32").total
        held = r["memory_bytes"]
        assert held >= states
        assert r["estimate_bytes"] == pytest.approx(held, rel=0.25)
    zero = json.loads((out / "zero_config.json").read_text())
    config = ZeroConfig(**zero)
    best = trials["best"]
    assert (config.stage, config.bucket_numel) == (best["stage"], 4096)
    ds = json.loads((out / "deepspeed.json").read_text())
    assert ZeroConfig.from_deepspeed(ds) == config
    assert ds["train_micro_batch_size_per_gpu"] == best["micro_batch"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["tune"], "give the model as --gpt, --script, or --model with --batch"),
        (["tune", "--model", "m:f"], "--model needs --batch"),
        (["tune", "--script", "x.py", "--model", "m:f"], "--script or --model/--batch"),
        (["tune", "--gpt", "1,8,2,8", "--stages", "5"], "TuneSpace.stages"),
        (["tune", "--gpt", "1,8,2,8", "--micro-batches", "3", "--global-batch", "4"], "4"),
    ],
)
def test_tune_cli_refuses_bad_input(argv, message, capsys):
    from coordinator.cli import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_tune_cli_refuses_an_unknown_compression():
    from coordinator.cli import main

    with pytest.raises(SystemExit):
        main(["tune", "--gpt", "1,8,2,8", "--compression", "zip"])


def test_trial_workers_load_a_scripts_functions(tmp_path):
    pytest.importorskip("torch")
    from worker import trials

    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "def build():\n    return torch.nn.Linear(3, 1)\n"
        "def batch(micro_batch, step, rank):\n    return (torch.ones(micro_batch, 3),)\n"
        "if __name__ == '__main__':\n    raise SystemExit('training must not run')\n"
    )
    spec, directory = trials._parse(
        ["--dir", str(tmp_path), "--model", f"{script}:build", "--batch", f"{script}:batch"]
    )
    assert directory == tmp_path
    assert spec.build().in_features == 3 and spec.batch(2, 0, 0)[0].shape == (2, 3)
    with pytest.raises(ValueError, match="no callable 'nope'"):
        trials._parse(["--dir", str(tmp_path), "--model", f"{script}:nope", "--batch", "x:y"])
