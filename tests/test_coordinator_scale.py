"""The coordinator at scale: host heartbeats and incremental generations.

Behaviour only (no timing: speed is measured in bench/coordinator_load.py).
"""

from __future__ import annotations

import queue
import time

import grpc
import pytest

from coordinator._proto.zeroplane.coordinator.v1 import coordinator_pb2 as pb
from coordinator.control.membership import Membership, StaleGeneration, UnknownWorker
from coordinator.core.generation_codec import (
    generation_from_proto,
    generation_to_proto,
    members_delta,
)
from coordinator.core.layout import compute_layout
from coordinator.core.messages import RankBeat, WorkerInfo, WorkerReport
from coordinator.core.reshard import LazyMoves, RankSchedules, reshard_schedule
from tests.coordinator_util import (
    AUTH,
    HOSTS,
    Clock,
    client,
    config,
    formed_on_hosts,
    inventory,
    raw_stub,
    register_request,
    running,
    wait_until,
    worker,
)

pytestmark = pytest.mark.timeout(60)


def beats(m: Membership, ranks: list[str], **kw: object) -> list[RankBeat]:
    return [RankBeat(worker_id=w, generation_id=m.generation_id, **kw) for w in ranks]


def test_host_heartbeats_keep_every_ranks_lease() -> None:
    clock = Clock()
    m = formed_on_hosts(clock)
    report = WorkerReport(step=5, applied_generation_id=1)
    for _ in range(10):  # 20 s: far past a 3 s lease
        clock.now += 2.0
        for host, ranks in HOSTS.items():
            dropped, outcomes = m.host_heartbeat(host, beats(m, ranks, report=report))
            assert dropped == [] and [o for _, o in outcomes] == [3.0] * len(ranks)
        assert m.expire() == []
        assert m.maybe_form() is None
    assert m.generation_id == 1
    assert {w.info.worker_id: w.report.step for w in m.status().members} == {
        w: 5 for ranks in HOSTS.values() for w in ranks
    }


def test_a_rank_missing_from_its_hosts_report_is_lost_at_the_next_heartbeat() -> None:
    clock = Clock()
    m = formed_on_hosts(clock)
    m.host_heartbeat("h1", beats(m, HOSTS["h1"]))
    gone = HOSTS["h1"][1]
    rank = m.generation.rank_of(gone)
    clock.now += 0.5  # well within the lease
    dropped, _ = m.host_heartbeat("h1", beats(m, [w for w in HOSTS["h1"] if w != gone]))
    assert dropped == [gone]
    gen = m.maybe_form()
    assert gen is not None and gen.id == 2 and gen.rank_of(gone) is None
    assert gen.reshard.lost_ranks == (rank,)
    assert gen.world_size == sum(len(r) for r in HOSTS.values()) - 1


def test_a_lost_hosts_ranks_all_leave_in_one_generation() -> None:
    clock = Clock()
    m = formed_on_hosts(clock)
    old = m.generation
    for _ in range(3):
        clock.now += 1.5
        for host in ("h0", "h2"):  # h1's agent fell silent with its machine
            m.host_heartbeat(host, beats(m, HOSTS[host]))
        expired = m.expire()
        if expired:
            break
    assert sorted(expired) == HOSTS["h1"]
    gen = m.maybe_form()
    assert gen is not None and gen.id == 2
    assert gen.reshard.lost_ranks == tuple(sorted(old.rank_of(w) for w in HOSTS["h1"]))
    assert [mm.worker_id for mm in gen.members] == HOSTS["h0"] + HOSTS["h2"]
    assert m.maybe_form() is None


def test_a_host_heartbeat_fences_and_checks_each_rank_on_its_own() -> None:
    clock = Clock()
    m = formed_on_hosts(clock)
    stale = RankBeat(worker_id="h2-0", generation_id=0, leaving=True)
    unknown = RankBeat(worker_id="nobody", generation_id=1)
    fine = RankBeat(worker_id="h2-1", generation_id=1)
    _, outcomes = m.host_heartbeat("h2", [stale, unknown, fine])
    assert isinstance(outcomes[0][1], StaleGeneration)
    assert isinstance(outcomes[1][1], UnknownWorker)
    assert outcomes[2] == ("h2-1", 3.0)
    # a stale beat's leaving flag counts (as a stale Heartbeat's does)
    assert next(w for w in m.status().members if w.info.worker_id == "h2-0").leaving


@pytest.mark.parametrize(
    ("old_world", "new_world", "lost"),
    [(24, 17, {3, 5, 6, 7, 9, 10, 11}), (5, 9, set()), (7, 3, {0, 4, 5, 6}), (16, 16, set())],
)
@pytest.mark.parametrize("by_unit", [False, True])
def test_the_incremental_schedule_reassembles_to_the_whole(
    old_world: int, new_world: int, lost: set[int], by_unit: bool
) -> None:
    specs = inventory(hidden=12)
    old = compute_layout(specs, old_world, bucket_numel=100, align=2, by_unit=False)
    new = compute_layout(specs, new_world, bucket_numel=100, align=2, by_unit=by_unit)
    whole = reshard_schedule(old, new)
    survivors = [r for r in range(old_world) if r not in lost]
    schedules = RankSchedules(old, new)
    got = []
    for rank in range(new_world):
        previous = survivors[rank] if rank < len(survivors) else None
        mine = schedules.for_rank(previous, rank)
        assert all(m.new_owner == rank or m.old_owner == previous for m in mine)
        assert mine == [m for m in whole if m.new_owner == rank or m.old_owner == previous]
        got.extend(mine)
    assert set(got) == set(whole)
    assert LazyMoves(old, new) == tuple(whole)


