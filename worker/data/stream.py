"""A loader for iterable sources that resumes at a step without re-reading.

[Note: streams]
An iterable source (a streaming ``datasets.IterableDataset``, a generator)
has no random access, so its order is its own (a seeded shuffle buffer in
``datasets``): global batch ``s`` is the stream's items ``s * global_batch``
to ``(s + 1) * global_batch`` of the current epoch (an incomplete tail starts
the next epoch, as in :class:`GlobalBatchSampler`). Every rank reads the
global stream and keeps its share, so the shares of a step are the same
global batch at any world size. A reader thread runs ahead by ``prefetch``
steps and records the source's ``state_dict()`` at the start of every step
it reads (``datasets`` 2.18+ iterables have one; so do torchdata's stateful
ones). Resuming at step ``s`` (a rollback, a changed world size, a
checkpoint) loads the state recorded for ``s`` and reads nothing twice. A
source without ``state_dict`` resumes by reading from its start and skipping,
and a rank that joins a running job has no recorded state: it starts from
the last checkpoint's (or the start) and skips forward; ``stats.reread``
counts the items read only to be skipped.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import default_collate

from worker.data.loader import (
    STATE_FORMAT,
    FollowsEngine,
    LoaderConfig,
    LoaderStats,
    check_state,
    map_tensors,
    prepare,
    resolve_pin,
)
from worker.data.sampler import split_global_batch

__all__ = ["StreamLoader"]

logger = logging.getLogger(__name__)

Key = tuple[int, int, int]


def _is_stateful(source: Any) -> bool:
    return hasattr(source, "state_dict") and hasattr(source, "load_state_dict")


class _Read:
    """One global batch as read, and this rank's micro-batches if already prepared."""

    __slots__ = ("items", "key", "prepared")

    def __init__(self, items: list[Any], key: Key | None, prepared: list[Any] | None) -> None:
        self.items, self.key, self.prepared = items, key, prepared


