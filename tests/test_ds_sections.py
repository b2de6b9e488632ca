"""A DeepSpeed config's ``optimizer`` and ``scheduler`` sections (worker/ds_sections.py),
against DeepSpeed's own schedule classes and a plain torch loop."""

from __future__ import annotations

import copy
import importlib
import json
import logging
import math
from typing import Any

import pytest
import torch

import worker
from worker.ds_sections import optimizer_from_deepspeed, scheduler_from_deepspeed
from worker.schedule import LrSchedule

try:  # the `bench` extra; the parity tests below need it, the rest do not
    lr_schedules = importlib.import_module("deepspeed.runtime.lr_schedules")
except ImportError:
    lr_schedules = None
with_deepspeed = pytest.mark.skipif(lr_schedules is None, reason="deepspeed is not installed")

STEPS = 45

SCHEDULES: list[tuple[str, dict[str, Any]]] = [
    ("WarmupLR", {"warmup_num_steps": 10}),
    (
        "WarmupLR",
        {
            "warmup_min_lr": [1e-5, 2e-5],
            "warmup_max_lr": 3e-3,
            "warmup_num_steps": 7,
            "warmup_type": "linear",
        },
    ),
    (
        "WarmupDecayLR",
        {
            "total_num_steps": 30,
            "warmup_min_lr": 1e-5,
            "warmup_max_lr": 1e-3,
            "warmup_num_steps": 8,
        },
    ),
    ("WarmupDecayLR", {"total_num_steps": 40, "warmup_num_steps": 5, "warmup_type": "linear"}),
    (
        "WarmupCosineLR",
        {
            "total_num_steps": 35,
            "warmup_num_steps": 6,
            "warmup_min_ratio": 0.1,
            "cos_min_ratio": 0.01,
        },
    ),
    ("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 4, "warmup_type": "linear"}),
    (
        "LRRangeTest",
        {
            "lr_range_test_min_lr": 1e-4,
            "lr_range_test_step_size": 5,
            "lr_range_test_step_rate": 0.5,
        },
    ),
    (
        "LRRangeTest",
        {
            "lr_range_test_min_lr": [1e-4, 3e-4],
            "lr_range_test_step_size": 4,
            "lr_range_test_staircase": True,
        },
    ),
    (
        "OneCycle",
        {
            "cycle_min_lr": 1e-4,
            "cycle_max_lr": 1e-2,
            "cycle_first_step_size": 6,
            "cycle_second_step_size": 4,
            "decay_step_size": 3,
            "decay_lr_rate": 0.1,
            "decay_mom_rate": 0.05,
        },
    ),
    (
        "OneCycle",
        {
            "cycle_min_lr": [1e-4, 2e-4],
            "cycle_max_lr": 1e-2,
            "cycle_first_step_size": 8,
            "cycle_first_stair_count": 3,
            "cycle_second_stair_count": 2,
            "cycle_momentum": True,
            "cycle_min_mom": 0.85,
            "cycle_max_mom": 0.95,
        },
    ),
]


def two_groups() -> torch.optim.Optimizer:
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    return torch.optim.Adam(
        [{"params": a.parameters()}, {"params": b.parameters(), "lr": 5e-3}], lr=1e-3
    )


def rates(opt: torch.optim.Optimizer) -> list[float]:
    return [x for g in opt.param_groups for x in (g["lr"], *g["betas"])]


@with_deepspeed
@pytest.mark.parametrize(("kind", "params"), SCHEDULES)
def test_each_schedule_gives_deepspeeds_rates_at_every_step(kind: str, params: dict) -> None:
    """Rates (and OneCycle's betas) after construction and after each step equal
    those DeepSpeed's own class sets on an identical optimizer."""
    ours_opt, theirs_opt = two_groups(), two_groups()
    ours = scheduler_from_deepspeed({"type": kind, "params": params})(ours_opt)
    theirs = getattr(lr_schedules, kind)(theirs_opt, **params)
    for step in range(STEPS + 1):
        assert rates(ours_opt) == pytest.approx(rates(theirs_opt), rel=1e-12), (kind, step)
        ours.step()
        theirs.step()


@pytest.mark.parametrize(("kind", "params"), SCHEDULES[::3])
def test_a_schedule_seeks_to_any_step(kind: str, params: dict) -> None:
    """The engine's seek (a snapshot, then steps forward) lands where an
    uninterrupted schedule is, forward and back."""
    build = scheduler_from_deepspeed({"type": kind, "params": params})
    opt = two_groups()
    schedule = LrSchedule(build(opt), opt, step=0)
    reference_opt = two_groups()
    reference = build(reference_opt)
    at = []
    for _ in range(STEPS):
        at.append(rates(reference_opt))
        reference.step()
    for target in (30, 3, 17, 0, 44):
        schedule.seek(target)
        assert rates(opt) == pytest.approx(at[target], rel=1e-12), (kind, target)


def test_adam_sections_build_what_deepspeed_builds() -> None:
    params = [torch.nn.Parameter(torch.zeros(2))]
    adamw = optimizer_from_deepspeed(
        {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}}, params
    )
    assert type(adamw) is torch.optim.AdamW
    assert tuple(adamw.defaults["betas"]) == (0.9, 0.95) and adamw.defaults["weight_decay"] == 0.1
    # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false, and its
    # weight decay defaults to 0 (torch's AdamW would take 0.01)
    adam = optimizer_from_deepspeed({"type": "adam", "params": {"lr": 1e-3}}, params)
    assert type(adam) is torch.optim.AdamW and adam.defaults["weight_decay"] == 0.0
    coupled = optimizer_from_deepspeed(
        {"type": "Adam", "params": {"adam_w_mode": False, "torch_adam": True}}, params
    )
    assert type(coupled) is torch.optim.Adam
    sgd = optimizer_from_deepspeed({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, params)
    assert type(sgd) is torch.optim.SGD and sgd.defaults["momentum"] == 0.9


@pytest.mark.parametrize(
    ("section", "names"),
    [
        ({"type": "Lamb"}, "DeepSpeed's own"),
        ({"type": "Nadamm"}, "unknown optimizer type 'Nadamm'"),
        ({"type": "AdamW", "params": {"lrr": 1e-3}}, "['lrr']"),
        ({"type": "AdamW", "params": {"max_grad_norm": 1.0}}, "gradient_clipping"),
        ({"type": "Adam", "params": {"bias_correction": False}}, "bias_correction"),
        ({"type": "AdamW", "params": {"lr": -1.0}}, "Invalid learning rate"),
        ({"params": {}}, "'type'"),
        ({"type": "AdamW", "params": {"lr": "auto", "eps": "auto"}}, "['eps', 'lr'] are \"auto\""),
    ],
)
def test_a_bad_optimizer_section_names_what_is_wrong(section: dict, names: str) -> None:
    with pytest.raises(ValueError, match=None) as err:
        optimizer_from_deepspeed(section, [torch.nn.Parameter(torch.zeros(2))])
    assert names in str(err.value)


@pytest.mark.parametrize(
    ("section", "names"),
    [
        ({"type": "WarmupLRR"}, "unknown scheduler type 'WarmupLRR'"),
        ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}}, "warmup_num_steps"),
        ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}}, "warmup_type"),
        ({"type": "WarmupLR", "params": {"warmup_min_lr": [0.0, 0.0, 0.0]}}, "expected 2"),
        ({"type": "WarmupDecayLR", "params": {"warmup_steps": 3}}, "['warmup_steps']"),
        ({"type": "WarmupLR", "params": {"last_batch_iteration": 5}}, "last_batch_iteration"),
    ],
)
def test_a_bad_scheduler_section_names_what_is_wrong(section: dict, names: str) -> None:
    with pytest.raises(ValueError) as err:
        scheduler_from_deepspeed(section)(two_groups())
    assert names in str(err.value)


