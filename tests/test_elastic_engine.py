"""Live re-sharding between world sizes, against the uninterrupted torch reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import default_collate

import worker
from tests.reference import OPTIMIZERS, VOCAB, max_diff, seeded_model
from tests.test_checkpoint import GLOBAL, global_batch, reference, use_extra
from worker.ballot import BoundaryVote
from worker.collectives import CollectiveError, Collectives, Handle
from worker.data import LoaderConfig, PackedTokens, StepLoader
from worker.live import (
    GradientLog,
    Holding,
    buffer_of,
    exchange,
    pack_entries,
    plan_restore,
    refresh_replica,
    roll_forward,
    start_refresh,
    unpack_entries,
)

STEPS = 9


def make(
    stage: int, joining: bool = False, group=None, build_for=None, **config
) -> worker.ZeroEngine:
    model = seeded_model()
    config = worker.ZeroConfig(stage=stage, bucket_numel=97, stage3_min_unit_numel=1, **config)
    return worker.ZeroEngine(
        model,
        OPTIMIZERS["adamw"](model),
        config=config,
        group=group,
        initial_state="peers" if joining else "module",
        build_for=build_for,
    )


def train(engine: worker.ZeroEngine, steps: range) -> None:
    per = GLOBAL // engine.world_size
    for step in steps:
        idx, tgt = global_batch(step)
        sl = slice(engine.rank * per, (engine.rank + 1) * per)
        engine.backward(engine(idx[sl], tgt[sl], use_extra(step)))
        engine.step()


def pair_then_newcomer(
    stage: int, build_for: Collectives | None = None, **config
) -> tuple[int, dist.ProcessGroup, worker.ZeroEngine]:
    """Ranks 0-1 train 3 steps over their own group; rank 2 builds to join them."""
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])
    if rank < 2:
        engine = make(stage, group=pair, **config)
        train(engine, range(0, 3))
    else:
        engine = make(stage, joining=True, build_for=build_for, **config)
    return rank, pair, engine


def matches_reference(engine: worker.ZeroEngine) -> float:
    diff, name = max_diff(engine.full_state_dict(), reference(STEPS))
    assert diff < 1e-5, f"{name} differs from the uninterrupted reference by {diff:.3g}"
    return diff


def resize_2_3_2(stage: int) -> float | None:
    """Ranks 0-1 train; rank 2 joins; then rank 2 leaves gracefully."""
    rank, pair, engine = pair_then_newcomer(stage)
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
    return matches_reference(engine)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resize_2_3_2_matches_uninterrupted_training(pools, stage: int) -> None:
    results = pools(3).run(resize_2_3_2, stage)
    assert results[2] is None and results[0] == results[1]


def join_built_ahead(stage: int, planned_rank: int) -> float | None:
    """Ranks 0-1 train; rank 2 built its buffers ahead for rank ``planned_rank`` of 3
    (worker/elastic/joining.py [Note: a newcomer builds ahead]), then joins as rank 2."""
    ahead = Collectives.ahead(planned_rank, 3, "gloo")
    rank, _, engine = pair_then_newcomer(stage, build_for=ahead)
    if rank == 2:
        assert (engine.rank, engine.world_size) == (planned_rank, 3)
        builds = engine.state.builds
        if planned_rank == rank:
            engine.state.rebind(Collectives(None))
            assert engine.state.builds == builds, "a rank built as planned is not rebuilt"
        else:
            # a superseded rendezvous gave another rank: the buffers are rebuilt
            with pytest.raises(ValueError, match=f"built for rank {planned_rank} of 3"):
                engine.state.rebind(Collectives(None))
            engine.state.build(Collectives(None), from_module=False)
    handover = exchange(engine.state, holds_state=rank < 2, via=None, new_members=[0, 1, 2])
    # members rebuild for the new world; the newcomer fills the buffers it built
    engine.adopt(handover, Collectives(None) if rank < 2 else None)
    assert (engine.rank, engine.world_size, engine.global_steps) == (rank, 3, 3)
    train(engine, range(3, STEPS))
    return matches_reference(engine)


@pytest.mark.parametrize(("stage", "planned_rank"), [(1, 2), (2, 2), (3, 2), (3, 0)])
def test_a_newcomer_built_ahead_of_its_group_trains_as_the_reference(
    pools, stage: int, planned_rank: int
) -> None:
    results = pools(3).run(join_built_ahead, stage, planned_rank)
    assert results[0] == results[1] == results[2]


@pytest.mark.parametrize("copy", [True, False])
@pytest.mark.parametrize("shift", [0, 3])
def test_pack_roundtrip_is_exact_and_pickle_free(copy: bool, shift: int) -> None:
    """Exact either way; without copies (a replica read at recovery) the values are
    views of the buffer where their alignment allows, copies where it does not (a
    buffer cut at an odd offset from a larger one)."""
    entries = {
        "w[0:5]": {
            "master": torch.randn(5),
            "state": {"exp_avg": torch.randn(5), "step": torch.tensor(3.0), "flag": True},
        },
        "h[0:3]": {"master": torch.randn(3).bfloat16(), "state": {"n": torch.arange(3)}},
        "b[2:3]": {"master": torch.randn(1, dtype=torch.float64), "state": {}},
    }
    packed = pack_entries(entries)
    buf = torch.cat([torch.zeros(shift, dtype=torch.uint8), packed])[shift:]
    assert buf.dtype == torch.uint8
    assert b"\x80\x04" not in bytes(buf[:16].tolist())  # not a pickle stream
    back = unpack_entries(buf, copy=copy)
    shares = (
        back["w[0:5]"]["master"].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    )
    assert shares == (not copy and shift == 0)
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


class LoggingMember:
    """The gradient-log half of an elastic session, without a coordinator."""

    def __init__(self) -> None:
        self.log = GradientLog()

    def vote(self, engine) -> BoundaryVote:
        return BoundaryVote()

    def log_gradients(self, engine, grads, used) -> Handle:
        st = engine.state
        return self.log.start(
            st.comm, 0, st.global_steps + 1, grads, used, st.optimizer.hyperparams()
        )

    def after_load(self, engine) -> None:
        pass

    def after_step(self, engine, agreed, stepped) -> None:
        if stepped:
            self.log.commit(engine.global_steps)

    def recover(self, engine, exc):
        raise exc

    def generation_id(self) -> int:
        return 0

    def replica_bytes(self) -> int:
        return self.log.nbytes()

    def close(self) -> None:
        pass


def bring_forward(stage: int, optimizer: str, dtype: str, clip: float) -> int:
    """3 ranks train 3 steps, swap replicas, train 4 more logging gradients with a
    learning rate that changes every step; each rank then rebuilds its left
    neighbour's state from the replica and the log (fp16 may skip a step: the
    log then has one step fewer)."""
    model = seeded_model()
    opt = OPTIMIZERS[optimizer](model)
    config = worker.ZeroConfig(
        stage=stage, bucket_numel=97, stage3_min_unit_numel=1, dtype=dtype,
        gradient_clipping=clip,
    )  # fmt: skip
    engine = worker.ZeroEngine(model, opt, config=config)
    member = LoggingMember()
    engine.membership = member
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for steps in (range(0, 3), range(3, 7)):
        for step in steps:
            train(engine, range(step, step + 1))
            sched.step()
        if steps.start == 0:
            replica = refresh_replica(engine.state, 0)
            member.log.reset(0, engine.global_steps)
            at = engine.global_steps
    assert member.log.coverage() == (0, at, engine.global_steps) and engine.global_steps > at
    left = (engine.rank - 1) % 3
    steps = member.log.between(at, engine.global_steps)
    rebuilt = roll_forward(engine.state, left, replica.neighbour, steps)
    actual: list = [None] * 3
    dist.all_gather_object(actual, engine.state.export_ranges())
    assert rebuilt.keys() == actual[left].keys()
    for key, want in actual[left].items():
        got = rebuilt[key]
        assert torch.equal(got["master"], want["master"]), key
        assert got["state"].keys() == want["state"].keys(), key
        for k, v in want["state"].items():
            assert torch.equal(got["state"][k], v), (key, k)
    engine.membership = None
    return len(rebuilt)


def assert_replica_holds(replica, at: list, rank: int) -> None:
    """``replica`` holds rank ``rank``'s and its left neighbour's exported state."""
    for got, want in ((replica.own, at[rank]), (replica.neighbour, at[(rank - 1) % len(at)])):
        assert got.keys() == want.keys()
        for key, entry in want.items():
            assert torch.equal(got[key]["master"], entry["master"]), key
            for k, v in entry["state"].items():
                assert torch.equal(got[key]["state"][k], v), (key, k)


def refresh_across_a_step(stage: int) -> bool:
    """3 ranks train 3 steps, start a refresh, train a fourth step while its bytes
    move, then finish it: the replica holds each rank's and its left neighbour's
    state of step 3, not of step 4. Then two more refreshes: into the first
    replica's buffer, which they reuse, and into one too small, which they do not."""
    engine = make(stage)
    train(engine, range(0, 3))
    at_3: list = [None] * 3
    dist.all_gather_object(at_3, engine.state.export_ranges())
    pending = start_refresh(engine.state, 0)
    train(engine, range(3, 4))
    replica = pending.finish()
    assert replica.counters.global_steps == 3 and engine.global_steps == 4
    assert_replica_holds(replica, at_3, engine.rank)
    moved = engine.state.export_ranges()
    ahead = any(not torch.equal(moved[k]["master"], v["master"]) for k, v in replica.own.items())
    # [Note: a snapshot into the last one's buffer]
    spare = buffer_of(replica)
    for into, reused in ((spare, True), (torch.empty(16, dtype=torch.uint8), False)):
        at: list = [None] * 3
        dist.all_gather_object(at, engine.state.export_ranges())
        pending = start_refresh(engine.state, 0, into=into)
        step = engine.global_steps
        train(engine, range(step, step + 1))
        fresh = pending.finish()
        assert fresh.counters.global_steps == step
        assert (fresh.own_packed.data_ptr() == into.data_ptr()) == reused
        assert_replica_holds(fresh, at, engine.rank)
        if reused:
            assert buffer_of(fresh) is spare, "the buffer reused is the one to reuse again"
    return ahead


