"""zeroplane on one GPU: bf16, a ≈1B-parameter GPT, ZeRO stages 0-3, world size 1 on NCCL.

For each stage: median step time, tokens/s, MFU (6·N·tokens/s over the H200's dense
bf16 peak of 989 TFLOP/s; attention FLOPs are left out, as in the usual 6N rule),
``torch.cuda.max_memory_allocated()`` beside the model-state prediction of
``coordinator.core.memory.model_state_bytes`` and the engine's own ``memory_report()``,
and the single-card cost of stages 1-3 against stage 0 (on one rank no stage can
save memory; each only adds work, which this measures).

Sized to finish all four stages in well under 6 minutes on an H200: the model is
built directly on the GPU, each stage runs a few warm-up and ``--steps`` timed steps,
and a stage is skipped if ``--budget-s`` is already spent. Prints a table and writes
``$OUT/gpu_check.json`` when ``OUT`` is set.

``--dry-run`` runs the same code on CPU (gloo, world size 1) with a tiny model, to
check the script without a GPU; its MFU column means nothing.

``--offload`` runs the offload section instead (worker/offload.py):

1. step time of optimizer offload against none, stage 2, on the ≈1B model
   (``--offload-stage``), with ``max_memory_allocated`` beside the planner's
   device bytes (``coordinator.core.memory.offloaded_state_bytes``);
2. a model that does not fit at stage 3 without offload: the card is capped to
   ``--offload-cap-gib`` (``torch.cuda.set_per_process_memory_fraction``), a
   ≈2.6B GPT (16 bytes per parameter: 42 GB) is tried at stage 3 without
   offload (expected: out of memory), then with optimizer and parameter
   offload as ``choose_stage`` proposes for that card, reporting
   ``max_memory_allocated`` against the planner's figure.

DeepSpeed's ZeRO-Offload is not run here (it is rarely installed on the GPU
machine); bench/offload_cpu.py compares the two on CPU.

Two more sections follow the stage table in a full run, each only if what is
left of ``--budget-s`` fits it (``--birth`` and ``--two-ranks`` run them alone):

- birth (worker/birth.py [Note: birth on the meta device]): the ≈1B GPT built
  under ``torch.device("meta")`` and brought to life by the engine at stage 3,
  beside the ordinary construction on the GPU: ``max_memory_allocated`` through
  birth and through the first step (micro-batch 1, activation checkpointing),
  against the bound 16Ψ/N + the largest gather unit (fp32) and
  ``coordinator.core.memory.birth_bytes`` ([Note: birth peak]);
- two ranks on the one GPU over gloo with CUDA tensors (NCCL refuses two ranks
  on one device): a ≈124M GPT (≈163M untied for the pipeline) at stages 2 and 3,
  each also with pinned optimizer offload, qwZ (``stage3_gather_compression=
  "int8"``) at stages 2 and 3, and a pipeline of two stages (``engine.train_batch``,
  4 micro-batches). Both ranks train on the same batches, so their losses must
  agree (exactly, but for qwZ, whose ranks round each other's slices) and be
  finite; step time and ``max_memory_allocated`` per rank. The ranks are one
  job of two fresh processes over a TCP store; a case that kills or hangs its
  job is reported and the job restarts at the next case.

They write ``$OUT/gpu_check_birth.json`` and ``$OUT/gpu_check_two_ranks.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

# Run from a checkout without installing the package.
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import quiet_gloo_warnings, rank_env, stop_processes  # noqa: E402
from coordinator.core.memory import (  # noqa: E402
    birth_bytes,
    model_state_bytes,
    offloaded_state_bytes,
)
from coordinator.core.planner import PlanConfig, choose_stage  # noqa: E402
from coordinator.core.ports import free_port  # noqa: E402
from worker.models import GPT, GPTConfig  # noqa: E402

H200_BF16_DENSE_PEAK = 989e12  # FLOP/s, dense (no sparsity), from NVIDIA's H200 datasheet

# 18 blocks of d=2048, GPT-2's padded vocabulary, 1024 context: 1.01B parameters (tied).
FULL_CFG = GPTConfig(vocab_size=50304, block_size=1024, n_layer=18, n_head=16, n_embd=2048)
TINY_CFG = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)
# 32 blocks of d=2560: 2.65B parameters, 42 GB of model state at 16 bytes each
BIG_CFG = GPTConfig(vocab_size=50304, block_size=1024, n_layer=32, n_head=20, n_embd=2560)
TINY_BIG_CFG = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=2, n_embd=96)
# GPT-2 small's shape: 124M parameters tied, 163M untied (the pipeline's), two fit with room
TWO_RANK_CFG = GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
# seconds a section of a full run needs at least to be started (guesses for an H200)
SECTION_MIN_S = {"birth": 45.0, "two_ranks": 60.0}


@dataclass
class StageResult:
    stage: int
    checkpointing: bool = False  # activation checkpointing of every block
    status: str = "ok"  # "ok", "skipped: ..." or "failed: ..."
    median_step_s: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    max_allocated_bytes: int | None = None
    predicted_state_bytes: float | None = None
    reported_state_bytes: int | None = None
    saved_activation_bytes: int | None = None
    loss: float | None = None

    @property
    def label(self) -> str:
        return f"{self.stage}{'+ac' if self.checkpointing else ''}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_stage(
    stage: int,
    cfg: GPTConfig,
    device: torch.device,
    args: argparse.Namespace,
    deadline: float,
    checkpointing: bool = False,
) -> StageResult:
    import worker

    res = StageResult(stage=stage, checkpointing=checkpointing)
    torch.manual_seed(0)
    # Built on the device: initialising 1B parameters on the host takes longer than a stage.
    with device:
        model = GPT(cfg)
    numel = sum(p.numel() for p in model.parameters())  # tied weights once
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    config = worker.ZeroConfig(
        stage=stage, dtype="bf16", activation_checkpointing="units" if checkpointing else "none"
    )
    engine = worker.initialize(model, opt, config=config)
    # A 1B-parameter step on the host would take the whole budget: fail fast instead.
    stray = {str(p.device) for p in model.parameters()} - {str(device)}
    if stray:
        raise RuntimeError(f"engine left parameters on {sorted(stray)}, expected {device}")
    g = torch.Generator(device=device).manual_seed(1)
    batches = [
        torch.randint(
            0, cfg.vocab_size, (args.micro_batch, args.seq + 1), device=device, generator=g
        )
        for _ in range(2)
    ]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def train_step(i: int) -> torch.Tensor:
        if time.perf_counter() > deadline:
            raise TimeoutError(f"time budget of {args.budget_s:.0f} s spent during stage {stage}")
        idx = batches[i % len(batches)]
        loss = engine(idx[:, :-1], idx[:, 1:])
        engine.backward(loss)
        engine.step()
        return loss.detach()

    for i in range(args.warmup):
        train_step(i)
    _sync(device)
    times = []
    loss = torch.zeros(())
    for i in range(args.steps):
        t0 = time.perf_counter()
        loss = train_step(i)
        _sync(device)  # the step is done when the GPU is, not when Python returns
        times.append(time.perf_counter() - t0)

    tokens = args.micro_batch * args.seq
    res.median_step_s = statistics.median(times)
    res.tokens_per_s = tokens / res.median_step_s
    res.mfu = 6 * numel * res.tokens_per_s / H200_BF16_DENSE_PEAK
    res.loss = loss.float().item()
    res.predicted_state_bytes = model_state_bytes(
        numel, stage=stage, world_size=1, dtype="bf16"
    ).total
    report = engine.memory_report()
    res.reported_state_bytes = int(report["total"])
    res.saved_activation_bytes = int(report["activations"])
    if device.type == "cuda":
        res.max_allocated_bytes = torch.cuda.max_memory_allocated(device)
    return res


def _cleanup(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def format_table(results: list[StageResult], numel: int, args: argparse.Namespace) -> str:
    # GiB for the real model; MiB keeps the dry run's tiny numbers readable.
    unit, uname = (2**20, "MiB") if args.dry_run else (2**30, "GiB")
    base = next(
        (r for r in results if r.stage == 0 and not r.checkpointing and r.status == "ok"), None
    )
    header = (
        f"{'stage':>5} {'step ms':>8} {'tok/s':>9} {'MFU':>6} {'max alloc ' + uname:>13} "
        f"{'formula ' + uname:>11} {'engine ' + uname:>10} {'saved act ' + uname:>13} "
        f"{'t/t0':>6} {'mem/mem0':>8} {'loss':>8}"
    )
    lines = [
        f"{numel / 1e6:,.1f}M params, bf16, micro-batch {args.micro_batch} x seq {args.seq}, "
        f"world size 1; median of {args.steps} steps after {args.warmup} warm-up",
        header,
        "-" * len(header),
    ]
    for r in results:
        if r.status != "ok":
            lines.append(f"{r.label:>5} {r.status}")
            continue
        alloc = r.max_allocated_bytes
        lines.append(
            f"{r.label:>5} {1e3 * r.median_step_s:>8.1f} {r.tokens_per_s:>9.0f} "
            f"{100 * r.mfu:>5.1f}% "
            f"{alloc / unit if alloc is not None else float('nan'):>13.2f} "
            f"{r.predicted_state_bytes / unit:>11.2f} {r.reported_state_bytes / unit:>10.2f} "
            f"{(r.saved_activation_bytes or 0) / unit:>13.2f} "
            f"{r.median_step_s / base.median_step_s if base else float('nan'):>5.2f}x "
            + (
                f"{alloc / base.max_allocated_bytes:>7.2f}x"
                if base and alloc and base.max_allocated_bytes
                else f"{'-':>8}"
            )
            + f" {r.loss:>8.4f}"
        )
    lines.append(
        "formula = model states only (16 bytes/param at world size 1 for every stage); "
        "max alloc adds activations and transient buffers; saved act = bytes autograd kept "
        "for backward (+ac: every block under activation checkpointing)"
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny model on CPU, gloo")
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=range(4))
    p.add_argument(
        "--checkpointing-stages",
        type=int,
        nargs="*",
        default=[0, 3],
        choices=range(4),
        help="also run these stages with activation checkpointing on every block",
    )
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument(
        "--offload",
        action="store_true",
        help="run the offload section (see the module notes) instead of the stage table",
    )
    p.add_argument("--offload-stage", type=int, default=2, choices=(1, 2, 3))
    p.add_argument(
        "--offload-cap-gib",
        type=float,
        default=24.0,
        help="device memory the offload fit check may use (GiB)",
    )
    p.add_argument(
        "--birth",
        action="store_true",
        help="run the meta-device birth section (module notes) instead of the stage table",
    )
    p.add_argument(
        "--two-ranks",
        action="store_true",
        help="run the two-ranks-on-one-GPU section (module notes) instead of the stage table",
    )
    p.add_argument(
        "--two-rank-cases",
        nargs="+",
        default=[c.name for c in TWO_RANK_CASES],
        choices=[c.name for c in TWO_RANK_CASES],
        help="the cases of the two-rank section to run",
    )
    p.add_argument("--two-rank-worker", help=argparse.SUPPRESS)  # one rank of that section
    p.add_argument(
        "--budget-s",
        type=float,
        default=300.0,
        help="skip the remaining stages once this many seconds have passed; the birth and "
        "two-rank sections of a full run start only if what is left fits them",
    )
    args = p.parse_args(argv)
    if args.dry_run:
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 2)
        args.micro_batch, args.seq = 2, TINY_CFG.block_size
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.two_rank_worker:
        return two_rank_worker(Path(args.two_rank_worker))
    if args.dry_run:
        device, backend, cfg = torch.device("cpu"), "gloo", TINY_CFG
    else:
        if not torch.cuda.is_available():
            print("no CUDA device; use --dry-run to check the script on CPU", file=sys.stderr)
            return 2
        device, backend, cfg = torch.device("cuda", 0), "nccl", FULL_CFG
        torch.cuda.set_device(device)
    if args.seq > cfg.block_size:
        print(f"--seq {args.seq} exceeds the model's block_size {cfg.block_size}", file=sys.stderr)
        return 2
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port("127.0.0.1")))
    init_kw = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, rank=0, world_size=1, **init_kw)

    if args.offload:
        try:
            return run_offload(args, device)
        finally:
            dist.destroy_process_group()

    start = time.perf_counter()
    # --birth / --two-ranks run those alone; a full run adds each to the stage table
    # when what is left of the budget fits it
    alone = args.birth or args.two_ranks
    rc = 0
    try:
        if not alone:
            rc |= run_stages(args, device, cfg, start)
        if args.birth or (not alone and _fits("birth", args, start)):
            rc |= run_birth(args, device, start)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if args.two_ranks or (not alone and _fits("two_ranks", args, start)):
        rc |= run_two_ranks(args, device, start)
    return rc


def _fits(section: str, args: argparse.Namespace, start: float) -> bool:
    """Whether a section of a full run fits what is left of ``--budget-s``; says so if not."""
    need = SECTION_MIN_S[section]
    left = args.budget_s - (time.perf_counter() - start)
    if left >= need:
        return True
    print(f"section {section} skipped: {left:.0f} s of the budget left, it needs ~{need:.0f} s")
    return False


def run_stages(args: argparse.Namespace, device: torch.device, cfg: GPTConfig, start: float) -> int:
    """The stage table (module notes), in the process group ``main`` formed."""
    results: list[StageResult] = []
    runs = [(s, False) for s in args.stages] + [(s, True) for s in args.checkpointing_stages]
    for stage, ckpt in runs:
        elapsed = time.perf_counter() - start
        if elapsed > args.budget_s:
            results.append(StageResult(stage, ckpt, status=f"skipped: {elapsed:.0f} s spent"))
            continue
        try:
            results.append(run_stage(stage, cfg, device, args, start + args.budget_s, ckpt))
        # One stage failing (say, out of memory) should not hide the others' numbers.
        except Exception as e:
            traceback.print_exc()
            results.append(StageResult(stage, ckpt, status=f"failed: {type(e).__name__}: {e}"))
        finally:
            _cleanup(device)
        print(
            f"stage {results[-1].label}: {results[-1].status} "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    with torch.device("meta"):
        numel = sum(p.numel() for p in GPT(cfg).parameters())

    print()
    print(format_table(results, numel, args))
    out = os.environ.get("OUT")
    if out:
        report = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dry_run": args.dry_run,
            "torch": torch.__version__,
            "params": numel,
            "config": asdict(cfg),
            "micro_batch": args.micro_batch,
            "seq": args.seq,
            "steps": args.steps,
            "warmup": args.warmup,
            "peak_flops": H200_BF16_DENSE_PEAK,
            "wall_s": time.perf_counter() - start,
            "results": [asdict(r) for r in results],
        }
        path = Path(out) / "gpu_check.json"
        path.write_text(json.dumps(report, indent=2))
        print(f"wrote {path}")
    return 0 if all(r.status == "ok" for r in results) else 1


# ---------------------------------------------------------------------------- offload


@dataclass
class OffloadResult:
    name: str
    stage: int
    offload: str  # "none", "optimizer", "optimizer+params"
    status: str = "ok"
    params: int = 0
    median_step_s: float | None = None
    max_allocated_bytes: int | None = None
    predicted_device_bytes: float | None = None
    predicted_host_bytes: float | None = None
    reported_device_bytes: int | None = None
    reported_host_bytes: int | None = None
    loss: float | None = None


def run_offload_case(
    name: str,
    stage: int,
    offload: str,
    cfg: GPTConfig,
    device: torch.device,
    args: argparse.Namespace,
) -> OffloadResult:
    import worker

    res = OffloadResult(name, stage, offload)
    torch.manual_seed(0)
    with device:
        model = GPT(cfg)
    res.params = numel = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    config = worker.ZeroConfig(
        stage=stage,
        dtype="bf16",
        offload_optimizer="cpu" if "optimizer" in offload else "none",
        offload_params="cpu" if "params" in offload else "none",
        activation_checkpointing="units",
    )
    engine = worker.initialize(model, opt, config=config)
    g = torch.Generator(device=device).manual_seed(1)
    idx = torch.randint(
        0, cfg.vocab_size, (args.micro_batch, args.seq + 1), device=device, generator=g
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    loss = torch.zeros(())
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        loss = engine(idx[:, :-1], idx[:, 1:])
        engine.backward(loss)
        engine.step()
        _sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    res.median_step_s = statistics.median(times)
    res.loss = loss.float().item()
    dev, host = offloaded_state_bytes(numel, stage=stage, world_size=1, offload=offload)
    res.predicted_device_bytes, res.predicted_host_bytes = dev.total, host.total
    split = engine.memory_by_location()
    res.reported_device_bytes = split["device"]["total"]
    res.reported_host_bytes = split["host"]["total"]
    if device.type == "cuda":
        res.max_allocated_bytes = torch.cuda.max_memory_allocated(device)
    engine.close()
    return res


def run_offload(args: argparse.Namespace, device: torch.device) -> int:
    """The offload section (module notes): speed at ``--offload-stage``, then fit."""
    speed_cfg = TINY_CFG if args.dry_run else FULL_CFG
    big_cfg = TINY_BIG_CFG if args.dry_run else BIG_CFG
    args.seq = min(args.seq, speed_cfg.block_size)
    cases: list[tuple[str, int, str, GPTConfig]] = [
        ("speed", args.offload_stage, "none", speed_cfg),
        ("speed", args.offload_stage, "optimizer", speed_cfg),
    ]
    cap = int(args.offload_cap_gib * 2**30)
    choice = None
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
        with torch.device("meta"):
            big = sum(p.numel() for p in GPT(big_cfg).parameters())
        choice = choose_stage(
            big, world_size=1, device_memory_bytes=cap, config=PlanConfig(precision="bf16")
        )
        print(f"planner for {big / 1e9:.2f}B params on {args.offload_cap_gib} GiB: {choice.reason}")
    offload = (
        choice.offload if choice is not None and choice.offload != "none" else "optimizer+params"
    )
    cases += [("fit", 3, "none", big_cfg), ("fit", 3, offload, big_cfg)]
    results = []
    for name, stage, off, cfg in cases:
        try:
            results.append(run_offload_case(name, stage, off, cfg, device, args))
        except Exception as e:  # out of memory is the expected result of the first fit case
            results.append(
                OffloadResult(
                    name, stage, off, status=f"failed: {type(e).__name__}: {str(e)[:120]}"
                )
            )
        finally:
            _cleanup(device)
        print(f"{name} stage {stage} offload {off}: {results[-1].status}", flush=True)
    gib = 2**30
    print(
        f"\n{'case':>6} {'stage':>5} {'offload':>17} {'params':>8} {'step ms':>9} "
        f"{'max alloc':>10} {'plan dev':>9} {'engine dev':>10} {'plan host':>10} "
        f"{'engine host':>11}   (GiB)"
    )
    base = results[0].median_step_s
    for r in results:
        if r.status != "ok":
            print(f"{r.name:>6} {r.stage:>5} {r.offload:>17} {r.status}")
            continue
        alloc = r.max_allocated_bytes / gib if r.max_allocated_bytes else float("nan")
        print(
            f"{r.name:>6} {r.stage:>5} {r.offload:>17} {r.params / 1e9:>7.2f}B "
            f"{1e3 * r.median_step_s:>9.1f} {alloc:>10.2f} {r.predicted_device_bytes / gib:>9.2f} "
            f"{r.reported_device_bytes / gib:>10.2f} {r.predicted_host_bytes / gib:>10.2f} "
            f"{r.reported_host_bytes / gib:>11.2f}"
        )
    if base and results[1].median_step_s:
        print(f"optimizer offload step time: {results[1].median_step_s / base:.2f}x no offload")
    out = os.environ.get("OUT")
    if out:
        path = Path(out) / "gpu_check_offload.json"
        report = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dry_run": args.dry_run,
            "cap_bytes": cap,
            "plan": None if choice is None else choice.reason,
            "results": [asdict(r) for r in results],
        }
        path.write_text(json.dumps(report, indent=2))
        print(f"wrote {path}")
    fit_ok = results[-1].status == "ok"
    return 0 if fit_ok and all(r.status == "ok" for r in results[:2]) else 1


# ---------------------------------------------------------------------------- birth

# One sequence per step: its activations (checkpointed) are small beside 16Ψ/N, so the
# first step's peak is the model state's and the gathers', as the bound counts them.
BIRTH_MICRO_BATCH = 1


@dataclass
class BirthResult:
    method: str  # "meta": built under torch.device("meta"); "ordinary": built on the device
    status: str = "ok"
    params: int = 0
    largest_unit_numel: int = 0
    birth_s: float | None = None  # construction and worker.initialize
    first_step_s: float | None = None
    birth_max_allocated_bytes: int | None = None  # construction through initialize
    step_max_allocated_bytes: int | None = None  # through birth and the first step
    left_allocated_bytes: int | None = None  # once the engine is closed and dropped
    bound_bytes: float | None = None  # 16Ψ/N + the largest gather unit in fp32
    birth_estimate_bytes: float | None = None  # coordinator.core.memory.birth_bytes
    reported_state_bytes: int | None = None  # the engine's memory_report() after the step
    saved_activation_bytes: int | None = None
    loss: float | None = None


def run_birth_case(
    method: str, cfg: GPTConfig, device: torch.device, args: argparse.Namespace
) -> BirthResult:
    """One model born at stage 3 and trained one step; peaks from before its construction."""
    import worker

    res = BirthResult(method)
    cuda = device.type == "cuda"
    world = dist.get_world_size()
    with torch.device("meta"):
        res.params = numel = sum(p.numel() for p in GPT(cfg).parameters())
    base = torch.cuda.memory_allocated(device) if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    init = None
    if method == "meta":
        with torch.device("meta"):
            model = GPT(cfg)
        init = GPT._init  # what GPT.__init__ applies after construction
    else:
        with device:
            model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    config = worker.ZeroConfig(stage=3, dtype="bf16", activation_checkpointing="units")
    engine = worker.initialize(model, opt, config=config, device=device, init=init)
    _sync(device)
    res.birth_s = time.perf_counter() - t0
    if cuda:
        res.birth_max_allocated_bytes = torch.cuda.max_memory_allocated(device) - base
    stray = {str(p.device) for p in model.parameters()} - {str(device)}
    if stray:
        raise RuntimeError(f"engine left parameters on {sorted(stray)}, expected {device}")
    units: Counter[int] = Counter()
    for spec in engine.inventory.specs:
        units[spec.unit] += math.prod(spec.shape)
    res.largest_unit_numel = unit = max(units.values())

    g = torch.Generator(device=device).manual_seed(1)
    idx = torch.randint(
        0, cfg.vocab_size, (BIRTH_MICRO_BATCH, args.seq + 1), device=device, generator=g
    )
    t0 = time.perf_counter()
    loss = engine(idx[:, :-1], idx[:, 1:])
    engine.backward(loss)
    engine.step()
    _sync(device)
    res.first_step_s = time.perf_counter() - t0
    if cuda:
        res.step_max_allocated_bytes = torch.cuda.max_memory_allocated(device) - base
    res.loss = loss.float().item()
    report = engine.memory_report()
    res.reported_state_bytes = int(report["total"])
    res.saved_activation_bytes = int(report["activations"])
    states = model_state_bytes(numel, stage=3, world_size=world, dtype="bf16")
    res.bound_bytes = states.total + 4 * unit
    estimate = birth_bytes(numel, stage=3, world_size=world, dtype="bf16", unit_numel=unit)
    res.birth_estimate_bytes = estimate.meta if method == "meta" else estimate.ordinary
    engine.close()
    del engine, model, opt, loss
    _cleanup(device)
    if cuda:
        res.left_allocated_bytes = torch.cuda.memory_allocated(device) - base
    return res


def format_birth_table(results: list[BirthResult], args: argparse.Namespace) -> str:
    unit, uname = (2**20, "MiB") if args.dry_run else (2**30, "GiB")
    done = next((r for r in results if r.status == "ok"), None)

    def size(x: float | None) -> str:
        return f"{x / unit:.2f}" if x is not None else "-"

    def share(x: float | None, of: float | None) -> str:
        return f"{x / of:.2f}" if x is not None and of else "-"

    lines = []
    if done is not None:
        lines.append(
            f"stage 3, world size {dist.get_world_size() if dist.is_initialized() else 1}, "
            f"{done.params / 1e6:,.1f}M params, largest gather unit "
            f"{done.largest_unit_numel:,} elements; bound = 16Ψ/N + 4·unit = "
            f"{size(done.bound_bytes)} {uname}; first step: micro-batch {BIRTH_MICRO_BATCH} "
            f"x seq {args.seq}, activation checkpointing"
        )
    header = (
        f"{'method':>8} {'birth s':>8} {'step s':>7} {'birth peak':>10} {'step peak':>10} "
        f"{'estimate':>9} {'engine':>8} {'left':>7} {'birth/bd':>8} {'step/bd':>8} "
        f"{'loss':>8}   ({uname})"
    )
    lines += [header, "-" * len(header)]
    for r in results:
        if r.status != "ok":
            lines.append(f"{r.method:>8} {r.status}")
            continue
        lines.append(
            f"{r.method:>8} {r.birth_s:>8.2f} {r.first_step_s:>7.2f} "
            f"{size(r.birth_max_allocated_bytes):>10} {size(r.step_max_allocated_bytes):>10} "
            f"{size(r.birth_estimate_bytes):>9} {size(r.reported_state_bytes):>8} "
            f"{size(r.left_allocated_bytes):>7} "
            f"{share(r.birth_max_allocated_bytes, r.bound_bytes):>8} "
            f"{share(r.step_max_allocated_bytes, r.bound_bytes):>8} {r.loss:>8.4f}"
        )
    lines.append(
        "peaks: max_memory_allocated from before the construction; estimate = birth_bytes "
        "(model state but the optimizer's, + 4Ψ ordinary / + 8·unit meta); engine = "
        "memory_report() after the step; left = still allocated once the engine is dropped"
    )
    return "\n".join(lines)


def run_birth(args: argparse.Namespace, device: torch.device, start: float) -> int:
    """The birth section (module notes): meta against ordinary at stage 3."""
    cfg = TINY_CFG if args.dry_run else FULL_CFG
    results: list[BirthResult] = []
    for method in ("meta", "ordinary"):
        elapsed = time.perf_counter() - start
        if elapsed > args.budget_s:
            results.append(BirthResult(method, status=f"skipped: {elapsed:.0f} s spent"))
            continue
        try:
            results.append(run_birth_case(method, cfg, device, args))
        except Exception as e:
            traceback.print_exc()
            results.append(BirthResult(method, status=f"failed: {type(e).__name__}: {e}"))
        finally:
            _cleanup(device)
        print(
            f"birth {method}: {results[-1].status} ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    print()
    print(format_birth_table(results, args))
    out = os.environ.get("OUT")
    if out:
        report = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dry_run": args.dry_run,
            "torch": torch.__version__,
            "config": asdict(cfg),
            "stage": 3,
            "world_size": dist.get_world_size(),
            "micro_batch": BIRTH_MICRO_BATCH,
            "seq": args.seq,
            "wall_s": time.perf_counter() - start,
            "results": [asdict(r) for r in results],
        }
        path = Path(out) / "gpu_check_birth.json"
        path.write_text(json.dumps(report, indent=2))
        print(f"wrote {path}")
    return 0 if all(r.status == "ok" for r in results) else 1


# ---------------------------------------------------------------------------- two ranks


@dataclass(frozen=True)
class TwoRankCase:
    name: str
    stage: int
    offload: str = "none"  # ZeroConfig.offload_optimizer ("cpu": pinned host buffers on CUDA)
    gather: str = "none"  # ZeroConfig.stage3_gather_compression (qwZ: "int8")
    pp: int = 1  # pipeline stages (the pipeline refuses stage 3)


TWO_RANK_CASES = (
    TwoRankCase("s2", 2),
    TwoRankCase("s2+offload", 2, offload="cpu"),
    TwoRankCase("s3", 3),
    TwoRankCase("s3+offload", 3, offload="cpu"),
    TwoRankCase("s2+qwZ", 2, gather="int8"),
    TwoRankCase("s3+qwZ", 3, gather="int8"),
    TwoRankCase("pp2", 1, pp=2),
)
TWO_RANK_MICRO_BATCH = 4  # sequences per rank and step (the pipeline: one per micro-batch)
PP_MICROBATCHES = 4
# the ranks train on the same batches: their losses agree exactly, but under qwZ,
# where each rank's forward uses the others' slices rounded to int8
LOSS_TOL = {"none": 1e-3, "int8": 2e-2}
PEER_GRACE_S = 15.0  # after one rank dies, for the other to notice and report


@dataclass
class TwoRankResult:
    name: str
    stage: int
    offload: str = "none"
    gather: str = "none"
    pp: int = 1
    status: str = "ok"
    params: int = 0  # the whole model's
    median_step_s: list[float] = field(default_factory=list)  # per rank
    max_allocated_bytes: list[int | None] = field(default_factory=list)  # per rank
    device_state_bytes: list[int] = field(default_factory=list)  # memory_by_location
    host_state_bytes: list[int] = field(default_factory=list)
    losses: list[list[float]] = field(default_factory=list)  # per rank, per step
    loss_rel_diff: float | None = None  # the largest between the ranks, over the steps

    @classmethod
    def of(cls, case: TwoRankCase, status: str) -> TwoRankResult:
        return cls(**asdict(case), status=status)


def run_two_rank_case(case: TwoRankCase, cfg: GPTConfig, device: torch.device, spec: dict) -> dict:
    """One case on this rank: build, train ``warmup + steps`` steps, report."""
    import worker
    from worker.mesh import ParallelConfig
    from worker.pipeline import lm_loss

    cuda = device.type == "cuda"
    if case.pp > 1:
        cfg = replace(cfg, tie_weights=False)  # the embedding and the head on two stages
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    with device:
        model = GPT(cfg)
    numel = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    config = worker.ZeroConfig(
        stage=case.stage,
        dtype="bf16",
        offload_optimizer=case.offload,
        stage3_gather_compression=case.gather,
        pin_memory=True,
    )
    mesh = {}
    if case.pp > 1:
        parallel = ParallelConfig(pipeline_parallel=case.pp, microbatches=PP_MICROBATCHES)
        mesh = {"parallel": parallel, "loss_fn": lm_loss}
    engine = worker.initialize(model, opt, config=config, device=device, **mesh)
    stray = {str(p.device) for p in engine.module.parameters()} - {str(device)}
    if stray:
        raise RuntimeError(f"engine left parameters on {sorted(stray)}, expected {device}")
    # the same batches on both ranks, so that their losses must agree
    g = torch.Generator(device=device).manual_seed(1)
    shape = (spec["micro_batch"], spec["seq"] + 1)
    batches = [
        torch.randint(0, cfg.vocab_size, shape, device=device, generator=g) for _ in range(2)
    ]

    def train_step(i: int) -> float:
        idx = batches[i % len(batches)]
        if case.pp > 1:
            mean = engine.train_batch([(idx[:, :-1], idx[:, 1:])])
            return float("nan") if mean is None else float(mean)
        loss = engine(idx[:, :-1], idx[:, 1:])
        engine.backward(loss)
        engine.step()
        return loss.float().item()

    times, losses = [], []
    for i in range(spec["warmup"] + spec["steps"]):
        t0 = time.perf_counter()
        losses.append(train_step(i))
        _sync(device)
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t0)
    split = engine.memory_by_location()
    got = {
        "params": numel,
        "median_step_s": statistics.median(times),
        "max_allocated_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "device_state_bytes": split["device"]["total"],
        "host_state_bytes": split["host"]["total"],
        "losses": losses,
    }
    engine.close()
    return got


def two_rank_worker(spec_path: Path) -> int:
    """One rank of the two-rank section's job: its cases in order, a JSON line each.

    A failed case ends the process (the group may be broken, a peer stuck in a
    collective): the parent restarts the job at the next case."""
    spec = json.loads(spec_path.read_text())
    quiet_gloo_warnings()
    rank = int(os.environ["RANK"])
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)  # both ranks on the one GPU
    # the host's cores shared between the ranks (offload's optimizer steps run there)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2) if device.type == "cuda" else 1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{spec['port']}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=spec["timeout_s"]),
    )
    out = spec_path.parent / f"rank{rank}.jsonl"

    def emit(line: dict) -> None:
        with out.open("a") as f:
            f.write(json.dumps({"rank": rank, "t": time.time(), **line}) + "\n")

    emit({"ready": True})
    cfg = TINY_CFG if spec["dry_run"] else TWO_RANK_CFG
    last = 0.0  # the last case's seconds: the next one's estimate
    for fields in spec["cases"]:
        case = TwoRankCase(**fields)
        # rank 0 decides, so that both ranks run the case or neither
        go = torch.tensor([time.time() + last < spec["deadline"]], dtype=torch.int32)
        dist.broadcast(go, src=0)
        if not go.item():
            emit({"case": case.name, "status": "skipped: budget spent"})
            continue
        t0 = time.perf_counter()
        try:
            got = run_two_rank_case(case, cfg, device, spec)
        except Exception as e:
            traceback.print_exc()
            emit({"case": case.name, "status": f"failed: {type(e).__name__}: {str(e)[:200]}"})
            sys.stderr.flush()
            os._exit(1)  # no group teardown: it could wait on the peer
        _cleanup(device)
        last = time.perf_counter() - t0
        emit({"case": case.name, "status": "ok", **got})
    dist.destroy_process_group()
    return 0


def _two_rank_job(
    cases: list[TwoRankCase], spec: dict, workdir: Path, limit: float
) -> tuple[dict[tuple[str, int], dict], int, str]:
    """Run ``cases`` in one job of two fresh processes until they end or ``limit``
    (perf_counter); returns each (case, rank)'s line, how many ranks formed the
    group, and why the job ended early ("" if it did not)."""
    workdir.mkdir()
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps({**spec, "cases": [asdict(c) for c in cases]}))
    procs = []
    for rank in range(2):
        # LOCAL_RANK 0: both ranks' device is cuda:0 (worker.initialize gets it anyway)
        env = {**os.environ, **rank_env(rank, 2, spec["port"]), "LOCAL_RANK": "0"}
        cmd = [sys.executable, __file__, "--two-rank-worker", str(spec_path)]
        procs.append(subprocess.Popen(cmd, env=env))
    why = ""
    while any(p.poll() is None for p in procs):
        dead = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode not in (None, 0)]
        if dead:
            why = f"rank {dead[0][0]} exited with {dead[0][1]}"
            grace = time.perf_counter() + PEER_GRACE_S
            while any(p.poll() is None for p in procs) and time.perf_counter() < grace:
                time.sleep(0.2)
            break
        if time.perf_counter() > limit:
            why = "killed: the budget was spent"
            break
        time.sleep(0.2)
    stop_processes(procs, grace=5.0)
    codes = [p.returncode for p in procs]
    if not why and any(codes):
        why = f"exit codes {codes}"
    lines: dict[tuple[str, int], dict] = {}
    ready = 0
    for rank in range(2):
        path = workdir / f"rank{rank}.jsonl"
        for raw in path.read_text().splitlines() if path.exists() else []:
            line = json.loads(raw)
            if line.get("ready"):
                ready += 1
            else:
                lines[line["case"], rank] = line
    return lines, ready, why


def _job_failure(got: list[dict | None], why: str) -> str:
    """The status of the case a job ended in, where a rank said nothing (killed by a
    signal, or by the budget): the job's end, then what the other rank said."""
    said = "".join(f"; rank {g['rank']}: {g['status']}" for g in got if g is not None)
    return f"failed: {why}{said}"


