"""examples/train_gpt.py, except that as a newcomer this worker is not ready to
switch (worker/rendezvous.py [Note: meeting ahead]) until the file named by
``$ZEROPLANE_TEST_PROCEED`` exists: the members keep training in their old
generation meanwhile, with a scale-up pending."""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path

import worker.elastic.joining

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
_warm = worker.elastic.joining._warm


def slow_warm(*args: object) -> None:
    proceed = Path(os.environ["ZEROPLANE_TEST_PROCEED"])
    deadline = time.monotonic() + 120
    while not proceed.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    _warm(*args)


worker.elastic.joining._warm = slow_warm
sys.argv = [str(EXAMPLE), *sys.argv[1:]]
runpy.run_path(str(EXAMPLE), run_name="__main__")