@pytest.mark.parametrize("stage", [1, 3])
def test_a_refresh_snapshots_its_step_while_the_next_one_trains(pools, stage: int) -> None:
    """[Note: a refresh overlaps a step]: the copies move during the next step's
    collectives, and the replica is the state of the step the refresh began at."""
    assert all(pools(3).run(refresh_across_a_step, stage))


def session_reuses_buffers(stage: int) -> bool:
    """An elastic session's refresh cycle, without a coordinator: a newcomer's first
    snapshot goes into the buffer its shards arrived in; once a confirmed refresh
    retires a replica, the next snapshot goes into that replica's buffer."""
    from types import SimpleNamespace

    from worker.elastic.session import ElasticSession

    rank, _, engine = pair_then_newcomer(stage, replica_interval=1)
    session = ElasticSession()
    session.control = SimpleNamespace(generation=SimpleNamespace(id=1))
    handover = exchange(engine.state, holds_state=rank < 2, via=None, new_members=[0, 1, 2])
    session._adopt(engine, handover, Collectives(None) if rank < 2 else None)
    received = handover.received
    assert received is not None and (session.spare is received or rank < 2)
    buffers, at = [], []
    for step in range(3, 7):
        at = [None] * 3
        dist.all_gather_object(at, engine.state.export_ranges())
        session._refresh_replica(engine)  # confirms the one before, then starts
        buffers.append(session.refreshing.own)
        train(engine, range(step, step + 1))
    session._confirm_refresh(engine)
    # refresh 1's confirm retired replica 0, whose buffer refresh 2 took; refresh
    # 2's confirm retired replica 1 for refresh 3
    assert buffers[2].data_ptr() == buffers[0].data_ptr()
    assert buffers[3].data_ptr() == buffers[1].data_ptr()
    assert session.spare is not None
    assert session.replica_bytes() >= session.replicas[0].nbytes() + session.spare.numel()
    # the last replica holds the state of the step it began at, exactly
    assert_replica_holds(session.replicas[0], at, engine.rank)
    # the newcomer's first snapshot went where its shards had arrived
    return rank < 2 or buffers[0].data_ptr() == received.data_ptr()


