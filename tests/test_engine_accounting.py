"""memory_report() and comm_report() against the ZeRO formulas of docs/design.md
("Model-state bytes per rank", "Words moved per step")."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import worker
from coordinator.core.memory import model_state_bytes
from worker.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=18)
ELT = {"fp32": 4, "bf16": 2}


def gpt_engine(stage: int, dtype: str, **config: int) -> tuple[worker.ZeroEngine, int]:
    torch.manual_seed(0)
    model = GPT(CFG)
    numel = sum(p.numel() for p in dict.fromkeys(model.parameters()) if p.requires_grad)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    config = worker.ZeroConfig(stage=stage, dtype=dtype, bucket_numel=5000, **config)
    return worker.initialize(model, opt, config=config), numel


def one_step(engine: worker.ZeroEngine, seed: int) -> None:
    g = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    idx = torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=g)
    engine.backward(engine(idx, idx))
    engine.step()


def memory_case(stage: int, dtype: str) -> dict:
    engine, numel = gpt_engine(stage, dtype)
    one_step(engine, 0)
    return {
        "report": engine.memory_report(),
        "numel": numel,
        "padded": engine.layout.padded_numel,
        "buckets": len(engine.layout.buckets),
        "state_entries": len(engine.optimizer.inner.state),
    }


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_memory_report_matches_formulas(pools, world: int, dtype: str) -> None:
    per_stage = {s: pools(world).run(memory_case, s, dtype) for s in (0, 1, 2, 3)}
    for stage, ranks in per_stage.items():
        numel, padded = ranks[0]["numel"], ranks[0]["padded"]
        # padding is the only reason bytes exceed the formula: < N elements per bucket
        assert 0 <= padded - numel < world * ranks[0]["buckets"]
        formula_padded = model_state_bytes(padded, stage=stage, world_size=world, dtype=dtype)
        for rank, case in enumerate(ranks):
            got = case["report"]
            for kind in ("params", "grads", "master"):
                assert got[kind] == formula_padded.as_dict()[kind], (stage, rank, kind, got)
            assert got["buffers"] == 0
        # Adam keeps two fp32 tensors per element it owns, plus a 4-byte step count per
        # parameter piece; every element is owned once (stages 1-3) or N times (stage 0).
        owners = world if stage == 0 else 1
        optimizer = sum(c["report"]["optimizer"] for c in ranks)
        scalars = 4 * sum(c["state_entries"] for c in ranks)
        assert optimizer - scalars == owners * 8 * numel, (stage, optimizer, scalars)

        formula = model_state_bytes(numel, stage=stage, world_size=world, dtype=dtype).total
        total = max(c["report"]["total"] for c in ranks)
        assert abs(total - formula) / formula < 0.05, (stage, total, formula)

    if world > 1:
        base = per_stage[0][0]["report"]["total"]
        for stage in (1, 2, 3):
            saving = per_stage[stage][0]["report"]["total"] / base
            want = model_state_bytes(1, stage=stage, world_size=world, dtype=dtype).total / (
                model_state_bytes(1, stage=0, world_size=world, dtype=dtype).total
            )
            assert saving == pytest.approx(want, rel=0.05), (stage, saving, want)


def comm_case(stage: int, dtype: str, **config: int) -> dict:
    engine, numel = gpt_engine(stage, dtype, **config)
    one_step(engine, 0)  # records the stage-3 forward order, so prefetching is on
    before = engine.comm_report()
    one_step(engine, 1)
    after = engine.comm_report()
    delta = {
        op: {k: after[op][k] - before.get(op, {}).get(k, 0) for k in ("calls", "bytes")}
        for op in after
    }
    root = sum(b.padded_numel for b in engine.layout.buckets if b.unit == 0)
    # the last block's forward ends last before the root's: its backward comes first
    last = next((u.index for u in engine.units if u.module is engine.module.blocks[-1]), None)
    return {
        "delta": delta,
        "numel": numel,
        "padded": engine.layout.padded_numel,
        "root": root,
        "last": sum(b.padded_numel for b in engine.layout.buckets if b.unit == last),
        "trainable": len(engine.inventory.trainable),
    }


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_comm_report_matches_theory(pools, stage: int, dtype: str) -> None:
    case = pools(2).run(comm_case, stage, dtype)[0]
    p, numel, padded = ELT[dtype], case["numel"], case["padded"]
    got = {op: v["bytes"] for op, v in case["delta"].items() if v["calls"]}
    # one MAX all-reduce of the used-parameter flags (int32, one per trainable parameter)
    # with the four membership slots riding on it (generation, leaving rank, staying,
    # waiting), and the step's loss summed over the ranks (two float64)
    want = {"control": 4 * (case["trainable"] + 4) + 2 * 8}
    if stage == 0:
        want["all_reduce"] = p * numel
    elif stage in (1, 2):
        want["reduce_scatter"] = p * padded
        want["all_gather"] = p * padded
    else:
        # every unit is gathered for forward and again for backward, except the root
        # and the last block, which stay gathered from their forward to their backward
        want["reduce_scatter"] = p * padded
        want["all_gather"] = p * (2 * padded - case["root"] - case["last"])
        assert case["last"] > 0
    assert got == want


def test_stage3_keeping_every_unit_gathers_once_per_step(pools) -> None:
    """stage3_max_reuse_distance past the model's size: one forward gather per unit,
    none in backward, the same all-gather volume as stage 2's publish."""
    case = pools(2).run(comm_case, 3, "fp32", stage3_max_reuse_distance=10**9)[0]
    got = {op: v["bytes"] for op, v in case["delta"].items() if v["calls"]}
    assert got["all_gather"] == 4 * case["padded"]
    assert got["reduce_scatter"] == 4 * case["padded"]
