"""Quantized hierarchical gradient reduce-scatters (ZeRO++'s qgZ) at stages 2-3: each
rank's reduced shard is the exact sum within int8's bound, training stays within 2% of
uncompressed, the cross-node bytes shrink, bad configs are refused
(worker/compression.py [Note: hierarchical gradient reduce-scatter])."""

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
# small buckets: several per model, so several exchanges are in flight at once
BUCKET = 8192
WORLD, K = 4, 2
LR = 2e-3


def _batch(g: torch.Generator) -> torch.Tensor:
    """The global batch of one step: 2 sequences per rank."""
    return walk_batch(g, WORLD * 2, CFG.vocab_size, CFG.block_size)


def _engine(stage: int, **kw) -> worker.ZeroEngine:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    config = worker.ZeroConfig(
        stage=stage, compression_block=BLOCK, bucket_numel=BUCKET, overlap_comm=True, **kw
    )
    return worker.initialize(model, opt, config=config)


def _flat(spec, grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """Gradients laid out as bucket ``spec``'s padded elements."""
    out = torch.zeros(spec.padded_numel)
    for slot in spec.slots:
        out[slot.offset : slot.offset + slot.numel] = grads[slot.name].reshape(-1)
    return out


def shard_bound_case(stage: int) -> dict:
    """One backward with qgZ (k=2, int8, error feedback), beside a one-process torch
    reference on the global batch: this rank's reduced shard of every bucket against
    the exact mean gradient, within the bound of int8 on each node's sum."""
    rank = dist.get_rank()
    engine = _engine(stage, compression="int8", hierarchical_reduce=K)
    seq = _batch(torch.Generator().manual_seed(1234))
    mine = seq[rank * 2 : (rank + 1) * 2]
    engine.backward(engine(mine[:, :-1], mine[:, 1:]))
    torch.manual_seed(0)
    ref = GPT(CFG)
    ref(seq[:, :-1], seq[:, 1:]).backward()
    mean = {n: p.grad.clone() for n, p in ref.named_parameters()}
    # each rank's own gradient: what the node legs sum
    local = []
    for r in range(WORLD):
        ref.zero_grad()
        ref(seq[r * 2 : (r + 1) * 2, :-1], seq[r * 2 : (r + 1) * 2, 1:]).backward()
        local.append({n: p.grad.clone() for n, p in ref.named_parameters()})
    worst_ratio, worst_err, checked = 0.0, 0.0, 0
    for b in engine.state.buckets:
        spec, s = b.spec, b.spec.shard_numel
        lo, hi = rank * s, (rank + 1) * s
        got = b.grad_shard.detach().float() / WORLD  # the engine divides at its step
        want = _flat(spec, mean)[lo:hi]
        bound = torch.zeros(s)
        for node in range(WORLD // K):
            # what node ``node``'s rank at this rank's place encoded for this rank
            node_sum = sum(_flat(spec, local[node * K + j])[lo:hi] for j in range(K))
            blocks = torch.nn.functional.pad(node_sum, (0, -s % BLOCK)).view(-1, BLOCK)
            bound += blocks.abs().amax(dim=1).repeat_interleave(BLOCK)[:s] / 127 / 2
        bound = bound / WORLD
        err = (got - want).abs()
        # float sums in another order: a few ulps of the values summed
        slack = 1e-6 * sum(_flat(spec, g)[lo:hi].abs() for g in local) / WORLD + 1e-9
        worst_ratio = max(worst_ratio, ((err - slack) / (bound + 1e-12)).max().item())
        worst_err = max(worst_err, err.max().item())
        checked += s
    groups = engine.state.comm_groups()
    return {
        "worst_ratio": worst_ratio,
        "worst_err": worst_err,
        "checked": checked,
        "node": dist.get_process_group_ranks(groups["node"].group),
        "cross": dist.get_process_group_ranks(groups["cross"].group),
        "residual": sum(b.residual.numel() for b in engine.state.buckets),
        "padded": sum(b.spec.padded_numel for b in engine.state.buckets),
        "by_group": engine.comm_report(by_group=True),
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_reduced_shard_is_the_mean_within_the_codec_bound(pools, stage: int) -> None:
    for rank, case in enumerate(pools(WORLD).run(shard_bound_case, stage, timeout=300)):
        assert case["checked"] > 0
        assert case["worst_ratio"] <= 1.0, case["worst_ratio"]
        assert case["worst_err"] > 0, "nothing was quantized"
        # node groups of consecutive ranks, cross-node groups of the same place
        assert case["node"] == [rank // K * K, rank // K * K + 1]
        assert case["cross"] == [rank % K, rank % K + K]
        # error feedback keeps 1/k of every bucket: the node sum's share
        assert case["residual"] == case["padded"] // K
        by_group = case["by_group"]
        assert "reduce_scatter" not in by_group["world"]
        node, cross = by_group["node"]["reduce_scatter"], by_group["cross"]["reduce_scatter"]
        # the node leg is the whole bucket in fp32, the cross leg 1/k of it, encoded
        assert node["bytes"] == node["wire_bytes"] == case["padded"] * 4
        assert cross["bytes"] == case["padded"] * 4 // K
        assert cross["wire_bytes"] < cross["bytes"] * 0.3


def train_case(stage: int, kw: dict, steps: int) -> dict:
    """``steps`` steps on the same batches; the loss (mean over ranks) at each, and the
    bytes by group."""
    rank = dist.get_rank()
    engine = _engine(stage, **kw)
    g = torch.Generator().manual_seed(99)
    losses = []
    for _ in range(steps):
        seq = _batch(g)[rank * 2 : (rank + 1) * 2]
        loss = engine(seq[:, :-1], seq[:, 1:])
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / WORLD)
    return {
        "losses": losses,
        "by_group": engine.comm_report(by_group=True),
        "memory": engine.memory_report(),
    }


QGZ = {"compression": "int8", "hierarchical_reduce": K}


@pytest.mark.parametrize(
    ("stage", "extra"),
    [
        (2, {}),
        (3, {}),
        # all three ZeRO++ pieces: hpZ's node groups serve qgZ's node leg too
        (3, {"hpz_partition_size": K, "stage3_gather_compression": "int8"}),
    ],
)
def test_trains_like_uncompressed_with_fewer_cross_node_bytes(
    pools, stage: int, extra: dict
) -> None:
    steps = 40
    pool = pools(WORLD)
    base = pool.run(train_case, stage, {}, steps, timeout=600)[0]
    qgz = pool.run(train_case, stage, QGZ | extra, steps, timeout=600)[0]
    for step, (a, b) in enumerate(zip(base["losses"], qgz["losses"], strict=True)):
        assert abs(b - a) / a < 0.02, f"step {step}: loss {b:.4f} vs {a:.4f}"
    assert base["losses"][-1] < 0.8 * base["losses"][0], "the reference did not train"
    plain = base["by_group"]["world"]["reduce_scatter"]
    assert set(base["by_group"]) == {"world"}
    cross = qgz["by_group"]["cross"]
    assert set(cross) == {"reduce_scatter"}  # only the gradients' second leg crosses here
    # per step, both sums of every step's buckets
    assert cross["reduce_scatter"]["wire_bytes"] <= 0.3 * plain["bytes"], (
        cross["reduce_scatter"]["wire_bytes"] / plain["bytes"]
    )
    assert "reduce_scatter" not in qgz["by_group"]["world"]
    node = qgz["by_group"]["node"]
    assert node["reduce_scatter"]["bytes"] == plain["bytes"]
    if extra:
        assert node["all_gather"]["calls"] > 0  # hpZ's backward gathers on the same group
    assert qgz["memory"]["compression"] > 0


# ---------------------------------------------------------------- configuration


def refused_case() -> list[str]:
    """qgZ's refusals that need a live group: a size that does not divide the world,
    an engine on a subgroup, reconfigure onto a new group."""
    messages = []
    try:
        _engine(2, **QGZ | {"hierarchical_reduce": 3})
    except ValueError as exc:
        messages.append(str(exc))
    sub = dist.new_group(list(range(WORLD)))
    try:
        torch.manual_seed(0)
        model = GPT(CFG)
        worker.initialize(
            model,
            torch.optim.AdamW(model.parameters(), lr=LR),
            config=worker.ZeroConfig(stage=2, **QGZ),
            group=sub,
        )
    except ValueError as exc:
        messages.append(str(exc))
    engine = _engine(2, **QGZ)
    try:
        engine.reconfigure(sub, via=None, new_members=list(range(WORLD)))
    except ValueError as exc:
        messages.append(str(exc))
    return messages


def test_qgz_refused_where_it_cannot_run(pools) -> None:
    for messages in pools(WORLD).run(refused_case, timeout=300):
        assert len(messages) == 3, messages
        assert (
            "ZeroConfig.hierarchical_reduce must divide the world size (4 ranks), got 3"
            in messages[0]
        )
        assert (
            "hierarchical_reduce=2 needs the engine on the default process group" in (messages[1])
        )
        assert "cannot form qgZ's node groups" in messages[2]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (
            {"stage": 1, "compression": "int8", "hierarchical_reduce": 2},
            r"ZeroConfig\.hierarchical_reduce must be 1 unless stage is 2 or 3 .*got 2",
        ),
        (
            {"stage": 0, "compression": "int8", "hierarchical_reduce": 2},
            r"ZeroConfig\.hierarchical_reduce must be 1 unless stage is 2 or 3",
        ),
        (
            {"stage": 2, "hierarchical_reduce": 2},
            r"ZeroConfig\.hierarchical_reduce must be 1 with compression='none' .*got 2",
        ),
        (
            {"stage": 3, "compression": "int8", "hierarchical_reduce": 2, "hpz_partition_size": 4},
            r"ZeroConfig\.hierarchical_reduce must equal hpz_partition_size=4 .*got 2",
        ),
        (
            {"stage": 2, "compression": "int8", "hierarchical_reduce": 0},
            r"ZeroConfig\.hierarchical_reduce must be an integer >= 1, got 0",
        ),
        (
            {"stage": 2, "compression": "int8", "hierarchical_reduce": True},
            r"ZeroConfig\.hierarchical_reduce must be an integer >= 1, got True",
        ),
    ],
)
def test_bad_qgz_config_is_refused(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        worker.ZeroConfig(**kw)


def test_qgz_config_accepted_and_planned() -> None:
    for stage in (2, 3):
        for codec in ("bf16", "int8", "onebit"):
            assert worker.ZeroConfig(stage=stage, compression=codec, hierarchical_reduce=4)
    cfg = worker.ZeroConfig(stage=3, hpz_partition_size=2, **QGZ)
    assert cfg.with_plan(stage=2, bucket_numel=64).hierarchical_reduce == K
    assert cfg.with_plan(stage=1, bucket_numel=64).hierarchical_reduce == 1


def test_deepspeed_zero_quantized_gradients(caplog) -> None:
    def read(zero: dict) -> worker.ZeroConfig:
        return worker.ZeroConfig.from_deepspeed({"zero_optimization": zero})

    cfg = read({"stage": 3, "zero_quantized_gradients": True, "zero_hpz_partition_size": 8})
    assert (cfg.compression, cfg.hierarchical_reduce, cfg.hpz_partition_size) == ("int8", 8, 8)
    # the node size comes from hpZ's key whichever comes first
    cfg = read({"stage": 3, "zero_hpz_partition_size": "4", "zero_quantized_gradients": "true"})
    assert (cfg.compression, cfg.hierarchical_reduce) == ("int8", 4)
    # without it the node size is unknown: the int8 reduce-scatter stays flat
    cfg = read({"stage": 3, "zero_quantized_gradients": True})
    assert (cfg.compression, cfg.hierarchical_reduce) == ("int8", 1)
    assert read({"stage": 3, "zero_quantized_gradients": False}) == read({"stage": 3})
    # stage 2: hpZ's key is ignored there, qgZ still takes the node size from it
    with caplog.at_level(logging.WARNING, logger="worker.ds_config"):
        cfg = read({"stage": 2, "zero_quantized_gradients": 1, "zero_hpz_partition_size": 2})
    assert (cfg.compression, cfg.hierarchical_reduce, cfg.hpz_partition_size) == ("int8", 2, 1)
    assert "qgZ takes it as the ranks per node" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="worker.ds_config"):
        assert read({"stage": 1, "zero_quantized_gradients": True}) == read({"stage": 1})
    assert "zero_quantized_gradients' ignored: quantized gradient reduce-scatters" in (caplog.text)
    with pytest.raises(ValueError, match=r"'zero_optimization\.zero_quantized_gradients'"):
        read({"stage": 3, "zero_quantized_gradients": "maybe"})
    # written back under DeepSpeed's keys, and read again to an equal config
    cfg = worker.ZeroConfig(
        stage=3, hpz_partition_size=4, compression="int8", hierarchical_reduce=4
    )
    ds = cfg.to_deepspeed()
    assert ds["zero_optimization"]["zero_quantized_gradients"] is True
    assert ds["zero_optimization"]["zero_hpz_partition_size"] == 4
    assert "zeroplane" not in ds
    assert worker.ZeroConfig.from_deepspeed(ds) == cfg
    # what DeepSpeed's key cannot say goes in the zeroplane section, and round-trips too
    for cfg in (
        worker.ZeroConfig(stage=2, **QGZ),
        worker.ZeroConfig(stage=3, compression="bf16", hierarchical_reduce=2),
        worker.ZeroConfig(stage=3, hpz_partition_size=2, compression="int8"),
    ):
        ds = cfg.to_deepspeed()
        assert "zero_quantized_gradients" not in ds["zero_optimization"]
        assert worker.ZeroConfig.from_deepspeed(ds) == cfg
