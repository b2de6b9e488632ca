"""Data loading: how long a training step waits for its batch, one run, side by side.

    python bench/data_loading.py                    # ~4 min on 2 cores (2 rounds)
    python bench/data_loading.py --io-ms 4 --cpu-ms 1 --steps 60

A dataset whose items cost ``--io-ms`` of latency (a sleep: storage or network)
and ``--cpu-ms`` of pure-Python preprocessing (holds the GIL), read in global
batches of ``--batch`` by one rank that trains a small MLP (one torch thread).
For each loader: median step time, the fraction of the run spent waiting for
data, and the step time relative to the synchronous loader. Loaders:

- ``sync``: zeroplane's StepLoader without workers (reads when asked);
- ``zp-thread`` / ``zp-process``: StepLoader, ``--workers`` threads / processes,
  ``--prefetch`` steps ahead;
- ``torch``: ``torch.utils.data.DataLoader(num_workers=--workers)`` over the
  same global batches (a batch sampler from the same GlobalBatchSampler).

Then the cost of resuming: the items read before the first batch of step
``--resume-at`` at another world size, zeroplane's loader against reading from
the start and skipping (what an iterator-position loader does when its
position does not carry over to the new world size).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.data import GlobalBatchSampler, LoaderConfig, StepLoader


class SlowItems:
    """Item i: a feature vector and a label, after simulated I/O and preprocessing."""

    def __init__(self, n: int, dim: int, io_ms: float, cpu_ms: float) -> None:
        self.n, self.dim, self.io_s, self.cpu_s = n, dim, io_ms / 1e3, cpu_ms / 1e3
        self.reads = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}  # to worker processes

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            self.reads += 1
        time.sleep(self.io_s)
        end, acc = time.perf_counter() + self.cpu_s, i
        while time.perf_counter() < end:  # preprocessing in Python: holds the GIL
            acc = (acc * 1103515245 + 12345) & 0x7FFFFFFF
        g = torch.Generator().manual_seed(i)
        return torch.randn(self.dim, generator=g), torch.tensor(i % 10)


class Batches:
    """The GlobalBatchSampler's global batches as a torch batch sampler."""

    def __init__(self, sampler: GlobalBatchSampler, steps: int) -> None:
        self.sampler, self.steps = sampler, steps

    def __iter__(self):
        return (self.sampler.batch_at(s) for s in range(self.steps))

    def __len__(self) -> int:
        return self.steps


def train(
    next_batch, steps: int, warmup: int, dim: int, hidden: int
) -> tuple[list[float], list[float]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
    head = nn.Linear(hidden, 10)
    opt = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.01)
    step_s, wait_s = [], []
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        x, y = next_batch(step)
        t1 = time.perf_counter()
        loss = nn.functional.cross_entropy(head(model(x)), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        t2 = time.perf_counter()
        if step >= warmup:
            step_s.append(t2 - t0)
            wait_s.append(t1 - t0)
    return step_s, wait_s


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    n = args.batch * (args.steps + args.warmup + 4)
    total = args.steps + args.warmup
    rows = []

    def zp(num_workers: int, prefetch: int, workers: str = "thread"):
        data = SlowItems(n, args.dim, args.io_ms, args.cpu_ms)
        config = LoaderConfig(
            global_batch=args.batch, num_workers=num_workers, prefetch=prefetch, workers=workers
        )
        loader = StepLoader(data, config)
        try:
            return train(
                lambda s: loader.batches(s, 0, 1)[0], args.steps, args.warmup, args.dim, args.hidden
            )
        finally:
            loader.close()

    def torch_loader():
        data = SlowItems(n, args.dim, args.io_ms, args.cpu_ms)
        sampler = Batches(GlobalBatchSampler(n, args.batch), total)
        dl = DataLoader(
            data, batch_sampler=sampler, num_workers=args.workers, prefetch_factor=args.prefetch
        )
        it = iter(dl)
        return train(lambda s: next(it), args.steps, args.warmup, args.dim, args.hidden)

    systems = {
        "sync": lambda: zp(0, 0),
        "zp-thread": lambda: zp(args.workers, args.prefetch),
        "zp-process": lambda: zp(args.workers, args.prefetch, "process"),
        "torch": torch_loader,
    }
    # rounds: every loader once per round, so a burst of load from other processes
    # on a shared machine lands on all of them; the table takes medians over rounds
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in systems}
    load = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for name, fn in systems.items():
            step_s, wait_s = fn()
            results[name].append((statistics.median(step_s), sum(wait_s) / sum(step_s)))
        load.append(os.getloadavg()[0])
    for name, runs in results.items():
        rows.append(
            (name, statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
        )
    data_ms = args.batch * (args.io_ms + args.cpu_ms)
    print(
        f"\n{args.batch} items/step, each {args.io_ms} ms I/O + {args.cpu_ms} ms Python "
        f"preprocessing ({data_ms:.0f} ms of data per step read serially); "
        f"{args.workers} workers, {args.prefetch} steps ahead; {args.steps} timed steps, "
        f"median of {args.rounds} round(s); load average {min(load):.1f}-{max(load):.1f} "
        f"on {os.cpu_count()} cores\n"
    )
    base = rows[0][1]
    print(f"{'loader':<12} {'step ms':>8} {'waiting':>8} {'vs sync':>8}")
    for name, med, frac in rows:
        print(f"{name:<12} {med * 1e3:>8.1f} {frac * 100:>7.1f}% {med / base:>8.2f}")

    # resuming at step k as rank 0 of 3 (the job was at 2 ranks): items read first
    k = args.resume_at
    data = SlowItems(n, args.dim, 0, 0)
    cfg = LoaderConfig(global_batch=12, num_workers=1, prefetch=0)
    with StepLoader(data, cfg) as loader:
        loader.batches(k, 0, 3)
    skipping = k * 12 + 12 // 3
    print(
        f"\nresume at step {k} as rank 0 of 3: zeroplane read {data.reads} items, "
        f"reading from the start and skipping reads {skipping}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--io-ms", type=float, default=2.0)
    p.add_argument("--cpu-ms", type=float, default=0.5)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--prefetch", type=int, default=4)
    p.add_argument("--resume-at", type=int, default=50)
    p.add_argument("--rounds", type=int, default=2)
    run(p.parse_args())


if __name__ == "__main__":
    main()
