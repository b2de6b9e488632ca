"""The membership state machine on a fake clock: formation rules, leases, fencing, restore."""

from __future__ import annotations

import dataclasses

import pytest

from coordinator.control.membership import (
    InvalidRequest,
    InventoryMismatch,
    Membership,
    StaleGeneration,
    UnknownWorker,
)
from coordinator.control.statefile import load_snapshot, save_snapshot
from coordinator.core.messages import FINISHED, STOPPED, WorkerReport
from coordinator.core.reshard import moves_for_rank
from coordinator.core.settings import MembershipConfig, PlanConfig
from tests.coordinator_util import Clock, inventory, worker

pytestmark = pytest.mark.timeout(30)


def membership(clock: Clock, **kw: object) -> Membership:
    settings = dict(
        min_workers=2,
        max_workers=3,
        join_window_s=5.0,
        lease_timeout_s=3.0,
        heartbeat_interval_s=1.0,
    )
    settings.update(kw)
    return Membership(
        MembershipConfig(**settings),
        PlanConfig(stage=1, bucket_numel=100, align=2),
        clock=clock,
        wall_clock=clock,
    )


def test_first_generation_waits_for_min_workers_and_the_join_window() -> None:
    clock = Clock()
    m = membership(clock)
    m.register(worker("b", free_ports=(2001,)), inventory())
    assert m.maybe_form() is None
    assert "1 of at least 2" in m.waiting_reason()
    clock.now += 1
    m.register(worker("a", free_ports=(1001,)), inventory())
    clock.now += 3.9  # window counts from the first registration
    assert m.maybe_form() is None
    assert "join window" in m.waiting_reason()
    clock.now += 0.2
    gen = m.maybe_form()
    assert gen is not None and gen.id == 1
    # Joiners sort by (host, id); rank 0 hosts the rendezvous on a port it reported.
    assert [x.worker_id for x in gen.members] == ["a", "b"]
    assert gen.rendezvous_endpoint == "127.0.0.1:1001"
    assert gen.reshard is None and gen.stage == 1
    assert m.maybe_form() is None


def test_the_launchers_expected_workers_form_the_first_generation_at_once() -> None:
    clock = Clock()
    m = membership(clock, min_workers=2, max_workers=8, expected_workers=3)
    m.register(worker("a", free_ports=(1001,)), inventory())
    m.register(worker("b", free_ports=(1002,)), inventory())
    assert m.maybe_form() is None  # two of the three: the window runs
    m.register(worker("c", free_ports=(1003,)), inventory())
    gen = m.maybe_form()
    assert gen is not None and gen.world_size == 3
    m.register(worker("d", free_ports=(1004,)), inventory())
    assert m.maybe_form() is None  # later joins wait for the window again
    m.expect_more(1)  # unless the launcher says it started them: then at once
    assert m.maybe_form().world_size == 4
    m.expect_more(1)
    m.register(worker("e", free_ports=(1005,)), inventory())
    assert m.maybe_form().world_size == 5
    m.register(worker("f", free_ports=(1006,)), inventory())
    assert m.maybe_form() is None  # the expectation was met: the window again


def test_newcomers_count_workers_started_or_waiting_until_the_job_stops() -> None:
    """What members all asked to leave wait for (worker/elastic/change.py [Note:
    leaving with nobody to hand over to]): workers a launcher started and that have
    not registered, and registered ones waiting for a generation, not leaving."""
    clock = Clock()
    m = membership(clock, min_workers=2, max_workers=4)
    for wid in ("a", "b"):
        m.register(worker(wid), inventory())
    clock.now += 6
    gen = m.maybe_form()
    assert gen is not None and m.status().newcomers == 0
    m.expect_more(2)  # a launcher started two
    assert m.status().newcomers == 2
    m.register(worker("c"), inventory())
    assert m.status().newcomers == 2  # one registered and waiting, one on its way
    m.heartbeat("c", gen.id, leaving=True)  # asked to leave before it joined: not coming
    assert m.status().newcomers == 1
    m.register(worker("d"), inventory())
    assert m.status().newcomers == 1
    m.stop("the launcher stops the job")
    assert m.status().newcomers == 0


