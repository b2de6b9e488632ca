"""ZeroplaneStrategy (worker/lightning.py): Lightning trains like a single-process torch run.

Every run trains examples/train_lightning.py's MLP (or a variant) on the same global
batches and is compared with :func:`reference`, plain torch in this process.

Lightning's own launcher re-runs its script for the other ranks, so this file is
also the script: ``python tests/test_lightning.py --devices N --out DIR JOB...``
runs the named jobs one after another in the same processes (one launch for all
stages) and rank 0 writes ``DIR/<job>.pt``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_lightning.py"
THIS = Path(__file__).resolve()

GLOBAL_BATCH, SAMPLES = 16, 64  # 4 optimizer steps an epoch
EPOCHS = 2
STEPS = EPOCHS * SAMPLES // GLOBAL_BATCH
LAUNCHED = ["stage0", "stage1", "stage2", "stage3", "accumulate", "manual", "bf16", "save"]


def load_example():
    spec = importlib.util.spec_from_file_location("train_lightning", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference(steps: int, optimizer: str = "adamw") -> dict[str, torch.Tensor]:
    """The example's training in one process: each step the whole global batch, mean
    loss; the scheduler stepped after every optimizer step.

    Lightning gives a training loader a shuffling DistributedSampler (seed 0, its
    epoch set each epoch). Its permutation does not depend on the world size, and
    rank r of W takes every W-th sample of it, so the global batch of step s of an
    epoch is samples ``perm[s * GLOBAL_BATCH : (s + 1) * GLOBAL_BATCH]`` at any W."""
    ex = load_example()
    net = ex.build_net(0)
    opt, schedule = ex.build_optimizer(net.parameters(), optimizer)
    data = ex.make_dataset(SAMPLES)
    x, y = data.tensors
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    per_epoch = SAMPLES // GLOBAL_BATCH
    for step in range(steps):
        epoch, s = divmod(step, per_epoch)
        sampler.set_epoch(epoch)
        batch = list(sampler)[s * GLOBAL_BATCH : (s + 1) * GLOBAL_BATCH]
        F.mse_loss(net(x[batch]), y[batch]).backward()
        opt.step()
        schedule.step()
        opt.zero_grad()
    return {f"net.{n}": p.detach().clone() for n, p in net.named_parameters()}


def worst_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    return max((got[k].float() - want[k]).abs().max().item() for k in want)


def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``cmd`` in its own session, killed with everything it started on timeout."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("ZEROPLANE_")
        and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n{out[-4000:]}")
    finally:
        # Lightning's launched ranks outlive rank 0 by a moment: no strays
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def result(out: Path, job: str, proc: subprocess.CompletedProcess) -> dict:
    path = out / f"{job}.pt"
    assert proc.returncode == 0 and path.exists(), (
        f"{job}: exit {proc.returncode}\n" + (proc.stdout[-6000:])
    )
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One run under Lightning's launcher, 2 CPU processes, every job of LAUNCHED."""
    out = tmp_path_factory.mktemp("lightning")
    cmd = [sys.executable, str(THIS), "--devices", "2", "--out", str(out), *LAUNCHED]
    return out, run(cmd, timeout=400)


# ------------------------------------------------------------ Lightning's launcher


@pytest.mark.timeout(450)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_lightning_launcher_matches_single_process(launched, stage: int) -> None:
    got = result(launched[0], f"stage{stage}", launched[1])
    assert got["info"]["stage"] == stage and got["info"]["world"] == 2
    assert got["info"]["global_step"] == got["info"]["engine_steps"] == STEPS
    assert worst_difference(got["params"], reference(STEPS)) < 1e-5


@pytest.mark.timeout(450)
@pytest.mark.parametrize("job", ["accumulate", "manual"])
def test_accumulation_and_manual_optimization(launched, job: str) -> None:
    """Two micro-batches a step (Trainer(accumulate_grad_batches=2), the engine's
    accumulation); manual optimization (manual_backward, opt.step, the scheduler
    stepped by the module). SGD: unlike Adam's, its step scales with the loss."""
    got = result(launched[0], job, launched[1])
    assert got["info"]["global_step"] == got["info"]["engine_steps"] == STEPS
    assert worst_difference(got["params"], reference(STEPS, "sgd")) < 1e-5


@pytest.mark.timeout(450)
def test_bf16_mixed_runs_in_bf16(launched) -> None:
    got = result(launched[0], "bf16", launched[1])
    assert got["info"]["dtype"] == "bf16"
    # fp32 master weights, bf16 compute: near the fp32 run, not equal to it
    diff = worst_difference(got["params"], reference(STEPS))
    assert 0 < diff < 0.05


@pytest.mark.timeout(450)
def test_resume_at_another_world_size_and_stage(launched) -> None:
    """Saved after one epoch at 2 ranks, stage 3; resumed at 1 rank, stage 1, for the
    second: the same parameters as the uninterrupted run."""
    out, proc = launched
    saved = result(out, "save", proc)
    assert saved["info"]["global_step"] == STEPS // EPOCHS
    assert (out / "ckpt" / "latest").exists()  # a zeroplane checkpoint directory
    resumed = run(
        [sys.executable, str(THIS), "--devices", "1", "--out", str(out), "resume"], timeout=240
    )
    got = result(out, "resume", resumed)
    assert got["info"]["world"] == 1 and got["info"]["stage"] == 1
    assert got["info"]["global_step"] == got["info"]["engine_steps"] == STEPS
    assert worst_difference(got["params"], reference(STEPS)) < 1e-5


# ------------------------------------------------------------ zeroplane run