def ds_config(tmp_path, **sections) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 2},
        **sections,
    }


OPTIMIZER = {"type": "AdamW", "params": {"lr": 2e-2, "betas": [0.9, 0.99], "weight_decay": 0.05}}
SCHEDULER = {
    "type": "WarmupDecayLR",
    "params": {"total_num_steps": 12, "warmup_num_steps": 4, "warmup_max_lr": 2e-2},
}


def warmup_decay(step: int) -> float:
    """SCHEDULER's rate over the optimizer's at step ``step``, written out from
    DeepSpeed's documentation: log warmup from 0 over 4 steps (the rate of
    iteration -1 first), then linear to 0 at step 12."""
    it = step - 1
    if it < 0:
        return 0.0
    gamma = math.log(it + 1) / math.log(4) if it < 4 else max(0.0, (12 - it) / (12 - 4))
    return gamma * 2e-2 / OPTIMIZER["params"]["lr"]


@pytest.mark.parametrize("as_file", [False, True])
def test_initialize_trains_with_the_configs_optimizer_and_schedule(
    tmp_path, caplog, as_file
) -> None:
    """``worker.initialize(model, config=ds)`` against a plain torch loop with
    torch's AdamW and DeepSpeed's WarmupDecayLR written out as a LambdaLR."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    reference = copy.deepcopy(model)
    config: Any = ds_config(tmp_path, optimizer=OPTIMIZER, scheduler=SCHEDULER)
    if as_file:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(config))
        config = str(path)
    with caplog.at_level(logging.WARNING):
        engine = worker.initialize(model, config=config)
    opt = torch.optim.AdamW(reference.parameters(), **OPTIMIZER["params"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_decay)
    data = torch.Generator().manual_seed(1)
    for _ in range(10):
        x, y = torch.randn(4, 5, generator=data), torch.randn(4, 1, generator=data)
        assert engine.get_lr() == pytest.approx([g["lr"] for g in opt.param_groups], rel=1e-12)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    got = engine.full_state_dict()
    for name, want in reference.state_dict().items():
        assert torch.allclose(got[name], want, atol=1e-6), name
    engine.close()


def test_an_optimizer_passed_and_configured_is_refused() -> None:
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="'optimizer' section: give one of them"):
        worker.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1), config={"optimizer": OPTIMIZER}
        )
    with pytest.raises(ValueError, match="needs an optimizer"):
        worker.initialize(model, config={"zero_optimization": {"stage": 1}})
    with pytest.raises(ValueError, match="cannot read the DeepSpeed config"):
        worker.initialize(model, config="/nonexistent/ds.json")
