"""examples/train_moe.py under ``zeroplane run --ep``: a transformers Mixtral as it comes,
its experts split over the ranks of each ep group, against one-process torch."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.reference import max_diff

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_moe.py"


def _example():
    spec = importlib.util.spec_from_file_location("train_moe", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    # ep beside tp runs the same launch path, tested from Python (tests/test_moe_mesh.py)
    ("tp", "pp", "cp", "stage"),
    [(1, 1, 2, 3), (1, 2, 1, 2)],
    ids=["ep-x-cp", "pp-x-ep"],
)
def test_an_expert_parallel_job_under_zeroplane_run_trains_like_torch(
    tmp_path, tp: int, pp: int, cp: int, stage: int
) -> None:
    """At tp = 2 the attention, embedding and head split over tp (worker/tp.py
    ``moe_plan``), the experts whole on each tp rank; at pp = 2 the layers in two
    stages; either way each stage's experts split over the ep group of two dp
    indices at its tp and pp position. At cp = 2 each share's sequences split over
    the two ranks of its cp group (ring attention), which are its ep group too:
    ``train_batch`` with ``lm_loss`` takes each rank's shard of the tokens."""
    out, steps, world = tmp_path / "final.pt", 3, 4
    cmd = [
        sys.executable, "-m", "coordinator.cli", "run", "--nproc", str(world), "--ep", "2",
        "--tp", str(tp), "--pp", str(pp), "--cp", str(cp), "--cp-kind", "ring", "--no-http",
        str(EXAMPLE), "--steps", str(steps), "--stage", str(stage), "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "expert parallel: ep=2" in done.stdout + done.stderr
    if tp * pp > 1:
        assert f"mesh pp={pp} dp=2 tp={tp}" in done.stdout + done.stderr
    if cp > 1:
        assert "context parallel: cp=2 (ring)" in done.stdout + done.stderr

    from worker.pipeline import lm_loss

    example = _example()
    ref = example.build_model()
    opt = example.optimizer(ref)
    shares = world // (tp * pp * cp)
    for step in range(steps):
        for share in range(shares):
            ids = example.batch(step, share)
            (lm_loss(ref(input_ids=ids[:, :-1]).logits, ids[:, 1:]) / shares).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    got = torch.load(out, weights_only=True)
    diff, name = max_diff(got, dict(ref.named_parameters()))
    assert diff < 1e-5, f"{name} differs from torch by {diff:.3g}"


def test_run_refuses_an_ep_that_does_not_divide_the_job() -> None:
    from coordinator.cli import main

    assert main(["run", "--nproc", "3", "--ep", "2", str(EXAMPLE)]) == 2
    # an elastic one grows and shrinks by whole ep groups (tests/test_moe_elastic.py)
    assert main(["run", "--nproc", "4", "--ep", "2", "--max-nproc", "5", str(EXAMPLE)]) == 2
    assert main(["run", "--nproc", "4", "--ep", "2", "--min-nproc", "3", str(EXAMPLE)]) == 2
    # ep x tp runs whole tp x ep blocks, at one size for now
    assert main(["run", "--nproc", "6", "--ep", "2", "--tp", "2", str(EXAMPLE)]) == 2
    assert main(["run", "--nproc", "4", "--ep", "2", "--tp", "2", "--max-nproc", "8",
                 str(EXAMPLE)]) == 2  # fmt: skip
    assert main(["run", "--nproc", "6", "--ep", "2", "--pp", "2", str(EXAMPLE)]) == 2
    assert main(["run", "--nproc", "4", "--ep", "2", "--mesh", "auto", str(EXAMPLE)]) == 2