@pytest.mark.timeout(300)
def test_zeroplane_run_matches_single_process(tmp_path: Path) -> None:
    out = tmp_path / "final.pt"
    cmd = [
        sys.executable,
        "-m",
        "coordinator.cli",
        "run",
        "--nproc",
        "2",
        "--stage",
        "2",
        str(EXAMPLE),
        "--epochs",
        str(EPOCHS),
        "--out",
        str(out),
    ]
    proc = run(cmd, timeout=240)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert "world size 2" in proc.stdout  # the workers registered with the coordinator
    got = torch.load(out, weights_only=True)
    assert got["info"]["stage"] == 2 and got["info"]["world"] == 2
    assert worst_difference(got["params"], reference(STEPS)) < 1e-5


# ------------------------------------------------------------ configuration


def test_registered_names_and_precision_mapping() -> None:
    import lightning as L
    from lightning.pytorch.strategies import StrategyRegistry

    from worker.lightning import ZeroplaneStrategy

    for name in ["zeroplane", *(f"zeroplane_stage_{s}" for s in range(4))]:
        assert name in StrategyRegistry
    for stage in range(4):
        trainer = L.Trainer(
            strategy=f"zeroplane_stage_{stage}", accelerator="cpu", devices=1, logger=False
        )
        assert isinstance(trainer.strategy, ZeroplaneStrategy)
        assert trainer.strategy.config.stage == stage
    for flag, dtype in [("32-true", "fp32"), ("bf16-mixed", "bf16"), ("32", "fp32")]:
        trainer = L.Trainer(strategy="zeroplane", accelerator="cpu", devices=1, precision=flag)
        assert trainer.strategy.precision_plugin.dtype == dtype


@pytest.mark.parametrize("flag", ["64-true", "bf16-true", "16-true"])
def test_unsupported_precision_is_refused_by_name(flag: str) -> None:
    import lightning as L

    import worker.lightning  # noqa: F401 - registers "zeroplane"

    with pytest.raises(ValueError, match=f"precision='{flag}'"):
        L.Trainer(strategy="zeroplane", accelerator="cpu", devices=1, precision=flag)


def test_bad_strategy_config_is_refused() -> None:
    from worker.config import ZeroConfig
    from worker.lightning import ZeroplaneStrategy, engine_config

    with pytest.raises(ValueError, match="stage"):
        ZeroplaneStrategy(stage=5)
    with pytest.raises(TypeError, match="ZeroConfig"):
        ZeroplaneStrategy(config={"stage": 2})
    with pytest.raises(ValueError, match="disagrees"):
        ZeroplaneStrategy(config=ZeroConfig(stage=1), stage=2)
    # what the Trainer sets must agree with what the config says
    with pytest.raises(ValueError, match="precision='bf16-mixed'"):
        engine_config(ZeroConfig(dtype="bf16"), precision="32-true")
    with pytest.raises(ValueError, match="gradient_clip_algorithm='value'"):
        engine_config(
            ZeroConfig(),
            precision="32-true",
            gradient_clip_val=1.0,
            gradient_clip_algorithm="value",
        )
    with pytest.raises(ValueError, match="accumulate_grad_batches=2"):
        engine_config(
            ZeroConfig(gradient_accumulation_steps=4),
            precision="32-true",
            accumulate_grad_batches=2,
        )
    got = engine_config(
        ZeroConfig(stage=2),
        precision="bf16-mixed",
        gradient_clip_val=0.5,
        accumulate_grad_batches=2,
    )
    assert (got.stage, got.dtype, got.gradient_clipping, got.gradient_accumulation_steps) == (
        2,
        "bf16",
        0.5,
        2,
    )


@pytest.mark.timeout(60)
def test_worker_imports_without_lightning() -> None:
    code = (
        "import sys\n"
        "sys.modules['lightning'] = None\n"
        "import worker\n"
        "try:\n"
        "    import worker.lightning\n"
        "except ImportError as e:\n"
        "    print('refused:', e)\n"
    )
    proc = run([sys.executable, "-c", code], timeout=50)
    assert proc.returncode == 0, proc.stdout
    assert "refused: worker.lightning needs PyTorch Lightning" in proc.stdout


# ------------------------------------------------------------ the launched script


def _job(name: str, devices: int, out: Path) -> None:
    """Train job ``name`` at ``devices`` ranks; rank 0 writes ``out/<name>.pt``."""
    from worker.lightning import ZeroplaneStrategy

    ex = load_example()

    class ManualRegressor(ex.Regressor):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt, schedule = self.optimizers(), self.lr_schedulers()
            x, y = batch
            loss = F.mse_loss(self(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            schedule.step()
            return loss

    sizes = {"global_batch": GLOBAL_BATCH, "samples": SAMPLES}
    sgd = {"optimizer": "sgd", **sizes}
    stage, epochs, kwargs, ckpt = 2, EPOCHS, {}, None
    model = ex.Regressor(**sizes)
    if name.startswith("stage"):
        stage = int(name[5:])
    elif name == "accumulate":
        model = ex.Regressor(micro_batches=2, **sgd)
        kwargs["accumulate_grad_batches"] = 2
    elif name == "manual":
        stage, model = 1, ManualRegressor(**sgd)
    elif name == "bf16":
        kwargs["precision"] = "bf16-mixed"
    elif name == "save":
        stage, epochs = 3, 1
    elif name == "resume":
        stage, ckpt = 1, out / "ckpt"
    trainer = ex.trainer_for(ZeroplaneStrategy(stage=stage), devices, max_epochs=epochs, **kwargs)
    trainer.fit(model, ckpt_path=ckpt)
    ex.write_result(trainer, out / f"{name}.pt")
    if name == "save":
        trainer.save_checkpoint(out / "ckpt")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("jobs", nargs="+")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for job in args.jobs:
        _job(job, args.devices, args.out)