@pytest.mark.parametrize("stage", [1, 3])
def test_a_session_snapshots_into_buffers_nothing_reads(pools, stage: int) -> None:
    """[Note: a snapshot into the last one's buffer] in worker/live/replicas.py."""
    assert all(pools(3).run(session_reuses_buffers, stage))


class LoadCounting(LoggingMember):
    def __init__(self) -> None:
        super().__init__()
        self.loads = 0

    def after_load(self, engine) -> None:
        self.loads += 1


def micro_batches(engine: worker.ZeroEngine, step: int, accumulation: int):
    """This rank's micro-batches of ``step``: its share of the global batch, split."""
    idx, tgt = global_batch(step)
    per = GLOBAL // engine.world_size // accumulation
    first = engine.rank * per * accumulation
    for m in range(accumulation):
        sl = slice(first + m * per, first + (m + 1) * per)
        yield idx[sl], tgt[sl], use_extra(step)


def cut_short_then_rebuilt(stage: int, accumulation: int) -> float:
    """Step 3's last backward fails (a lost peer, simulated on every rank alike)
    after a parameter got its gradient but before it was taken; the ranks rebuild,
    as a recovery does, and train steps 3-8 again from their first micro-batch."""
    model = seeded_model()
    config = worker.ZeroConfig(
        stage=stage, bucket_numel=97, gradient_accumulation_steps=accumulation
    )
    engine = worker.ZeroEngine(model, OPTIMIZERS["adamw"](model), config=config)

    def train_steps(steps: range) -> None:
        for step in steps:
            for batch in micro_batches(engine, step, accumulation):
                engine.backward(engine(*batch))
                engine.step()

    train_steps(range(0, 3))
    *before, last = micro_batches(engine, 3, accumulation)
    for batch in before:
        engine.backward(engine(*batch))
        assert not engine.step()
    reducer, taken = engine.state.reducer, 0
    on_grad = reducer.on_grad

    def fails_at_the_third(b, pos, p) -> None:
        nonlocal taken
        taken += 1
        if taken == 3:
            raise CollectiveError("a peer was lost (simulated)")
        on_grad(b, pos, p)

    reducer.on_grad = fails_at_the_third
    with pytest.raises(CollectiveError):
        engine.backward(engine(*last))
    reducer.on_grad = on_grad
    # what a recovery does (reconfigure() is for step boundaries only)
    handover = exchange(engine.state, holds_state=True, via=None, new_members=[0, 1])
    engine.adopt(handover, Collectives(None))
    assert engine.global_steps == 3
    train_steps(range(3, STEPS))
    return matches_reference(engine)


