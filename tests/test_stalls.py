"""The coordinator names a stall from the ranks' whereabouts (coordinator/control/stalls.py).

The rules on made-up whereabouts here; the whereabouts real ranks send, and what the
coordinator does with a real job's stalls, in tests/test_stalls_job.py.
"""

from __future__ import annotations

import random

import pytest

from coordinator.control.stalls import RankView, StallWatch, diagnose, parse_ranks
from coordinator.core.messages import Whereabouts
from worker.whereabouts import Tracker, describe_ranks


def waits(rank: int, seq: int, *, op="all_gather", group="0-3", unit="blocks.1", s=12.0, **kw):
    where = Whereabouts(state="collective", for_s=s, op=op, seq=seq, group=group, unit=unit)
    return RankView(rank, f"w{rank}", where, kw.get("heard", 0.5), kw.get("step", 7))


def runs(rank: int, s: float, *, heard: float = 0.5, state: str = "running") -> RankView:
    where = Whereabouts(state=state, for_s=s, op="all_gather", seq=56, group="0-3", unit="b.0")
    return RankView(rank, f"w{rank}", where, heard, 7)


def name(views, after=5.0):
    return diagnose(views, after_s=after, silent_s=5.0)


def test_ranks_round_trip_through_their_short_form():
    rng = random.Random(0)
    for _ in range(300):
        ranks = sorted(rng.sample(range(64), rng.randint(1, 20)))
        assert list(parse_ranks(describe_ranks(ranks))) == ranks
    assert describe_ranks([0, 1, 2, 3]) == "0-3"
    assert describe_ranks([1, 3, 5, 7]) == "1-7/2"
    assert describe_ranks([0, 5]) == "0,5"
    assert parse_ranks("garbage") == () and parse_ranks("3-1") == ()


def test_a_job_whose_waits_are_short_has_no_stall():
    assert name([waits(0, 5, s=0.1), waits(1, 5, s=0.1), runs(2, 1.0), runs(3, 0.2)]) is None


def test_a_rank_in_another_unit_at_the_same_number_is_a_mismatch():
    views = [waits(r, 57, unit="blocks.3.experts.1") for r in range(3)]
    views.append(waits(3, 57, op="reduce_scatter", unit="blocks.3.experts.2", s=11))
    stall = name(views)
    assert stall is not None and stall.kind == "mismatch"
    assert [v.rank for v in stall.culprits] == [3]
    assert "ranks 0-2 wait in all-gather #57 on ranks 0-3, unit blocks.3.experts.1" in stall.text
    assert "rank 3 waits in reduce-scatter #57 on ranks 0-3, unit blocks.3.experts.2" in stall.text
    assert "rank 3 issued other collectives than the rest of their group" in stall.text
    assert "data-dependent" in stall.text


def test_ranks_waiting_on_each_other_in_different_groups_deadlock():
    views = [waits(0, 18, unit="a"), waits(1, 18, unit="a"), runs(3, 0.5)]
    views.append(waits(2, 1, op="all_reduce", group="1,2", unit="", s=9))
    stall = name(views)
    assert stall.kind == "mismatch" and [v.rank for v in stall.culprits] == [2]
    assert "rank 2 waits in all-reduce #1 on ranks 1,2" in stall.text, stall.text


def test_a_rank_running_outside_any_collective_is_stuck():
    stall = name([waits(0, 57), waits(1, 57), waits(2, 57), runs(3, 14.0)])
    assert stall is not None and stall.kind == "stuck"
    assert [v.rank for v in stall.culprits] == [3]
    assert "rank 3 runs outside any collective for 14s" in stall.text
    # one that has just left its last collective is still advancing
    assert name([waits(0, 57), waits(1, 57), waits(2, 57), runs(3, 1.0)]).kind == "waiting"


def test_a_rank_without_heartbeats_is_silent_before_stuck_or_mismatched():
    views = [waits(0, 57), waits(1, 57), runs(2, 30.0), runs(3, 20.0, heard=8.0)]
    stall = name(views)
    assert stall.kind == "silent" and [v.rank for v in stall.culprits] == [3]
    assert "rank 3 (w3) has sent no heartbeat for 8s" in stall.text


def test_checkpointing_and_re_forming_ranks_are_never_blamed():
    views = [waits(0, 57), runs(1, 40.0, state="checkpoint"), runs(2, 40.0, state="recovering")]
    views.append(waits(3, 57))
    assert name(views).kind == "waiting"


def test_a_rank_blocked_in_an_unnumbered_torch_collective_is_not_blamed():
    """tp = 2 x dp = 2: rank 3 stopped; its tp peer 2 blocks in DTensor's all-reduce
    (torch's, unnumbered). Rank 0 waits on dp group 0,2 for rank 2, rank 1 on 1,3 for
    rank 3: only the silent rank is blamed, never the rank inside torch's wait."""
    blocked = Whereabouts(state="torch", for_s=20.0, op="wait_tensor", unit="blocks.0")
    views = [
        waits(0, 9, op="reduce_scatter", group="0,2"),
        waits(1, 9, op="reduce_scatter", group="1,3"),
        RankView(2, "w2", blocked, 0.5, 7),
        runs(3, 30.0, heard=9.0),
    ]
    stall = name(views)
    assert stall.kind == "silent" and [v.rank for v in stall.culprits] == [3]
    # a stuck rank's tp peer, blocked on it in torch: the stuck one is blamed, alone
    views[3] = runs(3, 30.0)
    stall = name(views)
    assert stall.kind == "stuck" and [v.rank for v in stall.culprits] == [3]
    assert "rank 2 waits in torch.distributed's wait_tensor (not numbered" in stall.text


