"""The one module that calls ``torch.distributed`` collectives, and counts them.

Every collective the engine issues goes through :class:`Collectives`, which
records calls, bytes, wire bytes and seconds per op. Bytes are the size of the
full (unsharded) logical tensor of the call: the input of an all-reduce, the
input of a reduce-scatter, the output of an all-gather. Wire bytes are what
the call actually moved: the same, unless the payload was compressed.
Seconds run from issue to completion (for an async op, to its ``wait``).
Small bookkeeping reductions (the used-parameter bitmap, the gradient norm,
the fp16 overflow flag) are counted under ``"control"`` so the data-plane
numbers can be checked against the ZeRO formulas exactly.

gloo's ``ReduceOp.AVG`` has had a silent wrong-result bug (pytorch#162338), so
averages are a SUM followed by a division by the caller.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from worker.compat import all_gather_flat, reduce_scatter_flat

__all__ = ["Collectives", "Handle", "OpStats"]

Op = Literal["all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "control"]
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0
    wire_bytes: int = 0
    seconds: float = 0.0


class Handle:
    """A pending collective. ``wait()`` blocks until done and books its time."""

    __slots__ = ("_start", "_stats", "_work")

    def __init__(self, work: dist.Work | None, stats: OpStats | None, start: float) -> None:
        self._work, self._stats, self._start = work, stats, start

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._stats is not None:
            self._stats.seconds += time.perf_counter() - self._start
            self._stats = None


_DONE = Handle(None, None, 0.0)


@dataclass
class Collectives:
    """Collectives over one process group (``None`` = the default group).

    With no initialized process group, or a group of one, every op is local and
    nothing is counted: a single process moves no bytes.
    """

    group: dist.ProcessGroup | None = None
    stats: dict[str, OpStats] = field(default_factory=lambda: defaultdict(OpStats))

    def __post_init__(self) -> None:
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(self.group)
            self.world_size = dist.get_world_size(self.group)
            self.backend = str(dist.get_backend(self.group))
        else:
            self.rank, self.world_size, self.backend = 0, 1, "none"

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def _book(self, op: Op, nbytes: int, wire: int | None = None) -> tuple[OpStats, float]:
        stats = self.stats[op]
        stats.calls += 1
        stats.bytes += nbytes
        stats.wire_bytes += nbytes if wire is None else wire
        return stats, time.perf_counter()

    def _finish(
        self, work: dist.Work | None, stats: OpStats, start: float, async_op: bool
    ) -> Handle:
        handle = Handle(work, stats, start)
        if not async_op:
            handle.wait()
        return handle

    def all_reduce(
        self,
        tensor: torch.Tensor,
        *,
        op: str = "sum",
        async_op: bool = False,
        control: bool = False,
    ) -> Handle:
        if not self.distributed:
            return _DONE
        stats, start = self._book("control" if control else "all_reduce", _nbytes(tensor))
        work = dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=self.group, async_op=async_op)
        return self._finish(work, stats, start, async_op)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False
    ) -> Handle:
        """Sum ``input`` (``world_size`` equal chunks) across ranks; chunk r lands on rank r."""
        if not self.distributed:
            output.copy_(input)
            return _DONE
        stats, start = self._book("reduce_scatter", _nbytes(input))
        work = reduce_scatter_flat(output, input, group=self.group, async_op=async_op)
        return self._finish(work, stats, start, async_op)

    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        async_op: bool = False,
        logical_bytes: int | None = None,
    ) -> Handle:
        """Concatenate every rank's ``input`` into ``output`` in rank order.

        ``logical_bytes``: for a compressed payload, the size of the tensor it
        stands for (``bytes`` counts that, ``wire_bytes`` the payload).
        """
        if not self.distributed:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return _DONE
        wire = _nbytes(output)
        stats, start = self._book("all_gather", logical_bytes or wire, wire)
        work = all_gather_flat(output, input, group=self.group, async_op=async_op)
        return self._finish(work, stats, start, async_op)

    def broadcast(self, tensor: torch.Tensor, *, src: int = 0, async_op: bool = False) -> Handle:
        if not self.distributed:
            return _DONE
        stats, start = self._book("broadcast", _nbytes(tensor))
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        work = dist.broadcast(tensor, src=global_src, group=self.group, async_op=async_op)
        return self._finish(work, stats, start, async_op)

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        async_op: bool = False,
        as_op: Op = "all_to_all",
        logical_bytes: int | None = None,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> Handle:
        """Chunks of ``input`` to every rank (equal, or as the split sizes say);
        ``as_op`` books it under the op it implements (a compressed reduce-scatter
        is an all-to-all of payloads)."""
        if not self.distributed:
            output.copy_(input)
            return _DONE
        wire = _nbytes(input)
        stats, start = self._book(as_op, logical_bytes or wire, wire)
        work = dist.all_to_all_single(
            output,
            input,
            output_split_sizes=output_split_sizes,
            input_split_sizes=input_split_sizes,
            group=self.group,
            async_op=async_op,
        )
        return self._finish(work, stats, start, async_op)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def report(self) -> dict[str, dict[str, int | float]]:
        return {
            op: {
                "calls": s.calls,
                "bytes": s.bytes,
                "wire_bytes": s.wire_bytes,
                "seconds": s.seconds,
            }
            for op, s in sorted(self.stats.items())
        }


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