class StreamLoader(FollowsEngine):
    """Global batches of an iterable ``source`` for any (step, rank, world size).

    ``source``: a function that creates the stream (a new one each time; needed
    for a stream with ``state_dict``, which resumes without re-reading), or an
    iterable (resumes by reading from its start and skipping).
    ``transform`` runs on this rank's items (in the reader thread when the
    request was foreseen), ``collate`` makes each micro-batch. The same
    ``batches`` / ``attach`` / ``current`` / ``state_dict`` interface as
    :class:`~worker.data.loader.StepLoader`. See [Note: streams].
    """

    def __init__(
        self,
        source: Callable[[], Iterable[Any]] | Iterable[Any],
        config: LoaderConfig,
        *,
        transform: Callable[[Any], Any] | None = None,
        collate: Callable[[list[Any]], Any] = default_collate,
        device: torch.device | str | None = None,
        history: int = 64,
    ) -> None:
        self.source = source
        self.config = config
        self.transform = transform
        self.collate = collate
        self.device = torch.device(device) if device is not None else None
        self.pin = resolve_pin(config, self.device)
        # Each (re)start reads a new stream made by the factory: a ``datasets``
        # iterable resumes every later iterator from the last state loaded into it
        # (loading its initial state does not reset it), and a deep copy of one
        # copies a process-wide cache that other threads change.
        self._factory = source if callable(source) and not hasattr(source, "__iter__") else None
        if self._factory is None and _is_stateful(source):
            raise TypeError(
                f"{type(source).__name__} has a state_dict: pass a function that creates the "
                "stream (e.g. lambda: load_dataset(..., streaming=True)) so that each resume "
                "starts from a new one at a recorded position"
            )
        self.stateful = self._factory is not None and _is_stateful(self._factory())
        self._live: Any = None
        self.history = history
        self.stats = LoaderStats()
        self.reread = 0  # items read only to skip them (see [Note: streams])
        self.position = 0
        self._engine: Any = None
        self._cond = threading.Condition()
        # step -> (epoch, the source's state at the start of the step)
        self._states: dict[int, tuple[int, Any]] = {0: (0, None)}
        self._ready: dict[int, _Read] = {}
        self._want: Key | None = None  # the reader prepares this rank's share
        self._next_read = -1  # the step the reader reads next; -1: not running
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- batches

    def batches(self, step: int, rank: int, world_size: int) -> list[Any]:
        """Rank ``rank``'s micro-batches of global step ``step`` at ``world_size`` ranks."""
        t0 = time.perf_counter()
        key = (step, rank, world_size)
        micro = split_global_batch(
            list(range(self.config.global_batch)), rank, world_size, self.config.micro_batch
        )
        with self._cond:
            running = self._thread is not None and (step in self._ready or self._next_read == step)
            self._want = key
        if not running:
            self.stats.missed += 1
            self._restart(step)
        else:
            self.stats.prefetched += 1
        with self._cond:
            while step not in self._ready and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise RuntimeError(f"reading the stream failed: {self._error}") from self._error
            read = self._ready.pop(step)
            self._want = (step + 1, rank, world_size)
            for old in [s for s in self._ready if s < step]:
                del self._ready[old]
            for old in [s for s in self._states if s < step - self.history]:
                del self._states[old]
            self._cond.notify_all()
        out = read.prepared if read.key == key else self._prepare(read.items, micro)
        if self.device is not None:
            non_blocking = self.pin and self.device.type == "cuda"
            out = map_tensors(lambda t: t.to(self.device, non_blocking=non_blocking), out)
        self.position = step + 1
        self.stats.steps += 1
        self.stats.wait_s += time.perf_counter() - t0
        return out

    def _prepare(self, items: list[Any], micro: list[list[int]]) -> list[Any]:
        if self.transform is not None:
            wanted = {i for m in micro for i in m}
            items = [self.transform(x) if i in wanted else x for i, x in enumerate(items)]
        return prepare(items, self.collate, micro, self.pin)

    # ---------------------------------------------------------------- the reader

    def _restart(self, step: int) -> None:
        """Stop the reader and start it again at ``step`` from the nearest recorded state."""
        self._stop_reader()
        # a stateful source's recorded (epoch, None) is that epoch's start
        usable = [s for s in self._states if s <= step and (self.stateful or s == 0)]
        known = max(usable, default=0)
        epoch, state = self._states.get(known, (0, None))
        if known != step:
            logger.warning(
                "stream position for step %d not recorded: reading from step %d and skipping",
                step,
                known,
            )
        self._stop = threading.Event()
        self._ready.clear()
        self._next_read = known
        self._thread = threading.Thread(
            target=self._read,
            args=(known, step, epoch, state, self._stop),
            name="zp-stream",
            daemon=True,
        )
        self._thread.start()

    def _start_epoch(self, epoch: int, state: Any) -> Iterator[Any]:
        """An iterator at ``state`` of ``epoch`` (None: the epoch's start)."""
        if self._factory is None:
            return iter(self.source)
        self._live = self._factory()
        if hasattr(self._live, "set_epoch"):
            self._live.set_epoch(epoch)
        if state is not None:
            self._live.load_state_dict(copy.deepcopy(state))
        return iter(self._live)

    def _read(self, step: int, serve_from: int, epoch: int, state: Any, stop: threading.Event):
        gb = self.config.global_batch
        try:
            it = self._start_epoch(epoch, state)
            fresh, in_epoch = state is None, 0  # a fresh epoch must hold a global batch
            # until its first item, a new iterator's state_dict() is not its position
            started, loaded = True, state
            while not stop.is_set():
                with self._cond:
                    while not stop.is_set() and len(self._ready) > self.config.prefetch:
                        self._cond.wait()
                if stop.is_set():
                    return
                if not self.stateful:
                    at_start = (epoch, None)
                elif started:
                    at_start = (epoch, copy.deepcopy(loaded))
                else:
                    at_start = (epoch, copy.deepcopy(self._live.state_dict()))
                items: list[Any] = []
                while len(items) < gb:
                    try:
                        items.append(next(it))
                        in_epoch, started = in_epoch + 1, False
                    except StopIteration:
                        if fresh and in_epoch < gb:
                            raise ValueError(
                                f"the stream has {in_epoch} items in epoch {epoch}, fewer "
                                f"than global_batch={gb}"
                            ) from None
                        epoch, items, fresh, in_epoch = epoch + 1, [], True, 0
                        it, started, loaded = self._start_epoch(epoch, None), True, None
                if step < serve_from:
                    self.reread += len(items)
                    step += 1
                    continue
                with self._cond:
                    want = self._want
                prepared = None
                if want is not None and want[0] == step:
                    micro = split_global_batch(
                        list(range(gb)), want[1], want[2], self.config.micro_batch
                    )
                    prepared = self._prepare(items, micro)
                with self._cond:
                    if stop.is_set():
                        return
                    self._states[step] = at_start
                    self._ready[step] = _Read(items, want if prepared else None, prepared)
                    self._next_read = step + 1
                    self._cond.notify_all()
                step += 1
        except BaseException as exc:
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _stop_reader(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join()
        self._thread = None
        self._next_read = -1
        self._error = None

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """The next step and the source's state at its start (plain values if the source's are)."""
        step = self._engine.global_steps if self._engine is not None else self.position
        with self._cond:
            while (
                step not in self._states
                and self._thread is not None
                and self._error is None
                and self._next_read <= step
            ):
                self._cond.wait(timeout=1.0)
            epoch, state = self._states.get(step, (None, None))
        return {
            "format": STATE_FORMAT,
            "source": "stream",
            "global_batch": self.config.global_batch,
            "step": step,
            "epoch": epoch,
            "stream": state,
        }

    def validate_state_dict(self, state: dict[str, Any]) -> None:
        check_state(state, "stream", {"global_batch": self.config.global_batch})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.validate_state_dict(state)
        self._stop_reader()
        self._ready.clear()
        step = int(state["step"])
        if self.stateful and state.get("epoch") is not None:
            self._states = {0: (0, None), step: (int(state["epoch"]), state["stream"])}
        self.position = step

    # ---------------------------------------------------------------- lifetime

    def close(self) -> None:
        self._stop_reader()

    def __enter__(self) -> StreamLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