def _merge(case: TwoRankCase, ranks: list[dict]) -> TwoRankResult:
    """Both ranks' lines of a case, the losses checked: finite, and agreeing. Of two
    errors the first is the cause (the other is mostly its peer's closed connection)."""
    bad = sorted((r for r in ranks if r["status"] != "ok"), key=lambda r: r["t"])
    if bad:
        return TwoRankResult.of(case, bad[0]["status"])
    res = TwoRankResult.of(case, "ok")
    res.params = ranks[0]["params"]
    res.median_step_s = [r["median_step_s"] for r in ranks]
    res.max_allocated_bytes = [r["max_allocated_bytes"] for r in ranks]
    res.device_state_bytes = [r["device_state_bytes"] for r in ranks]
    res.host_state_bytes = [r["host_state_bytes"] for r in ranks]
    res.losses = [r["losses"] for r in ranks]
    flat = [x for r in res.losses for x in r]
    if not all(math.isfinite(x) for x in flat):
        res.status = f"failed: a loss is not finite ({flat})"
        return res
    res.loss_rel_diff = max(
        abs(a - b) / max(abs(a), 1e-12) for a, b in zip(*res.losses, strict=True)
    )
    if res.loss_rel_diff > LOSS_TOL[case.gather]:
        res.status = (
            f"failed: the ranks' losses differ by {res.loss_rel_diff:.2e} relative "
            f"(> {LOSS_TOL[case.gather]:g})"
        )
    return res