def test_max_workers_forms_at_once_and_extra_workers_stand_by() -> None:
    clock = Clock()
    m = membership(clock)
    for wid in ("a", "b", "c"):
        m.register(worker(wid), inventory())
    gen = m.maybe_form()
    assert gen is not None and gen.world_size == 3
    m.register(worker("d"), inventory())
    clock.now += 10
    for wid in ("a", "b", "c", "d"):
        m.heartbeat(wid, gen.id)
    assert m.maybe_form() is None  # full: d waits
    status = m.status()
    assert [(w.info.worker_id, w.state) for w in status.workers][-1] == ("d", "standby")


def test_a_lost_member_forms_the_next_generation_at_once_with_lost_ranks() -> None:
    clock = Clock()
    m = membership(clock, max_workers=4)
    for wid in ("a", "b", "c"):
        m.register(worker(wid, free_ports=(3000 + ord(wid),)), inventory())
    clock.now += 5
    g1 = m.maybe_form()
    assert g1 is not None and g1.world_size == 3
    clock.now += 2
    m.heartbeat("a", 1)
    m.heartbeat("c", 1)
    clock.now += 1.5  # b's lease (3 s) has run out, a's and c's have not
    assert m.expire() == ["b"]
    g2 = m.maybe_form()
    assert g2 is not None and g2.id == 2
    assert [(x.worker_id, x.rank, x.previous_rank) for x in g2.members] == [
        ("a", 0, 0),
        ("c", 1, 2),
    ]
    assert g2.reshard is not None
    assert g2.reshard.lost_ranks == (1,) and g2.reshard.from_world_size == 3
    # A fresh port, never the previous generation's.
    assert g2.rendezvous_endpoint != g1.rendezvous_endpoint
    # c was rank 2 and becomes rank 1: what it keeps, sends and receives.
    mine = moves_for_rank(g2.reshard.moves, old_rank=2, new_rank=1)
    assert mine.keep and all(mv.old_owner == 2 and mv.new_owner == 1 for mv in mine.keep)
    assert [e.kind for e in m.events][-2:] == ["expired", "generation"]


def test_a_leave_and_a_standby_make_one_generation_that_tells_left_from_lost() -> None:
    clock = Clock()
    m = membership(clock, max_workers=3)
    for wid in ("a", "b", "c"):
        m.register(worker(wid), inventory())
    g1 = m.maybe_form()
    assert g1 is not None and g1.world_size == 3
    m.register(worker("d"), inventory())
    assert m.maybe_form() is None  # full: d stands by
    m.leave("c", "SIGTERM")
    g2 = m.maybe_form()
    assert g2 is not None
    assert [(x.worker_id, x.previous_rank) for x in g2.members] == [
        ("a", 0),
        ("b", 1),
        ("d", None),
    ]
    assert g2.reshard is not None
    assert (g2.reshard.left_ranks, g2.reshard.lost_ranks) == ((2,), ())
    # a lease that runs out is a loss, not a leave, and the next generation says so
    clock.now += 2
    for wid in ("a", "d"):
        m.heartbeat(wid, g2.id)
    clock.now += 1.5
    assert m.expire() == ["b"]
    g3 = m.maybe_form()
    assert g3 is not None and g3.reshard is not None
    assert (g3.reshard.left_ranks, g3.reshard.lost_ranks) == ((), (1,))


def test_a_worker_whose_stream_stays_closed_is_dropped_after_one_interval() -> None:
    clock = Clock()
    m = membership(clock, lease_timeout_s=30.0, heartbeat_interval_s=1.0)
    for wid in ("a", "b", "c"):
        m.register(worker(wid), inventory())
    gen = m.maybe_form()
    assert gen is not None
    tokens = {wid: m.watch_opened(wid) for wid in ("a", "b", "c")}
    # a's stream breaks and its client opens another within the interval: kept
    m.watch_closed("a", tokens["a"])
    clock.now += 0.5
    tokens["a"] = m.watch_opened("a")
    # b's process died: its stream closed for good
    m.watch_closed("b", tokens["b"])
    clock.now += 0.9
    assert m.expire() == []
    clock.now += 0.2
    assert m.expire() == ["b"]
    # a stream of an older incarnation closing late does not touch the new one
    m.register(worker("c", incarnation="two"), inventory())
    m.watch_closed("c", tokens["c"])
    clock.now += 5
    for wid in ("a", "c"):
        m.heartbeat(wid, gen.id)
    assert m.expire() == []


