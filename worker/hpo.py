"""A training script's side of a hyperparameter search (``zeroplane hpo``,
coordinator/tuning/search.py).

    import worker, worker.hpo

    trial = worker.hpo.trial(defaults={"lr": 1e-3})
    opt = torch.optim.AdamW(model.parameters(), lr=trial.params["lr"])
    engine = worker.initialize(model, opt, config=...)
    engine.progress(total=steps)
    if trial.resume_from:                      # Tune started this trial again
        engine.load_checkpoint(trial.resume_from)
    while engine.global_steps < steps:
        ...; engine.step()                     # loss and step reach Tune from the engine
        if trial.checkpoint_dir and engine.checkpoint_due(every):
            engine.save_checkpoint(trial.checkpoint_dir)

Outside a search ``trial()`` returns the defaults and no directories, so the
same script runs under ``zeroplane run`` as it is.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.tuning.search import CHECKPOINT_ENV, HPARAMS_ENV, RESUME_ENV, HpoSpec, search

__all__ = ["HpoSpec", "Trial", "search", "trial"]


@dataclass(frozen=True, kw_only=True)
class Trial:
    """This run's point of the search space, where to save checkpoints, and the
    checkpoint to resume from (a trial Tune started again)."""

    params: Mapping[str, Any] = field(default_factory=dict)
    checkpoint_dir: Path | None = None
    resume_from: Path | None = None

    @property
    def in_search(self) -> bool:
        return self.checkpoint_dir is not None


def trial(defaults: Mapping[str, Any] | None = None) -> Trial:
    """The trial this process belongs to (the defaults outside a search)."""
    raw = os.environ.get(HPARAMS_ENV)
    params = dict(defaults or {})
    if raw:
        try:
            given = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"${HPARAMS_ENV} is not JSON: {exc}") from None
        if not isinstance(given, dict):
            raise ValueError(f"${HPARAMS_ENV} must be a JSON object, got {raw[:80]!r}")
        params.update(given)
    ckpt, resume = os.environ.get(CHECKPOINT_ENV), os.environ.get(RESUME_ENV)
    return Trial(
        params=params,
        checkpoint_dir=Path(ckpt) if ckpt else None,
        resume_from=Path(resume) if resume else None,
    )