def test_the_tracker_says_a_thread_blocked_in_torch_distributed_is_in_torch():
    """The snapshot looks at the training thread's innermost frames: a function of
    torch.distributed's collectives (here one compiled under c10d's file name, blocked
    on an event) reads as "torch" and its name; elsewhere, as running."""
    import os
    import threading
    import time

    from worker.whereabouts import in_torch_collective

    release = threading.Event()
    space = {"release": release}
    path = os.path.join("site-packages", "torch", "distributed", "distributed_c10d.py")
    exec(compile("def recv():\n    release.wait(30)\n", path, "exec"), space)
    thread = threading.Thread(target=space["recv"])
    thread.start()
    try:
        time.sleep(0.2)
        assert in_torch_collective(thread.ident) == "recv"
        tracker = Tracker()
        tracker._thread = thread.ident
        where = tracker.snapshot()
        assert (where.state, where.op, where.group) == ("torch", "recv", "")
        assert in_torch_collective(threading.get_ident()) == ""  # this thread: elsewhere
    finally:
        release.set()
        thread.join()


def test_a_chain_of_waits_is_followed_to_its_cause():
    # a pipeline: rank 0 waits on its send to rank 1, which waits in rank 1-3's
    # all-reduce, where rank 3 is stuck in its own code
    views = [
        waits(0, 9, op="send_recv", group="0,1", unit=""),
        waits(1, 4, op="all_reduce", group="1-3", unit=""),
        waits(2, 4, op="all_reduce", group="1-3", unit=""),
        runs(3, 25.0),
    ]
    stall = name(views)
    assert stall.kind == "stuck" and [v.rank for v in stall.culprits] == [3]


def test_ranks_that_wait_to_re_form_wait_for_every_member():
    views = [runs(0, 9.0, state="recovering"), runs(1, 9.0, state="recovering"), runs(2, 40.0)]
    stall = name(views)
    assert stall.kind == "stuck" and [v.rank for v in stall.culprits] == [2]
    assert "ranks 0-1 wait for the job to re-form" in stall.text


def test_the_watch_acts_once_at_the_bound_and_keeps_the_cause_through_timeouts():
    now = [100.0]
    watch = StallWatch(2.0, 10.0, 5.0, clock=lambda: now[0])
    mismatch = [waits(0, 8, s=3.0), waits(1, 8, unit="blocks.2", s=3.0)]
    assert watch.check(mismatch) is None and watch.current.kind == "mismatch"
    now[0] += 5
    assert watch.check(mismatch) is None  # 8 s into it
    # their collectives time out: both wait for a re-formation nobody will form
    recovering = [runs(0, 2.5, state="recovering"), runs(1, 2.5, state="recovering")]
    now[0] += 3
    act = watch.check(recovering)
    assert act is not None and act.kind == "mismatch" and "(after: " in act.text
    assert watch.check(recovering) is None  # once
    assert watch.count == 1  # one stall, its cause kept
    now[0] += 1
    assert watch.check([runs(0, 0.1), runs(1, 0.1)]) is None and watch.current is None


def test_a_watch_needs_its_naming_within_its_bound():
    with pytest.raises(ValueError, match="stall-after"):
        StallWatch(10.0, 5.0, 5.0)


def test_the_tracker_numbers_each_group_and_says_what_it_waits_on():
    from worker.whereabouts import GroupTag

    t = Tracker()
    world, pair = GroupTag("0", (0, 1, 2, 3), "0-3", None), GroupTag("1", (0, 2), "0,2", None)
    t.issue("all_gather", world)
    with t.labelled("blocks.0"):
        second = t.issue("all_gather", world)
    t.issue("all_reduce", pair)
    with t.waiting(second):
        where = t.snapshot()
    assert (where.state, where.op, where.seq, where.group, where.unit) == (
        "collective",
        "all_gather",
        2,
        "0-3",
        "blocks.0",
    )
    after = t.snapshot()
    assert (after.state, after.op, after.seq, after.group) == ("running", "all_reduce", 1, "0,2")
    with t.state("recovering"):
        assert t.snapshot().state == "recovering"
    t.forget_groups()
    assert t.issue("broadcast", world).seq == 1


SUBGROUPS = """
import datetime, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from worker.compat import time_out_subgroups_as
timeout = datetime.timedelta(seconds=7)
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:{port}",
                        timeout=timeout)
time_out_subgroups_as(timeout)
cpu = torch.device("cpu")
mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
for group in (dist.new_group([0]), mesh.get_group("dp"), mesh.get_group("tp")):
    print(group._get_backend(cpu).options._timeout.total_seconds())
"""


def test_subgroups_and_meshes_time_out_as_the_jobs_group():
    """torch gives a new group 30 minutes on gloo whatever the default group's timeout:
    a rank stuck on a pipeline or tensor-parallel group outlived the job's."""
    import subprocess
    import sys

    from coordinator.core.ports import free_port

    code = SUBGROUPS.format(port=free_port())
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["7.0", "7.0", "7.0"], out.stderr[-2000:]
