"""zeroplane's worker runtime: the ZeRO engine (stages 0–3) and its pieces.

import worker
engine = worker.initialize(model, optimizer, config=worker.ZeroConfig(stage=2))
loss = engine(batch); engine.backward(loss); engine.step()
"""

from worker import models
from worker.config import ZeroConfig
from worker.engine import ZeroEngine
from worker.session import StepAborted, initialize

__all__ = ["StepAborted", "ZeroConfig", "ZeroEngine", "initialize", "models"]
