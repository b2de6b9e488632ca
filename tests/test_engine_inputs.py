"""The engine in one plain process, and its errors on bad input."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import worker
from tests.reference import OPTIMIZERS, Schedule, max_diff, reference_run, seeded_model


@pytest.mark.parametrize("stage", [0, 3])
def test_single_process_without_torch_distributed(stage: int) -> None:
    assert not torch.distributed.is_initialized()
    schedule = Schedule(steps=8, extra_on_all_ranks=True)
    model = seeded_model()
    engine = worker.initialize(
        model, OPTIMIZERS["adamw"](model), config=worker.ZeroConfig(stage=stage)
    )
    for step in range(schedule.steps):
        idx, tgt = schedule.batch(step, 0, 0)
        engine.backward(engine(idx, tgt, schedule.use_extra(step, 0, 0)))
        engine.step()
    want, _ = reference_run(schedule, "adamw")
    diff, name = max_diff(engine.full_state_dict(), want)
    assert diff < 1e-6, name
    assert engine.comm_report() == {}


def test_stage_above_zero_on_one_rank_warns(caplog) -> None:
    model = seeded_model()
    with caplog.at_level(logging.WARNING, logger="worker.engine"):
        worker.initialize(model, OPTIMIZERS["sgd"](model), config=worker.ZeroConfig(stage=2))
    assert "single rank saves no memory" in caplog.text


def test_optimizer_factory() -> None:
    model = seeded_model()
    engine = worker.initialize(model, lambda groups: torch.optim.SGD(groups, lr=0.1))
    assert isinstance(engine.user_optimizer, torch.optim.SGD)


def test_optimizer_with_state_is_refused() -> None:
    model = nn.Linear(3, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="already has state"):
        worker.initialize(model, opt)


def test_trainable_parameter_missing_from_optimizer_is_named() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"'1\.weight' requires grad but is in no optimizer"):
        worker.initialize(model, opt)


def test_optimizer_over_foreign_tensor_is_refused() -> None:
    model = nn.Linear(3, 3)
    opt = torch.optim.SGD([*model.parameters(), nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(ValueError, match="not a parameter of the model"):
        worker.initialize(model, opt)


def test_non_elementwise_optimizer_is_refused() -> None:
    model = nn.Linear(3, 3)
    opt = torch.optim.LBFGS(model.parameters())
    with pytest.raises(TypeError, match="LBFGS is not known to be elementwise"):
        worker.initialize(model, opt)


def test_backward_of_a_constant_is_refused() -> None:
    model = nn.Linear(3, 3)
    engine = worker.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="requires grad"):
        engine.backward(torch.tensor(1.0))
