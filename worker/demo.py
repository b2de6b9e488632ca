"""The per-worker training script behind ``zeroplane demo``.

Run under a launcher that sets torchrun's environment (``zeroplane run -m
worker.demo ...`` or the demo command itself): every rank builds the same small
byte-level GPT from the same seed, wraps it with ``worker.initialize`` at the
requested ZeRO stage, and trains on its slice of each global batch drawn from
the shipped corpus (``worker/data/corpus.txt.gz``), read through
:class:`worker.data.StepLoader` (each step's batch prepared ahead in a
background thread).

Its progress reaches the parent as any job's does: through the coordinator
(``engine.progress(total=steps)``, ``engine.step(samples=, tokens=)``). Each rank
also writes ``rank{R}.json`` in ``--out`` once at the end (atomically, JSON, never
pickle), with the model's trainable element count, ``engine.memory_report()``,
the collectives of the training steps (``engine.comm_report()`` less the
setup's) and every step's loss and time.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

import worker
from coordinator.core.settings import ADDRESS_ENV
from worker.config import stage_from_env
from worker.data import LoaderConfig, PackedTokens, StepLoader
from worker.models import GPT, GPTConfig

__all__ = [
    "DemoConfig",
    "DemoWindows",
    "corpus_path",
    "load_corpus",
    "main",
    "make_loader",
    "sample_batch",
    "train",
]

logger = logging.getLogger(__name__)

CORPUS = "data/corpus.txt.gz"


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """One demo run on one rank.

    stage / dtype: passed to ``worker.ZeroConfig``.
    steps: optimizer steps.
    batch_size: sequences per global batch, split evenly across ranks.
    block_size, n_layer, n_head, n_embd: the GPT's shape (byte vocabulary, 256).
    lr: AdamW learning rate.
    seed: seeds the model's initialisation and the batch sampler, so every stage
        trains the same model on the same data.
    """

    stage: Literal[0, 1, 2, 3] = 0
    dtype: Literal["fp32", "bf16"] = "fp32"
    steps: int = 40
    batch_size: int = 16
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    lr: float = 3e-3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"DemoConfig.stage must be 0, 1, 2 or 3, got {self.stage!r}")
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"DemoConfig.dtype must be 'fp32' or 'bf16', got {self.dtype!r}")
        for name in ("steps", "batch_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DemoConfig.{name} must be an integer >= 1, got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"DemoConfig.lr must be > 0, got {self.lr!r}")

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=256,
            block_size=self.block_size,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
        )


def corpus_path() -> Path:
    """The shipped corpus file (gzip-compressed text)."""
    return Path(str(resources.files("worker").joinpath(CORPUS)))


def load_corpus() -> torch.Tensor:
    """The shipped corpus as a 1-D int64 tensor of bytes."""
    raw = gzip.decompress(resources.files("worker").joinpath(CORPUS).read_bytes())
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


class DemoWindows:
    """The demo's global batches: ``batch_size`` windows of the corpus at random
    starts, drawn with replacement from (seed, step) alone, so a batch is the same
    for every stage and world size (a :class:`worker.data.BatchPlan`)."""

    def __init__(self, cfg: DemoConfig, num_tokens: int) -> None:
        self.seed, self.batch_size = cfg.seed, cfg.batch_size
        self.high = num_tokens - cfg.block_size - 1

    def batch_at(self, step: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return torch.randint(0, self.high, (self.batch_size,), generator=g).tolist()

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed}


def make_loader(data: torch.Tensor, cfg: DemoConfig, *, num_workers: int = 1) -> StepLoader:
    """A loader of the demo's batches: window ``i`` is ``data[i : i + block_size]`` and
    the next bytes as targets."""
    windows = PackedTokens(data, cfg.block_size, stride=1)
    config = LoaderConfig(
        global_batch=cfg.batch_size,
        seed=cfg.seed,
        num_workers=num_workers,
        prefetch=2 if num_workers else 0,
    )
    return StepLoader(windows, config, plan=DemoWindows(cfg, data.numel()))


def sample_batch(
    data: torch.Tensor, cfg: DemoConfig, step: int, rank: int, world_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of global batch ``step``: inputs and next-byte targets."""
    # The global batch depends only on (seed, step), so it is the same for every
    # stage and world size; each rank keeps its contiguous share.
    with make_loader(data, cfg, num_workers=0) as loader:
        ((x, y),) = loader.batches(step, rank, world_size)
    return x, y


def _write_json(path: Path, record: dict[str, Any]) -> None:
    # Write then rename, so the parent never reads half a file.
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)


def _comm_since(
    before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]
) -> dict[str, dict[str, int]]:
    zero = {"calls": 0, "bytes": 0}
    return {
        op: {k: int(v) - int(before.get(op, zero).get(k, 0)) for k, v in stats.items()}
        for op, stats in after.items()
    }


def train(cfg: DemoConfig, out: Path) -> dict[str, Any]:
    """Train on this rank; write and return its report.

    Under ``zeroplane run`` the engine registers with the job's coordinator and
    forms the process group; run by hand, the group must be up already."""
    data = load_corpus()
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.gpt_config())
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    engine = worker.initialize(
        model, opt, config=worker.ZeroConfig(stage=cfg.stage, dtype=cfg.dtype)
    )
    rank, world_size = engine.rank, engine.world_size
    if cfg.batch_size % world_size:
        raise ValueError(
            f"DemoConfig.batch_size ({cfg.batch_size}) must be divisible by the "
            f"world size ({world_size})"
        )

    engine.progress(total=cfg.steps)  # the launcher's progress line: step / total, ETA
    setup_comm = engine.comm_report()  # the initial broadcast is not part of a step
    losses: list[float] = []
    step_times: list[float] = []
    loader = make_loader(data, cfg)
    for step in range(cfg.steps):
        ((x, y),) = loader.batches(step, rank, world_size)
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step(samples=x.shape[0], tokens=x.numel())
        dt = time.perf_counter() - t0
        losses.append(float(loss.detach()))
        step_times.append(dt)

    report = {
        "rank": rank,
        "world_size": world_size,
        "config": asdict(cfg),
        "numel": numel,
        "memory": {k: int(v) for k, v in engine.memory_report().items()},
        "comm": _comm_since(setup_comm, engine.comm_report()),
        "losses": losses,
        "step_s": step_times,
    }
    _write_json(out / f"rank{rank}.json", report)
    loader.close()
    engine.close()
    return report


def _parse_args(argv: Sequence[str] | None) -> tuple[DemoConfig, Path]:
    default = DemoConfig()
    p = argparse.ArgumentParser(prog="python -m worker.demo", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="directory for the JSON reports")
    p.add_argument(
        "--stage",
        type=int,
        default=stage_from_env(0),
        help="ZeRO stage (default: $ZEROPLANE_STAGE, else 0)",
    )
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=default.dtype)
    for name in ("steps", "batch_size", "block_size", "n_layer", "n_head", "n_embd", "seed"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(default, name))
    p.add_argument("--lr", type=float, default=default.lr)
    args = vars(p.parse_args(argv))
    out = args.pop("out")
    return DemoConfig(**args), out


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg, out = _parse_args(argv)
    out.mkdir(parents=True, exist_ok=True)
    # One thread per worker: the ranks share the machine's cores.
    torch.set_num_threads(1)
    if not os.environ.get(ADDRESS_ENV):
        # Seconds, not the default 30 minutes: a dead peer should fail the job quickly.
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        train(cfg, out)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