@pytest.mark.parametrize(("stage", "accumulation"), [(1, 2), (2, 1), (3, 1), (3, 2)])
def test_a_backward_cut_short_leaves_nothing_behind(pools, stage: int, accumulation: int) -> None:
    """A step abandoned in its backward is trained again from its first micro-batch:
    a gradient the abandoned backward produced and the engine never took (stages
    2-3 take each from ``.grad`` as it arrives) must not be added to the next
    backward's, and the micro-batches counted before the loss must not move the
    accumulation boundary."""
    pools(2).run(cut_short_then_rebuilt, stage, accumulation)


def scale_with_a_newcomer(stage: int, path: str) -> tuple[float, ...]:
    """fp16, dynamic scaling, the scale doubling every 4 good steps: ranks 0-1 train
    3 steps and save; rank 2 joins; all train to step 9; then every rank loads
    step 3 and trains to 9 again. The scales along the way, rank by rank."""
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])
    fp16 = {"dtype": "fp16", "initial_scale_power": 4, "loss_scale_window": 4}
    engine = make(stage, joining=rank == 2, group=pair if rank < 2 else None, **fp16)
    if rank < 2:
        train(engine, range(0, 3))
        engine.save_checkpoint(path)
    engine.reconfigure(None, via=None, new_members=[0, 1, 2], holds_state=rank < 2)
    scales = []
    for step in range(3, STEPS):
        train(engine, range(step, step + 1))
        scales.append(engine.loss_scale)
    engine.load_checkpoint(path)
    for step in range(3, STEPS):
        train(engine, range(step, step + 1))
        scales.append(engine.loss_scale)
    return tuple(scales)


@pytest.mark.parametrize("stage", [1, 3])
def test_the_loss_scale_changes_at_the_same_step_on_every_rank(pools, tmp_path, stage) -> None:
    """The dynamic fp16 scale's window and hysteresis travel with it (to a newcomer,
    into checkpoints): a rank that started its window again would double the scale
    at another step than its peers, and they would add gradients of different
    scales. No step overflows here: the scale doubles at steps 4 and 8."""
    results = pools(3).run(scale_with_a_newcomer, stage, str(tmp_path / "ckpt"))
    assert results[0] == results[1] == results[2], results
    uninterrupted = [16.0 * 2 ** (step // 4) for step in range(4, STEPS + 1)]
    assert list(results[0]) == uninterrupted * 2, results[0]


def unsharded_follow_the_holders(stage: int) -> list[list[torch.Tensor]]:
    """A BatchNorm model with a frozen layer, built from each rank's own seed (rank 2's
    frozen weights differ): ranks 0-1 train on their own halves (their running
    statistics differ); rank 2 joins; rank 0 then leaves. The buffers and frozen
    parameters of every rank after each change."""
    rank = dist.get_rank()
    pair, survivors = dist.new_group([0, 1]), dist.new_group([1, 2])
    torch.manual_seed(rank)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
        torch.nn.Linear(8, 4), torch.nn.Linear(4, 1),
    )  # fmt: skip
    model[3].requires_grad_(False)
    config = worker.ZeroConfig(stage=stage, bucket_numel=29, stage3_min_unit_numel=1)
    engine = worker.ZeroEngine(
        model,
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2),
        config=config,
        group=pair if rank < 2 else None,
        initial_state="peers" if rank == 2 else "module",
    )
    data = torch.Generator().manual_seed(rank)

    def train(steps: int) -> None:
        for _ in range(steps):
            x = torch.randn(4, 6, generator=data) * (rank + 1) + rank
            engine.backward(engine(x).square().mean())
            engine.step()

    def unsharded() -> list[torch.Tensor]:
        return [t.detach().clone() for t in (*model.buffers(), *model[3].parameters())]

    if rank < 2:
        train(3)
    seen = [unsharded()]
    engine.reconfigure(None, via=None, new_members=[0, 1, 2], holds_state=rank < 2)
    seen.append(unsharded())
    train(2)
    seen.append(unsharded())
    engine.reconfigure(survivors if rank > 0 else None, via=None, new_members=[1, 2])
    seen.append(unsharded())
    return seen


