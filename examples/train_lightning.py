"""Train a small regression MLP with PyTorch Lightning on zeroplane's strategy.

    python examples/train_lightning.py --devices 2 --stage 2      # Lightning's launcher
    zeroplane run --nproc 2 --stage 2 examples/train_lightning.py  # zeroplane's

Each optimizer step takes the same global batch (``--global-batch`` samples, split
over the ranks by Lightning's DistributedSampler), so the result does not depend
on the world size. ``--out FILE`` writes the final fp32 parameters and what the
engine ran as (rank 0); ``--save DIR`` writes a checkpoint directory after
training; ``--resume DIR`` continues from one, at any world size and stage.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from worker.config import ZeroConfig, stage_from_env
from worker.lightning import ZeroplaneStrategy

FEATURES, HIDDEN = 8, 32
LR = 1e-2
WARMUP = 4  # optimizer steps of linear learning-rate warmup


def make_dataset(samples: int, seed: int = 0) -> TensorDataset:
    """``samples`` noisy points of a smooth function of FEATURES inputs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, FEATURES, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True)) + 0.1 * torch.randn(samples, 1, generator=g)
    return TensorDataset(x, y)


def build_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, 1),
    )


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / WARMUP)


def build_optimizer(
    params, kind: str = "adamw"
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    if kind == "sgd":
        opt = torch.optim.SGD(params, lr=10 * LR, momentum=0.9)
    else:
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup)


class Regressor(L.LightningModule):
    """The MLP, its loss, optimizer and schedule, and its data.

    ``micro_batches``: how many batches each rank's share of a global batch comes
    in (with ``Trainer(accumulate_grad_batches=micro_batches)``). ``optimizer``:
    ``"adamw"`` or ``"sgd"`` (with momentum).
    """

    def __init__(
        self,
        *,
        global_batch: int = 16,
        samples: int = 64,
        micro_batches: int = 1,
        optimizer: str = "adamw",
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.net = build_net(seed)
        self.global_batch, self.samples, self.micro_batches = global_batch, samples, micro_batches
        self.optimizer_kind = optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt, schedule = build_optimizer(self.parameters(), self.optimizer_kind)
        # stepped after every optimizer step: zeroplane's engine steps it and keeps
        # it in its checkpoints
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def _per_rank_batch(self) -> int:
        parts = self.trainer.world_size * self.micro_batches
        if self.global_batch % parts:
            raise ValueError(
                f"--global-batch {self.global_batch} does not split into {parts} equal parts"
            )
        return self.global_batch // parts

    def train_dataloader(self) -> DataLoader:
        return DataLoader(make_dataset(self.samples), batch_size=self._per_rank_batch())

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            make_dataset(self.global_batch, seed=1), batch_size=self._per_rank_batch()
        )


def trainer_for(strategy: ZeroplaneStrategy, devices: int, **kwargs) -> L.Trainer:
    """A quiet CPU Trainer with no logger and no automatic checkpoints."""
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def write_result(trainer: L.Trainer, out: Path) -> None:
    """The final fp32 parameters (a collective: every rank calls it) and what the
    engine ran as, in ``out`` (rank 0)."""
    engine = trainer.strategy.engine
    params = engine.full_state_dict()
    if trainer.is_global_zero:
        info = {
            "stage": engine.stage,
            "world": engine.world_size,
            "dtype": engine.config.dtype,
            "global_step": trainer.global_step,
            "engine_steps": engine.global_steps,
            "lr": engine.get_lr(),
            "mean_loss": engine.mean_loss(),
        }
        torch.save({"params": params, "info": info}, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # under `zeroplane run` the workers are already started: one device each
    p.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    p.add_argument("--stage", type=int, default=stage_from_env(2))
    p.add_argument("--precision", default="32-true")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--out", type=Path)
    p.add_argument("--save", type=Path)
    p.add_argument("--resume", type=Path)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)

    model = Regressor(global_batch=args.global_batch, samples=args.samples)
    strategy = ZeroplaneStrategy(config=ZeroConfig(stage=args.stage))
    trainer = trainer_for(strategy, args.devices, max_epochs=args.epochs, precision=args.precision)
    trainer.fit(model, ckpt_path=args.resume)
    if args.out is not None:
        write_result(trainer, args.out)
    if args.save is not None:
        trainer.save_checkpoint(args.save)


if __name__ == "__main__":
    main()
