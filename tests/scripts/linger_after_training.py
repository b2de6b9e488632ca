"""examples/train_gpt.py, except that once training has ended each worker waits,
before closing its engine, until the file ``$LINGER_UNTIL`` exists: members busy
after their last step (saving, evaluating) while workers are added to the job."""

from __future__ import annotations

import logging
import os
import runpy
import sys
import time
from pathlib import Path

from worker.engine import ZeroEngine

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
close = ZeroEngine.close


def linger_then_close(self: ZeroEngine) -> None:
    logging.info("training ended; lingering")
    release, deadline = Path(os.environ["LINGER_UNTIL"]), time.monotonic() + 120
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    close(self)


ZeroEngine.close = linger_then_close
sys.argv = [str(EXAMPLE), *sys.argv[1:]]
runpy.run_path(str(EXAMPLE), run_name="__main__")
