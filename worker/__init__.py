"""zeroplane's worker runtime: the ZeRO engine (stages 0–3) and its pieces.

import worker
engine = worker.initialize(model, optimizer, config=worker.ZeroConfig(stage=2))
loss = engine(batch); engine.backward(loss); engine.step()

A model larger than one rank comes to life sharded: build it under
``torch.device("meta")`` or ``worker.meta_parameters()``, or load a Hugging Face
checkpoint with ``worker.from_pretrained(path, optimizer, config=...)``.
"""

from worker import models
from worker.birth import meta_parameters, skip_init
from worker.collectives import StepAborted
from worker.config import ZeroConfig
from worker.engine import ZeroEngine
from worker.entry import initialize
from worker.hf import from_pretrained
from worker.leaves import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules

__all__ = [
    "StepAborted",
    "ZeroConfig",
    "ZeroEngine",
    "from_pretrained",
    "get_z3_leaf_modules",
    "initialize",
    "meta_parameters",
    "models",
    "set_z3_leaf_modules",
    "skip_init",
    "unset_z3_leaf_modules",
]
