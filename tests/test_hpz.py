"""Hierarchical partitioning (ZeRO++'s hpZ) at stage 3: bit-identical to plain stage 3,
equal to a one-process torch reference, the backward's gathers within the node groups,
the secondary copies counted, bad configs refused (worker/stages.py [Note: hierarchical
partitioning])."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

import worker
from coordinator.core.memory import model_state_bytes
from tests.reference import walk_batch
from worker.collectives import Collectives
from worker.models import GPT, GPTConfig

# three blocks: with the default reuse distance the first two are freed after their
# forward and gathered again for their backward
CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=3, n_head=2, n_embd=32)
STEPS = 4
LR = 2e-3


def _batch(g: torch.Generator, world: int) -> torch.Tensor:
    """The global batch of one step: 2 sequences per rank."""
    return walk_batch(g, world * 2, CFG.vocab_size, CFG.block_size)


def _engine(hpz: int, **kw) -> worker.ZeroEngine:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    config = worker.ZeroConfig(stage=3, hpz_partition_size=hpz, **kw)
    return worker.initialize(model, opt, config=config)


def train_case(hpz: int, dtype: str, accumulation: int) -> dict:
    """``STEPS`` steps at stage 3; halfway, the engine is bound to a fresh group object
    as a membership change does (ShardState.rebind), so hpZ forms its node groups
    again mid-run."""
    world, rank = dist.get_world_size(), dist.get_rank()
    engine = _engine(hpz, dtype=dtype, gradient_accumulation_steps=accumulation)
    g = torch.Generator().manual_seed(1234)
    losses = []
    for step in range(STEPS):
        if step == STEPS // 2:
            engine.state.rebind(Collectives(None))
        for micro in range(accumulation):
            seq = _batch(g, world)[rank * 2 : (rank + 1) * 2]
            half = seq[micro::accumulation] if accumulation > 1 else seq
            loss = engine(half[:, :-1], half[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float().clone())
    report = engine.comm_report(by_group=True)
    merged = engine.comm_report()
    node = engine.state.comm_groups().get("node")
    secondary = sum(
        b.secondary.numel() * b.secondary.element_size()
        for b in engine.buckets
        if b.secondary is not None
    )
    padded = sum(b.spec.padded_numel for b in engine.buckets)
    return {
        "losses": losses,
        "state": engine.full_state_dict(),
        "by_group": report,
        "merged": merged,
        "node_ranks": None if node is None else dist.get_process_group_ranks(node.group),
        "memory": engine.memory_report(),
        "secondary": secondary,
        "padded": padded,
        "numel": engine.layout.numel,
    }


def _reference(world: int) -> dict[str, torch.Tensor]:
    """The same training in one process on the global batch, in fp32."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    g = torch.Generator().manual_seed(1234)
    for _ in range(STEPS):
        seq = _batch(g, world)
        opt.zero_grad()
        model(seq[:, :-1], seq[:, 1:]).backward()
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.parametrize(("dtype", "accumulation"), [("fp32", 1), ("bf16", 2)])
def test_hpz_is_plain_stage_3_bit_for_bit(pools, dtype: str, accumulation: int) -> None:
    pool = pools(4)
    plain = pool.run(train_case, 1, dtype, accumulation, timeout=300)
    hpz = pool.run(train_case, 2, dtype, accumulation, timeout=300)
    for rank, (p, h) in enumerate(zip(plain, hpz, strict=True)):
        # the same values gathered: the same losses and master weights, to the bit
        assert all(torch.equal(a, b) for a, b in zip(p["losses"], h["losses"], strict=True))
        assert p["state"].keys() == h["state"].keys()
        for name in p["state"]:
            assert torch.equal(p["state"][name], h["state"][name]), (rank, name)
        # node groups of consecutive ranks: {0, 1} and {2, 3}
        assert h["node_ranks"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert p["node_ranks"] is None and "node" not in p["by_group"]
        # the backward's gathers moved to the node group: the same logical bytes in all,
        # fewer across the world
        node, world = h["by_group"]["node"]["all_gather"], h["by_group"]["world"]["all_gather"]
        plain_gather = p["by_group"]["world"]["all_gather"]
        assert node["bytes"] > 0 and node["calls"] > 0
        assert world["bytes"] + node["bytes"] == plain_gather["bytes"]
        assert world["bytes"] < plain_gather["bytes"]
        assert h["merged"]["all_gather"]["bytes"] == plain_gather["bytes"]
        assert set(h["by_group"]["node"]) == {"all_gather"}  # nothing else on the node group
        assert h["merged"]["reduce_scatter"] == p["merged"]["reduce_scatter"] | {
            "seconds": h["merged"]["reduce_scatter"]["seconds"]
        }
        # the secondary copies: 1/k of every (padded) bucket, counted under params
        element = 4 if dtype == "fp32" else 2
        assert h["secondary"] == h["padded"] // 2 * element
        assert h["memory"]["params"] - p["memory"]["params"] == h["secondary"]
        assert p["memory"]["total"] < h["memory"]["total"]
        formula = (
            model_state_bytes(
                h["numel"], stage=3, world_size=4, dtype=dtype, hpz_partition_size=2
            ).params
            - model_state_bytes(h["numel"], stage=3, world_size=4, dtype=dtype).params
        )
        assert formula <= h["secondary"] <= formula + element * (h["padded"] - h["numel"])
    if dtype == "fp32" and accumulation == 1:
        want = _reference(4)
        got = hpz[0]["state"]
        for name, value in want.items():
            assert (got[name] - value).abs().max().item() < 1e-5, name


def refused_case() -> list[str]:
    """hpZ's refusals that need a live group: a size that does not divide the world,
    an engine on a subgroup, reconfigure onto a new group."""
    messages = []
    for hpz in (3, 8):
        try:
            _engine(hpz)
        except ValueError as exc:
            messages.append(str(exc))
    sub = dist.new_group([0, 1, 2, 3])
    try:
        torch.manual_seed(0)
        model = GPT(CFG)
        worker.initialize(
            model,
            torch.optim.AdamW(model.parameters(), lr=LR),
            config=worker.ZeroConfig(stage=3, hpz_partition_size=2),
            group=sub,
        )
    except ValueError as exc:
        messages.append(str(exc))
    engine = _engine(2)
    try:
        engine.reconfigure(sub, via=None, new_members=[0, 1, 2, 3])
    except ValueError as exc:
        messages.append(str(exc))
    return messages


def test_hpz_refused_where_it_cannot_run(pools) -> None:
    for messages in pools(4).run(refused_case, timeout=300):
        assert len(messages) == 4, messages
        assert (
            "ZeroConfig.hpz_partition_size must divide the world size (4 ranks), got 3"
            in (messages[0])
        )
        assert "got 8" in messages[1]
        assert "hpz_partition_size=2 needs the engine on the default process group" in (messages[2])
        assert (
            "engine.reconfigure() onto a new group cannot form hpZ's node groups" in (messages[3])
        )
        assert "nothing was moved" in messages[3]


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (
            {"stage": 2, "hpz_partition_size": 2},
            r"ZeroConfig\.hpz_partition_size must be 1 unless stage is 3 .*got 2",
        ),
        (
            {"stage": 3, "hpz_partition_size": 0},
            r"ZeroConfig\.hpz_partition_size must be an integer >= 1, got 0",
        ),
        (
            {"stage": 3, "hpz_partition_size": 2.0},
            r"hpz_partition_size must be an integer >= 1, got 2\.0",
        ),
        (
            {"stage": 3, "hpz_partition_size": 2, "offload_params": "cpu"},
            r"ZeroConfig\.hpz_partition_size must be 1 with offload_params='cpu'",
        ),
    ],
)
def test_bad_hpz_config_is_refused(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        worker.ZeroConfig(**kw)


def test_deepspeed_zero_hpz_partition_size(caplog) -> None:
    def read(zero: dict) -> worker.ZeroConfig:
        return worker.ZeroConfig.from_deepspeed({"zero_optimization": zero})

    assert read({"stage": 3, "zero_hpz_partition_size": 8}).hpz_partition_size == 8
    assert read({"stage": 3, "zero_hpz_partition_size": "4"}).hpz_partition_size == 4
    assert read({"stage": 3, "zero_hpz_partition_size": 1}) == read({"stage": 3})
    for bad in (0, "two", 1.5):
        with pytest.raises(ValueError, match=r"'zero_optimization\.zero_hpz_partition_size'"):
            read({"stage": 3, "zero_hpz_partition_size": bad})
    # DeepSpeed builds hpZ at stage 3 only and ignores the key below
    with caplog.at_level(logging.WARNING, logger="worker.ds_config"):
        assert read({"stage": 2, "zero_hpz_partition_size": 8}).hpz_partition_size == 1
    assert "zero_hpz_partition_size' ignored: only stage 3" in caplog.text
    # written back under DeepSpeed's key, and read again to an equal config
    cfg = worker.ZeroConfig(stage=3, hpz_partition_size=4, stage3_gather_compression="int8")
    ds = cfg.to_deepspeed()
    assert ds["zero_optimization"]["zero_hpz_partition_size"] == 4
    assert worker.ZeroConfig.from_deepspeed(ds) == cfg
    # with offload_param the error names the key it was read from
    with pytest.raises(ValueError, match=r"read from DeepSpeed key"):
        read({"stage": 3, "zero_hpz_partition_size": 2, "offload_param": {"device": "cpu"}})


def test_with_plan_turns_hpz_off_below_stage_3() -> None:
    cfg = worker.ZeroConfig(stage=3, hpz_partition_size=2)
    assert cfg.with_plan(stage=3, bucket_numel=64).hpz_partition_size == 2
    assert cfg.with_plan(stage=2, bucket_numel=64).hpz_partition_size == 1


def test_memory_formula_counts_the_secondary_copies() -> None:
    plain = model_state_bytes(8000, stage=3, world_size=8, dtype="bf16")
    hpz = model_state_bytes(8000, stage=3, world_size=8, dtype="bf16", hpz_partition_size=4)
    assert hpz.params - plain.params == 2 * 8000 / 4
    assert (hpz.grads, hpz.master, hpz.optimizer) == (plain.grads, plain.master, plain.optimizer)
    with pytest.raises(ValueError, match="hpz_partition_size"):
        model_state_bytes(8000, stage=2, world_size=8, hpz_partition_size=4)
