"""``import worker.deepspeed as deepspeed`` (worker/deepspeed/__init__.py [Note: a drop-in for
DeepSpeed scripts]): a DeepSpeed-shaped script, its arguments, ``init_distributed``,
``initialize``'s 4-tuple with param groups and a training set, and the engine members
DeepSpeed scripts call, trained against one process with torch alone."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, TensorDataset

import worker.deepspeed as deepspeed
from coordinator.launchers.local import find_free_port

CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
    "zero_optimization": {"stage": 2},
    "gradient_clipping": 1.0,
    "fp16_master_weights_and_grads": False,  # DeepSpeed's default, written out
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _groups(model: torch.nn.Module) -> list[dict]:
    """Weight decay on the weights only: the usual custom groups."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0}]


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(32, 6, generator=g), torch.randn(32, 1, generator=g))


def _reference(epochs: int) -> dict[str, torch.Tensor]:
    """torch alone: AdamW over the same groups, the sampler's order, two micro-batches
    of four a step, the mean over them, the norm clipped at 1."""
    model = _model()
    opt = torch.optim.AdamW(_groups(model), lr=1e-2, weight_decay=0.1)
    data = _data()
    sampler = DistributedSampler(data, num_replicas=1, rank=0)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        order = list(sampler)
        for start in range(0, len(order), 8):
            for micro in (order[start : start + 4], order[start + 4 : start + 8]):
                x, y = data[micro]
                (torch.nn.functional.mse_loss(model(x), y) / 2).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.timeout(120)
def test_a_deepspeed_script_trains_as_torch_with_only_its_import_changed(
    tmp_path: Path, monkeypatch
) -> None:
    # (set through monkeypatch, so that what init_distributed reads is undone after)
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for name, value in {**env, "MASTER_PORT": str(find_free_port())}.items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(CONFIG))
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    deepspeed.init_distributed()
    try:
        dist.barrier()  # a script's own call before initialize ("rank 0 downloads first")
        model = _model()
        engine, optimizer, loader, scheduler = deepspeed.initialize(
            args=args, model=model, model_parameters=_groups(model), training_data=_data()
        )
        assert scheduler is None and optimizer is engine.optimizer
        assert (engine.local_rank, engine.global_rank, engine.world_size) == (0, 0, 1)
        assert not engine.fp16_enabled() and not engine.bfloat16_enabled()
        assert engine.zero_optimization_stage() == 2
        assert engine.gradient_accumulation_steps() == 2  # a method, as DeepSpeed's
        assert engine.train_micro_batch_size_per_gpu() == 4 and engine.train_batch_size() == 8
        for epoch in range(2):
            loader.sampler.set_epoch(epoch)
            for x, y in loader:
                engine.backward(torch.nn.functional.mse_loss(engine(x), y))
                boundary = engine.is_gradient_accumulation_boundary()
                engine.step()
                if boundary:
                    assert engine.was_step_applied()
                    assert isinstance(engine.get_global_grad_norm(), float)
        assert engine.global_steps == 8
        assert deepspeed.comm.get_world_size() == 1 and deepspeed.comm.get_rank() == 0
        got = engine.full_state_dict()
    finally:
        dist.destroy_process_group()
    want = _reference(2)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst < 1e-6, worst


def test_deepspeeds_leaf_modules_call_is_zeroplanes() -> None:
    from worker.leaves import set_z3_leaf_modules

    assert deepspeed.utils.set_z3_leaf_modules is set_z3_leaf_modules


def test_initialize_names_what_is_missing() -> None:
    with pytest.raises(ValueError, match="needs model="):
        deepspeed.initialize(config=CONFIG)
    with pytest.raises(ValueError, match=r"no config \(config=, config_params= or"):
        deepspeed.initialize(model=_model())
    with pytest.raises(ValueError, match="mpu=/mesh_param="):
        deepspeed.initialize(model=_model(), config=CONFIG, mpu=object())


def test_zero_init_builds_on_meta_and_the_engine_brings_the_same_values() -> None:
    torch.manual_seed(3)
    ordinary = _model()
    with deepspeed.zero.Init(config_dict_or_path=CONFIG):
        torch.manual_seed(3)
        model = _model()
    assert all(p.is_meta for p in model.parameters())
    gather = deepspeed.zero.GatheredParameters(list(model.parameters()))
    with pytest.raises(RuntimeError, match="meta device"), gather:
        pass
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=_groups(model),
        config={**CONFIG, "zero_optimization": {"stage": 3}},
    )
    full = engine.full_state_dict()
    assert all(torch.equal(full[n], p) for n, p in ordinary.named_parameters())
    engine.close()


def test_the_accelerator_and_moe_helpers_answer_as_deepspeeds() -> None:
    from worker.deepspeed.accelerator import get_accelerator
    from worker.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    accel = get_accelerator()
    want = "cuda:1" if torch.cuda.is_available() else "cpu"
    assert accel.device_name(1) == want
    assert accel.communication_backend_name() == ("nccl" if torch.cuda.is_available() else "gloo")
    with pytest.raises(AttributeError, match="not in zeroplane's DeepSpeed drop-in"):
        accel.create_graph()
    model = _model()
    expert = model[2].weight
    expert.allreduce, expert.group_name = False, "ep_size_2"
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters", "lr": 0.1}
    )
    assert [len(g["params"]) for g in groups] == [3, 1]
    assert groups[1]["moe"] is True and groups[1]["lr"] == 0.1 and groups[1]["params"][0] is expert
    plain = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(_model().parameters())}
    )
    assert len(plain) == 1 and len(plain[0]["params"]) == 4
