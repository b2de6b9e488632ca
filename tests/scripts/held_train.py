"""examples/train_gpt.py, except that each step waits while a file ``hold`` exists
beside ``--out``: a test freezes training (every rank waits on the one that holds)
for as long as a slow operation around the job takes, so the job cannot finish
first."""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path

from worker.engine import ZeroEngine

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
HOLD = Path(sys.argv[sys.argv.index("--out") + 1]).parent / "hold"
step = ZeroEngine.step


def held_step(self: ZeroEngine, *args: object, **kwargs: object) -> object:
    while HOLD.exists():
        time.sleep(0.05)
    return step(self, *args, **kwargs)


ZeroEngine.step = held_step
sys.argv = [str(EXAMPLE), *sys.argv[1:]]
runpy.run_path(str(EXAMPLE), run_name="__main__")
