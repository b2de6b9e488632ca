"""torch Distributed Checkpoint directories across the switch (worker/dcp_checkpoint.py
[Note: DCP checkpoints]): an FSDP2 job's (torchtitan's flattened optimizer keys) loads
into a zeroplane engine at another world size and trains on; a zeroplane engine's
``save_dcp`` loads into an FSDP2 job that trains on; each equal to one uninterrupted
torch run (tests/test_ds_checkpoint.py's model, batches and reference)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import worker
from coordinator.core.manifest import CheckpointError
from coordinator.launchers.local import find_free_port
from tests.test_ds_checkpoint import ds_train, reference, trained, trained_of, worst
from tests.test_ds_checkpoint import zp_engine as engine
from tests.test_ds_checkpoint import zp_train as train

ROOT = Path(__file__).resolve().parents[1]
FSDP2 = ROOT / "tests" / "scripts" / "fsdp2_train.py"
HALF = 5


def fsdp2(*args: str) -> None:
    """tests/scripts/fsdp2_train.py on two ranks (torchrun)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(find_free_port()), str(FSDP2), *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.timeout(240)
def test_zeroplane_to_fsdp2_and_back_goes_on_as_one_run(tmp_path: Path) -> None:
    """zeroplane (one process) trains, ``save_dcp``; an FSDP2 job of two ranks loads it,
    trains on and saves with torchtitan's flattened optimizer keys; zeroplane loads
    that and trains on: equal to one torch run of the three parts."""
    e = engine(2)
    train(e, 0, HALF)
    e.save_dcp(tmp_path / "zp")
    again = engine(1)  # read back here first: the nested form, whole
    again.load_checkpoint(tmp_path / "zp")
    assert worst(trained_of(again), trained_of(e)) == 0.0
    e.close()
    again.close()
    out = tmp_path / "fsdp2.pt"
    fsdp2(
        *("--load", str(tmp_path / "zp"), "--steps", str(2 * HALF), "--out", str(out)),
        *("--save", str(tmp_path / "fsdp2"), "--flatten"),
    )
    model, _ = reference([(1, HALF), (2, HALF)])
    want = {n: p.detach() for n, p in model.named_parameters()}
    assert worst(torch.load(out, weights_only=True), want) < 1e-5
    last = engine(3)
    last.load_checkpoint(tmp_path / "fsdp2")
    assert last.global_steps == 2 * HALF
    train(last, 2 * HALF, 3 * HALF)
    model, _ = reference([(1, HALF), (2, HALF), (1, HALF)])
    assert worst(trained_of(last), trained(model)) < 1e-5
    last.close()


def test_param_groups_that_differ_are_refused(tmp_path: Path) -> None:
    e = engine(2)
    train(e, 0, 1)
    e.save_dcp(tmp_path / "dcp")
    e.close()
    model = ds_train.build()
    one_group = [p for p in model.parameters() if p.requires_grad]
    other = worker.initialize(model, torch.optim.AdamW(one_group, lr=ds_train.LR))
    before = other.full_state_dict()
    with pytest.raises(CheckpointError, match="param group 0"):
        other.load_checkpoint(tmp_path / "dcp")
    assert worst(other.full_state_dict(), before) == 0.0
    other.close()
