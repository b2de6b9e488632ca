"""bench/goodput.py's plan and report logic on synthetic events (no processes, no timing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.goodput import (
    FAILED,
    Killer,
    format_table,
    kill_points,
    parse_args,
    read_events,
    summarize,
    table,
)


def step(n: int, done: float, rank: int = 0, world: int = 3) -> dict:
    return {"ev": "step", "t": done, "done": done, "step": n, "rank": rank, "world": world}


def test_kill_points_follow_the_period_at_a_seeded_phase() -> None:
    points = kill_points(200, 50, 10, seed=3)
    assert len(points) == 3
    for k, p in enumerate(points, start=1):
        assert 50 * k <= p < 50 * k + 10
    assert kill_points(200, 50, 10, seed=3) == points  # replayable
    assert kill_points(200, None, 10, seed=3) == []
    assert all(p < 45 for p in kill_points(45, 20, 10, seed=0))
    with pytest.raises(ValueError, match="every must be >= 1"):
        kill_points(100, 0, 10, seed=0)


def test_summarize_counts_useful_steps_over_the_wall_and_replays() -> None:
    # rank 0 does steps 1-6, is rolled back to 4, redoes 5-6 and goes on to 10;
    # rank 1 does the same a little later; a save in between is not a step
    times = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0]
    numbers = [1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9, 10]
    events = [step(n, t) for n, t in zip(numbers, times, strict=True)]
    events += [step(n, t + 0.1, rank=1) for n, t in zip(numbers, times, strict=True)]
    events.append({"ev": "saved", "t": 4.5, "step": 4})
    out = summarize(events, steps=10)
    assert out["wall_s"] == pytest.approx(14.0 - 1.0)
    assert out["goodput"] == pytest.approx(9 / 13.0)
    assert out["replayed"] == 2
    assert out["computed"] == 12
    assert out["step_s"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no step 11"):
        summarize(events, steps=11)


def test_table_compares_each_run_with_its_own_baseline_and_the_restart() -> None:
    def run(system: str, every: int | None, wall: float, kills: int) -> dict:
        return {
            "system": system,
            "every": every,
            "kills": [{}] * kills,
            "wall_s": wall,
            "goodput": 99 / wall,
            "replayed": 0,
            "step_s": 0.1,
        }

    rows = table(
        [
            run("zeroplane", None, 10.0, 0),
            run("restart", None, 8.0, 0),
            run("zeroplane", 50, 11.0, 2),
            run("restart", 50, 16.0, 4),
        ]
    )
    zp0, rs0, zp, rs = rows
    assert rs0["x_restart"] is None and rs0["lost"] == pytest.approx(0.0)
    assert zp0["lost"] == pytest.approx(0.0) and zp0["x_restart"] == pytest.approx(8.0 / 10.0)
    assert zp0["zp_over_rs_lost"] is None  # no failures, no ratio of losses
    assert zp["lost"] == pytest.approx(1 - 10.0 / 11.0)
    assert rs["lost"] == pytest.approx(1 - 8.0 / 16.0)
    assert zp["s_per_kill"] == pytest.approx(0.5) and rs["s_per_kill"] == pytest.approx(2.0)
    assert zp["x_restart"] == pytest.approx(16.0 / 11.0)
    assert zp["zp_over_rs_lost"] == pytest.approx((1 - 10.0 / 11.0) / 0.5)
    assert zp["zp_over_rs_per_kill"] == pytest.approx(0.25)
    assert zp["kills_differ"] and rs["x_restart"] is None
    # without the other system's runs the comparison columns stay empty
    (alone,) = table([run("zeroplane", 20, 12.0, 1)])
    assert alone["lost"] is None and alone["x_restart"] is None and alone["s_per_kill"] is None


def test_a_failed_run_is_reported_not_measured() -> None:
    ok = {"system": "zeroplane", "every": None, "kills": [], "wall_s": 10.0, "goodput": 9.9}
    ok |= {"replayed": 0, "step_s": 0.1}
    failed = {"system": "zeroplane", "every": 50, "kills": [{}], **FAILED}
    failed["error"] = "zeroplane: rank 0 failed with exit code 1\ntraceback"
    rows = table([ok, failed])
    assert rows[1]["lost"] is None and rows[1]["s_per_kill"] is None
    text = format_table(rows)
    assert "FAILED: zeroplane, a kill every 50 steps: zeroplane: rank 0 failed" in text
    assert "traceback" not in text
    # a worker that died after the last step: measured, and the error noted
    late = {**ok, "every": 20, "late_error": "restart: workers failed {'l1r0': -6}\nlog"}
    rows = table([ok, late])
    assert rows[1]["lost"] == pytest.approx(0.0)
    assert "note: zeroplane, a kill every 20 steps, after its last step: restart: workers" in (
        format_table(rows)
    )


def test_killer_waits_for_the_point_at_full_size_after_the_last_kill() -> None:
    killer = Killer([5, 12], nproc=3, seed=0)
    assert killer.due([step(4, 1.0)]) is None
    assert killer.due([step(5, 1.0, world=2)]) is None  # not back at full size
    at = killer.due([step(4, 1.0), step(5, 2.0)])
    assert at is not None and at["step"] == 5
    killer.record(at, "w1")
    assert killer.due([step(12, 0.0)]) is None  # done before the last kill
    assert killer.due([step(12, killer.kills[-1]["t"] + 1)]) is not None


def test_read_events_merges_the_workers_files_in_time(tmp_path: Path) -> None:
    (tmp_path / "w-2.jsonl").write_text(json.dumps(step(2, 2.0)) + "\n" + '{"ev": "st')
    (tmp_path / "w-1.jsonl").write_text(json.dumps(step(1, 1.0)) + "\n")
    events = read_events(tmp_path)
    assert [e["step"] for e in events] == [1, 2]  # the half-written line is left out
    assert [e["src"] for e in events] == ["w-1", "w-2"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--global-batch", "8"], "--global-batch 8 must split over 3 and 2"),
        (["--nproc", "1"], "--nproc must be >= 2"),
        (["--every", "0"], "--every must be >= 1"),
        (["--replica-every", "-1"], "--replica-every must be >= 0"),
    ],
)
def test_bad_flags_are_named(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(flags)
    assert message in capsys.readouterr().err
