"""Quantized parameter all-gathers (ZeRO++'s qwZ) at stages 1-2: the fp32 master stays
exact given the gradients, the compute copies are within the codec's bound, the wire
bytes shrink, and bad configs are refused (worker/compression.py [Note: quantized
parameter gathers])."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

import worker
from tests.reference import walk_batch
from worker.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32)
BLOCK = 64
# small buckets: several per model, so the step publishes in chunks
BUCKET = 8192


def _batch(g: torch.Generator, world: int, rank: int) -> torch.Tensor:
    walk = walk_batch(g, world * 4, CFG.vocab_size, CFG.block_size)
    return walk[rank * 4 : (rank + 1) * 4]


def _engine(stage: int, gather: str, **kw) -> worker.ZeroEngine:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    config = worker.ZeroConfig(
        stage=stage,
        stage3_gather_compression=gather,
        compression_block=BLOCK,
        bucket_numel=BUCKET,
        **kw,
    )
    return worker.initialize(model, opt, config=config)


def master_given_gradients_case(stage: int, steps: int) -> dict:
    """The engine with int8 qwZ beside a one-process AdamW fed the same gradients:
    each rank's gradient is computed on a plain model holding that rank's compute
    parameters (rounded where another rank owns them), averaged over the ranks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    engine = _engine(stage, "int8")
    torch.manual_seed(0)
    master = GPT(CFG)  # the reference fp32 master, whole
    plain = GPT(CFG)  # the reference's compute copy, this rank's
    ref_opt = torch.optim.AdamW(master.parameters(), lr=2e-3)
    compute = dict(engine.module.named_parameters())
    g = torch.Generator().manual_seed(1234)
    worst = 0.0
    for _ in range(steps):
        seq = _batch(g, world, rank)
        with torch.no_grad():
            for name, p in plain.named_parameters():
                p.copy_(compute[name])
        plain.zero_grad()
        plain(seq[:, :-1], seq[:, 1:]).backward()
        loss = engine(seq[:, :-1], seq[:, 1:])
        engine.backward(loss)
        engine.step()
        for p, q in zip(master.parameters(), plain.parameters(), strict=True):
            grad = q.grad.clone()
            dist.all_reduce(grad)
            p.grad = grad / world
        ref_opt.step()
        got = engine.full_state_dict()
        for name, p in master.named_parameters():
            worst = max(worst, (got[name] - p.detach()).abs().max().item())
    return {"worst": worst, "differs": _rounded_elsewhere(engine)}


def _rounded_elsewhere(engine: worker.ZeroEngine) -> bool:
    """Whether some compute parameter differs from its master (the gathers did round)."""
    st = engine.state
    return any(not torch.equal(b.full, st.gather_master(b).to(b.full.dtype)) for b in st.buckets)


@pytest.mark.parametrize("stage", [1, 2])
def test_master_is_exact_given_the_gradients(pools, stage: int) -> None:
    case = pools(2).run(master_given_gradients_case, stage, 5, timeout=300)
    for rank in case:
        # AdamW on the same averaged gradients: only float reassociation apart
        assert rank["worst"] < 1e-6, rank["worst"]
        assert rank["differs"], "the compute parameters were never rounded"


def compute_copy_bound_case(stage: int, dtype: str, offload: str) -> dict:
    """After a few steps: this rank's own slice of every bucket is its master (cast
    to the compute dtype) exactly; other ranks' slices are within int8's bound."""
    world, rank = dist.get_world_size(), dist.get_rank()
    engine = _engine(stage, "int8", dtype=dtype, offload_optimizer=offload)
    g = torch.Generator().manual_seed(7)
    for _ in range(3):
        seq = _batch(g, world, rank)
        engine.backward(engine(seq[:, :-1], seq[:, 1:]))
        engine.step()
    own_exact, within, checked = True, True, 0
    for b in engine.state.buckets:
        master = engine.state.gather_master(b).float().cpu()
        full = b.full.detach().float().cpu()
        shard = b.spec.shard_numel
        for r in range(world):
            x, y = master[r * shard : (r + 1) * shard], full[r * shard : (r + 1) * shard]
            if r == rank:
                own = x.to(b.full.dtype).float()
                own_exact &= torch.equal(y, own)
                continue
            blocks = torch.nn.functional.pad(x, (0, -shard % BLOCK)).view(-1, BLOCK)
            bound = blocks.abs().amax(dim=1).repeat_interleave(BLOCK)[:shard] / 127 / 2
            bound = bound * (1 + 1e-5) + 1e-12
            if dtype != "fp32":
                # the shard sent is the master rounded to bf16, and what is decoded
                # is rounded to bf16 again: half an ulp (at most 2**-8 relative) each
                bound = bound + (x.abs() + y.abs()) * 2**-8
            within &= bool(((y - x).abs() <= bound).all())
            checked += shard
    return {"own_exact": own_exact, "within": within, "checked": checked}


