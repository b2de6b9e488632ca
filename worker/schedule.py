"""The engine's learning-rate scheduler, kept at the engine's step through every restore.

[Note: a scheduler that follows the step]
A torch LR scheduler is a counter that writes the optimizer's hyperparameters
(``lr``; some also ``momentum`` or ``betas``) each time it is stepped, most of
them from the values they wrote the step before. Elastic events move the
engine's step out from under a scheduler the script steps itself: a newcomer
joins at step T with a fresh scheduler at 0 (and steps its partition with
another learning rate than its peers), a rollback takes the state back to an
earlier step while the scheduler stays ahead.

Handed to the engine (``worker.initialize(..., lr_scheduler=...)``, as to
DeepSpeed's), the scheduler is stepped after every optimizer step that is not
skipped, so its count is the engine's ``global_steps``; it is saved in every
checkpoint; and after any restore to step T (a hand-over, a join, a rollback,
a checkpoint) it is put back to T: from the newest of its own snapshots at or
before T (the one taken when the engine got it, one every ``SNAPSHOT_EVERY``
steps, the last one loaded), stepped forward to T. Every rank reads the same
hyperparameters at every step, as the uninterrupted run would.

This holds for any scheduler whose values follow from how often it was
stepped: all of torch's except ``ReduceLROnPlateau``, which needs a metric
and is refused. A snapshot holds the scheduler's ``state_dict()`` and the
optimizer's param-group hyperparameters, which the recursive schedulers read.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from worker.optim import group_hyperparams

__all__ = ["SNAPSHOT_EVERY", "LrSchedule", "SchedulerArg", "resolve_scheduler"]

SNAPSHOT_EVERY = 64  # steps between kept snapshots; the newest few are kept
_KEPT = 4

SchedulerArg = LRScheduler | Callable[[torch.optim.Optimizer], LRScheduler]


def resolve_scheduler(arg: SchedulerArg | None, optimizer: torch.optim.Optimizer) -> Any:
    """The scheduler itself, built from ``arg(optimizer)`` when ``arg`` is a factory;
    checked to schedule ``optimizer`` and to need no metric."""
    if arg is None:
        return None
    scheduler = arg(optimizer) if callable(arg) else arg
    if isinstance(scheduler, ReduceLROnPlateau):
        raise TypeError(
            "lr_scheduler: ReduceLROnPlateau steps on a metric the engine does not see; "
            "step it in the script (its learning rate is then the script's to keep "
            "across membership changes)"
        )
    if not hasattr(scheduler, "step") or not hasattr(scheduler, "load_state_dict"):
        raise TypeError(
            f"lr_scheduler must be a torch LR scheduler or a callable that builds one "
            f"from the optimizer, got {type(scheduler).__name__}"
        )
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError(
            "lr_scheduler schedules another optimizer than the one given to the engine"
        )
    return scheduler


class LrSchedule:
    """A scheduler stepped with the engine and put back to its step after a restore
    ([Note: a scheduler that follows the step])."""

    def __init__(self, scheduler: Any, optimizer: torch.optim.Optimizer, step: int) -> None:
        self.scheduler, self.optimizer = scheduler, optimizer
        self.step_count = step
        self._first = self._snapshot()
        self._recent: list[dict[str, Any]] = []

    def step(self) -> None:
        """After an optimizer step that was not skipped."""
        with warnings.catch_warnings():
            # the engine steps its own optimizer over the shards, never the one the
            # scheduler holds: torch would warn the scheduler stepped first
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
            self.scheduler.step()
        self.step_count += 1
        if self.step_count % SNAPSHOT_EVERY == 0:
            self._recent = [*self._recent[-(_KEPT - 1) :], self._snapshot()]

    def seek(self, step: int) -> None:
        """Put the scheduler (and the hyperparameters it wrote) at ``step``."""
        if step == self.step_count:
            return
        if step < self.step_count:
            usable = [s for s in (self._first, *self._recent) if s["step"] <= step]
            if not usable:
                raise RuntimeError(
                    f"lr_scheduler: cannot go back to step {step}, before the step it "
                    f"was given to the engine at ({self._first['step']})"
                )
            self._apply(max(usable, key=lambda s: s["step"]))
            self._recent = [s for s in self._recent if s["step"] <= step]
        while self.step_count < step:
            self.step()

    def state_dict(self) -> dict[str, Any]:
        """For checkpoints: the scheduler's state, the hyperparameters and the step."""
        return self._snapshot()

    def validate_state_dict(self, state: Any) -> None:
        if not (
            isinstance(state, dict)
            and isinstance(state.get("step"), int)
            and isinstance(state.get("scheduler"), dict)
            and isinstance(state.get("groups"), list)
        ):
            raise ValueError("the saved lr_scheduler state is not one zeroplane wrote")
        if len(state["groups"]) != len(self.optimizer.param_groups):
            raise ValueError(
                f"the saved lr_scheduler state has {len(state['groups'])} param groups, "
                f"the optimizer {len(self.optimizer.param_groups)}"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._apply(state)
        self._recent = [copy.deepcopy(state)]

    def _snapshot(self) -> dict[str, Any]:
        return {
            "step": self.step_count,
            "scheduler": copy.deepcopy(self.scheduler.state_dict()),
            "groups": [copy.deepcopy(group_hyperparams(g)) for g in self.optimizer.param_groups],
        }

    def _apply(self, snapshot: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(copy.deepcopy(snapshot["scheduler"]))
        for group, saved in zip(self.optimizer.param_groups, snapshot["groups"], strict=True):
            group.update(copy.deepcopy(saved))
        self.step_count = snapshot["step"]
