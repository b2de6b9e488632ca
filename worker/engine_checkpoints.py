"""The engine's checkpoints and weights (:class:`Checkpointing`, a part of
:class:`~worker.engine.ZeroEngine`): saving and loading checkpoints at any world size
and stage (worker/checkpoint.py [Note: checkpoint format]), pretrained weights in
and out (worker/pretrained.py), the state objects saved with them, and when a loop
saves. The state they read and write is the engine's shard state, or a view of it
by full parameter (a mesh's, worker/tp_checkpoint.py; an expert-parallel engine's,
worker/moe/checkpoint.py)."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from torch import nn

from worker import adapters, checkpoint, converted, dcp_checkpoint, pretrained
from worker.collectives import CollectiveError
from worker.whereabouts import TRACKER

__all__ = ["Checkpointing", "guarded"]


def guarded(method):
    """In a session, a failed collective becomes recovery (which raises StepAborted)."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except CollectiveError as exc:
            if self.membership is None:
                raise
            self.membership.recover(self, exc)

    return wrapper


class Checkpointing:
    """Checkpoints and weights of a :class:`~worker.engine.ZeroEngine` (its attributes
    are the engine's)."""

    state: Any
    experts: Any
    membership: Any
    module: nn.Module
    ballot: Any
    last_checkpoint: Path | None
    _saved_at: int
    _extras: dict[str, checkpoint.Stateful]
    _schedule: Any
    global_steps: Any

    def publish_snapshot(self) -> None: ...

    def checkpoint_due(self, every: int) -> bool:
        """Whether a loop that saves every ``every`` steps should save now.

        The same answer on every rank, newcomers included, and after a rollback
        nobody re-saves the step it rolled back to.

        [Note: no save at a join]
        Newcomers join a running job at a step boundary, N, inside the members'
        ``train_batch`` of step N. A loop that saves after its step ("train, then
        save if due") asks the members at N, but a newcomer, whose first call is
        ``initialize``, first asks after step N + 1: were N due, the members would
        save it alone and wait for the newcomers in the save while these wait for
        them in step N + 1. So a generation that admits newcomers marks N saved on
        every rank (worker/elastic/rings.py ``_restore``, worker/elastic/change.py
        ``grow_to``, worker/elastic/joining.py): that save is skipped, whatever the
        loop's shape, and the next is at the next multiple of ``every``.
        """
        steps = self.global_steps
        return steps > 0 and steps % every == 0 and steps != self._saved_at

    @guarded
    def save_checkpoint(self, path: str | os.PathLike, *, client_state: dict | None = None) -> Path:
        """Save a checkpoint loadable at any world size and stage (all ranks call this).

        ``client_state`` (tensors and plain Python values, e.g. a sampler's
        ``state_dict()``) is stored with it and returned by ``load_checkpoint``.
        See worker/checkpoint.py [Note: checkpoint format].
        """
        extras = {name: obj.state_dict() for name, obj in self._extras.items()}
        with TRACKER.state("checkpoint"):
            saved = checkpoint.save_checkpoint(self._checkpoint_view(), path, client_state, extras)
        self.last_checkpoint = Path(path)
        self._saved_at = self.global_steps
        return saved

    def load_checkpoint(self, path: str | os.PathLike) -> dict:
        """Load a checkpoint saved at any world size and stage; returns its client_state.

        A DeepSpeed ZeRO checkpoint directory (stages 1-3, any world size) and a torch
        DCP one (FSDP2's, torchtitan's) load as they are, optimizer state included
        (worker/foreign.py: each rank reads it whole; ``zeroplane checkpoint convert``
        does that once, ahead of time, for DeepSpeed's)."""
        view = self._checkpoint_view()
        with TRACKER.state("checkpoint"):
            if converted.foreign_kind(path) is not None:
                optimizer = type(view.user_optimizer).__name__
                layout = dcp_checkpoint.layout_of(view)
                with converted.converted(path, optimizer=optimizer, layout=layout) as step_dir:
                    state = checkpoint.load_checkpoint(view, step_dir, self._extras)
            else:
                state = checkpoint.load_checkpoint(view, path, self._extras)
        self._saved_at = self.global_steps
        self.last_checkpoint = Path(path)
        if self.membership is not None:
            self.membership.after_load(self)
        self.after_restore()
        return state

    def load_weights(self, path: str | os.PathLike) -> None:
        """Pretrained weights (safetensors or torch files, what ``save_pretrained``
        wrote) into this engine before it trains, each rank reading only its ranges
        (worker/pretrained.py [Note: weights by range]). Every rank calls it."""
        pretrained.load_weights(self._checkpoint_view(), self.module, path)
        if self.membership is not None:
            self.membership.after_load(self)
        self.after_restore()

    def save_dcp(self, path: str | os.PathLike) -> Path:
        """The training state as a torch Distributed Checkpoint in FSDP2's form
        (``{"model": ..., "optimizer": ...}``, whole tensors: ``dcp.load`` reshards
        them), which an FSDP2 or torchtitan job loads at any world size
        (worker/dcp_checkpoint.py). Every rank calls it; rank 0 gathers and writes."""
        return dcp_checkpoint.save_dcp(self._checkpoint_view(), path)

    def save_pretrained(
        self, out: str | os.PathLike, *, merged: bool = False, **options: Any
    ) -> list[Path]:
        """The weights in the directory ``out`` as ``save_pretrained`` writes them, a
        bucket at a time (worker/pretrained.py :func:`save_weights`, its ``dtype`` and
        ``max_shard_bytes``). Every rank calls it; rank 0 writes.

        A PEFT model (at the root or inside the module): its adapters as PEFT writes
        them, ``adapter_config.json`` included; ``merged=True``: the base model with
        the adapters merged, as ``merge_and_unload().save_pretrained`` writes it
        (worker/adapters.py)."""
        found = adapters.find_peft(self.module)
        if found is not None:
            if self._full_export() is not None or self.experts is not None:
                raise ValueError(
                    "save_pretrained of a PEFT model is supported on a data-parallel "
                    "engine (stages 0-3), not yet beside tensor or expert parallelism: "
                    "save a checkpoint (engine.save_checkpoint), which loads at any layout"
                )
            prefix, peft_model = found
            if merged:
                return adapters.save_merged(self, out, peft_model=peft_model, **options)
            if options:
                raise ValueError(
                    f"save_pretrained({', '.join(sorted(options))}=...) does not apply to "
                    "PEFT adapters, which PEFT writes as trained (merged=True takes them)"
                )
            return adapters.save_adapters(self, out, prefix=prefix, peft_model=peft_model)
        if merged:
            raise ValueError(
                "save_pretrained(merged=True) merges PEFT adapters into their base model, "
                "and this model holds no PEFT model"
            )
        return pretrained.save_weights(
            self.state, self.module, out, full=self._full_export(), experts=self.experts,
            **options,
        )  # fmt: skip

    def _checkpoint_view(self) -> Any:
        """What checkpoints and pretrained weights read and write: the shard state
        (a mesh engine presents it by full parameter, worker/tp_checkpoint.py)."""
        if self.experts is not None:  # worker/moe/checkpoint.py
            from worker.moe.checkpoint import ExpertParallelView

            return ExpertParallelView(self.state, self.experts)
        return self.state

    def _full_export(self) -> Any:
        """How ``save_pretrained`` makes full tensors of local ones: None, they are
        (a mesh engine gathers them over tp, worker/tp_checkpoint.py FullExport)."""
        return None

    def after_restore(self) -> None:
        """The state was just replaced (a hand-over, a checkpoint in any format): put
        the LR scheduler at its step (by replay, when the checkpoint did not hold it)
        and publish the snapshot the metrics read."""
        if self._schedule is not None:
            self._schedule.seek(self.global_steps)
        self.publish_snapshot()

    def register_state(self, name: str, obj: checkpoint.Stateful) -> None:
        """Save ``obj.state_dict()`` in every checkpoint under ``name`` and hand it back to
        ``obj.load_state_dict`` when one is loaded (e.g. a data loader's position)."""
        if name in self._extras and self._extras[name] is not obj:
            raise ValueError(f"engine state {name!r} is already registered")
        self._extras[name] = obj

    @property
    def saved_at(self) -> int:
        """The step of the last checkpoint saved or loaded (-1: none): what
        :meth:`checkpoint_due` compares with. A re-formed group sets it to the value
        its ranks agree on (worker/elastic/rings.py), so the answer stays one."""
        return self._saved_at

    @saved_at.setter
    def saved_at(self, step: int) -> None:
        self._saved_at = step

    def mark_restored(self) -> None:
        """The state was just restored (a rollback): its step is not saved again and
        no ballot from the abandoned step is pending."""
        self.ballot.clear()
        self._saved_at = self.global_steps
