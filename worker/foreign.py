"""Checkpoints of other systems, held whole and written as zeroplane's.

    write_whole(read_deepspeed("ds_dir/"), "zp_dir/", optimizer="AdamW")

A reader (worker/ds_checkpoint.py for DeepSpeed's ZeRO directories,
worker/dcp_checkpoint.py for torch Distributed Checkpoint's) assembles every
parameter whole: a :class:`WholeCheckpoint`. :func:`write_whole` writes it as a
zeroplane checkpoint of world size 1, each trainable parameter's whole range in
one file, whose manifest says where it came from (``converted_from``); it then
loads at any world size and stage, all or nothing, as every zeroplane checkpoint
does (worker/checkpoint.py [Note: loading all or nothing]), so the checks a
foreign checkpoint meets (shapes, frozen or not, param groups, buffers) are the
ones every checkpoint meets.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from coordinator.core.manifest import FORMAT, manifest_checksum, rank_file
from coordinator.core.ranges import Range
from worker.checkpoint import sha256_of
from worker.inventory import dtype_name

__all__ = ["HYPERPARAMETERS", "WholeCheckpoint", "write_whole"]

# param-group hyperparameters torch's optimizers keep (the rest is DeepSpeed's)
HYPERPARAMETERS = frozenset(
    {
        "lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "momentum",
        "dampening", "nesterov", "alpha", "centered", "lr_decay", "initial_lr",
        "decoupled_weight_decay",
    }
)  # fmt: skip


@dataclass
class WholeCheckpoint:
    """A training state, every tensor whole: what a zeroplane checkpoint holds."""

    source: str  # where it came from, for the manifest and messages
    stage: int
    global_steps: int
    skipped_steps: int
    micro_steps: int
    groups: list[list[str]]  # the trainable parameters' names, by optimizer param group
    shapes: dict[str, torch.Size]
    master: dict[str, torch.Tensor]  # by name, in the parameter's shape, fp32
    state: dict[str, dict[str, Any]]  # by name: flat per-element tensors, scalars
    param_groups: list[dict[str, Any]]  # each group's hyperparameters
    frozen: dict[str, torch.Tensor] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    # a tied parameter's later names, each to the name it is held under
    aliases: dict[str, str] = field(default_factory=dict)
    loss_scale: float = 1.0
    client_state: dict[str, Any] = field(default_factory=dict)


def write_whole(whole: WholeCheckpoint, out: str | os.PathLike, *, optimizer: str) -> Path:
    """``whole`` as a zeroplane checkpoint in ``out`` (``out/step-N``, ``out/latest``),
    for an engine whose optimizer class is named ``optimizer``; the step folder."""
    root = Path(out)
    step_dir = root / f"step-{whole.global_steps:08d}"
    step_dir.mkdir(parents=True, exist_ok=True)
    entries = {
        Range(name, 0, t.numel()).key: {"master": t.reshape(-1).float(), "state": whole.state[name]}
        for name, t in whole.master.items()
    }
    unsharded = {
        "frozen": whole.frozen,
        "buffers": whole.buffers,
        "param_groups": whole.param_groups,
        "micro_steps": whole.micro_steps,
        "skipped_steps": whole.skipped_steps,
        "loss_scaler": [0, 0],
        "client_state": whole.client_state,
        "extras": {},
    }
    file = step_dir / rank_file(0)
    torch.save({"entries": entries, "unsharded": unsharded}, file)
    params: dict[str, dict[str, Any]] = {}
    for g, names in enumerate(whole.groups):
        for name in names:
            shape = list(whole.shapes[name])
            params[name] = {"shape": shape, "dtype": "float32", "requires_grad": True, "group": g}
    for name, t in whole.frozen.items():
        params[name] = {
            "shape": list(t.shape), "dtype": dtype_name(t.dtype), "requires_grad": False, "group": 0
        }  # fmt: skip
    manifest = {
        "format": FORMAT,
        "global_steps": whole.global_steps,
        "world_size": 1,
        "stage": whole.stage,
        "dtype": "fp32",
        "optimizer": optimizer,
        "loss_scale": whole.loss_scale,
        "params": params,
        "aliases": dict(whole.aliases),
        "files": {
            rank_file(0): {
                "bytes": file.stat().st_size,
                "sha256": sha256_of(file),
                "ranges": [[n, 0, t.numel()] for n, t in whole.master.items()],
            }
        },
        "converted_from": whole.source,
    }
    manifest["checksum"] = manifest_checksum(manifest)
    (step_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    (root / "latest").write_text(step_dir.name)
    return step_dir
