"""bf16 and fp16 mixed precision against the fp32 torch reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import worker
from worker.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32)
STEPS = 50


def batches(world: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sequences of a fixed random walk over the vocabulary: learnable, not trivial."""
    g = torch.Generator().manual_seed(step)
    out = []
    for _ in range(world):
        start = torch.randint(0, CFG.vocab_size, (4, 1), generator=g)
        steps = torch.randint(1, 3, (4, CFG.block_size), generator=g)
        seq = (start + steps.cumsum(1)) % CFG.vocab_size
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def reference_losses(world: int) -> list[float]:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for idx, tgt in batches(world, step):
            loss = model(idx, tgt) / world
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def bf16_curve(stage: int) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine = worker.initialize(model, opt, config=worker.ZeroConfig(stage=stage, dtype="bf16"))
    losses = []
    for step in range(STEPS):
        idx, tgt = batches(world, step)[rank]
        loss = engine(idx, tgt)
        engine.backward(loss)
        engine.step()
        t = loss.detach().float()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    master_dtypes = {str(v.dtype) for v in engine.full_state_dict().values()}
    param_dtypes = {str(b.full.dtype) for b in engine.buckets}
    return {"losses": losses, "master": master_dtypes, "params": param_dtypes}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_loss_curve_within_2_percent_of_fp32(pools, stage: int) -> None:
    got = pools(2).run(bf16_curve, stage)[0]
    want = reference_losses(2)
    assert got["master"] == {"torch.float32"}
    assert got["params"] == {"torch.bfloat16"}
    assert want[-1] < 0.8 * want[0], "the reference did not learn; the comparison is vacuous"
    worst = max(abs(a - b) / b for a, b in zip(got["losses"], want, strict=True))
    assert worst < 0.02, f"bf16 loss strays {worst:.2%} from fp32"


def fp16_overflow(stage: int) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    config = worker.ZeroConfig(stage=stage, dtype="fp16", initial_scale_power=8)
    engine = worker.initialize(model, opt, config=config)
    idx, tgt = batches(2, 0)[rank]

    engine.backward(engine(idx, tgt))
    assert engine.step() is True
    before = engine.full_state_dict()
    scale = engine.loss_scale

    # a loss that overflows fp16 gradients on one rank only: every rank must skip
    loss = engine(idx, tgt)
    engine.backward(loss * (1e6 if rank == 0 else 1.0))
    stepped = engine.step()
    after = engine.full_state_dict()
    unchanged = all(torch.equal(before[k], after[k]) for k in before)

    engine.backward(engine(idx, tgt))
    recovered = engine.step()
    return {
        "stepped": stepped,
        "unchanged": unchanged,
        "scale": (scale, engine.loss_scale),
        "skipped": engine.skipped_steps,
        "recovered": recovered,
    }


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_overflow_skips_step_and_halves_scale(pools, stage: int) -> None:
    for case in pools(2).run(fp16_overflow, stage):
        assert case["stepped"] is False
        assert case["unchanged"], "an overflowing step changed parameters"
        assert case["scale"] == (256.0, 128.0)
        assert case["skipped"] == 1
        assert case["recovered"] is True


def bf16_buffers() -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    llama = LlamaForCausalLM(cfg)
    want = {n: b.clone() for n, b in llama.named_buffers()}
    engine = worker.initialize(
        llama,
        torch.optim.AdamW(llama.parameters(), lr=1e-3),
        config=worker.ZeroConfig(stage=3, dtype="bf16"),
    )
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    kept = {
        n: b.dtype == want[n].dtype and torch.equal(b, want[n]) for n, b in llama.named_buffers()
    }

    bn_model = torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1)
    )
    bn = worker.initialize(
        bn_model,
        torch.optim.SGD(bn_model.parameters(), lr=0.1),
        config=worker.ZeroConfig(stage=2, dtype="bf16"),
    )
    loss = bn(torch.randn(4, 8)).float().pow(2).mean()
    bn.backward(loss)
    bn.step()
    return {"kept": kept, "bn_loss": loss.item()}


def test_bf16_keeps_buffers_in_the_models_dtype(pools) -> None:
    """FSDP2's rule: only parameters are cast for compute; a Llama's fp32 rotary
    ``inv_freq`` stays exactly what the model computed (batch norm's running
    statistics, which torch needs in the weight's dtype, are the exception)."""
    for case in pools(2).run(bf16_buffers):
        assert case["kept"] and all(case["kept"].values()), case["kept"]
        assert case["bn_loss"] == case["bn_loss"]  # finite, trained


def grad_scaler_scales(pattern: list[bool], *, init: float, interval: int) -> list[float]:
    """torch.amp.GradScaler's scale after each step of ``pattern`` (True: an overflow)."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=init, growth_interval=interval)
    scales = []
    for overflow in pattern:
        scaler.scale(p.sum()).backward()
        if overflow:
            p.grad.fill_(float("inf"))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales


def loss_scaler_scales(pattern: list[bool], **kw) -> list[float]:
    from worker.precision import LossScaler

    scaler = LossScaler(dynamic=True, **kw)
    scales = []
    for overflow in pattern:
        scaler.update(overflow)
        scales.append(scaler.scale)
    return scales


def test_loss_scaler_is_grad_scaler_where_deepspeed_agrees_and_differs_where_it_does_not() -> None:
    """Why zeroplane keeps its own LossScaler beside torch.amp.GradScaler: the
    overflow decision is one across ranks on sharded gradients (worker/engine.py),
    and DeepSpeed's fp16 settings (hysteresis, min_loss_scale) have no GradScaler
    counterpart. With those off the two follow the same scale, step for step."""
    rng = torch.Generator().manual_seed(0)
    pattern = [bool(x) for x in (torch.rand(200, generator=rng) < 0.08)]
    pattern[10:13] = [True, True, True]  # consecutive overflows
    same = dict(scale=2.0**16, window=7, hysteresis=1, min_scale=1.0)
    assert loss_scaler_scales(pattern, **same) == grad_scaler_scales(
        pattern, init=2.0**16, interval=7
    )
    # hysteresis 2 (DeepSpeed's default): a lone overflow skips the step without halving
    lone = [False] * 3 + [True] + [False] * 3
    assert grad_scaler_scales(lone, init=1024.0, interval=1000)[3] == 512.0
    assert loss_scaler_scales(lone, **{**same, "scale": 1024.0, "hysteresis": 2})[3] == 1024.0
    # min_loss_scale: the scale never goes below it (GradScaler's keeps halving)
    many = [True] * 12
    assert grad_scaler_scales(many, init=1024.0, interval=1000)[-1] < 1.0
    assert loss_scaler_scales(many, **{**same, "scale": 1024.0, "min_scale": 1.0})[-1] == 1.0
