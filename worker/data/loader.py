"""A prefetching loader addressed by the global step.

[Note: step-addressed loading]
The loader keeps no iterator whose state depends on the world. The batch a
rank trains on at step ``s`` is ``split_global_batch(plan.batch_at(s), rank,
world_size)``: a pure function of (seed, epoch, step, rank, world size). The
training loop asks for ``loader.batches(engine.global_steps, engine.rank,
engine.world_size)`` (``loader.current()`` once attached), so after a
membership change, a rollback or a restart the next request names the right
samples and nothing before them is read again; across world sizes the ranks
of each step together read its global batch, so every sample of an epoch is
read once. Prefetching guesses that the next request is (s + 1, same rank,
same world size) and keeps ``prefetch`` steps in flight in background
workers; a request the guess missed drops the guesses (they cost work, never
correctness) and refills from the request.

[Note: accumulation that follows the world]
The global batch is constant and a rank's share of it is about ``global_batch /
world_size`` (worker/data/sampler.py [Note: uneven shares] for sizes that do
not divide it); with ``micro_batch`` set, that share is cut into micro-batches,
so their number changes with the world size (12 samples of micro-batches of 2:
three per rank at 2 ranks, two at 3 and at 5). ``current()`` therefore tells
the attached engine how many micro-batches it returns and how many samples
each holds (``engine.set_micro_batches``), at every step: after a membership
change the engine steps after the last micro-batch of the step, whatever the
world, weighs each by its share of the global batch, and the update is the one
of the whole global batch. A fixed accumulation from the config would have
ended the optimizer step mid-way through a step's micro-batches, or run into
the next.

Workers are threads by default: item reads that wait on I/O, and tensor work,
release the GIL. ``workers="process"`` runs them in spawned processes for
preprocessing written in pure Python (the dataset and collate function must
pickle; tensors come back through shared memory). On CUDA the prepared
batches are pinned in the workers and copied with ``non_blocking=True``, so
the copy overlaps the step that follows.

Why not torchdata's ``StatefulDataLoader``: its state is an iterator
position per rank (the sampler's and each worker's), taken at one world size;
resuming at another world size, or at the step a recovery rolled back to,
needs the position recomputed from the global step anyway, which is all this
loader's state is. It installs cleanly (torchdata 0.11 with torch 2.13) but
would add a dependency that does not remove that work.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, Self

import torch
from torch.utils.data import default_collate

from worker.data.sampler import (
    BatchPlan,
    GlobalBatchSampler,
    micro_batch_counts,
    split_global_batch,
)

__all__ = ["LoaderConfig", "LoaderStats", "StepLoader", "map_tensors"]

logger = logging.getLogger(__name__)

STATE_FORMAT = 1


@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """How a :class:`StepLoader` (and a :class:`~worker.data.stream.StreamLoader`) feeds a rank.

    global_batch: samples per optimizer step over all ranks; constant when the
        world size changes (each rank takes ``global_batch / world_size``).
    micro_batch: the most samples in a micro-batch on a rank; None: the rank's
        whole share as one micro-batch. Any world size works, whether or not it
        divides the global batch (worker/data/sampler.py [Note: uneven shares]).
    seed: fixes the sample order of every epoch.
    prefetch: steps prepared ahead of the one being trained (0: none).
    num_workers: background workers preparing steps; 0 prepares each step in
        the caller's thread when it is asked for (synchronous).
    workers: ``"thread"`` or ``"process"`` (see [Note: step-addressed loading]);
        processes are spawned, so the training script needs its
        ``if __name__ == "__main__":`` guard, as with torch's DataLoader.
    pin_memory: pin prepared batches; None: when the device is CUDA.
    """

    global_batch: int
    micro_batch: int | None = None
    seed: int = 0
    prefetch: int = 2
    num_workers: int = 2
    workers: Literal["thread", "process"] = "thread"
    pin_memory: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.global_batch, int) or self.global_batch < 1:
            raise ValueError(
                f"LoaderConfig.global_batch must be an integer >= 1, got {self.global_batch!r}"
            )
        if self.micro_batch is not None and (
            not isinstance(self.micro_batch, int) or self.micro_batch < 1
        ):
            raise ValueError(
                f"LoaderConfig.micro_batch must be None or an integer >= 1, "
                f"got {self.micro_batch!r}"
            )
        for name in ("prefetch", "num_workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"LoaderConfig.{name} must be an integer >= 0, got {value!r}")
        if self.workers not in ("thread", "process"):
            raise ValueError(
                f"LoaderConfig.workers must be 'thread' or 'process', got {self.workers!r}"
            )
        if self.num_workers == 0 and self.prefetch:
            raise ValueError(
                f"LoaderConfig.prefetch ({self.prefetch}) needs num_workers >= 1; "
                "set prefetch=0 for synchronous loading"
            )


@dataclass
class LoaderStats:
    """What the loader did: steps served, how many were ready, time callers waited."""

    steps: int = 0
    prefetched: int = 0  # steps that were already being prepared when asked for
    missed: int = 0  # steps prepared only when asked for (the first, or after a change)
    dropped: int = 0  # prefetched steps thrown away because the request changed
    wait_s: float = 0.0  # time spent inside batches(), waiting for data


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it (nested tuples, lists, dicts)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(map_tensors(fn, v) for v in obj)
    return obj


def _pin(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory()


def resolve_pin(config: LoaderConfig, device: torch.device | None) -> bool:
    """Whether to pin prepared batches: by default when they go to a CUDA device."""
    if config.pin_memory is None:
        return device is not None and device.type == "cuda"
    if config.pin_memory and not torch.cuda.is_available():
        raise ValueError("LoaderConfig.pin_memory=True needs CUDA, which is not available")
    return config.pin_memory


def prepare(
    dataset: Any, collate: Callable[[list[Any]], Any], micro: Sequence[Sequence[int]], pin: bool
) -> list[Any]:
    """Read, collate and (optionally) pin one rank's micro-batches of one step."""
    out = [collate([dataset[i] for i in indices]) for indices in micro]
    return map_tensors(_pin, out) if pin else out


