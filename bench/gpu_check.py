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
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

# Run from a checkout without installing the package.
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from coordinator.core.memory import model_state_bytes, offloaded_state_bytes  # noqa: E402
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
        "--budget-s",
        type=float,
        default=300.0,
        help="skip the remaining stages once this many seconds have passed",
    )
    args = p.parse_args(argv)
    if args.dry_run:
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 2)
        args.micro_batch, args.seq = 2, TINY_CFG.block_size
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
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
    results: list[StageResult] = []
    numel = 0
    try:
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
    finally:
        dist.destroy_process_group()

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


if __name__ == "__main__":
    sys.exit(main())
