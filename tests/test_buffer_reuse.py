"""Transient bucket-sized buffers are reused, not made anew at every step or
membership change: gloo's reduce-scatter receive buffer (worker/collectives.py
[Note: a reduce-scatter's receive buffer is reused]), the stage 2-3 gradient
staging buffers across a rebuild for another world size (worker/reducers.py
StagingPool.reset), each as large as its bucket needs, and stage 3's gathered
storages (worker/flat.py [Note: gathered storages from a pool]). Results are
checked against sums computed here."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import worker
from tests.reference import OPTIMIZERS, VOCAB, seeded_model
from worker.collectives import BUFFER_GRAIN, Collectives
from worker.shared_exchange import SHM_DISABLE_ENV


def _input(rank: int, it: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * it + rank))


def _reduce_scatter_reuses(sizes: list[int]) -> dict:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ[SHM_DISABLE_ENV] = "1"  # over gloo's transport (shared memory needs none)
    try:
        return _gloo_reduce_scatter_reuses(sizes, rank, world)
    finally:
        del os.environ[SHM_DISABLE_ENV]


def _gloo_reduce_scatter_reuses(sizes: list[int], rank: int, world: int) -> dict:
    comm = Collectives(None)
    seen: list[set[int]] = []
    for it, n in enumerate(sizes):
        numel = n * world
        out = torch.empty(n)
        comm.reduce_scatter(out, _input(rank, it, numel), async_op=True).wait()
        # the chunks added in rank order, as through shared memory
        want = sum(_input(r, it, numel) for r in range(world)).view(world, -1)[rank]
        assert torch.equal(out, want)
        seen.append({b.data_ptr() for b in comm._scratch})
    # three in flight at once need three buffers; two are kept afterwards
    outs = [torch.empty(sizes[0]) for _ in range(3)]
    handles = [
        comm.reduce_scatter(o, _input(rank, 90 + i, sizes[0] * world), async_op=True)
        for i, o in enumerate(outs)
    ]
    for h in handles:
        h.wait()
    for i, o in enumerate(outs):
        want = sum(_input(r, 90 + i, sizes[0] * world) for r in range(world))
        torch.testing.assert_close(o, want.view(world, -1)[rank], rtol=0, atol=1e-5)
    kept = len(comm._scratch)
    # the next generation's Collectives takes the free buffers over
    before = {b.data_ptr() for b in comm._scratch}
    nxt = Collectives(None)
    nxt.inherit_scratch(comm)
    out = torch.empty(sizes[0])
    nxt.reduce_scatter(out, _input(rank, 99, sizes[0] * world), async_op=True).wait()
    return {
        "seen": seen,
        "kept": kept,
        "inherited": {b.data_ptr() for b in nxt._scratch} == before and not comm._scratch,
    }


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_reduce_scatter_reuses_its_receive_buffer(pools, world: int) -> None:
    # a large one, the same again, a smaller one (a view of the first), the large again
    sizes = [3 * BUFFER_GRAIN + 5, 3 * BUFFER_GRAIN + 5, 1000, 3 * BUFFER_GRAIN + 5]
    for rank, got in enumerate(pools(world).run(_reduce_scatter_reuses, sizes)):
        first = got["seen"][0]
        assert len(first) == 1, got
        assert all(s == first for s in got["seen"]), f"rank {rank} made new buffers: {got}"
        assert got["kept"] == 2, got
        assert got["inherited"], got


def test_a_rebuild_for_another_world_keeps_the_staging_buffers() -> None:
    model = seeded_model()
    engine = worker.initialize(
        model, OPTIMIZERS["adamw"](model), config=worker.ZeroConfig(stage=2, bucket_numel=4096)
    )
    idx = torch.randint(0, VOCAB, (2, 8))
    engine.backward(engine(idx, idx, True))
    engine.step()
    pool = engine.state.pool
    before = {b.data_ptr() for b in pool.free}
    assert before and all(b.numel() % BUFFER_GRAIN == 0 for b in pool.free)
    # as a newcomer's build for rank 1 of 3 (worker/elastic/joining.py [Note: a newcomer
    # builds ahead]): the buckets are padded for three ranks now, and still fit
    engine.state.build(Collectives.ahead(1, 3, "gloo"), from_module=False)
    assert max(b.spec.padded_numel for b in engine.buckets) <= pool.largest
    assert {b.data_ptr() for b in pool.free} == before
    assert pool.allocated == len(before)
    # a release that is not for a rebuild (a leaver's) frees them
    engine.state.release()
    assert not pool.free


def test_a_newcomer_built_ahead_writes_its_first_backwards_buffers_once() -> None:
    model = seeded_model()
    engine = worker.initialize(
        model, OPTIMIZERS["adamw"](model), config=worker.ZeroConfig(stage=2, bucket_numel=4096)
    )
    ahead = Collectives.ahead(1, 3, "gloo")
    engine.state.build(ahead, from_module=False)
    assert not engine.state.pool.free and not ahead._scratch
    engine.state.warm()
    largest = max(b.spec.padded_numel for b in engine.buckets)
    assert len(engine.state.pool.free) == 2 == engine.state.pool.allocated
    assert len(ahead._scratch) == 2
    assert all(b.numel() >= largest for b in (*engine.state.pool.free, *ahead._scratch))
    # the group that forms takes the receive buffers over
    formed = Collectives.ahead(1, 3, "gloo")
    engine.state.rebind(formed)
    assert len(formed._scratch) == 2 and not ahead._scratch


def _stage3_engine(**options) -> worker.ZeroEngine:
    model = seeded_model()
    config = worker.ZeroConfig(stage=3, stage3_min_unit_numel=1, **options)
    return worker.initialize(model, OPTIMIZERS["adamw"](model), config=config)


def _train(engine: worker.ZeroEngine, steps: int) -> list[set[int]]:
    """``steps`` steps; each step's addresses of every gathered bucket's memory."""
    seen: list[set[int]] = []
    units = engine.state.params.units

    def note(*_: object) -> None:
        seen[-1].update(b.full.data_ptr() for u in units for b in u.buckets
                        if b.full.untyped_storage().nbytes())  # fmt: skip

    hooks = [u.module.register_forward_hook(note) for u in units]
    for step in range(steps):
        seen.append(set())
        idx = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(step))
        engine.backward(engine(idx, idx, True))
        engine.step()
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.skipif(
    not hasattr(torch.UntypedStorage, "_swap_data_ptr_"), reason="torch without storage swaps"
)
def test_stage3_gathers_reuse_their_memory_step_after_step() -> None:
    """worker/flat.py [Note: gathered storages from a pool]: after the first steps the
    gathers of every step land in the same memory, at most two free storages of a
    size kept between steps, only the new sizes once a rebuild changes them."""
    engine = _stage3_engine()
    storages = engine.state.params.storages
    seen = _train(engine, 5)
    assert seen[2] and seen[2] == seen[3] == seen[4], seen
    sizes = {b.full.numel() * b.full.element_size() for b in engine.buckets}
    assert 0 < storages.held <= 2 * sum(sizes)
    assert all(b.full.untyped_storage().nbytes() == 0 for b in engine.buckets)
    # a rebuild for another world keeps only its own buckets' sizes
    engine.state.build(Collectives.ahead(1, 3, "gloo"), from_module=False)
    rebuilt = {b.full.numel() * b.full.element_size() for b in engine.buckets}
    assert rebuilt != sizes and storages.sizes <= rebuilt
    engine.state.release()
    assert storages.held == 0


class _TwoTables(torch.nn.Module):
    """Two embeddings that fill one bucket between them, and small layers after."""

    def __init__(self) -> None:
        super().__init__()
        # (buckets fill from the last parameter: the tables' first, then the layers')
        self.head = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 8))
        self.a, self.b = torch.nn.Embedding(4096, 32), torch.nn.Embedding(4096, 32)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.a(idx % 4096) + self.b(idx // 2))


def _train_three_steps(model: torch.nn.Module, bucket_numel: int) -> worker.ZeroEngine:
    config = worker.ZeroConfig(stage=2, bucket_numel=bucket_numel)
    engine = worker.initialize(model, torch.optim.AdamW(model.parameters()), config=config)
    for step in range(3):
        idx = torch.randint(0, 8192, (2, 8), generator=torch.Generator().manual_seed(step))
        engine.backward(engine(idx).square().mean())
        engine.step()
    return engine


def test_staging_buffers_are_as_large_as_their_buckets_need() -> None:
    """worker/reducers.py [Note: staging buffers by need]: a large bucket's buffer is
    not made for every bucket; each takes the smallest free buffer that fits."""
    torch.manual_seed(0)
    engine = _train_three_steps(_TwoTables(), bucket_numel=2 * 4096 * 32)
    needs = sorted((b.spec.padded_numel for b in engine.buckets), reverse=True)
    held = sorted((b.numel() for b in engine.state.pool.free), reverse=True)
    assert len(held) == 2 and needs == [needs[0], needs[1]], (needs, held)
    assert needs[0] > BUFFER_GRAIN > needs[1], (needs, held)
    assert held == [-(-needs[0] // BUFFER_GRAIN) * BUFFER_GRAIN, BUFFER_GRAIN], (needs, held)


def test_a_bucket_of_one_parameter_reduces_its_gradient_without_a_buffer() -> None:
    """An embedding alone in its bucket: its gradient is reduced as it is, so the pool
    never makes a buffer of its size, and the training is AdamW's in one process."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(  # an embedding of 4 x BUFFER_GRAIN elements, small layers
        torch.nn.Embedding(8192, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 8)
    )
    ref = copy.deepcopy(model)
    engine = _train_three_steps(model, bucket_numel=4096)
    assert [len(b.params) for b in engine.buckets if b.spec.numel > BUFFER_GRAIN] == [1]
    assert [b.numel() for b in engine.state.pool.free] == [BUFFER_GRAIN]
    opt = torch.optim.AdamW(ref.parameters())
    for step in range(3):
        idx = torch.randint(0, 8192, (2, 8), generator=torch.Generator().manual_seed(step))
        ref(idx).square().mean().backward()
        opt.step()
        opt.zero_grad()
    got = engine.full_state_dict()
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(got[name], want, rtol=0, atol=1e-6, msg=name)
