"""The autotuner's measured runs: a pool of ranks that run one short trial after another.

``zeroplane tune`` (coordinator/commands/tune.py) starts N processes of
``python -m worker.trials --dir D ...`` once; they form one process group and
then, for each trial the tuner asks for, build the model afresh (same seed),
wrap it in a :class:`~worker.engine.ZeroEngine` with the trial's
``ZeroConfig``, run ``warmup`` then ``steps`` optimizer steps on synthetic
batches, and close the engine. Starting processes once keeps a trial to the
cost of its steps, which is what makes searching affordable.

The tuner and the pool talk through files in ``D`` (JSON, never pickle):
``trial-K.json`` asks for trial K (written atomically by the tuner);
``result-K.json`` is rank 0's answer; ``stop`` ends the pool. A trial that
raises (out of memory, a config the model cannot take) is reported by every
rank that saw it in ``error-K-rankR.txt``, and the pool exits 1: the group
may be unusable, so the tuner starts a fresh pool for the next trial.

Throughput is global samples per second from the median step time (a step
delayed by another process on a shared machine does not decide a trial);
memory is the engine's model state plus what the last measured forward kept
for backward (and, on CUDA, the allocator's peak).

The model: ``--gpt LAYERS,HIDDEN,HEADS,SEQ`` (worker.models.GPT on random
bytes), or ``--model MODULE:FUNCTION`` (or ``FILE.py:FUNCTION``) returning an
``nn.Module`` with ``--batch`` naming a function that takes ``(micro_batch,
step, rank)`` and returns the arguments of the module's forward, which
returns the loss.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import importlib.util
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from worker.config import ZeroConfig
from worker.factory import build_engine
from worker.models import GPT, GPTConfig
from worker.spec import EngineSpec

__all__ = ["ModelSpec", "gpt_spec", "main", "run_trial"]

logger = logging.getLogger(__name__)

POLL_S = 0.02


class ModelSpec:
    """How to build the model and its batches (the same on every rank and trial)."""

    def __init__(
        self,
        build: Callable[[], nn.Module],
        batch: Callable[[int, int, int], tuple[Any, ...]],
        *,
        tokens_per_sample: int = 0,
    ) -> None:
        self.build = build
        self.batch = batch
        self.tokens_per_sample = tokens_per_sample


def gpt_spec(layers: int, hidden: int, heads: int, seq: int) -> ModelSpec:
    cfg = GPTConfig(block_size=seq, n_layer=layers, n_head=heads, n_embd=hidden)

    def batch(micro_batch: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step * 1009 + rank)
        x = torch.randint(0, cfg.vocab_size, (micro_batch, seq + 1), generator=g)
        return x[:, :-1], x[:, 1:]

    return ModelSpec(lambda: GPT(cfg), batch, tokens_per_sample=seq)


def _load(ref: str, what: str) -> Callable[..., Any]:
    """``package.module:function`` or ``path/to/file.py:function``."""
    module, sep, name = ref.rpartition(":")
    if not sep or not module or not name:
        raise ValueError(f"--{what} must be MODULE:FUNCTION or FILE.py:FUNCTION, got {ref!r}")
    if module.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(module).stem, module)
        if spec is None or spec.loader is None or not Path(module).is_file():
            raise ValueError(f"--{what} {ref!r}: no such file {module!r}")
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
    else:
        loaded = importlib.import_module(module)
    fn = getattr(loaded, name, None)
    if not callable(fn):
        raise ValueError(f"--{what} {ref!r}: {module} has no callable {name!r}")
    return fn


def _device() -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _to(device: torch.device, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def run_trial(
    spec: ModelSpec,
    config: ZeroConfig,
    *,
    micro_batch: int,
    warmup: int,
    steps: int,
    device: torch.device,
    seed: int = 0,
) -> dict[str, Any]:
    """One trial on this rank (all ranks call it): the figures rank 0 reports."""
    torch.manual_seed(seed)
    model = spec.build().to(device)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    engine = build_engine(EngineSpec(model=model, optimizer=opt, config=config))
    try:
        rank, world = engine.rank, engine.world_size
        accum = config.gradient_accumulation_steps
        times: list[float] = []
        for step in range(warmup + steps):
            start = time.perf_counter()
            for micro in range(accum):
                args = _to(device, spec.batch(micro_batch, step * accum + micro, rank))
                loss = engine(*args)
                engine.backward(loss)
                engine.step(samples=micro_batch)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step >= warmup:
                times.append(time.perf_counter() - start)
        memory = engine.memory_report()
        step_s = statistics.median(times)
        samples = micro_batch * accum * world
        result = {
            "samples_per_s": samples / step_s,
            "tokens_per_s": samples * spec.tokens_per_sample / step_s,
            "step_s": step_s,
            "numel": numel,
            "memory_bytes": memory["total"] + memory["activations"],
            "activations_bytes": memory["activations"],
            "model_state_bytes": memory["total"],
            "loss": float(loss.detach()),
        }
        if device.type == "cuda":
            result["peak_bytes"] = torch.cuda.max_memory_allocated(device)
            result["device_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
        return result
    finally:
        engine.close()
        del engine, opt, model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _write_json(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def serve(spec: ModelSpec, directory: Path, *, idle_timeout_s: float = 600.0) -> int:
    """Run the trials the tuner asks for until it writes ``stop``; returns an exit code."""
    device = _device()
    rank = dist.get_rank() if dist.is_initialized() else 0
    k = int((directory / "next").read_text()) if (directory / "next").exists() else 0
    waited = time.monotonic()
    while True:
        request = directory / f"trial-{k}.json"
        if (directory / "stop").exists():
            return 0
        if not request.exists():
            if time.monotonic() - waited > idle_timeout_s:
                logger.error("no trial asked for in %.0fs; the tuner is gone", idle_timeout_s)
                return 1
            time.sleep(POLL_S)
            continue
        ask = json.loads(request.read_text())
        try:
            result = run_trial(
                spec,
                ZeroConfig(**ask["config"]),
                micro_batch=int(ask["micro_batch"]),
                warmup=int(ask.get("warmup", 1)),
                steps=int(ask.get("steps", 3)),
                device=device,
                seed=int(ask.get("seed", 0)),
            )
        except Exception as exc:
            (directory / f"error-{k}-rank{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
            logger.exception("trial %d failed", k)
            return 1
        if rank == 0:
            _write_json(directory / f"result-{k}.json", result)
        k += 1
        waited = time.monotonic()


def _parse(argv: Sequence[str] | None) -> tuple[ModelSpec, Path]:
    p = argparse.ArgumentParser(prog="python -m worker.trials", description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, required=True, help="the tuner's exchange directory")
    p.add_argument("--gpt", metavar="LAYERS,HIDDEN,HEADS,SEQ", help="the built-in GPT")
    p.add_argument("--model", metavar="MODULE:FUNCTION", help="returns the nn.Module")
    p.add_argument("--batch", metavar="MODULE:FUNCTION", help="(micro_batch, step, rank) -> args")
    p.add_argument("--tokens-per-sample", type=int, default=0)
    args = p.parse_args(argv)
    if args.gpt:
        try:
            layers, hidden, heads, seq = (int(v) for v in args.gpt.split(","))
        except ValueError:
            p.error(f"--gpt wants LAYERS,HIDDEN,HEADS,SEQ, got {args.gpt!r}")
        return gpt_spec(layers, hidden, heads, seq), args.dir
    if not (args.model and args.batch):
        p.error("give --gpt, or --model and --batch")
    spec = ModelSpec(
        _load(args.model, "model"),
        _load(args.batch, "batch"),
        tokens_per_sample=args.tokens_per_sample,
    )
    return spec, args.dir


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    spec, directory = _parse(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    try:
        return serve(spec, directory)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
