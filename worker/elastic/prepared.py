"""A membership change a member prepares for while it trains: a scale-up
([Note: meeting ahead] in worker/rendezvous.py) or a leave ([Note: a leave prepared
ahead] in worker/elastic/change.py). What an elastic session prepares is one of
:class:`PreparedScaleUp`, :class:`PreparedLeave`, or nothing (None); change.py
makes the change with what it wrote."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass

from worker import live
from worker.flat import Reserve
from worker.state import ShardState

__all__ = ["PreparedLeave", "PreparedScaleUp"]

logger = logging.getLogger(__name__)


@dataclass
class _Prepared:
    """A membership change a member prepares for while it trains: the
    generation (for a leave, the current one), since when, this rank's place
    after the change (None: it is the leaver), and the thread writing its
    buffers: the build's (worker/build_ahead.py [Note: a build from buffers written
    ahead]) and the exchange's."""

    generation: int
    since: float
    rank: int | None
    world_size: int
    thread: threading.Thread | None = None
    wire: live.ExchangeBuffers | None = None

    def start(self, state: ShardState) -> None:
        # what to make is read here, beside the step; the thread only allocates
        send = live.sent_bound(state, self.rank, self.world_size)
        stays = self.rank is not None
        recv = live.packed_bound(state, self.rank, self.world_size) if stays else 0
        plan = state.reserve_plan(self.rank, self.world_size) if stays else []
        device = live.wire_device(state.comm)

        def write() -> None:
            try:
                if plan:
                    state.reserve = Reserve.make(plan)
                self.wire = live.ExchangeBuffers.make(send, recv, device)
            except Exception as exc:  # out of memory, say: the change allocates as before
                logger.warning("writing the buffers of generation %d ahead failed: %s",
                               self.generation, exc)  # fmt: skip

        self.thread = threading.Thread(target=write, name="zeroplane-prepare", daemon=True)
        self.thread.start()

    @property
    def written(self) -> bool:
        return self.thread is not None and not self.thread.is_alive()

    def ready(self, patience_s: float) -> bool:
        """Written, or prepared for longer than ``patience_s`` (then the change
        goes ahead with what is written, as it would unprepared)."""
        return self.written or time.monotonic() - self.since > patience_s


@dataclass
class PreparedScaleUp(_Prepared):
    """A scale-up to ``generation`` ([Note: meeting ahead] in worker/rendezvous.py),
    where this rank is ``rank`` of ``world_size``."""


@dataclass
class PreparedLeave(_Prepared):
    """The leave of ``leaver``, a rank of ``generation`` (the current one)
    ([Note: a leave prepared ahead]); ``rank``: this rank's place among the
    ``world_size`` survivors, None where it is the leaver."""

    leaver: int = dataclasses.field(kw_only=True)

    def prepares_leave(self, generation: int, leaver: int) -> bool:
        """Whether this prepares ``leaver``'s leave from ``generation``."""
        return (self.generation, self.leaver) == (generation, leaver)
