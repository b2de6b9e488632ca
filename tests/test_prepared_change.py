"""A scale-up prepared while the members train: the ranks meet ahead at the new
generation's store and switch once every rank is ready (worker/rendezvous.py
[Note: meeting ahead]), and the build, the import and the exchange take buffers
written ahead (worker/build_ahead.py [Note: a build from buffers written ahead]).
Training is checked against the uninterrupted torch reference."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch

from tests.test_elastic_engine import STEPS, matches_reference, pair_then_newcomer, train
from tests.test_rendezvous_meet import _Client, _free_port, _Generation
from worker.ballot import BoundaryVote
from worker.build_ahead import probe_state_fields
from worker.collectives import Collectives
from worker.flat import Reserve
from worker.live import (
    ExchangeBuffers,
    _Packing,
    exchange,
    pack_entries,
    packed_bound,
    sent_bound,
    wire_device,
)
from worker.rendezvous import ControlPlane


def _pointers(*tensors: torch.Tensor | None) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t is not None}


def _state_tensors(engine) -> list[torch.Tensor]:
    return [
        v
        for s in engine.state.optimizer.inner.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() == 1
    ]


def join_prepared(stage: int) -> dict:
    """Ranks 0-1 train; each writes ahead what a switch to rank r of 3 needs; rank 2,
    built ahead, writes the optimizer state it will import and a receive buffer,
    as worker/elastic/joining.py does; then the join exchange, and training on."""
    rank, _, engine = pair_then_newcomer(stage, build_for=Collectives.ahead(2, 3, "gloo"))
    state = engine.state
    if rank < 2:
        plan = state.reserve_plan(rank, 3)
        send = sent_bound(state, rank, 3)
    else:
        state.rebind(Collectives(None))
        plan = state.reserve_plan(rank, 3, buffers=False)
        send = 0
    # what a newcomer knows of the optimizer's state, it learned from a probe
    assert any(dtype == torch.float32 for _, dtype, _ in plan), plan
    state.reserve = Reserve.make(plan)
    reserved = _pointers(*(t for ts in state.reserve._free.values() for t in ts))
    wire = ExchangeBuffers.make(send, packed_bound(state, rank, 3), wire_device(state.comm))
    handover = exchange(state, holds_state=rank < 2, via=None, new_members=[0, 1, 2], buffers=wire)
    engine.adopt(handover, Collectives(None) if rank < 2 else None)
    built = [
        t
        for b in engine.buckets
        for t in (b.full if stage < 3 else None, b.master, b.grad_full, b.grad_shard)
        if t is not None
    ]
    took_buffers = _pointers(*built) <= reserved if rank < 2 else True
    took_state = _pointers(*_state_tensors(engine)) <= reserved
    received_into = handover.received is not None and (
        handover.received.data_ptr() == wire.recv.data_ptr()
    )
    leftover = state.reserve.nbytes
    assert (engine.rank, engine.world_size, engine.global_steps) == (rank, 3, 3)
    train(engine, range(3, STEPS))
    return {
        "diff": matches_reference(engine),
        "took_buffers": took_buffers,
        "took_state": took_state,
        "received_into": received_into,
        "leftover": leftover,
    }


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_scale_up_prepared_ahead_takes_its_buffers_and_trains_as_the_reference(
    pools, stage: int
) -> None:
    for rank, got in enumerate(pools(3).run(join_prepared, stage)):
        assert got["took_buffers"], f"rank {rank} built new buffers: {got}"
        assert got["took_state"], f"rank {rank} made new optimizer state: {got}"
        assert got["received_into"], f"rank {rank} received into a new buffer: {got}"
        assert got["leftover"] == 0, f"rank {rank} kept what the build did not take: {got}"


def _entries(ranges, fields: dict[str, torch.dtype], cuts: int, gen: torch.Generator):
    """Entries for ``ranges`` as a hand-over slices them: ``cuts`` ranges split in two."""
    entries = {}
    for i, r in enumerate(ranges):
        pieces = [(r.start, r.stop)]
        if i < cuts and r.numel > 1:
            mid = int(torch.randint(r.start + 1, r.stop, (1,), generator=gen))
            pieces = [(r.start, mid), (mid, r.stop)]
        for a, b in pieces:
            state = {k: torch.zeros(b - a, dtype=d) for k, d in fields.items()}
            state["step"] = torch.tensor(7.0)
            entries[f"{r.name}[{a}:{b}]"] = {"master": torch.zeros(b - a), "state": state}
    return entries


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_packed_bound_covers_every_split_of_a_ranks_share(stage: int) -> None:
    from coordinator.core.ranges import owned_ranges
    from tests.test_elastic_engine import make

    engine = make(stage)
    train(engine, range(0, 1))  # the optimizer holds its state: the fields are read from it
    state = engine.state
    fields = state.state_fields()
    assert set(fields) == {"exp_avg", "exp_avg_sq"}
    gen = torch.Generator().manual_seed(stage)
    for world in (1, 2, 3, 4, 7):
        for rank in range(world):
            ranges = owned_ranges(
                state.layout_for(world), rank, partitioned=state.stage.optimizer_sharded
            )
            bound = packed_bound(state, rank, world)
            for cuts in (0, world):
                packed = pack_entries(_entries(ranges, fields, cuts, gen))
                assert packed.numel() <= bound, (world, rank, cuts, packed.numel(), bound)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_sent_bound_covers_what_a_rank_sends_and_no_more_than_it_owns(stage: int) -> None:
    """Scale-ups and scale-downs (the last ranks leave): what each old rank packs
    for every other new rank, as worker/live/exchange.py ``exchange`` slices it."""
    import types

    from coordinator.core.ranges import Range, RangeIndex, owned_ranges
    from tests.test_elastic_engine import make

    engine = make(stage)
    train(engine, range(0, 1))
    state = engine.state
    fields = state.state_fields()
    partitioned = state.stage.optimizer_sharded
    gen = torch.Generator().manual_seed(stage)
    for old_world, new_world in ((2, 3), (3, 2), (3, 4), (4, 2), (2, 1)):
        for rank in range(old_world):
            new_rank = rank if rank < new_world else None
            view = types.SimpleNamespace(
                stage=state.stage,
                rank=rank,
                layout=state.layout_for(old_world),
                layout_for=state.layout_for,
                state_fields=lambda: fields,
            )
            held = owned_ranges(view.layout, rank, partitioned=partitioned)
            index = RangeIndex((r, "") for r in held)
            sent = 0
            for d in range(new_world):
                if d == new_rank:
                    continue
                wanted = owned_ranges(state.layout_for(new_world), d, partitioned=partitioned)
                parts = [Range(w.name, a, b) for w in wanted for _, a, b, _ in index.overlapping(w)]
                if parts:
                    sent += _Packing.of(_entries(parts, fields, 0, gen)).nbytes
            bound = sent_bound(view, new_rank, new_world)
            case = (old_world, new_world, rank, sent, bound)
            assert sent <= bound, case
            if partitioned and new_rank == 0 and new_world < old_world:
                assert sent == 0 and bound < 64 * 1024, case  # it keeps all it owns


class _NeedsArgs(torch.optim.Optimizer):
    def __init__(self, params, schedule) -> None:  # no defaults to rebuild it from
        super().__init__(params, {"lr": 1.0})


def test_a_newcomer_probes_its_optimizers_per_element_state() -> None:
    w = torch.nn.Parameter(torch.zeros(3))
    cpu = torch.device("cpu")
    adam = probe_state_fields(torch.optim.AdamW([w], lr=1e-3), cpu)
    assert adam == {"exp_avg": torch.float32, "exp_avg_sq": torch.float32}
    momentum = probe_state_fields(torch.optim.SGD([w], lr=0.1, momentum=0.9), cpu)
    assert momentum == {"momentum_buffer": torch.float32}
    assert probe_state_fields(torch.optim.SGD([w], lr=0.1), cpu) == {}
    assert probe_state_fields(_NeedsArgs([w], schedule=None), cpu) == {}
    assert w.grad is None and torch.equal(w, torch.zeros(3)), "the probe touched the model"


def _agreed(*votes: BoundaryVote) -> BoundaryVote:
    return BoundaryVote.decode(*map(max, zip(*(v.encode() for v in votes), strict=True)))


def test_the_ranks_switch_once_nobody_waits() -> None:
    one_waits = _agreed(BoundaryVote(5), BoundaryVote(4, waiting=True))
    assert one_waits.generation == 5 and not one_waits.switches_to_newer(4)
    assert _agreed(BoundaryVote(5), BoundaryVote(5)).switches_to_newer(4)
    # a rank that has not heard of generation 5 yet does not hold the others back
    assert _agreed(BoundaryVote(5), BoundaryVote(4)).switches_to_newer(4)
    assert not _agreed(BoundaryVote(4), BoundaryVote(4)).switches_to_newer(4)


@pytest.mark.timeout(60)
def test_members_meet_ahead_and_switch_once_the_newcomer_is_ready() -> None:
    gen = _Generation(f"127.0.0.1:{_free_port()}", world_size=3)
    planes = [ControlPlane(_Client(str(r)), gen, "gloo", timedelta(seconds=10)) for r in range(3)]
    newcomer_ready = threading.Event()
    met: dict[int, object] = {}
    deadline = time.monotonic() + 30

    def newcomer() -> None:
        met[2] = planes[2]._meet(gen, deadline, ready=newcomer_ready.is_set)

    thread = threading.Thread(target=newcomer, name="newcomer")
    thread.start()
    try:
        # the members train on: each step boundary, they connect ahead and look again
        ready = [False, False]
        for _ in range(20):
            ready = [planes[r].prepare(gen) for r in (0, 1)]
            time.sleep(0.02)
        assert ready == [False, False], "ready before the newcomer was"
        assert thread.is_alive(), "the newcomer met the members before they switched"
        assert all(planes[r]._ahead is not None for r in (0, 1)), "not connected ahead"
        newcomer_ready.set()
        t = time.monotonic()
        while not all(ready) and time.monotonic() - t < 10:
            ready = [planes[r].prepare(gen) for r in (0, 1)]
            time.sleep(0.01)
        assert all(ready), "the members never saw every rank ready"
        assert thread.is_alive(), "the newcomer met before the members arrived"
        # the switch: the members meet at the store they hold, and so does the newcomer
        held = [planes[r]._ahead.store for r in (0, 1)]
        switch = time.monotonic()
        members = [
            threading.Thread(target=lambda r=r: met.__setitem__(r, planes[r]._meet(gen, deadline)))
            for r in (0, 1)
        ]
        for m in members:
            m.start()
        for m in (*members, thread):
            m.join(timeout=20)
        assert met[0] is held[0] and met[1] is held[1], "the members met at another store"
        assert met[2] is not None
        # at most a few of the newcomer's looks apart (it never backs off past them)
        assert time.monotonic() - switch < 2.0
    finally:
        newcomer_ready.set()
        thread.join(timeout=20)
