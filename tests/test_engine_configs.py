"""Random combinations of the engine's settings against the single-process torch
reference: seeded and replayable, so a held-out combination that breaks is one
``ZEROPLANE_CONFIG_SEEDS=...`` away.

Each seed draws a world size, a stage and every setting that changes how the
engine moves and stores state but not what it computes in fp32: bucket size,
gather units, prefetch, units kept into backward, the live-parameter cap,
overlap, host offload of the optimizer and of stage-3 parameters, activation
checkpointing, accumulation, clipping, the optimizer, and an LR scheduler.
Every combination must end within 1e-5 of torch, as the fixed matrix of
tests/test_engine_parity.py does.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
import torch
import torch.distributed as dist

import worker
from tests.reference import OPTIMIZERS, Schedule, max_diff, reference_run, seeded_model

SEEDS = [int(s) for s in os.environ.get("ZEROPLANE_CONFIG_SEEDS", "0,1,2,3,4,5,6,7").split(",")]


def draw(seed: int) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """The world size, the ZeroConfig fields and the run's other choices of ``seed``."""
    rng = random.Random(seed)
    world = rng.choice((1, 2, 2, 3, 3))
    stage = rng.choice((0, 1, 2, 3))
    config: dict[str, Any] = {
        "stage": stage,
        "bucket_numel": rng.choice((31, 97, 1000, 2**22)),
        "overlap_comm": rng.random() < 0.7,
        "gradient_accumulation_steps": rng.choice((1, 1, 2, 3)),
        "gradient_clipping": rng.choice((0.0, 0.0, 0.05, 1.0)),
        "activation_checkpointing": rng.choice(("none", "none", "units", 2)),
    }
    if stage == 3:
        config |= {
            "stage3_min_unit_numel": rng.choice((1, 60, 2**20)),
            "stage3_prefetch": rng.choice((0, 1, 3)),
            "stage3_max_reuse_distance": rng.choice((0, 0, 150, 10**9)),
            "stage3_max_live_parameters": rng.choice((0, 200, 10**9)),
            "offload_params": rng.choice(("none", "none", "cpu")),
        }
    if stage >= 1:
        config["offload_optimizer"] = rng.choice(("none", "none", "cpu"))
    run = {"optimizer": rng.choice(("adamw", "sgd")), "scheduled": rng.random() < 0.5}
    return world, config, run


def schedule_for(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)


def train_and_compare(config: dict[str, Any], run: dict[str, Any]) -> float:
    world, rank = dist.get_world_size(), dist.get_rank()
    accum = config["gradient_accumulation_steps"]
    schedule = Schedule(
        steps=8, world_size=world, accum=accum, extra_on_all_ranks=config["stage"] == 3
    )
    model = seeded_model()
    engine = worker.initialize(
        model,
        OPTIMIZERS[run["optimizer"]](model),
        config=worker.ZeroConfig(**config),
        lr_scheduler=schedule_for if run["scheduled"] else None,
    )
    for step in range(schedule.steps):
        for micro in range(accum):
            idx, tgt = schedule.batch(step, micro, rank)
            engine.backward(engine(idx, tgt, schedule.use_extra(step, micro, rank)))
            engine.step()
    got = engine.full_state_dict()
    want, _ = reference_run(
        schedule,
        run["optimizer"],
        config["gradient_clipping"],
        scheduler=schedule_for if run["scheduled"] else None,
    )
    diff, name = max_diff(got, want)
    assert diff < 1e-5, f"{name} differs from the torch reference by {diff:.3g}: {config} {run}"
    return diff


@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_configuration_trains_as_torch(pools, seed: int) -> None:
    world, config, run = draw(seed)
    diffs = pools(world).run(train_and_compare, config, run)
    assert len(set(diffs)) == 1, f"seed {seed}, {config}, {run}: ranks disagree: {diffs}"
