"""What every engine offers a training script, whatever the layout.

``worker.initialize`` returns a :class:`~worker.engine.ZeroEngine` for data
parallelism, a :class:`~worker.mesh.MeshEngine` with tensor parallelism and a
:class:`~worker.pipeline.PipelineEngine` with pipeline stages. The last two are
ZeroEngines over the mesh's dp group (subclasses, not wrappers that forward by
hand), so a feature added to the engine is there under every layout; they
change only what depends on the layout: full parameters gathered over tp,
checkpoints and weights addressed by full parameter, a pipeline's step.

:class:`Engine` is that surface, written down once. A script that uses only
it runs under every layout; the one step that does is ``train_batch``::

    engine = worker.initialize(model, opt, config=..., parallel=ParallelConfig(...))
    loader = StepLoader(data, LoaderConfig(global_batch=64)).attach(engine)
    while engine.global_steps < steps:
        loss = engine.train_batch(loader.current())  # the global batch's mean loss

(``engine(x)``, ``backward`` and ``step`` remain for data and tensor
parallelism; a pipeline stage refuses them, since its forward and backward run
inside the schedule.) tests/test_surface.py checks each engine against it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["Engine"]


@runtime_checkable
class Engine(Protocol):
    """The training surface of every engine (``worker.initialize``'s result)."""

    module: nn.Module
    device: torch.device

    # the step
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def backward(self, loss: torch.Tensor, *, retain_graph: bool = False) -> None: ...
    def step(self, *, samples: int = 0, tokens: int = 0) -> bool: ...
    def train_batch(self, batches: Sequence[Any], loss_fn: Any = None) -> float | None: ...
    def set_micro_batches(self, counts: Sequence[int], global_batch: int) -> None: ...
    def set_gradient_accumulation_steps(self, n: int) -> None: ...

    # where the job is
    @property
    def global_steps(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def data_rank(self) -> tuple[int, int]: ...
    def mean_loss(self) -> float | None: ...
    def get_lr(self) -> list[float]: ...
    def progress(self, *, total: int) -> None: ...
    def memory_report(self) -> dict[str, int]: ...
    def comm_report(self) -> dict[str, dict[str, int]]: ...

    # state in and out
    def full_state_dict(self) -> dict[str, torch.Tensor]: ...
    def checkpoint_due(self, every: int) -> bool: ...
    def save_checkpoint(
        self, path: str | os.PathLike, *, client_state: dict | None = None
    ) -> Path: ...
    def load_checkpoint(self, path: str | os.PathLike) -> dict: ...
    def register_state(self, name: str, obj: Any) -> None: ...
    def load_weights(self, path: str | os.PathLike) -> None: ...
    def save_pretrained(self, out: str | os.PathLike, **options: Any) -> list[Path]: ...
    def close(self) -> None: ...
