"""DeepSpeed scripts as they are, under ``zeroplane run`` (worker/deepspeed [Note: a
drop-in for DeepSpeed scripts]): tests/scripts/ds_cifar.py, a CIFAR-10 script in the
shape of DeepSpeedExamples' (its import the only difference between the systems), with
the config of that example at its own stage (0) and at stage 3 over two ranks, equal to
one process training the same batches with torch alone; where DeepSpeed is installed,
the same script under DeepSpeed 0.19 (torchrun) ends equal to it under zeroplane, and
so does tests/scripts/ds_train.py."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

import worker.deepspeed as worker_deepspeed
from coordinator.launchers.local import find_free_port

ROOT = Path(__file__).resolve().parents[1]
CIFAR = ROOT / "tests" / "scripts" / "ds_cifar.py"
BERT = ROOT / "tests" / "scripts" / "ds_bert.py"


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ds_cifar = _load(CIFAR)
WORLD, GLOBAL_BATCH, EPOCHS, WARMUP = 2, 16, 2, 1000
LR, BETAS, EPS, DECAY = 1e-3, (0.8, 0.999), 1e-8, 3e-7


def config(stage: int) -> dict:
    """The CIFAR example's DeepSpeed config, at ``stage``."""
    return {
        "train_batch_size": GLOBAL_BATCH,
        "steps_per_print": 2000,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": DECAY},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": LR, "warmup_num_steps": WARMUP},
        },
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "wall_clock_breakdown": False,
        "zero_optimization": {
            "stage": stage,
            "allgather_partitions": True,
            "reduce_scatter": True,
            "allgather_bucket_size": 50000000,
            "reduce_bucket_size": 50000000,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "cpu_offload": False,
        },
    }


def reference(moe: list[str] | None = None) -> dict[str, torch.Tensor]:
    """One process, torch alone: each step the two ranks' micro-batches (their
    DistributedSampler's order, the epoch never set, as the script leaves it), the mean
    of their losses, clipped at 1; DeepSpeed's "Adam" (decoupled decay: AdamW) and its
    WarmupLR, logarithmic from 0 to LR over WARMUP steps: step k at DeepSpeed's
    iteration k - 1 (-1 before the first: the minimum), log(it + 1) / log(WARMUP).

    ``moe``: the script's MoE flags; the net then holds all the experts, and each
    rank's micro-batch runs from the random state every rank has there (their gates
    draw the same numbers: one seed), each epoch after the one number a DataLoader's
    iterator draws."""
    args = moe_args(moe or [])
    model = ds_cifar.build(args, worker_deepspeed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY)
    warm = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: 0.0 if k == 0 else min(math.log(k) / math.log(WARMUP), 1.0)
    )
    data = ds_cifar.images(ds_cifar.SAMPLES, seed=7)
    orders = [list(DistributedSampler(data, num_replicas=WORLD, rank=r)) for r in range(WORLD)]
    micro = GLOBAL_BATCH // WORLD
    for _ in range(EPOCHS):
        torch.empty((), dtype=torch.int64).random_()  # the loader's base seed
        for start in range(0, len(orders[0]), micro):
            losses, every_rank = [], torch.get_rng_state()
            for order in orders:
                x, y = data[order[start : start + micro]]
                torch.set_rng_state(every_rank)
                losses.append(torch.nn.functional.cross_entropy(model(x), y))
            (sum(losses) / WORLD).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            warm.step()
            opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def _after(names, prefix: str) -> list[str]:
    return [n[len(prefix) :] for n in names if n.startswith(prefix)]


def moe_args(flags: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    ds_cifar.add_moe_arguments(parser)
    return parser.parse_args(flags)


def run(system: str, stage: int, tmp_path: Path, moe: list[str] | None = None) -> dict:
    """The script's parameters and predictions; with MoE flags asking ``--ep-world-size``
    2, each rank's experts under their indices in the whole layer (DeepSpeed numbers a
    rank's own from 0)."""
    ds_config = tmp_path / f"ds_config_{stage}.json"
    ds_config.write_text(json.dumps(config(stage)))
    out = tmp_path / f"{system}-{stage}.pt"
    script = [str(CIFAR), "--system", system, "--deepspeed", "--deepspeed_config", str(ds_config)]
    launch(system, [*script, "--out", str(out), *(moe or [])])
    if moe_args(moe or []).ep_world_size == 1:
        return torch.load(out, weights_only=True)
    ranks = [torch.load(f"{out}.{r}", weights_only=True) for r in range(WORLD)]
    params: dict[str, torch.Tensor] = {}
    for rank, held in enumerate(ranks):
        for name, value in held["params"].items():
            if system == "deepspeed" and ".deepspeed_experts." in name:
                head, tail = name.split(".deepspeed_experts.")
                index, rest = tail.split(".", 1)
                prefix = f"{head}.deepspeed_experts."
                mine = {k.split(".")[0] for k in _after(held["params"], prefix)}
                name = f"{head}.deepspeed_experts.{rank * len(mine) + int(index)}.{rest}"
            params[name] = value
    return {"params": params, "predicted": ranks[0]["predicted"]}


def launch(system: str, script: list[str]) -> None:
    """``script`` on two ranks: ``zeroplane run``, or torchrun for DeepSpeed."""
    if system == "zeroplane":
        cmd = [sys.executable, "-m", "coordinator.cli", "run", "--nproc", str(WORLD), *script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD)]
        cmd += ["--master-port", str(find_free_port()), *script]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


def worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    return max((got[k] - want[k]).abs().max().item() for k in want)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("stage", [0, 3])
def test_the_cifar_script_trains_as_torch_under_zeroplane(tmp_path: Path, stage: int) -> None:
    got = run("zeroplane", stage, tmp_path)
    want = reference()
    assert worst(got["params"], want) < 1e-5
    # the net evaluated by itself after training, as the script does
    model = ds_cifar.build()
    model.load_state_dict(want)
    with torch.no_grad():
        expected = model(ds_cifar.images(8, seed=8).tensors[0]).argmax(1)
    assert torch.equal(got["predicted"], expected)


# DeepSpeed's MoE layers as the example's flags build them: two layers of 2 and 4
# experts over ep 2, top-1 with its random token selection and jittered gate input
MOE = ["--moe", "--num-experts", "2", "4", "--ep-world-size", "2", "--min-capacity", "2",
       "--noisy-gate-policy", "Jitter", "--moe-param-group"]  # fmt: skip


@pytest.mark.timeout(200)
def test_the_cifar_script_with_moe_layers_trains_as_torch_at_stage_3(tmp_path: Path) -> None:
    """``deepspeed.moe.layer.MoE`` with ``ep_size=2`` under ``zeroplane run`` at stage
    3 (which DeepSpeed refuses for its MoE): the experts split over the two ranks,
    equal to one process holding every expert."""
    got = run("zeroplane", 3, tmp_path, MOE)
    want = reference(MOE)
    assert worst(got["params"], want) < 1e-5
    assert any(".deepspeed_experts.3." in name for name in got["params"])


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [0, 3])
def test_the_cifar_script_ends_as_under_deepspeed(tmp_path: Path, stage: int) -> None:
    pytest.importorskip("deepspeed")
    theirs = run("deepspeed", stage, tmp_path)
    ours = run("zeroplane", stage, tmp_path)
    assert worst(ours["params"], theirs["params"]) < 1e-5
    assert torch.equal(ours["predicted"], theirs["predicted"])


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "flags", [MOE, ["--moe", "--num-experts", "4", "--top-k", "2", "--mlp-type", "residual"]]
)
def test_the_cifar_script_with_moe_layers_ends_as_under_deepspeed(
    tmp_path: Path, flags: list[str]
) -> None:
    """The MoE layers under DeepSpeed 0.19 at stage 2 (it refuses its MoE at stage 3)
    and under zeroplane at stage 2: the same gates, drops and experts."""
    pytest.importorskip("deepspeed")
    theirs = run("deepspeed", 2, tmp_path, flags)
    ours = run("zeroplane", 2, tmp_path, flags)
    assert worst(ours["params"], theirs["params"]) < 1e-5
    assert torch.equal(ours["predicted"], theirs["predicted"])


def bert_reference(steps: int, start: int = 0, whole=None) -> dict[str, torch.Tensor]:
    """One process, torch alone: the mean of the two ranks' masked-LM losses a step,
    AdamW as the config names it; from step ``start`` with the parameters and AdamW
    state of ``whole`` (a checkpoint read whole), or from the beginning."""
    ds_bert = _load(BERT)
    model = ds_bert.build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    if whole is not None:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in whole.master.items():
                params[name].copy_(value)
        for name, held in whole.state.items():
            p = params[name]
            opt.state[p] = {
                k: v.reshape(p.shape).clone() if v.numel() == p.numel() else v.clone()
                for k, v in held.items()
            }
    model.train()
    for step in range(start, steps):
        losses = [model(**ds_bert.batch(step, r)).loss for r in range(WORLD)]
        (sum(losses) / WORLD).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.timeout(300)
def test_the_bert_script_saves_and_resumes_as_torch_under_zeroplane(tmp_path: Path) -> None:
    """Three steps at stage 3 and a checkpoint with its client state; the script run
    again resumes from it at stage 1 (``_, client_state = load_checkpoint(dir)``)."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "final.pt"
    common = [str(BERT), "--system", "zeroplane", "--checkpoint-dir", str(ckpt)]
    launch("zeroplane", [*common, "--stage", "3", "--steps", "3"])
    launch("zeroplane", [*common, "--stage", "1", "--steps", "6", "--out", str(out)])
    assert worst(torch.load(out, weights_only=True), bert_reference(6)) < 1e-5


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_bert_script_goes_on_in_zeroplane_from_deepspeeds_checkpoint(tmp_path: Path) -> None:
    """The script's first half under DeepSpeed (its checkpoint, tied weights and all),
    its second under zeroplane from that directory. DeepSpeed's own steps are not
    torch's to 1e-5 here (AdamW turns the rounding of gradients near zero, the
    attention keys', into steps of the learning rate's size), so the reference is one
    torch process going on from the checkpoint: its parameters are DeepSpeed's own
    gathered ones, and the continuation must equal it."""
    pytest.importorskip("deepspeed")
    from worker.ds_checkpoint import read_deepspeed

    ckpt, theirs, out = tmp_path / "ckpt", tmp_path / "deepspeed.pt", tmp_path / "final.pt"
    launch("deepspeed", [str(BERT), "--system", "deepspeed", "--stage", "2", "--steps", "3",
                         "--checkpoint-dir", str(ckpt), "--out", str(theirs)])  # fmt: skip
    whole = read_deepspeed(ckpt)
    held = torch.load(theirs, weights_only=True)
    assert worst({n: held[n] for n in whole.master}, whole.master) == 0.0
    assert set(held) == set(whole.master)  # the tied names are aliases, not parameters
    launch("zeroplane", [str(BERT), "--system", "zeroplane", "--stage", "3", "--steps", "6",
                         "--checkpoint-dir", str(ckpt), "--out", str(out)])  # fmt: skip
    assert worst(torch.load(out, weights_only=True), bert_reference(6, 3, whole)) < 1e-5
