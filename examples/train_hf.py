"""Train a Hugging Face causal LM (Llama-style, built from a small config) with zeroplane.

    zeroplane run --nproc 2 --stage 3 examples/train_hf.py --steps 20 \\
        --checkpoint out/hf-ckpt --hf-dir out/hf-model
    zeroplane checkpoint export out/hf-ckpt out/hf-model/model.safetensors
    # then: transformers.AutoModelForCausalLM.from_pretrained("out/hf-model")

The data is the demo's shipped corpus, tokenized to bytes (a 256-token
vocabulary, so no tokenizer files are needed) and packed into fixed-length
sequences. Every decoder layer runs under activation checkpointing
(``ZeroConfig(activation_checkpointing="units")``; ``--hf-checkpointing``
uses the model's own ``gradient_checkpointing_enable`` instead, reentrant).
Each step takes the same global batch at any world size, as in
examples/train_gpt.py. ``--hf-dir`` gets the model's ``config.json`` (rank 0),
so the exported safetensors file beside it loads with ``from_pretrained``;
``--out FILE`` writes the final fp32 parameters by name.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import worker
from worker.config import stage_from_env
from worker.data import GlobalBatchSampler, share_of
from worker.demo import load_corpus

SEQ = 32
CONFIG = LlamaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=SEQ,
    tie_word_embeddings=False,
)


def build(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(CONFIG)


def samples(data: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """Sample i is the packed sequence of bytes starting at i * SEQ."""
    return torch.stack([data[i * SEQ : (i + 1) * SEQ] for i in indices]).long()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--stage", type=int, default=stage_from_env(3))
    p.add_argument("--hf-checkpointing", action="store_true")
    p.add_argument("--checkpoint", type=Path)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--hf-dir", type=Path, help="write the model's config.json here")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)

    data = load_corpus()
    sampler = GlobalBatchSampler(len(data) // SEQ, args.global_batch, seed=0)
    model = build()
    if args.hf_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    config = worker.ZeroConfig(
        stage=args.stage,
        activation_checkpointing="none" if args.hf_checkpointing else "units",
    )
    engine = worker.initialize(model, opt, config=config)
    if args.checkpoint and (args.checkpoint / "latest").exists() and engine.global_steps == 0:
        engine.load_checkpoint(args.checkpoint)

    while True:
        if args.checkpoint and engine.checkpoint_due(args.save_every):
            engine.save_checkpoint(args.checkpoint)
        if engine.global_steps >= args.steps:
            break
        batch = sampler.batch_at(engine.global_steps)
        # this rank's share as one micro-batch, at any world size: shares differ by
        # one sample where the world does not divide the batch, and the engine
        # weighs each by its size (worker/data/sampler.py [Note: uneven shares])
        (mine,) = share_of(batch, engine)
        ids = samples(data, mine)
        try:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step(samples=ids.shape[0], tokens=ids.numel())
        except worker.StepAborted:
            continue
        if engine.rank == 0 and engine.global_steps % 5 == 0:
            # the last step's loss averaged over every rank (not a collective)
            logging.info("step %d loss %.4f", engine.global_steps, engine.mean_loss())

    state = engine.full_state_dict()
    if engine.rank == 0:
        if args.hf_dir:
            args.hf_dir.mkdir(parents=True, exist_ok=True)
            model.config.save_pretrained(args.hf_dir)
        if args.out:
            torch.save(state, args.out)
    engine.close()


if __name__ == "__main__":
    main()
