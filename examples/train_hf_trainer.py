"""Train a Hugging Face causal LM with the Hugging Face ``Trainer`` on zeroplane.

    zeroplane run --nproc 2 examples/train_hf_trainer.py --steps 20 --save-dir out/hf-model
    # then: transformers.AutoModelForCausalLM.from_pretrained("out/hf-model")

    zeroplane run --nproc 2 examples/train_hf_trainer.py --config ds_config.json
    zeroplane run --nproc 2 examples/train_hf_trainer.py --lora --save-dir out/adapters \
        --merged-dir out/merged
    # then: peft.PeftModel.from_pretrained(base, "out/adapters"), or
    #       transformers.AutoModelForCausalLM.from_pretrained("out/merged")
    torchrun --nproc-per-node 2 examples/train_hf_trainer.py
    python examples/train_hf_trainer.py

A tiny Llama built from a config (nothing is downloaded), trained on the demo's
shipped corpus tokenized to bytes (a 256-token vocabulary, no tokenizer files)
and packed into fixed-length sequences. ``TrainingArguments`` sets the batch
(``per_device_train_batch_size`` x world size x ``gradient_accumulation_steps``
samples a step), clipping, the optimizer and the LR schedule, as it would for
``Trainer``; ``ZeroplaneTrainer`` (worker/hf_trainer.py) trains it sharded.
``--config`` takes a DeepSpeed JSON config, Hugging Face's "auto" values
included; without it the stage is ``--stage`` (``zeroplane run --stage``).
``--save-dir`` gets ``trainer.save_model()``; ``--out FILE`` the final fp32
parameters by name. ``--lora`` trains LoRA adapters (PEFT) on the attention's
query and value projections and a trained copy of the output head, the base
frozen: ``save_model`` then writes the adapters as PEFT does, and
``--merged-dir`` gets the model with them merged
(``engine.save_pretrained(dir, merged=True)``).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

import worker
from worker.config import stage_from_env
from worker.demo import load_corpus
from worker.hf_trainer import ZeroplaneTrainer

SEQ = 16
CONFIG = LlamaConfig(
    vocab_size=256,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=SEQ,
    tie_word_embeddings=False,
)


def build(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(CONFIG)


def build_lora(seed: int = 0) -> torch.nn.Module:
    """The model with LoRA adapters (r=4) on q_proj and v_proj and a trained copy of
    lm_head, everything else frozen."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj"],
        modules_to_save=["lm_head"],
    )
    return get_peft_model(build(seed), config)


def dataset(limit: int = 512) -> list[dict[str, torch.Tensor]]:
    """Sample i is the packed sequence of bytes starting at i * SEQ (labels = inputs:
    the model shifts them)."""
    data = load_corpus()
    n = min(limit, len(data) // SEQ)
    return [
        {"input_ids": ids, "labels": ids}
        for ids in (data[i * SEQ : (i + 1) * SEQ].long() for i in range(n))
    ]


def training_arguments(output_dir: Path, steps: int) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(output_dir),
        max_steps=steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        weight_decay=0.01,
        warmup_steps=2,
        lr_scheduler_type="linear",
        max_grad_norm=0.5,
        optim="adamw_torch",
        seed=0,
        logging_steps=5,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--stage", type=int, default=stage_from_env(3))
    p.add_argument("--config", type=Path, help="a DeepSpeed JSON config ('auto' values welcome)")
    p.add_argument("--output-dir", type=Path, default=Path("out/hf-trainer"))
    p.add_argument("--save-dir", type=Path, help="trainer.save_model() writes here")
    p.add_argument("--out", type=Path, help="the final fp32 parameters by name (torch.save)")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters (needs peft)")
    p.add_argument("--merged-dir", type=Path, help="with --lora: the model, adapters merged")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)

    # small units so that stage 3 gathers each decoder layer apart (a real model's
    # layers pass the default threshold on their own)
    config = args.config or worker.ZeroConfig(stage=args.stage, stage3_min_unit_numel=0)
    trainer = ZeroplaneTrainer(
        model=build_lora() if args.lora else build(),
        args=training_arguments(args.output_dir, args.steps),
        train_dataset=dataset(),
        zeroplane_config=config,
    )
    trainer.train()
    if args.save_dir:
        trainer.save_model(str(args.save_dir))
    if args.merged_dir:
        trainer.engine.save_pretrained(args.merged_dir, merged=True)
    state = trainer.engine.full_state_dict()  # a collective: every rank
    if trainer.is_world_process_zero() and args.out:
        torch.save(state, args.out)
    trainer.engine.close()


if __name__ == "__main__":
    main()
