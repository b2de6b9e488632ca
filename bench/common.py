"""What the bench/ scripts share: ports and rank setup, timed steps, stopping child
processes, and the numbers in their tables (medians, spread, ratios).

Scripts import it as ``bench.common`` after putting the checkout on ``sys.path``.
torch is imported inside the functions that use it, so a script that never touches
torch (coordinator_load.py) does not load it by importing this module.
"""

from __future__ import annotations

import contextlib
import signal
import statistics
import subprocess
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from coordinator.core import ports

T = TypeVar("T")

# --------------------------------------------------------------------------- ranks


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    return ports.free_port("127.0.0.1")


def rank_env(rank: int, world: int, port: int | str, addr: str = "127.0.0.1") -> dict[str, str]:
    """The variables torchrun sets for one rank of a single-host job."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
    }


def quiet_gloo_warnings() -> None:
    # torch 2.13 nags about all_gather_into_tensor and friends on gloo; not our code.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed.*")


@contextlib.contextmanager
def gloo_group(addr: str, port: int, rank: int, world: int, timeout: timedelta) -> Iterator[None]:
    """The default process group on gloo over TCP, destroyed on the way out."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=world,
        timeout=timeout,
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def timed_step(step: Callable[[], T]) -> tuple[T, float, float]:
    """``step()`` between two barriers: (its result, wall seconds, process CPU seconds).

    The barriers make ranks start together and the wall time end when the slowest
    rank is done. CPU time (all threads, gloo's included) barely moves when other
    processes take the cores, unlike wall time: a second, steadier view of the work.
    """
    import torch.distributed as dist

    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    out = step()
    cpu = time.process_time() - c0
    dist.barrier()
    return out, time.perf_counter() - t0, cpu


# --------------------------------------------------------------------------- processes


def stop_processes(
    procs: Iterable[subprocess.Popen[Any]], grace: float = 0.0, timeout: float | None = None
) -> list[subprocess.Popen[Any]]:
    """Stop every process that still runs and reap them all.

    With ``grace`` > 0 they get SIGTERM first and ``grace`` seconds in all to exit;
    whatever still runs then gets SIGKILL. Returns the processes that had still not
    exited ``timeout`` seconds after that (``None``: wait as long as it takes).
    """
    procs = list(procs)
    if grace > 0:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + grace
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.poll() is None:
            p.kill()
    stuck = []
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            stuck.append(p)
    return stuck


def _raise_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """SIGTERM (e.g. from a CI timeout) unwinds through the finally blocks, as Ctrl-C does."""
    signal.signal(signal.SIGTERM, _raise_on_sigterm)


# --------------------------------------------------------------------------- numbers


def median_ms(seconds: Sequence[float]) -> float:
    return 1e3 * statistics.median(seconds)


def rel_iqr(xs: Sequence[float]) -> float:
    """Inter-quartile range over the median: how noisy a series was (0 below two values)."""
    if len(xs) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(xs, n=4)
    return (q3 - q1) / statistics.median(xs)


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``; ``None`` when either is missing or ``b`` is not positive."""
    if a is None or b is None or not b > 0:
        return None
    return a / b


def fmt_cell(x: float | None, unit: str = "") -> str:
    """A table cell: two decimals and ``unit``, or ``-`` for a missing value (None, NaN)."""
    if x is None or x != x:
        return "-"
    return f"{x:.2f}{unit}"


def fmt_ratio(x: float | None) -> str:
    """A ratio cell, ``1.23x``, or ``-`` for a missing value."""
    return fmt_cell(x, "x")