def test_below_min_workers_the_generation_stays_and_status_says_why() -> None:
    clock = Clock()
    m = membership(clock, max_workers=2)
    m.register(worker("a"), inventory())
    m.register(worker("b"), inventory())
    assert m.maybe_form() is not None
    m.leave("b", "done")
    assert m.maybe_form() is None
    status = m.status()
    assert status.phase == "waiting"
    assert "lost 1 member" in status.waiting_reason
    # b left (it was not lost: its lease did not run out)
    assert [(w.info.worker_id, w.state) for w in status.workers] == [("a", "member"), ("b", "left")]
    m.register(worker("c"), inventory())
    gen = m.maybe_form()  # lost members: no join window
    assert gen is not None and [x.worker_id for x in gen.members] == ["a", "c"]
    assert gen.reshard is not None and gen.reshard.left_ranks == (1,)


def test_a_restarted_worker_is_a_new_incarnation_not_a_reattach() -> None:
    clock = Clock()
    m = membership(clock, min_workers=1, max_workers=2)
    m.register(worker("a", incarnation="one"), inventory())
    m.register(worker("b", incarnation="one"), inventory())
    assert m.maybe_form() is not None
    assert m.register(worker("a", incarnation="one"), inventory()) is True
    assert m.maybe_form() is None
    assert m.register(worker("a", incarnation="two"), inventory()) is False
    gen = m.maybe_form()
    assert gen is not None and gen.id == 2
    assert gen.reshard is not None and gen.reshard.lost_ranks == (0,)
    assert gen.member("a").previous_rank is None  # a joiner again, its state is gone


def test_heartbeats_are_fenced_by_generation() -> None:
    clock = Clock()
    m = membership(clock, min_workers=1, join_window_s=0)
    m.register(worker("a"), inventory())
    assert m.heartbeat("a", 0) == 3.0
    assert m.maybe_form() is not None
    with pytest.raises(StaleGeneration) as err:
        m.heartbeat("a", 0)
    assert err.value.current == 1
    with pytest.raises(StaleGeneration):
        m.heartbeat("a", 7)
    with pytest.raises(UnknownWorker, match="register again"):
        m.heartbeat("nobody", 1)


def test_a_member_that_says_it_is_leaving_is_marked_until_it_leaves() -> None:
    """HeartbeatRequest.leaving: shown in the status (a launcher counting members
    stops counting it), once as an event, even from a stale heartbeat."""
    clock = Clock()
    m = membership(clock, min_workers=2, join_window_s=0)
    m.register(worker("a"), inventory())
    m.register(worker("b"), inventory())
    assert m.maybe_form() is not None
    assert not any(w.leaving for w in m.status().workers)
    with pytest.raises(StaleGeneration):
        m.heartbeat("b", 0, leaving=True)
    m.heartbeat("b", 1, leaving=True)
    assert {w.info.worker_id: w.leaving for w in m.status().workers} == {"a": False, "b": True}
    assert [e.worker_id for e in m.status().events if e.kind == "leaving"] == ["b"]
    m.leave("b")
    assert [w.info.worker_id for w in m.status().workers if w.leaving] == []


def test_members_told_to_leave_with_nobody_to_hand_over_to_stop_the_job() -> None:
    """Leave reason "stopped" (or a launcher's stop()): as after a finish, nothing
    forms any more, and heartbeats tell the workers still waiting."""
    clock = Clock()
    m = membership(clock, min_workers=1, join_window_s=0)
    m.register(worker("a"), inventory())
    m.register(worker("b"), inventory())
    assert m.maybe_form() is not None
    m.leave("b", STOPPED)
    assert m.finished and "is stopping (b was told to leave" in m.waiting_reason()
    m.register(worker("c"), inventory())
    assert m.maybe_form() is None
    assert [e.kind for e in m.status().events][-3:] == ["left", "stopping", "registered"]
    other = membership(Clock(), min_workers=1, join_window_s=0)
    other.register(worker("a"), inventory())
    other.stop("the launcher got SIGTERM")
    assert other.maybe_form() is None and other.finished


def test_inventory_mismatch_names_the_first_differing_parameter() -> None:
    m = membership(Clock())
    m.register(worker("a"), inventory())
    other = inventory()
    other[2] = other[2].__class__(name="block.0.bias", shape=(9,), dtype="float32", unit=1)
    with pytest.raises(InventoryMismatch, match=r"'block\.0\.bias' has shape \(9,\)"):
        m.register(worker("b"), other)
    with pytest.raises(InventoryMismatch, match=r"'head\.weight' is missing"):
        m.register(worker("b"), inventory()[:-1])
    with pytest.raises(InvalidRequest, match="empty"):
        m.register(worker("c"), [])