# A process worker's dataset and collate function, set once when it starts.
_WORKER: tuple[Any, Callable[[list[Any]], Any]] | None = None


def _init_process_worker(dataset: Any, collate: Callable[[list[Any]], Any]) -> None:
    global _WORKER
    torch.set_num_threads(1)
    _WORKER = (dataset, collate)


def _prepare_in_process(micro: list[list[int]]) -> list[Any]:
    assert _WORKER is not None, "process worker used before its initializer ran"
    return prepare(_WORKER[0], _WORKER[1], micro, pin=False)


Key = tuple[int, int, int]  # (step, rank, world_size)


def check_state(state: Any, source: str, expected: Mapping[str, Any]) -> None:
    """Raise ValueError naming the first field of a saved loader ``state`` that is
    not a ``source`` loader's or differs from ``expected`` (the order would differ)."""
    if not isinstance(state, dict) or state.get("source") != source:
        raise ValueError(f"not a {source} loader state: {state!r:.200}")
    for field, mine in expected.items():
        if state.get(field) != mine:
            raise ValueError(
                f"loader state was saved with {field}={state.get(field)!r}, "
                f"this loader has {field}={mine!r}: the sample order would differ"
            )


class FollowsEngine:
    """What both loaders do with an engine: follow its step, rank and world size,
    and keep their position in its checkpoints."""

    _engine: Any = None
    config: LoaderConfig
    device: torch.device | None = None
    pin: bool = False

    def batches(self, step: int, rank: int, world_size: int) -> list[Any]:
        raise NotImplementedError

    def attach(self, engine: Any, name: str = "data") -> Self:
        """Follow ``engine``: :meth:`current` reads its step, rank and world size, and
        the loader's position is saved in its checkpoints and checked on load. A
        loader given no device delivers to the engine's from then on (pinned on the
        way to a GPU, unless ``LoaderConfig.pin_memory`` says otherwise)."""
        engine.register_state(name, self)
        device = getattr(engine, "device", None)
        if self.device is None and device is not None and device.type != "cpu":
            self.device = torch.device(device)
            self.pin = resolve_pin(self.config, self.device)
        self._engine = engine
        return self

    def current(self) -> list[Any]:
        """This rank's micro-batches of the attached engine's current step; the engine
        accumulates that many ([Note: accumulation that follows the world])."""
        if self._engine is None:
            raise RuntimeError(f"{type(self).__name__}.current() needs attach(engine) first")
        e = self._engine
        rank, world = e.data_rank  # (a context-parallel group shares one batch)
        out = self.batches(e.global_steps, rank, world)
        gb = self.config.global_batch
        e.set_micro_batches(micro_batch_counts(gb, rank, world, self.config.micro_batch), gb)
        return out