@pytest.mark.parametrize("stage", [1, 3])
def test_buffers_and_frozen_parameters_follow_the_lowest_rank_that_held_state(
    pools, stage: int
) -> None:
    """A newcomer's BatchNorm statistics and frozen weights are its fresh module's
    until the change gives it a holder's: the new world's lowest rank that held
    state (rank 0 on a join; on rank 0's leave, rank 1, now rank 0)."""
    before, joined, trained, left = zip(
        *pools(3).run(unsharded_follow_the_holders, stage), strict=True
    )
    assert any((a - b).abs().max() > 0 for a, b in zip(before[0], before[1], strict=True))
    assert any((a - b).abs().max() > 0 for a, b in zip(before[0], before[2], strict=True))
    for rank in (1, 2):
        for mine, theirs in zip(joined[rank], before[0], strict=True):
            assert torch.equal(mine, theirs), f"rank {rank} does not hold rank 0's"
    for mine, theirs in zip(left[2], trained[1], strict=True):
        assert torch.equal(mine, theirs), "the survivors do not hold rank 1's"


def loader_data() -> PackedTokens:
    g = torch.Generator().manual_seed(0)
    return PackedTokens(torch.randint(0, VOCAB, (60 * 5 + 1,), generator=g), 5)


def loader_reference(steps: int, plan) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, the whole global batch of each step as the loader's plan has it:
    the final parameters and each step's loss."""
    data, model = loader_data(), seeded_model()
    opt = OPTIMIZERS["adamw"](model)
    losses = []
    for step in range(steps):
        x, y = default_collate([data[i] for i in plan.batch_at(step)])
        loss = model(x, y, use_extra(step))
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    final = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return final, losses


def resize_with_micro_batches(stage: int, global_batch: int, micro: int | None) -> float | None:
    """Global batches of ``global_batch`` in micro-batches of ``micro``: at 12 and 2,
    three per rank at 2 ranks, two at 3; at sizes that do not divide the batch the
    shares differ and padding fills in ([Note: uneven shares]). Ranks 0-1 train
    (the config says 3), rank 2 joins, then leaves."""
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])
    group = pair if rank < 2 else None
    engine = make(stage, joining=rank == 2, group=group, gradient_accumulation_steps=3)
    loader = StepLoader(
        loader_data(),
        LoaderConfig(global_batch=global_batch, micro_batch=micro, num_workers=0, prefetch=0),
    ).attach(engine)

    def train(steps: range) -> None:
        for step in steps:
            assert engine.global_steps == step
            for x, y in loader.current():
                engine.backward(engine(x, y, use_extra(step)))
                engine.step(samples=x.shape[0])

    if rank < 2:
        train(range(0, 3))
    engine.reconfigure(None, via=None, new_members=[0, 1, 2], holds_state=rank < 2)
    train(range(3, 6))
    # the loss it logs is the mean over the global batch, padding or not
    want, losses = loader_reference(STEPS, loader.plan)
    assert engine.mean_loss() == pytest.approx(losses[5], rel=1e-5)
    engine.reconfigure(pair if rank < 2 else None, via=None, new_members=[0, 1])
    if rank == 2:
        return None
    train(range(6, STEPS))
    diff, name = max_diff(engine.full_state_dict(), want)
    assert diff < 1e-5, f"{name} differs from the uninterrupted reference by {diff:.3g}"
    return diff


@pytest.mark.parametrize(
    ("stage", "global_batch", "micro"),
    [(1, 12, 2), (2, 12, 2), (3, 10, 1), (2, 10, 3), (1, 2, None)],
)
def test_accumulation_follows_the_micro_batches_across_world_sizes(
    pools, stage: int, global_batch: int, micro: int | None
) -> None:
    """worker/data/loader.py [Note: accumulation that follows the world], and at world
    sizes that do not divide the batch (10 at 3 ranks; 2 at 3, one rank all padding)."""
    results = pools(3).run(resize_with_micro_batches, stage, global_batch, micro)
    assert results[2] is None and results[0] == results[1]


def load_tells_the_session(path: str) -> tuple[int, str]:
    model = seeded_model()
    engine = worker.ZeroEngine(
        model, OPTIMIZERS["sgd"](model), config=worker.ZeroConfig(stage=1, bucket_numel=97)
    )
    member = LoadCounting()
    engine.membership = member
    train(engine, range(0, 2))
    engine.save_checkpoint(path)
    assert member.loads == 0
    engine.load_checkpoint(path)
    engine.membership = None
    return member.loads, str(engine.last_checkpoint)