def test_snapshot_survives_the_state_file(tmp_path) -> None:
    clock = Clock()
    m = membership(clock, max_workers=2)
    m.register(worker("a", free_ports=(4001,)), inventory())
    m.register(worker("b"), inventory())
    m.maybe_form()
    m.leave("b")
    m.register(worker("c"), inventory())
    gen = m.maybe_form()
    assert gen is not None and gen.reshard is not None
    path = tmp_path / "state.json"
    save_snapshot(path, m.snapshot())
    # no temp file left; the inventory once, beside the state
    # (coordinator/control/statefile.py [Note: state file format])
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["state.json", f"state.json.inventory-{m.digest[:16]}.binpb"]

    restored = membership(clock, max_workers=2)
    snapshot = load_snapshot(path)
    assert snapshot is not None and snapshot.generation == gen
    restored.restore(snapshot)
    assert restored.generation == gen and restored.inventory == m.inventory
    restored.heartbeat("a", 2)
    restored.heartbeat("c", 2)
    assert restored.maybe_form() is None
    assert load_snapshot(tmp_path / "missing.json") is None
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="unreadable"):
        load_snapshot(tmp_path / "bad.json")


def test_a_scripts_own_group_keeps_its_ranks_and_forms_only_when_whole() -> None:
    """Workers whose script formed the process group register its ranks; the
    coordinator waits for the whole group (whatever the join window) and keeps them."""
    clock = Clock()
    m = membership(clock, min_workers=1, max_workers=3, join_window_s=0.0)
    m.register(dataclasses.replace(worker("a"), fixed_rank=2, fixed_world_size=3), inventory())
    m.register(dataclasses.replace(worker("c"), fixed_rank=0, fixed_world_size=3), inventory())
    clock.now += 10
    assert m.maybe_form() is None
    m.register(dataclasses.replace(worker("b"), fixed_rank=1, fixed_world_size=3), inventory())
    gen = m.maybe_form()
    assert gen is not None
    assert [x.worker_id for x in gen.members] == ["c", "b", "a"]


@pytest.mark.parametrize(
    "from_workers, asked, want, memory",
    [
        (True, (1, 1), 1, 0),
        (True, (None, None), 0, 0),
        (True, (1, 2), 2, 0),
        # --stage auto: the coordinator chooses where it knows the devices' memory (all
        # fits: stage 0), and the script's stage stands where it does not (a CPU job)
        (False, (1, 1), 0, 80 * 10**9),
        (False, (1, 1), 1, 0),
    ],
)
def test_the_workers_stage_applies_when_the_coordinator_has_none(
    from_workers: bool, asked: tuple[int | None, int | None], want: int, memory: int
) -> None:
    clock = Clock()
    m = Membership(
        MembershipConfig(min_workers=2, max_workers=2, join_window_s=0.0),
        PlanConfig(stage=None, stage_from_workers=from_workers, bucket_numel=100, align=2),
        clock=clock,
        wall_clock=clock,
    )
    for wid, stage in zip("ab", asked, strict=True):
        info = dataclasses.replace(worker(wid), stage=stage, device_memory_bytes=memory)
        m.register(info, inventory())
    gen = m.maybe_form()
    assert gen is not None and gen.stage == want, gen and gen.stage_reason
    assert ("asked for by the workers" in gen.stage_reason) == (
        (from_workers or not memory) and asked[0] is not None
    )


def test_a_finished_job_reads_finished_with_its_members_left_not_lost() -> None:
    from coordinator.core.messages import FINISHED

    clock = Clock()
    m = membership(clock, max_workers=2)
    for wid in "ab":
        m.register(worker(wid), inventory())
    assert m.maybe_form() is not None
    for wid in "ab":
        m.leave(wid, FINISHED)
    status = m.status()
    assert status.phase == "finished"
    assert {w.state for w in status.workers} == {"left"}
    clock.now += 60  # their leases would have run out: they left before
    assert {w.state for w in m.status().workers} == {"left"}


