"""`zeroplane run` with a torchrun-style script that forms its process group
itself (the README's example): the coordinator still sees every worker, the
stage follows the rules the README states, and training matches torch."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from coordinator.core.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "own_group.py"


def _script():
    spec = importlib.util.spec_from_file_location("own_group", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference() -> tuple[dict[str, torch.Tensor], float]:
    """One process, the two ranks' batches' mean loss per step: the final
    parameters and the last step's loss."""
    s = _script()
    torch.manual_seed(0)
    model = s.GPT(s.CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(s.STEPS):
        last = 0.0
        for rank in range(2):
            loss = model(*s.batch(step, rank)) / 2
            loss.backward()
            last += loss.item()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}, last


def _get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


class Job:
    """A `zeroplane run` in the background, its output collected as it comes."""

    def __init__(self, tmp: Path, launcher_stage: str | None, script_stage: int) -> None:
        stage = [] if launcher_stage is None else ["--stage", launcher_stage]
        cmd = [sys.executable, "-m", "coordinator.cli", "run", "--nproc", "2", *stage,
               "--http-port", "0", str(SCRIPT), str(tmp), str(script_stage)]  # fmt: skip
        self.tmp = tmp
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, what: str, ready, timeout: float = 90.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = ready()
            if got:
                return got
            assert self.proc.poll() is None, (
                f"the job ended while waiting for {what}:\n{self.output[-3000:]}"
            )
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}:\n{self.output[-3000:]}")

    def finish(self) -> int:
        (self.tmp / "release").touch()
        try:
            return self.proc.wait(timeout=60)
        finally:
            self.proc.kill()
            self.reader.join(timeout=5)


def run_job(
    tmp: Path, launcher_stage: str | None, script_stage: int
) -> tuple[Job, list[dict], dict]:
    job = Job(tmp, launcher_stage, script_stage)
    try:
        http = job.wait_for(
            "the status page address",
            lambda: (m := re.search(r"status page http://([^/\s]+)/", job.output)) and m.group(1),
        )
        ranks = job.wait_for(
            "both ranks to finish training",
            lambda: (
                all((tmp / f"rank{r}.json").exists() for r in range(2))
                and [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]
            ),
        )
        # heartbeats carry reports: wait for both to have arrived, whatever their pace
        status = job.wait_for(
            "both workers' reports",
            lambda: (
                (s := _get_json(f"http://{http}/api/status"))
                and sum(w["state"] == "member" and w["step"] is not None for w in s["workers"]) == 2
                and s
            ),
        )
        sd = _get_json(f"http://{http}/sd")
        status["sd_targets"] = sorted(t for g in sd for t in g["targets"])
        status["registered"] = sorted(w["metrics_endpoint"] for w in status["workers"])
    finally:
        code = job.finish()
    assert code == 0, job.output[-3000:]
    return job, ranks, status


def check_trained_like_torch(tmp: Path, job: Job, ranks: list[dict]) -> None:
    got = torch.load(tmp / "final.pt", weights_only=True)
    want, last_loss = reference()
    assert got.keys() == want.keys()
    worst = max((got[k] - want[k]).abs().max().item() for k in got)
    assert worst < 1e-5, worst
    # the loss a job logs is the mean over ranks (engine.mean_loss), and so is the
    # one in the summary the launcher ends with, from the workers' final reports
    assert all(abs(r["mean_loss"] - last_loss) < 1e-5 for r in ranks), (ranks, last_loss)
    summary = job.output[job.output.index("zeroplane run: finished in") :]
    s = _script()
    assert re.search(rf"steps +{s.STEPS} \(generation 1, world size 2", summary), summary
    loss = re.search(r"loss +([0-9.]+) \(step \d+, mean over 2 ranks\)", summary)
    assert loss and abs(float(loss.group(1)) - last_loss) < 1e-4, summary
    tokens = s.STEPS * 2 * 2 * s.CFG.block_size
    assert f"({tokens:,} tokens)" in summary, summary
    assert "metrics     http://" in summary, summary


@pytest.mark.timeout(240)
def test_own_group_script_is_managed_and_the_launchers_stage_wins(tmp_path: Path) -> None:
    job, ranks, status = run_job(tmp_path, "3", script_stage=1)
    assert [r["stage"] for r in ranks] == [3, 3]
    assert [r["world"] for r in ranks] == [2, 2]
    assert all(r["generation"] == 1 for r in ranks), ranks
    # the coordinator saw the job: its workers, their reports, Prometheus targets
    assert status["world_size"] == 2 and status["stage"] == 3
    assert len(status["sd_targets"]) == 2 and status["sd_targets"] == status["registered"]
    # said, not silent, with no logging set up in the script
    assert "stage 3 applies, not this script's ZeroConfig(stage=1)" in job.output
    assert job.output.count("this script formed its own process group") == 1
    check_trained_like_torch(tmp_path, job, ranks)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("launcher_stage, want", [(None, 1), ("auto", 1)])
def test_stage_is_the_scripts_unless_the_launcher_says(
    tmp_path: Path, launcher_stage, want
) -> None:
    """No --stage: the script's ZeroConfig(stage=1) applies; --stage auto: the planner's
    choice where it knows the devices' memory, and the script's stage where it does not
    (these CPU workers report none; tests/test_coordinator_membership.py has both)."""
    job, ranks, status = run_job(tmp_path, launcher_stage, script_stage=1)
    assert [r["stage"] for r in ranks] == [want, want]
    assert status["stage"] == want
    assert ("not this script's ZeroConfig" in job.output) == (want != 1)
    check_trained_like_torch(tmp_path, job, ranks)


@pytest.mark.timeout(240)
def test_under_torchrun_initialize_forms_the_group_a_script_did_not(tmp_path: Path) -> None:
    """A script that never calls init_process_group, under torchrun: initialize forms
    the group from torchrun's environment (as deepspeed.initialize does) instead of
    training WORLD_SIZE separate copies of the model."""
    (tmp_path / "release").touch()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(free_port("127.0.0.1"))]  # fmt: skip
    cmd = [*torchrun, str(SCRIPT), str(tmp_path), "2", "no-init"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["world"], r["stage"]) for r in ranks] == [(2, 2), (2, 2)]
    got = torch.load(tmp_path / "final.pt", weights_only=True)
    want, last_loss = reference()
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst < 1e-5, worst
    assert all(abs(r["mean_loss"] - last_loss) < 1e-5 for r in ranks), (ranks, last_loss)
