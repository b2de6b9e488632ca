"""PEFT adapters saved as PEFT saves them, and merged into the base model where asked.

    engine.save_pretrained(out)               # a PeftModel: adapter_model.safetensors
                                              # and adapter_config.json, as PEFT writes
    engine.save_pretrained(out, merged=True)  # the base model with the adapters merged:
                                              # config.json and model.safetensors

    PeftModel.from_pretrained(base, out)                  # the adapters, loaded
    AutoModelForCausalLM.from_pretrained(merged_dir)      # the merged model, strictly

[Note: adapters under ZeRO]
A PEFT model's trainable parameters are its adapters (and its ``modules_to_save``
copies); its frozen base weights are not sharded: every rank holds them whole
(worker/inventory.py lays out trainable parameters only). So an adapter save
gathers the trainable parameters (``engine.full_state_dict()``: fp32 masters,
small next to the model; and ``gathered_params`` for the while, since PEFT reads
its modules' parameters for their names) and gives PEFT's own
``save_pretrained`` a state dict of those and of the frozen tensors by reference: PEFT chooses the
keys (its adapter name stripped, embedding layers where it would save them),
writes ``adapter_config.json`` and the model card, exactly as it does on one
process. The PeftModel may sit at the engine's root (the Trainer, ``initialize``)
or anywhere inside it (a LightningModule's attribute); exactly one is looked for.

The merged model is what PEFT's ``merge_and_unload().save_pretrained()`` writes,
without a copy of the model: the base model's tensors under its own names (the
``base_layer`` of each adapted layer, the trained copy of each
``modules_to_save`` module), each adapted weight plus its layer's
``get_delta_weight`` computed from the gathered adapters, written a file at a
time on rank 0 (worker/checkpoint.py ``write_safetensors_shards``). DoRA's
merge rescales by the merged weight's norm; it is refused with what to do.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from worker.checkpoint import DEFAULT_SHARD_BYTES, Planned, write_safetensors_shards

__all__ = ["find_peft", "save_adapters", "save_merged"]

logger = logging.getLogger(__name__)

# Parameter names PEFT's tuners give the adapters themselves (never base weights).
_ADAPTER_KEY = re.compile(r"\.(lora_[A-Za-z_]+|lora_magnitude_vector)(\.|$)")


def find_peft(module: nn.Module) -> tuple[str, nn.Module] | None:
    """(its name prefix, the PeftModel) inside ``module``, or None when it holds none;
    ValueError when it holds several (which would one save?)."""
    found = [
        (name, m)
        for name, m in module.named_modules()
        if hasattr(m, "peft_config") and hasattr(m, "get_base_model")
    ]
    # a PeftModel holds its tuner (LoraModel), which has peft_config too: the outermost
    found = [(n, m) for n, m in found if not any(n.startswith(f"{o}.") for o, _ in found if o)]
    found = found[:1] if found and found[0][0] == "" else found
    if len(found) > 1:
        names = ", ".join(n or "<root>" for n, _ in found)
        raise ValueError(f"the model holds several PEFT models ({names}); save each apart")
    return found[0] if found else None


def _adapter(peft_model: nn.Module) -> str:
    return str(getattr(peft_model, "active_adapter", "default"))


def save_adapters(
    engine: Any, out: str | os.PathLike, *, prefix: str, peft_model: nn.Module
) -> list[Path]:
    """Write the PEFT model's adapters into ``out`` as PEFT's ``save_pretrained`` does
    (see [Note: adapters under ZeRO]); a collective: every rank calls it, rank 0
    writes. Returns the files written (on rank 0)."""
    full = engine.full_state_dict()  # the adapters, gathered: a collective
    directory = Path(out)
    writer = engine.state.comm.rank == 0
    # PEFT reads its modules' own parameters for their names: whole for the while
    with engine.gathered_params():
        if writer:
            state: dict[str, torch.Tensor] = {}
            for name, tensor in peft_model.state_dict(keep_vars=True).items():
                state[name] = full.get(f"{prefix}.{name}" if prefix else name, tensor).detach()
            peft_model.save_pretrained(directory, state_dict=state, safe_serialization=True)
            logger.info("wrote the PEFT adapters of %s to %s", prefix or "the model", directory)
    engine.state.comm.barrier()  # the files are whole before any rank reads them
    return sorted(directory.glob("adapter_*")) if writer else []


def _merged_name(key: str, adapter: str) -> str | None:
    """The base model's name of a key of the PEFT model's base model (None: not one
    of the base model's tensors)."""
    if _ADAPTER_KEY.search(key) or ".original_module." in key:
        return None
    key = key.replace(".base_layer.", ".")
    return key.replace(f".modules_to_save.{adapter}.", ".")


def save_merged(
    engine: Any,
    out: str | os.PathLike,
    *,
    peft_model: nn.Module,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> list[Path]:
    """Write the base model with the active adapter merged into ``out``, as
    ``merge_and_unload().save_pretrained(out)`` would, without a copy of the model
    (see [Note: adapters under ZeRO]); a collective, rank 0 writes."""
    adapter = _adapter(peft_model)
    config = peft_model.peft_config[adapter]
    if getattr(config, "use_dora", False):
        raise ValueError(
            "save_pretrained(merged=True) of a DoRA adapter is not supported (its merge "
            "rescales by the merged weight's norm): save the adapters and merge them with "
            "PeftModel.from_pretrained(base, dir).merge_and_unload() on one process"
        )
    base = peft_model.get_base_model()
    directory = Path(out)
    writer = engine.state.comm.rank == 0
    files: list[Path] = []
    with engine.gathered_params():  # the adapters whole on every rank: a collective
        if writer:
            deltas = {}
            for name, layer in base.named_modules():
                adapted = [*getattr(layer, "lora_A", {}), *getattr(layer, "lora_embedding_A", {})]
                if hasattr(layer, "get_delta_weight") and adapter in adapted:
                    deltas[f"{name}.base_layer.weight"] = layer.get_delta_weight(adapter).detach()

            def make(tensor: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
                value = tensor.detach().cpu()
                if delta is not None:
                    value = (value.float() + delta.cpu().float()).to(value.dtype)
                return value.to(dtype) if dtype is not None and value.is_floating_point() else value

            plan = []
            for key, tensor in base.state_dict(keep_vars=True).items():
                name = _merged_name(key, adapter)
                if name is None:
                    continue
                size = (dtype or tensor.dtype).itemsize
                run = functools.partial(make, tensor, deltas.get(key))
                plan.append(Planned(name, tensor.numel() * size, run))
            directory.mkdir(parents=True, exist_ok=True)
            files = write_safetensors_shards(
                plan, directory / "model.safetensors", {"format": "pt"}, max_shard_bytes
            )
            if hasattr(getattr(base, "config", None), "save_pretrained"):
                base.config.save_pretrained(directory)
            logger.info("wrote the merged model (%d tensors) to %s", len(plan), directory)
    engine.state.comm.barrier()
    return files
