"""A tiny regression trained under ``zeroplane hpo`` (tests/test_hpo.py).

Its hyperparameters come from ``worker.hpo.trial()``; it saves a zeroplane
checkpoint every ``--save-every`` steps and resumes from the one Tune gives a
trial it starts again. ``crash_lr``: the trial whose ``lr`` equals it exits
with code 3 at step ``--crash-at`` the first time it runs (not when resumed);
``mark_dir``: where rank 0 leaves a file saying at which step it resumed.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn

import worker
import worker.hpo


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--crash-at", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.1)
    args = p.parse_args()
    torch.set_num_threads(1)
    trial = worker.hpo.trial(defaults={"lr": 0.05})
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.5
    opt = torch.optim.SGD(model.parameters(), lr=float(trial.params["lr"]))
    engine = worker.initialize(model, opt, config=worker.ZeroConfig(stage=1))
    engine.progress(total=args.steps)
    if trial.resume_from:
        engine.load_checkpoint(trial.resume_from)
        print(f"resumed at step {engine.global_steps}", flush=True)
        if engine.rank == 0 and trial.params.get("mark_dir"):
            mark = f"resumed-lr{trial.params['lr']}-at-{engine.global_steps}"
            open(os.path.join(trial.params["mark_dir"], mark), "w").close()
    crash = trial.params.get("crash_lr") == trial.params["lr"] and not trial.resume_from
    per = 64 // engine.world_size
    mine = slice(engine.rank * per, (engine.rank + 1) * per)
    while True:
        try:
            if trial.checkpoint_dir and engine.checkpoint_due(args.save_every):
                engine.save_checkpoint(trial.checkpoint_dir)
            if engine.global_steps >= args.steps:
                break
            if crash and engine.global_steps == args.crash_at and engine.rank == 0:
                time.sleep(3.0)  # long enough for the trial to report the last checkpoint
                os._exit(3)
            loss = nn.functional.mse_loss(engine(x[mine]), y[mine])
            engine.backward(loss)
            engine.step(samples=per)
        except worker.StepAborted:
            continue  # a peer was lost: the engine re-formed the job at global_steps
        time.sleep(args.step_sleep)
    engine.close()


if __name__ == "__main__":
    main()
