"""A model built on the meta device comes to life sharded (worker/birth.py) and trains
exactly as one built with values: against the single-process torch reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import worker
from tests.reference import (
    OPTIMIZERS,
    ParityNet,
    Schedule,
    max_diff,
    reference_run,
    seeded_model,
)
from worker.models import GPT, GPTConfig


def _meta_parity_net() -> ParityNet:
    with torch.device("meta"):
        return ParityNet()


def train_meta_and_compare(stage: int) -> float:
    world, rank = dist.get_world_size(), dist.get_rank()
    schedule = Schedule(world_size=world, steps=8, extra_on_all_ranks=stage == 3)
    model = _meta_parity_net()
    assert all(p.is_meta for p in model.parameters())
    optimizer = OPTIMIZERS["adamw"](model)  # over the meta parameters, as a script builds it
    config = worker.ZeroConfig(stage=stage, bucket_numel=97, stage3_min_unit_numel=1)
    torch.manual_seed(0)  # the reference's seed: the draws happen now
    engine = worker.initialize(model, optimizer, config=config)
    assert not any(p.is_meta for p in model.parameters())
    born = engine.full_state_dict()
    for name, value in seeded_model().named_parameters(remove_duplicate=False):
        assert torch.equal(born[name], value.detach()), f"{name} came to life with other values"
    for step in range(schedule.steps):
        idx, tgt = schedule.batch(step, 0, rank)
        engine.backward(engine(idx, tgt, schedule.use_extra(step, 0, rank)))
        engine.step()
    want, _ = reference_run(schedule, "adamw")
    diff, name = max_diff(engine.full_state_dict(), want)
    assert diff < 1e-5, f"{name} differs from the torch reference by {diff:.3g}"
    return diff


@pytest.mark.parametrize("world", (1, 2, 3, 4))
@pytest.mark.parametrize("stage", (0, 1, 2, 3))
def test_a_meta_model_trains_to_the_reference(pools, stage: int, world: int) -> None:
    diffs = pools(world).run(train_meta_and_compare, stage)
    assert len(set(diffs)) == 1, f"ranks disagree: {diffs}"


def _gpt_config() -> GPTConfig:
    return GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=16)


def meta_gpt_with_init(stage: int) -> None:
    """A custom initialization (GPT._init, as ``model.apply`` runs it) through ``init=``."""
    cfg = _gpt_config()
    torch.manual_seed(3)
    ordinary = GPT(cfg)
    # what GPT.__init__ does after construction, less its per-name pass: apply(_init)
    torch.manual_seed(5)
    ordinary.apply(GPT._init)
    with torch.device("meta"):
        model = GPT(cfg)
    torch.manual_seed(5)
    engine = worker.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        config=worker.ZeroConfig(stage=stage, stage3_min_unit_numel=1),
        init=GPT._init,
    )
    born = engine.full_state_dict()
    for name, value in ordinary.named_parameters(remove_duplicate=False):
        assert torch.equal(born[name], value.detach()), f"{name} came to life with other values"
    for name, buf in ordinary.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], buf), name


@pytest.mark.parametrize("stage", (0, 3))
def test_init_fn_reproduces_apply_after_construction(pools, stage: int) -> None:
    pools(2).run(meta_gpt_with_init, stage)


class _Scale(nn.Module):
    """A module holding its own parameter and no reset_parameters."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def test_a_meta_tensor_nothing_can_initialize_is_named() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _Scale(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"'1\.gain' is on the meta device .*init=fn"):
        worker.initialize(model, opt, config=worker.ZeroConfig(stage=3))


def test_an_init_that_leaves_a_tensor_on_meta_is_an_error() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _Scale(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.reset_parameters()
        elif isinstance(module, _Scale):
            module.gain = nn.Parameter(torch.ones(4, device="meta"))  # replaced, still meta

    with pytest.raises(RuntimeError, match=r"still on the meta device.*1\.gain"):
        worker.initialize(model, opt, config=worker.ZeroConfig(stage=0), init=init)


def test_a_partly_meta_model_keeps_the_values_it_has() -> None:
    torch.manual_seed(1)
    first = nn.Linear(4, 4)
    with torch.device("meta"):
        second = nn.Linear(4, 2)
    model = nn.Sequential(first, second)
    kept = first.weight.detach().clone()
    torch.manual_seed(2)
    engine = worker.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), config=worker.ZeroConfig(stage=3)
    )
    torch.manual_seed(2)
    want = nn.Linear(4, 2)
    state = engine.full_state_dict()
    assert torch.equal(state["0.weight"], kept)
    assert torch.equal(state["1.weight"], want.weight.detach())
    assert torch.equal(state["1.bias"], want.bias.detach())


def test_mixed_precision_casts_a_meta_models_frozen_weights_after_initializing() -> None:
    torch.manual_seed(0)
    ordinary = ParityNet()
    model = _meta_parity_net()
    model.frozen.requires_grad_(False)
    torch.manual_seed(0)
    engine = worker.initialize(
        model, OPTIMIZERS["adamw"](model), config=worker.ZeroConfig(stage=2, dtype="bf16")
    )
    assert model.frozen.weight.dtype == torch.bfloat16
    want = ordinary.frozen.weight.detach().to(torch.bfloat16)
    assert torch.equal(model.frozen.weight, want)
    full = engine.full_state_dict()
    assert torch.equal(full["blocks.0.0.weight"], ordinary.blocks[0][0].weight.detach())


def test_an_explicit_device_places_an_ordinary_model() -> None:
    model = seeded_model()
    engine = worker.initialize(
        model, OPTIMIZERS["sgd"](model), config=worker.ZeroConfig(), device="cpu"
    )
    assert engine.device == torch.device("cpu")
    assert {p.device for p in model.parameters()} == {torch.device("cpu")}


def meta_parameters_model(stage: int) -> None:
    """worker.meta_parameters(): parameters never exist whole, buffers keep their values."""
    torch.manual_seed(4)
    ordinary = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    with worker.meta_parameters():
        model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())
    probe = nn.Linear(2, 2)  # outside the context: with values again
    assert not probe.weight.is_meta
    torch.manual_seed(4)
    engine = worker.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        config=worker.ZeroConfig(stage=stage, stage3_min_unit_numel=1),
    )
    born = engine.full_state_dict()
    for name, value in ordinary.named_parameters():
        assert torch.equal(born[name], value.detach()), name


@pytest.mark.parametrize("stage", (0, 3))
def test_meta_parameters_builds_without_values_and_keeps_buffers(pools, stage: int) -> None:
    pools(2).run(meta_parameters_model, stage)


def test_a_newcomer_built_on_meta_can_start_the_job_again_from_its_module() -> None:
    # a rank built for its peers' state (a newcomer) holds placeholders; when every
    # holder of the job's state is lost, it starts from the module: born as at the start
    from worker.collectives import Collectives
    from worker.engine import ZeroEngine

    model = _meta_parity_net()
    engine = ZeroEngine(
        model,
        OPTIMIZERS["adamw"](model),
        config=worker.ZeroConfig(stage=3, stage3_min_unit_numel=1),
        initial_state="peers",
    )
    assert not any(p.is_meta for p in model.parameters())
    torch.manual_seed(0)
    engine.state.build_from_kept_module(Collectives(None))
    born = engine.full_state_dict()
    for name, value in seeded_model().named_parameters(remove_duplicate=False):
        assert torch.equal(born[name], value.detach()), name
