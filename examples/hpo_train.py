"""Search a small GPT's learning rate, warm-up and weight decay on Ray Tune with zeroplane.

    pip install -e '.[hpo]'
    zeroplane hpo --nproc 2 --max-steps 200 --grace-steps 20 --samples 8 --concurrent 2 \\
        --param lr=loguniform:1e-4:3e-2 --param warmup=choice:0,20,50 \\
        --param weight_decay=uniform:0:0.1 --out best.json \\
        examples/hpo_train.py --steps 200

Each trial is a zeroplane job of ``--nproc`` workers (Ray actors); its point of
the space comes from ``worker.hpo.trial()``, its loss reaches Tune from the
engine (ASHA stops trials that fall behind), and it saves zeroplane
checkpoints where the trial says, so a trial Tune starts again resumes at its
last one. Outside a search it runs as any script does:
``zeroplane run --nproc 2 examples/hpo_train.py --steps 50``.
"""

from __future__ import annotations

import argparse
import logging
import os

import torch

import worker
import worker.hpo
from worker.data import GlobalBatchSampler, share_of
from worker.demo import load_corpus
from worker.models import GPT, GPTConfig

MODEL = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--save-every", type=int, default=20)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    trial = worker.hpo.trial(defaults={"lr": 3e-3, "warmup": 0, "weight_decay": 0.01})
    hp = trial.params

    torch.manual_seed(0)
    model = GPT(MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=hp["lr"], weight_decay=hp["weight_decay"])
    warmup = int(hp["warmup"])
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    model.to(device)
    engine = worker.initialize(model, opt, config=worker.ZeroConfig(stage=1))
    engine.progress(total=args.steps)
    if trial.resume_from:
        engine.load_checkpoint(trial.resume_from)

    data = load_corpus()
    t = MODEL.block_size
    sampler = GlobalBatchSampler((len(data) - 1) // t, args.global_batch, seed=0)
    while True:
        try:
            if trial.checkpoint_dir and engine.checkpoint_due(args.save_every):
                engine.save_checkpoint(trial.checkpoint_dir)
            if engine.global_steps >= args.steps:
                break
            batch = sampler.batch_at(engine.global_steps)
            (mine,) = share_of(batch, engine)  # at any world size
            # linear warm-up: the engine re-reads the optimizer's param groups every step
            for group in opt.param_groups:
                group["lr"] = hp["lr"] * min(1.0, (engine.global_steps + 1) / (warmup + 1))
            rows = torch.stack([data[i * t : i * t + t + 1] for i in mine]).long().to(device)
            x, y = rows[:, :-1], rows[:, 1:]
            loss = engine(x, y)
            engine.backward(loss)
            engine.step(samples=x.shape[0], tokens=x.numel())
        except worker.StepAborted:
            continue  # a peer was lost; the engine re-formed the job at global_steps
    engine.close()


if __name__ == "__main__":
    main()