class StepLoader(FollowsEngine):
    """Batches of a map-style dataset for any (step, rank, world size), prepared ahead.

    ``dataset`` is anything with ``__len__`` and ``__getitem__(int)`` (a torch
    map-style ``Dataset``, a Hugging Face ``datasets.Dataset``, a
    :class:`~worker.data.packing.PackedTokens`). ``plan`` chooses each step's
    global batch; the default is a :class:`GlobalBatchSampler` over the
    dataset (each sample once per epoch). ``collate`` turns a list of items
    into a batch (torch's ``default_collate``). ``device``: where batches are
    delivered (default: where the dataset's items are, the CPU).
    See [Note: step-addressed loading].
    """

    def __init__(
        self,
        dataset: Any,
        config: LoaderConfig,
        *,
        plan: BatchPlan | None = None,
        collate: Callable[[list[Any]], Any] = default_collate,
        device: torch.device | str | None = None,
    ) -> None:
        try:
            self.num_samples = len(dataset)
        except TypeError:
            raise TypeError(
                f"StepLoader needs a map-style dataset (with __len__ and __getitem__), got "
                f"{type(dataset).__name__}; use StreamLoader for an iterable source"
            ) from None
        self.dataset = dataset
        self.config = config
        self.plan = plan or GlobalBatchSampler(self.num_samples, config.global_batch, config.seed)
        self.collate = collate
        self.device = torch.device(device) if device is not None else None
        self.pin = resolve_pin(config, self.device)
        self.stats = LoaderStats()
        self.position = 0  # the step after the last one asked for
        self._pending: dict[Key, Future] = {}
        self._engine: Any = None
        self._pool: Executor | None = None
        self._pinner: ThreadPoolExecutor | None = None
        if config.num_workers and config.workers == "thread":
            self._pool = ThreadPoolExecutor(config.num_workers, thread_name_prefix="zp-data")
        elif config.num_workers:
            # spawn, not fork: the parent runs gloo and prefetch threads
            self._pool = ProcessPoolExecutor(
                config.num_workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_process_worker,
                initargs=(dataset, collate),
            )
            if self.pin:
                self._pinner = ThreadPoolExecutor(1, thread_name_prefix="zp-pin")

    # ---------------------------------------------------------------- batches

    def micro_indices(self, step: int, rank: int, world_size: int) -> list[list[int]]:
        """The sample indices of rank ``rank``'s micro-batches at ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        batch = self.plan.batch_at(step)
        if len(batch) != self.config.global_batch:
            raise ValueError(
                f"the plan's batch at step {step} has {len(batch)} samples, "
                f"LoaderConfig.global_batch is {self.config.global_batch}"
            )
        return split_global_batch(batch, rank, world_size, self.config.micro_batch)

    def batches(self, step: int, rank: int, world_size: int) -> list[Any]:
        """Rank ``rank``'s micro-batches of global step ``step`` at ``world_size`` ranks."""
        t0 = time.perf_counter()
        key = (step, rank, world_size)
        future = self._pending.pop(key, None)
        if future is None:
            self.stats.missed += 1
            future = self._submit(key)
        else:
            self.stats.prefetched += 1
        self._refill(key)
        try:
            out = future.result()
        except Exception as exc:
            raise RuntimeError(
                f"preparing step {step} (rank {rank} of {world_size}) failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if self.device is not None:
            non_blocking = self.pin and self.device.type == "cuda"
            out = map_tensors(lambda t: t.to(self.device, non_blocking=non_blocking), out)
        self.position = step + 1
        self.stats.steps += 1
        self.stats.wait_s += time.perf_counter() - t0
        return out

    def _submit(self, key: Key) -> Future:
        micro = self.micro_indices(*key)
        if self._pool is None:
            done: Future = Future()
            try:
                done.set_result(prepare(self.dataset, self.collate, micro, self.pin))
            except Exception as exc:
                done.set_exception(exc)
            return done
        if isinstance(self._pool, ThreadPoolExecutor):
            return self._pool.submit(prepare, self.dataset, self.collate, micro, self.pin)
        future = self._pool.submit(_prepare_in_process, micro)
        if self._pinner is not None:
            return self._pinner.submit(lambda: map_tensors(_pin, future.result()))
        return future

    def _refill(self, key: Key) -> None:
        step, rank, world = key
        wanted = [(s, rank, world) for s in range(step + 1, step + 1 + self.config.prefetch)]
        for stale in [k for k in self._pending if k not in wanted]:
            self._pending.pop(stale).cancel()
            self.stats.dropped += 1
        for k in wanted:
            if k not in self._pending:
                self._pending[k] = self._submit(k)

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """The position (the next step) and what fixes the order; plain values."""
        return {
            "format": STATE_FORMAT,
            "source": "map",
            "num_samples": self.num_samples,
            "global_batch": self.config.global_batch,
            "seed": self.config.seed,
            # attached, the engine's step is the position even before the first batch
            "step": self._engine.global_steps if self._engine is not None else self.position,
        }

    def validate_state_dict(self, state: dict[str, Any]) -> None:
        """Raise ValueError naming what differs if ``state`` is not this loader's order."""
        mine = self.state_dict()
        check_state(state, "map", {f: mine[f] for f in ("num_samples", "global_batch", "seed")})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.validate_state_dict(state)
        self._drop_pending()
        self.position = int(state["step"])

    # ---------------------------------------------------------------- lifetime

    def _drop_pending(self) -> None:
        for future in self._pending.values():
            future.cancel()
        self.stats.dropped += len(self._pending)
        self._pending.clear()

    def close(self) -> None:
        """Stop the workers (prepared batches not yet asked for are dropped)."""
        self._drop_pending()
        for pool in (self._pinner, self._pool):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        self._pool = self._pinner = None

    def __enter__(self) -> StepLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