def test_members_as_a_delta_expand_to_the_whole_generation() -> None:
    clock = Clock()
    m = formed_on_hosts(clock)
    first = m.generation
    m.leave("h0-1")
    m.register(WorkerInfo(worker_id="late", host="h9", free_ports=(3001,)), inventory())
    second = m.maybe_form()
    assert second is not None and [x.worker_id for x in second.members][-1] == "late"
    delta = members_delta(first, second)
    assert delta is not None and list(delta.removed_ranks) == [first.rank_of("h0-1")]
    msg = generation_to_proto(second)
    del msg.members[:]
    msg.members_delta.CopyFrom(delta)
    msg.reshard.partial = True
    del msg.reshard.moves[:]
    expanded = generation_from_proto(msg, first)
    assert expanded == second


# ---- on a real server over loopback ----------------------------------------------------------


def register_hosts(stub) -> None:
    for host, ranks in HOSTS.items():
        for wid in ranks:
            request = register_request(wid)
            request.worker.host = host
            stub.Register(request, metadata=AUTH, timeout=10)


def test_host_heartbeats_over_grpc_renew_leases_and_drop_a_missing_rank() -> None:
    with running(config(max_workers=8, join_window_s=60.0, lease_timeout_s=2.0)) as server:
        channel, stub = raw_stub(server.port)
        with channel, client(server) as agent:
            register_hosts(stub)
            wait_until(lambda: server.status().generation_id == 1, what="generation 1")
            # unary: every rank OK, and a rank with a stale generation fenced on its own
            ranks = [RankBeat(worker_id=w, generation_id=1) for w in HOSTS["h0"]]
            ranks.append(RankBeat(worker_id="h0-x", generation_id=1))
            reply = agent.host_heartbeat("h0", ranks)
            assert reply.generation_id == 1 and not reply.job_finished
            assert [r[1] for r in reply.ranks] == ["OK"] * 3 + ["UNKNOWN_WORKER"]

            # a stream per host for a while: no lease runs out (three leases long)
            feeds = {h: queue.Queue() for h in HOSTS}
            streams = {h: agent.host_heartbeats(h, iter(feeds[h].get, None)) for h in HOSTS}
            for _ in range(15):
                for host, ranks in HOSTS.items():
                    feeds[host].put([RankBeat(worker_id=w, generation_id=1) for w in ranks])
                    reply = next(streams[host])
                    assert [r[1] for r in reply.ranks] == ["OK"] * len(ranks)
                time.sleep(0.4)
            status = server.status()
            assert status.generation_id == 1 and status.world_size == 8

            # h1's agent stops listing h1-2: gone at once, generation 2 forms without it
            feeds["h1"].put([RankBeat(worker_id=w, generation_id=1) for w in HOSTS["h1"][:2]])
            next(streams["h1"])
            wait_until(lambda: server.status().generation_id == 2, what="generation 2")
            status = server.status()
            assert status.world_size == 7
            assert "h1-2" not in {w.info.worker_id for w in status.members}
            for host in HOSTS:
                feeds[host].put(None)


def test_a_host_heartbeat_stream_without_the_token_is_refused() -> None:
    with running(config()) as server:
        channel, stub = raw_stub(server.port)
        with channel:
            request = pb.HostHeartbeatRequest(host_id="h0")
            with pytest.raises(grpc.RpcError) as err:
                next(stub.HostHeartbeats(iter([request]), timeout=5))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_incremental_generations_over_grpc_reassemble_to_the_whole() -> None:
    with running(config(max_workers=8, join_window_s=60.0, lease_timeout_s=30.0)) as server:
        channel, stub = raw_stub(server.port)
        with channel, client(server) as a:
            register_hosts(stub)
            wait_until(lambda: server.status().generation_id == 1, what="generation 1")
            a.register(worker("late", free_ports=(40001,)), inventory())  # a standby
            a.start()
            # one leaves, the standby takes its place: both in one delta
            stub.Leave(pb.LeaveRequest(worker_id="h1-1"), metadata=AUTH, timeout=10)
            gen2 = a.wait_for_generation(after=1, timeout=10)
            assert gen2.id == 2 and gen2.rank_of("late") == 7

            def watch(worker_id: str, after: int, incremental: bool) -> pb.Generation:
                request = pb.WatchGenerationsRequest(
                    worker_id=worker_id, after_generation_id=after, incremental=incremental
                )
                return next(stub.WatchGenerations(request, metadata=AUTH, timeout=10))

            whole = watch("h0-0", 1, False)
            assert whole.id == 2 and not whole.reshard.partial and len(whole.members) == 8
            previous = generation_from_proto(watch("h0-0", 0, False))
            assert previous.id == 2  # a watch from 0 gets the newest
            moves = set()
            for member in whole.members:
                piece = watch(member.worker_id, 1, True)
                assert piece.reshard.partial and not piece.members
                assert piece.HasField("members_delta")
                assert list(piece.members_delta.removed_ranks) == [4]
                moves |= {
                    (m.name, m.start, m.stop, m.old_owner, m.new_owner) for m in piece.reshard.moves
                }
            assert moves == {
                (m.name, m.start, m.stop, m.old_owner, m.new_owner) for m in whole.reshard.moves
            }
            # a watcher that holds no previous generation gets the members whole
            fresh = watch("h0-0", 0, True)
            assert len(fresh.members) == 8 and not fresh.HasField("members_delta")
            # the client completed its incremental generation to the whole one
            assert gen2 == generation_from_proto(whole)
