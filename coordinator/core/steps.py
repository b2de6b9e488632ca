"""Long computations in steps, so that an event loop can interleave them with I/O.

[Note: steps]
The coordinator serves every RPC from one asyncio loop. Work linear in a
large inventory (reading it, its layout, a reshard schedule, encoding a
generation: about a second for 100k parameters) would stall that loop, and
running it on a helper thread does not help: a thread running Python holds
the GIL, and the loop thread, which gives the GIL up at each socket call,
waits a switch interval to get it back each time (the GIL "convoy"), so a
health check takes hundreds of milliseconds. Instead such work is written as
a generator that yields every ``STEP`` items and returns its result:
``finish`` runs it straight through (what the plain functions do), and
``finish_async`` runs it on the loop, giving the loop a turn every few
milliseconds.

The other stall is the garbage collector's: building a layout allocates
hundreds of thousands of objects, and every 25% growth of the long-lived
ones makes a full collection walk all of them (a third of a second for 100k
parameters, collecting nothing: none of it is cyclic), several times over
while the layout grows. ``finish_async`` holds automatic collection off
while steps run, so what they built is walked once by the next young
collection rather than at every quarter of growth. (Freezing it with
``gc.freeze`` would spare that walk too, but would also freeze the cycles
every RPC in flight leaves in grpc, which then are never collected.)
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Generator, Iterator
from typing import TypeVar

__all__ = ["STEP", "Steps", "finish", "finish_async"]

T = TypeVar("T")

# Items of work between two yields: a millisecond or two of Python.
STEP = 512

Steps = Generator[None, None, T]


def finish(steps: Steps[T]) -> T:
    """Run ``steps`` to the end; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


async def finish_async(steps: Steps[T], *, slice_s: float = 0.004) -> T:
    """Run ``steps`` on the running loop, letting other tasks run every ``slice_s``,
    with automatic garbage collection held off meanwhile (see [Note: steps])."""
    with _collection_held():
        until = time.perf_counter() + slice_s
        while True:
            try:
                next(steps)
            except StopIteration as stop:
                return stop.value
            if time.perf_counter() >= until:
                await asyncio.sleep(0)
                until = time.perf_counter() + slice_s


_holds = 0


@contextlib.contextmanager
def _collection_held() -> Iterator[None]:
    # Counted: steps of several requests interleave on one loop.
    global _holds
    if _holds == 0 and not gc.isenabled():
        yield  # someone else turned it off; leave it so
        return
    _holds += 1
    gc.disable()
    try:
        yield
    finally:
        _holds -= 1
        if _holds == 0:
            gc.enable()