def format_two_rank_table(results: list[TwoRankResult], spec: dict, dry_run: bool) -> str:
    unit, uname = (2**20, "MiB") if dry_run else (2**30, "GiB")

    def pair(xs: list, scale: float, fmt: str) -> str:
        return "/".join(fmt.format(x / scale) if x is not None else "-" for x in xs) or "-"

    header = (
        f"{'case':>10} {'stage':>5} {'offload':>7} {'gather':>6} {'pp':>2} {'params':>8} "
        f"{'step ms r0/r1':>15} {'max alloc r0/r1':>16} {'device r0/r1':>13} "
        f"{'host r0/r1':>13} {'last loss':>9} {'rel diff':>8}"
    )
    lines = [
        f"two ranks on {spec['device']} over gloo, bf16, micro-batch {spec['micro_batch']} x "
        f"seq {spec['seq']} per rank (the same batches on both; the pipeline's as "
        f"{PP_MICROBATCHES} micro-batches); median of {spec['steps']} steps after "
        f"{spec['warmup']} warm-up; memory in {uname}",
        header,
        "-" * len(header),
    ]
    for r in results:
        head = f"{r.name:>10} {r.stage:>5} {r.offload:>7} {r.gather:>6} {r.pp:>2}"
        if not r.median_step_s:
            lines.append(f"{head} {r.status}")
            continue
        lines.append(
            f"{head} {r.params / 1e6:>7.1f}M {pair(r.median_step_s, 1e-3, '{:.1f}'):>15} "
            f"{pair(r.max_allocated_bytes, unit, '{:.2f}'):>16} "
            f"{pair(r.device_state_bytes, unit, '{:.2f}'):>13} "
            f"{pair(r.host_state_bytes, unit, '{:.2f}'):>13} {r.losses[0][-1]:>9.4f} "
            f"{r.loss_rel_diff if r.loss_rel_diff is not None else float('nan'):>8.1e}"
            + ("" if r.status == "ok" else f"  {r.status}")
        )
    lines.append(
        "device/host = the engine's memory_by_location() totals (model state); rel diff = "
        "the largest relative difference of the ranks' losses over the steps"
    )
    return "\n".join(lines)