@pytest.mark.parametrize(
    ("stage", "dtype", "offload"),
    [(1, "fp32", "none"), (2, "fp32", "none"), (2, "bf16", "none"), (2, "fp32", "cpu")],
)
def test_compute_copy_is_master_within_the_codec_bound(
    pools, stage: int, dtype: str, offload: str
) -> None:
    for rank in pools(2).run(compute_copy_bound_case, stage, dtype, offload, timeout=300):
        assert rank["own_exact"], "a rank's own slice is not its master value"
        assert rank["within"], "a gathered slice is outside int8's bound"
        assert rank["checked"] > 0


def loss_and_bytes_case(stage: int, gather: str, steps: int) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    engine = _engine(stage, gather)
    g = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(steps):
        seq = _batch(g, world, rank)
        loss = engine(seq[:, :-1], seq[:, 1:])
        engine.backward(loss)
        engine.step()
        t = loss.detach()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    gather_op = engine.comm_report()["all_gather"]  # before full_state_dict's own
    return {
        "final": sum(losses[-10:]) / 10,
        "bytes": gather_op["bytes"],
        "wire": gather_op["wire_bytes"],
        "master": sorted(str(v.dtype) for v in engine.full_state_dict().values())[0],
    }


@pytest.mark.parametrize("stage", [1, 2])
def test_int8_gathers_shrink_the_wire_and_train_like_uncompressed(pools, stage: int) -> None:
    pool = pools(2)
    base = pool.run(loss_and_bytes_case, stage, "none", 80, timeout=300)[0]
    int8 = pool.run(loss_and_bytes_case, stage, "int8", 80, timeout=300)[0]
    bf16 = pool.run(loss_and_bytes_case, stage, "bf16", 80, timeout=300)[0]
    assert base["wire"] == base["bytes"]
    # the same logical bytes: the fp32 parameters, gathered once per step
    assert int8["bytes"] == bf16["bytes"] == base["bytes"]
    # an fp32 element sent as one int8 byte plus a 4-byte scale per 64
    assert int8["wire"] <= 0.3 * int8["bytes"], int8["wire"] / int8["bytes"]
    assert bf16["wire"] == bf16["bytes"] // 2
    for got in (int8, bf16):
        rel = abs(got["final"] - base["final"]) / base["final"]
        assert rel < 0.02, f"final loss {got['final']:.4f} vs {base['final']:.4f}"
        assert got["master"] == "torch.float32"


# ---------------------------------------------------------------- configuration


def test_every_sharded_stage_accepts_gather_compression() -> None:
    for stage in (1, 2, 3):
        for method in ("none", "bf16", "int8"):
            assert worker.ZeroConfig(stage=stage, stage3_gather_compression=method)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (
            {"stage": 0, "stage3_gather_compression": "int8"},
            r"ZeroConfig\.stage3_gather_compression must be 'none' at stage 0 .*got 'int8'",
        ),
        (
            {"stage": 2, "stage3_gather_compression": "int4"},
            r"ZeroConfig\.stage3_gather_compression must be one of none, bf16, int8, "
            r"float8, got 'int4'",
        ),
        (
            {"stage": 2, "stage3_gather_compression": "onebit"},
            r"must be one of none, bf16, int8, float8, got 'onebit'",
        ),
        (
            {"stage": 1, "stage3_gather_compression": "int8", "compression_block": 0},
            r"ZeroConfig\.compression_block must be an integer >= 1, got 0",
        ),
    ],
)
def test_bad_gather_compression_is_refused(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        worker.ZeroConfig(**kw)


def test_deepspeed_zero_quantized_weights(caplog) -> None:
    def read(zero: dict) -> worker.ZeroConfig:
        return worker.ZeroConfig.from_deepspeed({"zero_optimization": zero})

    for stage in (1, 2, 3):
        cfg = read({"stage": stage, "zero_quantized_weights": True})
        assert cfg.stage3_gather_compression == "int8"
        assert read({"stage": stage, "zero_quantized_weights": "false"}) == read({"stage": stage})
    with pytest.raises(
        ValueError,
        match=r"DeepSpeed key 'zero_optimization.zero_quantized_weights' must be true or "
        r"false, got 'maybe'",
    ):
        read({"stage": 2, "zero_quantized_weights": "maybe"})
    # DeepSpeed ignores it below stage 3; at stage 0 there is nothing to gather
    with caplog.at_level(logging.WARNING, logger="worker.ds_config"):
        assert read({"stage": 0, "zero_quantized_weights": True}).stage3_gather_compression == (
            "none"
        )
    assert "zero_quantized_weights' ignored: stage 0 gathers no parameters" in caplog.text
    # a ZeroConfig with bf16 gathers round-trips through its DeepSpeed JSON
    cfg = worker.ZeroConfig(stage=2, stage3_gather_compression="bf16")
    assert worker.ZeroConfig.from_deepspeed(cfg.to_deepspeed()) == cfg


def test_with_plan_keeps_gather_compression_at_sharded_stages() -> None:
    cfg = worker.ZeroConfig(stage=3, stage3_gather_compression="int8")
    assert cfg.with_plan(stage=2, bucket_numel=64).stage3_gather_compression == "int8"
    assert cfg.with_plan(stage=0, bucket_numel=64).stage3_gather_compression == "none"
