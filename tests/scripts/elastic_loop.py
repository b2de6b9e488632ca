"""The loop the elastic test scripts share: paced steps a test resizes and kills.

A script parses its arguments with :func:`parser` (``OUT_DIR``, ``--steps``,
``--stage``, ``--step-sleep``), builds its engine, and hands :func:`train` a step
function of the global step, this rank's data-parallel share and the number of
shares. :func:`train` runs it until ``--steps`` (a step abandoned after a lost peer
is run again), the first rank writing ``OUT_DIR/step`` as it goes; steps are paced
by ``--step-sleep`` (or the seconds ``OUT_DIR/pace`` holds: a test slows the job
while newcomers start on a loaded machine) until ``OUT_DIR/hurry`` exists;
``OUT_DIR/final.pt`` gets the full parameters. ``--checkpoint DIR --save-every N``
saves a checkpoint every N steps (what the job restores from where no replica covers a
lost rank).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

import worker


def parser(description: str, *, stage: int) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--stage", type=int, default=stage)
    p.add_argument("--step-sleep", type=float, default=0.4)
    p.add_argument("--checkpoint", type=Path, default=None)
    p.add_argument("--save-every", type=int, default=5)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    return args


def train(engine, args: argparse.Namespace, step: Callable[[int, int, int], None]) -> None:
    while engine.global_steps < args.steps:
        share, shares = engine.data_rank
        try:
            step(engine.global_steps, share, shares)
            if args.checkpoint and engine.checkpoint_due(args.save_every):
                engine.save_checkpoint(args.checkpoint)
        except worker.StepAborted:
            continue
        if dist.get_rank() == 0:
            (args.out / "step").write_text(str(engine.global_steps))
        if not (args.out / "hurry").exists():
            time.sleep(_pace(args))
    full = engine.full_state_dict()
    if dist.get_rank() == 0:
        torch.save(full, args.out / "final.pt")
    engine.close()


def _pace(args: argparse.Namespace) -> float:
    try:
        return float((args.out / "pace").read_text())
    except (OSError, ValueError):  # none, or being written
        return args.step_sleep
