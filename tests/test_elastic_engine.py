"""Live re-sharding between world sizes, against the uninterrupted torch reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import worker
from tests.reference import OPTIMIZERS, max_diff, seeded_model
from tests.test_checkpoint import GLOBAL, global_batch, reference, use_extra
from worker.elastic import pack_entries, unpack_entries

STEPS = 9


def make(stage: int, joining: bool = False, group=None) -> worker.ZeroEngine:
    model = seeded_model()
    config = worker.ZeroConfig(stage=stage, bucket_numel=97, stage3_min_unit_numel=1)
    return worker.ZeroEngine(
        model, OPTIMIZERS["adamw"](model), config=config, group=group, joining=joining
    )


def train(engine: worker.ZeroEngine, steps: range) -> None:
    per = GLOBAL // engine.world_size
    for step in steps:
        idx, tgt = global_batch(step)
        sl = slice(engine.rank * per, (engine.rank + 1) * per)
        engine.backward(engine(idx[sl], tgt[sl], use_extra(step)))
        engine.step()


def resize_2_3_2(stage: int) -> float | None:
    """Ranks 0-1 train; rank 2 joins; then rank 2 leaves gracefully."""
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])
    if rank < 2:
        engine = make(stage, group=pair)
        train(engine, range(0, 3))
    else:
        engine = make(stage, joining=True)
    # scale up: the transfer runs over the new, larger group
    engine.reconfigure(None, via=None, new_members=[0, 1, 2], holds_state=rank < 2)
    assert (engine.rank, engine.world_size, engine.global_steps) == (rank, 3, 3)
    train(engine, range(3, 6))
    # graceful scale down: the leaver hands over over the old group, then leaves
    engine.reconfigure(pair if rank < 2 else None, via=None, new_members=[0, 1])
    if rank == 2:
        assert engine.buckets == []
        return None
    assert engine.world_size == 2
    train(engine, range(6, STEPS))
    diff, name = max_diff(engine.full_state_dict(), reference(STEPS))
    assert diff < 1e-5, f"{name} differs from the uninterrupted reference by {diff:.3g}"
    return diff


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resize_2_3_2_matches_uninterrupted_training(pools, stage: int) -> None:
    results = pools(3).run(resize_2_3_2, stage)
    assert results[2] is None and results[0] == results[1]


def test_pack_roundtrip_is_exact_and_pickle_free() -> None:
    entries = {
        "w[0:5]": {
            "master": torch.randn(5),
            "state": {"exp_avg": torch.randn(5), "step": torch.tensor(3.0), "flag": True},
        },
        "b[2:3]": {"master": torch.randn(1, dtype=torch.float64), "state": {}},
    }
    buf = pack_entries(entries)
    assert buf.dtype == torch.uint8
    assert b"\x80\x04" not in bytes(buf[:16].tolist())  # not a pickle stream
    back = unpack_entries(buf)
    assert back.keys() == entries.keys()
    for key, entry in entries.items():
        assert torch.equal(back[key]["master"], entry["master"])
        for k, v in entry["state"].items():
            assert (
                torch.equal(back[key]["state"][k], v)
                if isinstance(v, torch.Tensor)
                else back[key]["state"][k] == v
            )
    assert unpack_entries(pack_entries({})) == {}
