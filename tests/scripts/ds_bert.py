"""A DeepSpeed masked-language-model script in the shape of DeepSpeedExamples'
``training/HelloDeepSpeed/train_bert_ds.py`` (written here, not copied): a Hugging Face
``BertForMaskedLM`` built from a config, ``deepspeed.initialize(model=,
model_parameters=, config=)`` with the config as a dict, ``model.train()``, the loop
``loss = model(**batch).loss; model.backward(loss); model.step()``, and
``save_checkpoint(dir, client_state={"checkpoint_step": N})`` to resume from with
``_, client_state = model.load_checkpoint(dir)``. The dataset is replaced by random
token ids masked as the example masks them (15 %, labels -100 elsewhere), a pure
function of (step, rank). ``--system`` picks ``import deepspeed`` or the drop-in:

    zeroplane run --nproc 2 tests/scripts/ds_bert.py --system zeroplane --stage 3 \\
        --steps 3 --checkpoint-dir ckpt
    zeroplane run --nproc 2 tests/scripts/ds_bert.py --system zeroplane --stage 3 \\
        --steps 6 --checkpoint-dir ckpt --out final.pt     # resumes at step 3
"""

from __future__ import annotations

import argparse
import importlib
import os
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import BertConfig, BertForMaskedLM

VOCAB, SEQ, MICRO, MASK_ID = 64, 16, 4, 3


def build() -> BertForMaskedLM:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForMaskedLM(config)


def batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s micro-batch of ``step``: token ids with 15 % masked, the
    masked positions' labels the original ids, -100 elsewhere."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    ids = torch.randint(4, VOCAB, (MICRO, SEQ), generator=g)
    masked = torch.rand(MICRO, SEQ, generator=g) < 0.15
    masked[:, 0] = True  # at least one a row
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    inputs = torch.where(masked, torch.full_like(ids, MASK_ID), ids)
    return {"input_ids": inputs, "attention_mask": torch.ones_like(ids), "labels": labels}


def ds_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--system", choices=["deepspeed", "zeroplane"], required=True)
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--checkpoint-dir", type=Path, required=True)
    p.add_argument("--out", help="the trained parameters by name (torch.save), rank 0")
    args = p.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    name = "deepspeed" if args.system == "deepspeed" else "worker.deepspeed"
    deepspeed = importlib.import_module(name)  # the one line a port changes

    model = build()
    model, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(args.stage)
    )
    start = 0
    if (args.checkpoint_dir / "latest").is_file():
        _, client_state = model.load_checkpoint(args.checkpoint_dir)
        start = client_state["checkpoint_step"]
    model.train()
    rank = dist.get_rank()
    for step in range(start, args.steps):
        loss = model(**batch(step, rank)).loss
        model.backward(loss)
        model.step()
    model.save_checkpoint(args.checkpoint_dir, client_state={"checkpoint_step": args.steps})
    params = list(model.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        full = {n: p.detach().clone().float() for n, p in model.module.named_parameters()}
    if args.out and rank == 0:
        torch.save(full, args.out)


if __name__ == "__main__":
    main()
