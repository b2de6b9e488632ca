"""``zeroplane hpo``: a hyperparameter search on Ray Tune, each trial a zeroplane job.

A local Ray instance runs 4 trials (learning rates of a tiny regression) of 2
workers each, 2 at a time, under ASHA. The trial with the best learning rate
crashes once at step 10 and Tune starts it again from the zeroplane checkpoint
it reported (step 8). Checked: ASHA stopped trials early, the best trial is
the one with the lowest loss (and the learning rate that converges), and the
crashed trial resumed from its checkpoint and ran to the end.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

if importlib.util.find_spec("ray") is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI must run the Ray tests: pip install -e '.[test]'")
    pytest.skip("ray is not installed (pip install -e '.[hpo]')", allow_module_level=True)

from coordinator.tuning.search import HpoSpec, parse_space, search

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "hpo_train.py"


def test_parse_space():
    from ray import tune

    space = parse_space(["lr=loguniform:1e-4:1e-1", "warmup=choice:0,10", "lr2=grid:1,2", "s=3"])
    assert isinstance(space["lr"], tune.search.sample.Float)
    assert space["warmup"].categories == [0, 10]
    assert space["lr2"] == {"grid_search": [1, 2]}
    assert space["s"] == 3
    with pytest.raises(ValueError, match="NAME=KIND:ARGS"):
        parse_space(["lr"])
    with pytest.raises(ValueError, match="'lr=loguniform:1'"):
        parse_space(["lr=loguniform:1"])


def test_spec_errors_name_the_field():
    with pytest.raises(ValueError, match=r"HpoSpec\.nproc"):
        HpoSpec(script="x.py", nproc=0)
    with pytest.raises(ValueError, match=r"HpoSpec\.grace_steps"):
        HpoSpec(script="x.py", max_steps=5, grace_steps=6)
    with pytest.raises(ValueError, match=r"HpoSpec\.reduction_factor"):
        HpoSpec(script="x.py", reduction_factor=1)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_asha_stops_bad_trials_and_a_failed_trial_resumes_from_its_checkpoint(
    tmp_path, monkeypatch
):
    from ray import tune

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    marks = tmp_path / "marks"
    marks.mkdir()
    good = 0.1
    result = search(
        HpoSpec(
            script=str(SCRIPT),
            args=("--steps", "20", "--save-every", "4", "--crash-at", "10"),
            space={
                "lr": tune.grid_search([good, 1e-3, 3e-4, 1e-4]),
                "crash_lr": good,
                "mark_dir": str(marks),
            },
            nproc=2,
            max_steps=20,
            grace_steps=4,
            reduction_factor=2,
            max_concurrent=2,
            max_failures=1,
            storage_path=str(tmp_path / "tune"),
            checkpoint_root=str(tmp_path / "ckpt"),
        )
    )
    table = result.table()
    assert len(result.trials) == 4, table
    assert not [t for t in result.trials if t.status == "failed"], table
    # ASHA stopped at least one trial before the end
    assert result.stopped_early, table
    assert all(t.step < 20 for t in result.stopped_early)
    # the best is the lowest last loss, and it is the learning rate that converges
    losses = [t.loss for t in result.trials if t.loss is not None]
    assert result.best is not None and result.best.loss == min(losses), table
    assert result.best.params["lr"] == good and result.best.status == "completed"
    assert result.best.checkpoint is not None
    # it crashed at step 10 and Tune started it again from the last checkpoint it had
    # reported (step 8, or 4 if the trial's report of step 8 came too late)
    assert [p.name for p in marks.iterdir()] in (
        [f"resumed-lr{good}-at-8"],
        [f"resumed-lr{good}-at-4"],
    )
