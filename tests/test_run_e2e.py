"""`zeroplane run` end to end: embedded coordinator, real workers, torch reference."""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_gpt.py"


def load_example():
    spec = importlib.util.spec_from_file_location("train_gpt", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference(
    steps: int, global_batch: int, optimizer: str = "adamw", warmup: int = 0
) -> dict[str, torch.Tensor]:
    """examples/train_gpt.py's parameters after ``steps`` steps in one torch process
    (trained once per arguments in a session: the tests only read them)."""
    return dict(_reference(steps, global_batch, optimizer, warmup))


@functools.cache
def _reference(steps: int, global_batch: int, optimizer: str, warmup: int) -> dict:
    ex = load_example()
    from worker.demo import load_corpus

    data = load_corpus()
    sampler = ex.make_sampler(data, global_batch)
    model, opt = ex.build(optimizer=optimizer)
    scheduler = ex.schedule(opt, warmup, steps)
    for _ in range(steps):
        x, y = ex.samples(data, sampler.next_global_batch())
        model(x, y).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", ["2", "3"])
def test_zeroplane_run_matches_single_process(tmp_path: Path, stage: str) -> None:
    out = tmp_path / "final.pt"
    cmd = [
        sys.executable,
        "-m",
        "coordinator.cli",
        "run",
        "--nproc",
        "2",
        "--stage",
        stage,
        str(EXAMPLE),
        "--steps",
        "6",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the workers went through the coordinator: it formed a generation of 2
    assert "world size 2" in proc.stderr + proc.stdout
    got = torch.load(out, weights_only=True)
    want = reference(6, 12)
    assert got.keys() == want.keys()
    worst = max((got[k] - want[k]).abs().max().item() for k in got)
    assert worst < 1e-5