def run_two_ranks(args: argparse.Namespace, device: torch.device, start: float) -> int:
    """The two-rank section (module notes): one job of two processes on ``device``."""
    cfg = TINY_CFG if args.dry_run else TWO_RANK_CFG
    deadline = start + args.budget_s
    spec = {
        "device": str(device),
        "dry_run": args.dry_run,
        "micro_batch": TWO_RANK_MICRO_BATCH,
        "seq": min(args.seq, cfg.block_size),
        # gloo moves every byte through the host: a few steps say enough
        "warmup": min(args.warmup, 2),
        "steps": min(args.steps, 5),
        "timeout_s": 60 if args.dry_run else 90,  # a collective waiting on a dead peer
        "deadline": time.time() + deadline - time.perf_counter(),
    }
    pending = [c for c in TWO_RANK_CASES if c.name in args.two_rank_cases]
    results: dict[str, TwoRankResult] = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        job = 0
        while pending:
            elapsed = time.perf_counter() - start
            if elapsed > args.budget_s:
                for case in pending:
                    results[case.name] = TwoRankResult.of(case, f"skipped: {elapsed:.0f} s spent")
                break
            spec["port"] = free_port("127.0.0.1")
            lines, ready, why = _two_rank_job(
                pending, spec, Path(tmp) / f"job{job}", deadline + PEER_GRACE_S
            )
            job += 1
            if ready < 2:  # the job never formed its group: the next would not either
                for case in pending:
                    results[case.name] = TwoRankResult.of(case, f"failed: no job ({why})")
                break
            while pending:
                case = pending.pop(0)
                got = [lines.get((case.name, rank)) for rank in range(2)]
                if all(g is not None for g in got):
                    results[case.name] = _merge(case, got)
                    if all(g["status"] == "ok" or g["status"].startswith("skipped") for g in got):
                        continue
                    break  # a rank failed it and ended the job: the next job goes on
                results[case.name] = TwoRankResult.of(case, _job_failure(got, why))
                break
            print(f"two ranks: job {job} ended ({why or 'ok'})", flush=True)
    ordered = [results[c.name] for c in TWO_RANK_CASES if c.name in results]
    print()
    print(format_two_rank_table(ordered, spec, args.dry_run))
    out = os.environ.get("OUT")
    if out:
        report = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dry_run": args.dry_run,
            "torch": torch.__version__,
            "backend": "gloo",
            "world_size": 2,
            "config": asdict(cfg),
            **{k: spec[k] for k in ("micro_batch", "seq", "warmup", "steps")},
            "pp_microbatches": PP_MICROBATCHES,
            "wall_s": time.perf_counter() - start,
            "results": [asdict(r) for r in ordered],
        }
        path = Path(out) / "gpu_check_two_ranks.json"
        path.write_text(json.dumps(report, indent=2))
        print(f"wrote {path}")
    return 0 if all(r.status == "ok" for r in ordered) else 1


if __name__ == "__main__":
    sys.exit(main())
