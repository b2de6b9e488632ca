"""torch.compile at every stage, the ways scripts write it: the whole model compiled
before ``worker.initialize``, blocks compiled after it (torchtitan's recipe), and
``ZeroConfig(compile=True)``;
each against eager one-process torch (worker/factory.py [Note: compiling at stage 3])."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import worker
from tests.reference import max_diff
from worker.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
STEPS, ROWS = 4, 2


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (ROWS, CFG.block_size),
                         generator=torch.Generator().manual_seed(10 * step + rank))  # fmt: skip


def compiled_against_eager_torch(stage: int, how: str) -> None:
    import torch._dynamo.utils

    world, rank = dist.get_world_size(), dist.get_rank()
    torch._dynamo.reset()  # the pool's processes are reused: compile afresh
    torch.manual_seed(0)
    model = GPT(CFG)
    torch.manual_seed(0)
    ref = GPT(CFG)
    # SGD with momentum: compiled kernels round differently from eager ones (about
    # 1e-7 here), which Adam's normalisation would blow up on near-zero gradients
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if how == "whole":
        model = torch.compile(model)
    # "config": the engine compiles it (ZeroConfig.compile, DeepSpeed's compile.deepcompile)
    config = worker.ZeroConfig(stage=stage, compile=how == "config")
    engine = worker.initialize(model, opt, config=config)
    if how == "blocks":
        for block in engine.module.blocks:
            block.compile()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    torch._dynamo.utils.counters.clear()
    for step in range(STEPS):
        idx = batch(step, rank)
        engine.backward(engine(idx, idx))
        engine.step()
        for r in range(world):
            idx = batch(step, r)
            (ref(idx, idx) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it did compile
    want = {n: p.detach() for n, p in ref.named_parameters(remove_duplicate=False)}
    diff, name = max_diff(engine.full_state_dict(), want)  # the model's own names
    assert diff < 1e-5, f"{name} differs from eager torch by {diff:.3g}"
    engine.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("stage", "how"), [(1, "whole"), (3, "whole"), (3, "blocks"), (2, "config")]
)
def test_compiled_training_equals_eager_torch(pools, stage: int, how: str) -> None:
    pools(2).run(compiled_against_eager_torch, stage, how)
