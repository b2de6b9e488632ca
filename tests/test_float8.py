"""torchao's float8 training (``Float8Linear``, emulated on the CPU) under every ZeRO
stage: a model converted with ``convert_to_float8_training`` before
``worker.initialize`` trains as the same converted model does in one process. Each
rank's micro-batch is cast with its own dynamic scales, so the reference runs the
ranks' micro-batches one by one (tests/reference.py ``train_beside_torch``); at stage 3
the engine gathers a unit's weights whole before its forward, where torchao casts
them, so the weights' scales are the whole tensors' as in one process."""

from __future__ import annotations

import pytest
import torch

import worker
from tests.reference import max_diff, train_beside_torch
from worker.models import GPT, GPTConfig

float8 = pytest.importorskip("torchao.float8", reason="torchao is not installed")

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def converted() -> torch.nn.Module:
    """The built-in GPT, seeded, its blocks' linear layers float8 (the tied head kept)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    float8.convert_to_float8_training(
        model,
        config=float8.Float8LinearConfig(emulate=True),
        module_filter_fn=lambda module, name: name.startswith("blocks."),
    )
    return model


def batch(micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * micro + rank)
    idx = torch.randint(0, CFG.vocab_size, (4, CFG.block_size), generator=g)
    return idx, torch.roll(idx, 1, 1)


def float8_against_torchao(stage: int, accum: int, clip: float) -> None:
    model, ref = converted(), converted()
    assert any(type(m).__name__ == "Float8Linear" for m in model.modules())

    def opt(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1)

    config = worker.ZeroConfig(
        stage=stage, gradient_accumulation_steps=accum, gradient_clipping=clip,
        bucket_numel=500, stage3_min_unit_numel=1,
    )  # fmt: skip
    engine = worker.initialize(model, opt(model), config=config)
    train_beside_torch(engine, ref, opt(ref), batch, steps=3, accum=accum, clip=clip)
    want = {n: p.detach() for n, p in ref.named_parameters(remove_duplicate=False)}
    diff, name = max_diff(engine.full_state_dict(), want)
    assert diff < 1e-5, f"{name} differs from one-process torchao by {diff:.3g} (stage {stage})"
    engine.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("stage", "accum", "clip"), [(0, 1, 0.0), (1, 2, 0.5), (2, 1, 0.5), (3, 2, 0.5)]
)
def test_float8_linear_layers_train_like_torchao_at_every_stage(pools, stage, accum, clip):
    pools(2).run(float8_against_torchao, stage, accum, clip)
