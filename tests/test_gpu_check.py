"""bench/gpu_check.py --dry-run of the birth and two-rank sections: the same code a lent
GPU runs, on CPU with tiny models, checked for its JSON's keys and finite numbers."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu_check.py"

BIRTH_NUMBERS = (
    "params",
    "largest_unit_numel",
    "birth_s",
    "first_step_s",
    "bound_bytes",
    "birth_estimate_bytes",
    "reported_state_bytes",
    "saved_activation_bytes",
    "loss",
)
TWO_RANK_CASES = {"s2", "s2+offload", "s3", "s3+offload", "s2+qwZ", "s3+qwZ", "pp2"}


def finite(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dry_run_of_the_birth_and_two_rank_sections(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--birth", "--two-ranks"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert not (tmp_path / "gpu_check.json").exists()  # the stage table ran not

    birth = json.loads((tmp_path / "gpu_check_birth.json").read_text())
    assert birth["dry_run"] is True and birth["stage"] == 3
    assert [r["method"] for r in birth["results"]] == ["meta", "ordinary"]
    for r in birth["results"]:
        assert r["status"] == "ok", r
        for key in BIRTH_NUMBERS:
            assert finite(r[key]), (r["method"], key, r[key])
        assert r["params"] > 0 and 0 < r["largest_unit_numel"] <= r["params"]
        # the bound is 16 bytes a parameter at world size 1 plus the unit in fp32
        assert r["bound_bytes"] == pytest.approx(16 * r["params"] + 4 * r["largest_unit_numel"])
    meta, ordinary = birth["results"]
    assert meta["birth_estimate_bytes"] < ordinary["birth_estimate_bytes"]

    two = json.loads((tmp_path / "gpu_check_two_ranks.json").read_text())
    assert two["dry_run"] is True and two["backend"] == "gloo" and two["world_size"] == 2
    assert {r["name"] for r in two["results"]} == TWO_RANK_CASES
    steps = two["warmup"] + two["steps"]
    for r in two["results"]:
        assert r["status"] == "ok", r
        assert finite(r["loss_rel_diff"]) and finite(r["params"]), r
        for key in ("median_step_s", "device_state_bytes", "host_state_bytes"):
            assert len(r[key]) == 2 and all(finite(x) for x in r[key]), (r["name"], key)
        assert len(r["losses"]) == 2
        assert all(len(ls) == steps and all(finite(x) for x in ls) for ls in r["losses"])
        offloaded = r["offload"] == "cpu"
        assert all((h > 0) == offloaded for h in r["host_state_bytes"]), r
    # the two ranks train on the same batches: the same losses, but for qwZ's rounding
    assert all(r["loss_rel_diff"] == 0.0 for r in two["results"] if r["gather"] == "none"), [
        (r["name"], r["loss_rel_diff"]) for r in two["results"]
    ]
    assert "two ranks on cpu over gloo" in run.stdout and "method" in run.stdout
