"""examples/train_gpt.py, except that this worker dies by SIGKILL the moment it
starts receiving its shards as a newcomer: a pod lost while joining a running
job, at the point where the members are already moving state to it."""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path

import worker.live

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"


def die(*args: object, **kwargs: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


worker.live.exchange = die
sys.argv = [str(EXAMPLE), *sys.argv[1:]]
runpy.run_path(str(EXAMPLE), run_name="__main__")