def test_a_loaded_checkpoint_replaces_what_the_session_kept(pools, tmp_path) -> None:
    """Replicas (and a gradient log) of the state before a load would let a recovery
    roll back past the checkpoint (chaos seed 9: a job restarted from the module,
    its script loaded step 12, a kill then rolled it back to the replica of step 0):
    the engine tells the session, which refreshes them (ElasticSession.after_load)."""
    path = str(tmp_path / "ckpt")
    assert pools(3).run(load_tells_the_session, path) == [(1, path)] * 3


@pytest.mark.parametrize(
    ("stage", "optimizer", "dtype", "clip"),
    [(1, "adamw", "fp32", 0.0), (2, "sgd", "bf16", 1e-3), (3, "adamw", "fp16", 0.0)],
)
def test_a_lost_rank_is_rebuilt_bit_for_bit_from_its_replica_and_the_log(
    pools, stage: int, optimizer: str, dtype: str, clip: float
) -> None:
    """[Note: rolling a lost rank forward]: the replayed optimizer steps are the ones
    the rank ran, to the bit, including a parameter some steps do not use
    (``use_extra``), a scheduled learning rate, mixed precision and clipping."""
    assert all(pools(3).run(bring_forward, stage, optimizer, dtype, clip))


# ---------------------------------------------------------------- recovery sources


def test_holding_roundtrips_through_its_row() -> None:
    h = Holding(
        live=(7, 2, 3), replicas=((6, 40, 1, 3), (6, 42, 1, 3)), holds_state=True,
        checkpoint="/ckpt/é x",
    )  # fmt: skip
    assert Holding.decode(h.encode()) == h
    logged = dataclasses.replace(h, live_step=41, log=(6, 40, 41))
    assert Holding.decode(logged.encode()) == logged
    empty = Holding(live=None, replicas=(), holds_state=False, checkpoint=None)
    assert Holding.decode(empty.encode()) == empty
    with pytest.raises(ValueError, match="checkpoint path longer"):
        Holding(None, (), True, "/" + "x" * 2000).encode()


def held(live=None, replica=None, holds_state=True, checkpoint=None, steps=(0,)) -> Holding:
    """``replica``: (generation, rank, world size), held as of each of ``steps``."""
    replicas = () if replica is None else tuple((replica[0], s, *replica[1:]) for s in steps)
    return Holding(live=live, replicas=replicas, holds_state=holds_state, checkpoint=checkpoint)


def test_a_newcomer_lost_while_joining_leaves_the_members_live_state() -> None:
    # generation 2 = {w0, w1}; generation 3 added w2, which died before it held anything
    members = [held(live=(2, 0, 2), checkpoint="/c"), held(live=(2, 1, 2), checkpoint="/c")]
    plan = plan_restore(members)
    assert (plan.source, plan.generation) == ("live", 2)


def test_a_member_lost_needs_its_state_from_elsewhere() -> None:
    # rank 2 of generation 3 trained and died: the live state of 3 misses rank 2
    live = [(3, 0, 3), (3, 1, 3)]
    replicas = [held(live=s, replica=(3, s[1], 3), checkpoint="/c") for s in live]
    # rank 0 keeps rank 2's replica (its left neighbour)
    assert plan_restore(replicas).source == "replica"
    # rank 1 lost instead: rank 2 keeps its replica, but rank 2 is gone too
    only_0 = [held(live=(3, 0, 3), replica=(3, 0, 3), checkpoint="/c")]
    plan = plan_restore(only_0)
    assert (plan.source, plan.checkpoint) == ("checkpoint", "/c")


def test_a_lost_block_is_covered_by_replicas_a_block_away() -> None:
    """worker/elastic/blocks.py [Note: a lost block]: blocks of 2 in a world of 6, the
    block of ranks 2 and 3 gone. Each rank keeps the replica of the rank a block to its
    left, so ranks 4 and 5 hold 2's and 3's; with neighbours one rank away, 3 would
    hold 2's and nobody 3's."""
    survivors = [held(live=(5, r, 6), replica=(5, r, 6), checkpoint="/c") for r in (0, 1, 4, 5)]
    plan = plan_restore(survivors, stride=2)
    assert (plan.source, plan.step, plan.lost) == ("replica", 0, frozenset({2, 3}))
    assert plan_restore(survivors).source == "checkpoint"
    # the block's other rank survived and is here: only the lost one comes from a replica
    five = [*survivors, held(live=(5, 2, 6), replica=(5, 2, 6), checkpoint="/c")]
    assert plan_restore(five, stride=2).lost == {3}
    # two blocks lost, one a block left of the other: 0's replica went with rank 2
    assert plan_restore(survivors[2:], stride=2).source == "checkpoint"