def test_newcomers_wait_until_a_recovery_generation_is_applied() -> None:
    """After a loss, the generation that replaces the lost rank is formed by the
    survivors alone until every one of them reports having applied it."""
    clock = Clock()
    m = membership(clock, min_workers=2, max_workers=4, join_window_s=0.0)
    for wid in "abc":
        m.register(worker(wid), inventory())
    first = m.maybe_form()
    assert first is not None and first.world_size == 3
    clock.now += 1
    for wid in "ab":  # c stops heartbeating: it is lost when its lease runs out
        m.heartbeat(wid, first.id, WorkerReport(applied_generation_id=first.id))
    clock.now += 3
    m.expire()
    second = m.maybe_form()
    assert second is not None and second.reshard.lost_ranks and second.world_size == 2
    m.register(worker("d"), inventory())
    clock.now += 1
    m.heartbeat("a", second.id, WorkerReport(applied_generation_id=second.id))
    m.heartbeat("b", second.id, WorkerReport(applied_generation_id=first.id))
    assert m.maybe_form() is None  # b is still restoring
    m.heartbeat("b", second.id, WorkerReport(applied_generation_id=second.id))
    third = m.maybe_form()
    assert third is not None and third.world_size == 3 and not third.reshard.lost_ranks


def test_a_member_that_finished_training_ends_the_job() -> None:
    """After a member leaves with the reason FINISHED, nothing forms: not the
    generation a standby was waiting for, nor a re-formed one for the rest."""
    clock = Clock()
    m = membership(clock, max_workers=2)
    for wid in ("a", "b", "c"):
        m.register(worker(wid, free_ports=(3001,)), inventory())
    first = m.maybe_form()
    assert first is not None and first.world_size == 2
    (standby,) = {"a", "b", "c"} - {w.worker_id for w in first.members}
    assert m.leave(standby, FINISHED) and not m.finished  # a standby finishes nothing
    m.register(worker(standby, free_ports=(3002,)), inventory())
    member = first.members[0].worker_id
    assert m.leave(member, FINISHED) and m.finished
    clock.now += 10
    assert m.maybe_form() is None  # a member left and a standby waits: still nothing
    assert "finished" in m.waiting_reason()
    assert [e.kind for e in m.events][-2:] == ["left", "finished"]


def test_a_leave_before_a_restart_stays_a_leave(tmp_path) -> None:
    """The coordinator restarts between a member's leave and the next generation: the
    state file says the member left, so the restarted coordinator re-forms without it
    at once (a leave, its shards handed over) instead of waiting for it to re-attach
    and then taking it for lost. A finished job stays finished."""
    clock = Clock()
    m = membership(clock, max_workers=3, min_workers=2)
    for wid in ("a", "b", "c"):
        m.register(worker(wid, free_ports=(5001,)), inventory())
    gen = m.maybe_form()
    assert gen is not None and gen.world_size == 3
    leaver = gen.members[2].worker_id
    m.leave(leaver, "SIGTERM")
    path = tmp_path / "state.json"
    save_snapshot(path, m.snapshot())  # what the server writes on a member's leave

    restored = membership(clock, max_workers=3, min_workers=2)
    snapshot = load_snapshot(path)
    assert snapshot is not None and snapshot.left == (leaver,)
    restored.restore(snapshot)
    nxt = restored.maybe_form()  # no lease to wait out: the leaver is gone for good
    assert nxt is not None and nxt.world_size == 2
    assert nxt.reshard is not None
    assert nxt.reshard.left_ranks == (2,) and nxt.reshard.lost_ranks == ()

    restored.leave(nxt.members[0].worker_id, FINISHED)
    save_snapshot(path, restored.snapshot())
    again = membership(clock, max_workers=3, min_workers=2)
    again.restore(load_snapshot(path))
    assert again.finished and again.maybe_form() is None


def test_a_stopping_job_stays_stopped_across_a_restart(tmp_path) -> None:
    """A launcher stopped the job (or every member left with reason stopped), then the
    coordinator restarted: it forms nothing for the workers that re-attach or wait."""
    clock = Clock()
    m = membership(clock, max_workers=2, min_workers=1)
    for wid in ("a", "b"):
        m.register(worker(wid, free_ports=(5001,)), inventory())
    assert m.maybe_form() is not None
    m.stop("the launcher is stopping the job (SIGTERM)")
    path = tmp_path / "state.json"
    save_snapshot(path, m.snapshot())

    restored = membership(clock, max_workers=2, min_workers=1)
    restored.restore(load_snapshot(path))
    assert restored.finished
    restored.register(worker("c", free_ports=(5002,)), inventory())
    clock.now += 10
    assert restored.maybe_form() is None
    assert "stopping (the launcher is stopping the job (SIGTERM))" in restored.waiting_reason()
