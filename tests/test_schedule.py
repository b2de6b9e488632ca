"""An LR scheduler handed to the engine follows the engine's step through joins,
hand-overs and checkpoint loads (worker/schedule.py), against an uninterrupted
single-process torch run with the same scheduler."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch.optim import lr_scheduler as sched

import worker
from tests.reference import OPTIMIZERS, max_diff, seeded_model
from tests.test_checkpoint import global_batch, use_extra
from tests.test_elastic_engine import train
from worker.schedule import SNAPSHOT_EVERY, LrSchedule

STEPS = 9


def warmup_then_cosine(opt: torch.optim.Optimizer) -> sched.LRScheduler:
    return sched.SequentialLR(
        opt,
        [sched.LinearLR(opt, 0.1, 1.0, total_iters=3), sched.CosineAnnealingLR(opt, T_max=5)],
        milestones=[3],
    )


SCHEDULERS = {
    # recursive (each value from the last one written), closed form, chained, and
    # one that writes the momentum too
    "step": functools.partial(sched.StepLR, step_size=2, gamma=0.5),
    "lambda": functools.partial(sched.LambdaLR, lr_lambda=lambda s: 1.0 / (1 + s)),
    "warmup_cosine": warmup_then_cosine,
    "one_cycle": functools.partial(sched.OneCycleLR, max_lr=0.05, total_steps=3 * SNAPSHOT_EVERY),
}


def hyperparams(opt: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
def test_seek_puts_the_scheduler_where_stepping_it_would(kind: str) -> None:
    """Forward from the start, back within the snapshots and before them, forward
    again: at every step the hyperparameters of an uninterrupted run."""
    make = SCHEDULERS[kind]
    opt = OPTIMIZERS["sgd"](seeded_model())
    reference, scheduler = make(opt), None
    want = [hyperparams(opt)]
    for _ in range(2 * SNAPSHOT_EVERY + 5):
        opt.step()
        reference.step()
        want.append(hyperparams(opt))
    opt = OPTIMIZERS["sgd"](seeded_model())
    scheduler = make(opt)
    schedule = LrSchedule(scheduler, opt, step=0)
    for target in (7, 2 * SNAPSHOT_EVERY + 3, SNAPSHOT_EVERY + 1, 3, 0, 2 * SNAPSHOT_EVERY + 5):
        schedule.seek(target)
        assert hyperparams(opt) == want[target], (kind, target)
    # a saved state is a snapshot: loaded elsewhere it seeks from there
    saved = schedule.state_dict()
    other_opt = OPTIMIZERS["sgd"](seeded_model())
    other = LrSchedule(make(other_opt), other_opt, step=0)
    other.validate_state_dict(saved)
    other.load_state_dict(saved)
    assert hyperparams(other_opt) == want[2 * SNAPSHOT_EVERY + 5]


def reference(steps: int) -> dict[str, torch.Tensor]:
    model = seeded_model()
    opt = OPTIMIZERS["adamw"](model)
    scheduler = warmup_then_cosine(opt)
    for step in range(steps):
        idx, tgt = global_batch(step)
        model(idx, tgt, use_extra(step)).backward()
        opt.step()
        scheduler.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def make(stage: int, joining: bool = False, group=None) -> worker.ZeroEngine:
    model = seeded_model()
    return worker.ZeroEngine(
        model,
        OPTIMIZERS["adamw"](model),
        config=worker.ZeroConfig(stage=stage, bucket_numel=97),
        group=group,
        initial_state="peers" if joining else "module",
        lr_scheduler=warmup_then_cosine,
    )


def join_leave_and_reload(stage: int, path: str) -> float | None:
    """Ranks 0-1 train and save at step 2; rank 2 joins at step 3 with a fresh
    scheduler; it leaves at step 6; the survivors load step 2's checkpoint (their
    schedulers are at 6) and train to the end."""
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])
    if rank < 2:
        engine = make(stage, group=pair)
        train(engine, range(0, 2))
        engine.save_checkpoint(path)
        train(engine, range(2, 3))
    else:
        engine = make(stage, joining=True)
    engine.reconfigure(None, via=None, new_members=[0, 1, 2], holds_state=rank < 2)
    train(engine, range(3, 6))
    lrs = torch.tensor(engine.get_lr())
    gathered = [torch.empty_like(lrs) for _ in range(3)]
    dist.all_gather(gathered, lrs)
    assert all(torch.equal(g, lrs) for g in gathered), "the ranks step with different rates"
    engine.reconfigure(pair if rank < 2 else None, via=None, new_members=[0, 1])
    if rank == 2:
        return None
    engine.load_checkpoint(path)
    train(engine, range(2, STEPS))
    diff, name = max_diff(engine.full_state_dict(), reference(STEPS))
    assert diff < 1e-5, f"{name} differs from the uninterrupted reference by {diff:.3g}"
    return diff


@pytest.mark.parametrize("stage", [1, 3])
def test_the_schedule_follows_joins_leaves_and_checkpoint_loads(pools, tmp_path, stage) -> None:
    path = str(tmp_path / "ckpt")
    results = pools(3).run(join_leave_and_reload, stage, path)
    assert results[2] is None and results[0] == results[1]


def test_a_scheduler_the_engine_cannot_keep_is_refused() -> None:
    model = seeded_model()
    opt = OPTIMIZERS["sgd"](model)
    config = worker.ZeroConfig(stage=0)
    with pytest.raises(TypeError, match="ReduceLROnPlateau"):
        worker.ZeroEngine(model, opt, config=config, lr_scheduler=sched.ReduceLROnPlateau(opt))
    other = OPTIMIZERS["sgd"](seeded_model())
    with pytest.raises(ValueError, match="another optimizer"):
        worker.ZeroEngine(model, opt, config=config, lr_scheduler=sched.StepLR(other, 2))
    with pytest.raises(TypeError, match="torch LR scheduler"):
        worker.ZeroEngine(model, opt, config=config, lr_scheduler=42)