def forward_holding(rank: int, step: int = 12, log=(3, 10, 12), replica_at: int = 10) -> Holding:
    """Rank ``rank`` of generation 3 (3 ranks), whole at ``step``, with replicas of
    ``replica_at`` and its left neighbour's gradient log ``log``."""
    return Holding(
        live=(3, rank, 3), replicas=((3, replica_at, rank, 3),), holds_state=True,
        checkpoint="/c", live_step=step, log=log,
    )  # fmt: skip


def test_a_lost_rank_is_brought_forward_when_its_right_neighbour_logged_up_to_now() -> None:
    # rank 1 lost; rank 2 holds its replica of step 10 and its gradients of 11-12
    plan = plan_restore([forward_holding(0), forward_holding(2)])
    assert (plan.source, plan.generation, plan.step, plan.lost) == (
        "forward", 3, 12, frozenset({1}),
    )  # fmt: skip
    # a restarted worker in the recovery group holds nothing and changes nothing
    newcomer = Holding(live=None, replicas=(), holds_state=False, checkpoint=None)
    assert plan_restore([forward_holding(0), forward_holding(2), newcomer]).source == "forward"
    # two lost at once, each with its right neighbour alive (4 ranks, 0 and 2 lost)
    four = [
        dataclasses.replace(forward_holding(r), live=(3, r, 4), replicas=((3, 10, r, 4),))
        for r in (1, 3)
    ]
    plan = plan_restore(four)
    assert (plan.source, plan.lost) == ("forward", frozenset({0, 2}))
    # rank 1 died at step 13's go, after delivering its gradients: nobody stepped
    plan = plan_restore([forward_holding(0), forward_holding(2, log=(3, 10, 13))])
    assert (plan.source, plan.step) == ("forward", 12)


class LoopbackComm:
    """The two calls a GradientLog makes, with every exchange delivered at once."""

    rank, world_size = 1, 3

    def send_recv(self, send, dst, recv, src, *, async_op):
        for out, into in zip(send, recv, strict=True):
            into.copy_(out)
        return Handle(None, None, 0.0)


def test_the_log_keeps_a_step_whose_go_failed_and_replays_only_up_to_the_plan() -> None:
    log, comm = GradientLog(), LoopbackComm()
    log.reset(0, 10)

    def exchange(step: int) -> None:
        log.start(comm, 0, step, [torch.full((4,), float(step))], [1], [{"lr": 0.1}])

    exchange(11)
    log.commit(11)  # stepped
    exchange(12)
    log.commit(11)  # delivered, then the loss at step 12's go: nobody stepped
    assert log.coverage() == (0, 10, 12)
    assert [e.step for e in log.between(10, 11)] == [11]
    assert log.between(10, 11)[0].grads[0].tolist() == [11.0] * 4
    exchange(14)  # neither the step just done nor the next: not this log's
    log.commit(12)
    assert log.coverage() == (0, 10, 12)


@pytest.mark.parametrize(
    "holdings",
    [
        # the right neighbour's log stops a step short (the lost rank died before sending)
        [forward_holding(0), forward_holding(2, log=(3, 10, 11))],
        # the survivors are at different steps
        [forward_holding(0, step=11, log=(3, 10, 11)), forward_holding(2)],
        # the log starts after the replica: steps between are missing
        [forward_holding(0), forward_holding(2, log=(3, 11, 12))],
        # the log is of another generation
        [forward_holding(0), forward_holding(2, log=(2, 10, 12))],
        # rank 0 lost too: rank 1, its right neighbour, is gone as well
        [forward_holding(2)],
        # a survivor's state is torn (no live state): only replicas can serve
        [forward_holding(0), dataclasses.replace(forward_holding(2), live=None)],
    ],
)
def test_otherwise_recovery_rolls_back_to_the_replicas(holdings) -> None:
    assert plan_restore(holdings).source in ("replica", "checkpoint")


def test_a_torn_live_state_is_never_used() -> None:
    # a peer died during the optimizer update: the survivors' state is half-stepped
    torn = [held(replica=(4, 0, 2), checkpoint="/c")]
    plan = plan_restore(torn)
    assert plan.source == "replica"


def test_replicas_are_all_or_nothing() -> None:
    # one member holds no replica of the generation that lost a rank: it would
    # restore a later step than the others
    mixed = [held(replica=(5, 0, 3)), held(replica=(4, 1, 3))]
    with pytest.raises(RuntimeError, match="replica_interval or save checkpoints"):
        plan_restore(mixed)
    # a restarted worker holds nothing and takes no part in that
    with_newcomer = [held(replica=(5, 0, 3)), held(replica=(5, 1, 3)), held(holds_state=False)]
    assert plan_restore(with_newcomer).source == "replica"


