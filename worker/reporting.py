"""What both kinds of session (worker/attached.py, worker/elastic/session.py) share:
the reports a member's heartbeats carry, the last one sent at interpreter exit, and
the config a generation's plan makes of the script's."""

from __future__ import annotations

import atexit
import functools
import logging
import sys
import weakref
from collections.abc import Callable

from coordinator.core.messages import FINISHED, Generation
from worker.config import ZeroConfig
from worker.engine import ZeroEngine
from worker.rendezvous import ControlPlane

__all__ = ["FinalReport", "planned_config", "report"]

logger = logging.getLogger(__name__)


def report(control: ControlPlane, engine: ZeroEngine) -> None:
    """What this rank's heartbeats carry from now on: memory, step, loss, throughput."""
    control.report(
        engine.memory_report(),
        engine.global_steps,
        loss=engine.stats.last_step_loss(),
        samples=engine.stats.samples,
        tokens=engine.stats.tokens,
        checkpoint="" if engine.last_checkpoint is None else str(engine.last_checkpoint.resolve()),
        total_steps=engine.stats.total_steps,
    )


def _report_at_exit(
    control: ControlPlane, engine_ref: weakref.ref[ZeroEngine], settle: Callable[[], None]
) -> None:
    """At interpreter exit, the coordinator's last view of this rank is its last step;
    a script that ends without an uncaught exception has finished training. What the
    session still has on the wire lands first (``settle``)."""
    engine = engine_ref()
    if engine is not None and engine.membership is not None:
        finished = getattr(sys, "last_value", None) is None  # set when a traceback was printed
        if finished:
            settle()
        report(control, engine)
        control.final_report()
        if finished:
            control.close(leave=True, reason=FINISHED)


def planned_config(config: ZeroConfig, gen: Generation, rank: int) -> ZeroConfig:
    """``config`` with the generation's stage and bucket size, the coordinator's plan
    for the whole job; a stage other than the script's is said (once, by rank 0)."""
    if gen.stage != config.stage and rank == 0:
        logger.warning(
            "stage %d applies, not this script's ZeroConfig(stage=%d): %s",
            gen.stage,
            config.stage,
            gen.stage_reason or "the coordinator's plan",
        )
    return config.with_plan(stage=gen.stage, bucket_numel=gen.bucket_numel)


class FinalReport:
    """A session whose last report (the final step, loss, tokens) reaches the
    coordinator when the interpreter exits, for the job's summary."""

    control: ControlPlane | None

    def __init__(self) -> None:
        self._at_exit: Callable[[], None] | None = None

    def report_at_exit(self, engine: ZeroEngine) -> None:
        assert self.control is not None
        self._at_exit = functools.partial(
            _report_at_exit, self.control, weakref.ref(engine), self.settle
        )
        atexit.register(self._at_exit)

    def settle(self) -> None:
        """Let what this session still has on the wire land (at the script's end)."""

    def _forget_exit(self, *, send: bool = False) -> None:
        """Drop the exit hook; ``send``: send its final report now (closing early)."""
        at_exit, self._at_exit = self._at_exit, None
        if at_exit is not None:
            atexit.unregister(at_exit)
            if send:
                at_exit()