def test_a_loss_right_after_a_change_rolls_back_to_the_replicas_before_it() -> None:
    """Generation 4 grew generation 3 (3 ranks) by one; a member died before 4's first
    replicas were confirmed. The members hold 3's, which still cover 3's ranks (the
    lost one's in its right neighbour's copy); the newcomer holds none of 3's and
    takes its state from the others. After a leave, the leaver's state is in its right
    neighbour's copy too, unless that neighbour is the one lost."""
    members = [held(live=(4, r, 4), replica=(3, r, 3), checkpoint=None) for r in (0, 1)]
    newcomer = held(live=(4, 3, 4), replica=None, checkpoint=None)
    plan = plan_restore([*members, newcomer])
    assert (plan.source, plan.generation, plan.lost) == ("replica", 3, frozenset({2}))
    # rank 1 left in the change (its state handed over) and rank 2 was lost after:
    # rank 0 holds 2's copy, but 1's was with rank 2
    left = [held(live=(4, 0, 2), replica=(3, 0, 3), checkpoint="/c")]
    assert plan_restore(left).source == "checkpoint"
    # a member holding another step of that generation still forbids it
    ahead = held(live=(4, 1, 4), replica=(3, 1, 3), steps=(5,), checkpoint=None)
    with pytest.raises(RuntimeError, match="replica_interval or save checkpoints"):
        plan_restore([members[0], ahead, newcomer])


def test_the_plan_reads_what_is_lost_from_the_holdings() -> None:
    """A group formed after a superseded rendezvous: the ranks of the replicas'
    generation that nobody holds are the lost ones, whatever the schedule said."""
    group = [held(replica=(3, 0, 3)), held(replica=(3, 2, 3)), held(holds_state=False)]
    plan = plan_restore(group)
    assert (plan.source, plan.generation, plan.lost) == ("replica", 3, frozenset({1}))
    nothing = [held(holds_state=False), held(holds_state=False, checkpoint="/c")]
    assert plan_restore(nothing).source == "checkpoint"


def test_a_group_that_holds_nothing_starts_from_the_module() -> None:
    """Every holder of the job's state was lost (two kills before the replicas were
    refreshed, the survivors then restarted): fresh processes start again, as a
    torchrun restart would; a survivor holding a part nothing completes refuses."""
    fresh = [held(holds_state=False), held(holds_state=False)]
    assert plan_restore(fresh).source == "module"
    partial = [held(replica=(3, 2, 3)), held(holds_state=False)]
    with pytest.raises(RuntimeError, match="restarts from its script's checkpoint"):
        plan_restore(partial)


def test_a_refresh_cut_short_restores_the_newest_step_every_member_holds() -> None:
    """The loss came during a replica swap at step 10: rank 0 got the new copies,
    rank 1 did not (it kept step 8's). Restoring each from its newest would mix
    steps 8 and 10; the plan takes step 8, which both still hold."""
    torn = [held(replica=(3, 0, 3), steps=(8, 10)), held(replica=(3, 1, 3), steps=(8,))]
    plan = plan_restore(torn)
    assert (plan.source, plan.generation, plan.step, plan.lost) == (
        "replica", 3, 8, frozenset({2}),
    )  # fmt: skip
    # the barrier after the swap passed on rank 0 (it dropped step 8): rank 1 then
    # finished the swap too and holds step 10 beside its unconfirmed step 8
    confirmed = [held(replica=(3, 0, 3), steps=(10,)), held(replica=(3, 1, 3), steps=(8, 10))]
    assert plan_restore(confirmed).step == 10


def agreed(*votes: BoundaryVote) -> BoundaryVote:
    """What the ballot's MAX all-reduce makes of the ranks' votes."""
    return BoundaryVote.decode(*map(max, zip(*(v.encode() for v in votes), strict=True)))


def test_the_vote_says_whether_anyone_stays() -> None:
    """One rank asking to leave is handed over; when every rank asks, nobody can take
    the shards ([Note: leaving with nobody to hand over to])."""
    one = agreed(BoundaryVote(3), BoundaryVote(4, leaving_rank=1, staying=False))
    assert one == BoundaryVote(4, leaving_rank=1, staying=True) and not one.everyone_leaving
    every = agreed(*(BoundaryVote(4, leaving_rank=r, staying=False) for r in range(3)))
    assert every.leaving_rank == 2 and every.everyone_leaving
    assert not agreed(BoundaryVote(), BoundaryVote()).everyone_leaving
