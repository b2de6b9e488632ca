"""torch Distributed Checkpoint (DCP) directories, as FSDP2 and torchtitan users hold them.

    engine.load_checkpoint("dcp_dir/")     # what dcp.save wrote, at any world size
    engine.save_dcp("dcp_dir/")            # what dcp.load + set_state_dict read back

[Note: DCP checkpoints]
An FSDP2 job saves ``{"model": get_model_state_dict(model), "optimizer":
get_optimizer_state_dict(model, opt)}`` with ``dcp.save`` (a ``.metadata`` file
and ``__R_0.distcp`` files of each rank's shards, keyed by flattened names such as
``model.layers.0.weight`` and ``optimizer.state.layers.0.weight.exp_avg``);
torchtitan the same with the optimizer's keys flattened per parameter
(``flatten_optimizer_state_dict``: ``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``)
and a weights-only save with the model's keys at the top. Both are read here
whole (``dcp_to_torch_save``, no process group) into a
:class:`~worker.foreign.WholeCheckpoint`, matched against the loading model by
fully-qualified name (a ``torch.compile`` or checkpoint-wrapper prefix dropped),
and loaded as every zeroplane checkpoint is (worker/foreign.py). The loading model
decides what is trainable, frozen or a buffer, and which param group each
parameter is in: the checkpoint's groups must agree, or the load is refused.

Written: rank 0 gathers every rank's ranges of the masters and optimizer state
(``gather_object`` over the engine's group: the whole training state on rank 0
for the while, as a consolidated save needs) and saves the nested form FSDP2's
``get_*_state_dict`` gives, plain whole tensors, which ``dcp.load`` reshards into
any FSDP2 mesh.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from coordinator.core.manifest import CheckpointError
from coordinator.core.ranges import Range
from worker.foreign import HYPERPARAMETERS, WholeCheckpoint
from worker.inventory import persistent_buffers

__all__ = ["ModelLayout", "is_dcp_checkpoint", "read_dcp", "save_dcp"]

# the prefixes wrappers put in a module's names (torch.compile, activation checkpointing)
_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.")


def is_dcp_checkpoint(path: str | os.PathLike) -> bool:
    return Path(path, ".metadata").is_file()


@dataclass(frozen=True)
class ModelLayout:
    """What the loading model holds: trainable parameters with their param group,
    frozen parameters, persistent buffers (all by name)."""

    trainable: dict[str, int]
    frozen: frozenset[str]
    buffers: frozenset[str]


def _canonical(name: str) -> str:
    for prefix in _WRAPPERS:
        name = name.replace(prefix, "")
    return name


def _read_all(path: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(prefix="zeroplane-dcp-") as scratch:
        whole = Path(scratch, "whole.pt")
        try:
            dcp_to_torch_save(path, whole)
            return torch.load(whole, map_location="cpu", weights_only=True)
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [""])[0]
            raise CheckpointError(
                f"{path}: cannot read it as a DCP checkpoint ({type(exc).__name__}: {first})"
            ) from None


def _optimizer(raw: dict[str, Any], model_names: set[str]) -> tuple[dict, list[dict]]:
    """(state by name, param groups with their names) from the nested form or from
    torchtitan's flattened one."""
    if isinstance(raw.get("state"), dict) and isinstance(raw.get("param_groups"), list):
        state = {_canonical(k): v for k, v in raw["state"].items()}
        groups = [
            {k: v for k, v in g.items() if k != "params"}
            | {"params": [_canonical(n) for n in g["params"]]}
            for g in raw["param_groups"]
        ]
        return state, groups
    by_length = sorted(model_names, key=len, reverse=True)
    state: dict[str, dict] = {}
    hyper: dict[str, dict] = {}
    for key, value in raw.items():
        kind, _, rest = key.partition(".")
        rest = _canonical(rest)
        name = next((n for n in by_length if rest.startswith(f"{n}.")), None)
        if kind not in ("state", "param_groups") or name is None:
            raise CheckpointError(f"optimizer key {key!r} names no parameter of the model")
        target = state if kind == "state" else hyper
        target.setdefault(name, {})[rest[len(name) + 1 :]] = value
    groups: list[dict] = []
    for name, h in hyper.items():  # one group per set of hyperparameters, in order
        same = next((g for g in groups if {k: g[k] for k in h} == h), None)
        if same is None:
            groups.append({**h, "params": [name]})
        else:
            same["params"].append(name)
    return state, groups


def read_dcp(path: str | os.PathLike, *, layout: ModelLayout) -> WholeCheckpoint:
    """A DCP checkpoint whole, matched to ``layout`` ([Note: DCP checkpoints])."""
    root = Path(path)
    raw = _read_all(root)
    model = raw.get("model") if isinstance(raw.get("model"), dict) else raw
    model = {_canonical(k): v for k, v in model.items() if isinstance(v, torch.Tensor)}
    optim = raw.get("optimizer", raw.get("optim"))
    if not isinstance(optim, dict):
        raise CheckpointError(
            f"{root} holds no optimizer state (a weights-only save): load it with "
            "engine.load_weights after exporting it, or save the optimizer with the model"
        )
    missing = sorted((set(layout.trainable) | layout.frozen | layout.buffers) - set(model))
    if missing:
        raise CheckpointError(f"{root} lacks the model's {missing[:5]}")
    state, groups = _optimizer(optim, set(model))
    names: list[list[str]] = [[] for _ in range(1 + max(layout.trainable.values(), default=-1))]
    for name, g in layout.trainable.items():
        names[g].append(name)
    saved_group = {n: i for i, g in enumerate(groups) for n in g["params"]}
    for name in layout.trainable:
        if name not in state:
            raise CheckpointError(f"{root} has no optimizer state for {name!r}")
    order = []
    for g, members in enumerate(names):
        saved = {saved_group.get(n) for n in members}
        kept = set(groups[next(iter(saved))]["params"]) if len(saved) == 1 else set()
        if None in saved or len(saved) != 1 or kept & set(layout.trainable) != set(members):
            raise CheckpointError(
                f"{root}: param group {g} here ({members[:3]}...) is not one param group "
                "there; build the optimizer's groups as the run that saved it did"
            )
        order.append(next(iter(saved)))
    master, per = {}, {}
    for name in layout.trainable:
        value = model[name]
        master[name] = value.float().clone()
        per[name] = {
            k: v.reshape(-1).float().clone() if v.shape == value.shape else v.clone()
            for k, v in state[name].items()
            if isinstance(v, torch.Tensor)
        }
    first = next(iter(per.values()), {})
    steps = int(first.get("step", torch.tensor(0.0)).item())
    return WholeCheckpoint(
        source=f"torch DCP {root.name}",
        stage=0,
        global_steps=steps,
        skipped_steps=0,
        micro_steps=steps,
        groups=names,
        shapes={n: model[n].shape for n in layout.trainable},
        master=master,
        state=per,
        param_groups=[{k: v for k, v in groups[i].items() if k in HYPERPARAMETERS} for i in order],
        frozen={n: model[n].clone() for n in layout.frozen},
        buffers={n: model[n].clone() for n in layout.buffers},
    )


def layout_of(state: Any) -> ModelLayout:
    """The layout of an engine's shard state (its inventory and module)."""
    trainable = {s.name: s.group for s in state.inventory.specs if s.requires_grad}
    frozen = frozenset(s.name for s in state.inventory.specs if not s.requires_grad)
    return ModelLayout(trainable, frozen, frozenset(persistent_buffers(state.module)))


def save_dcp(state: Any, path: str | os.PathLike) -> Path:
    """Write the engine's training state (``state``: its shard state) as a DCP
    checkpoint in FSDP2's nested form ([Note: DCP checkpoints]); a collective, rank 0
    writes."""
    import torch.distributed.checkpoint as dcp

    comm = state.comm
    mine = state.export_ranges()
    if comm.distributed:
        every: list[Any] = [None] * comm.world_size if comm.rank == 0 else None
        dst = dist.get_global_rank(comm.group, 0) if comm.group is not None else 0
        dist.gather_object(mine, every, dst=dst, group=comm.group)
    else:
        every = [mine]
    out = Path(path)
    if comm.rank == 0:
        pieces: dict[str, list[tuple[Range, dict]]] = {}
        for entries in every:
            for key, entry in entries.items():
                rng = Range.parse(key)
                pieces.setdefault(rng.name, []).append((rng, entry))
        model: dict[str, torch.Tensor] = {}
        optim_state: dict[str, dict[str, Any]] = {}
        for spec in state.inventory.specs:
            if not spec.requires_grad:
                model[spec.name] = state.inventory.params[spec.name].detach().clone()
                continue
            parts = sorted(pieces[spec.name], key=lambda p: p[0].start)
            model[spec.name] = torch.cat([e["master"] for _, e in parts]).view(spec.shape)
            # per-element state sliced as the masters are; scalars (step) as they are
            optim_state[spec.name] = {
                k: torch.cat([e["state"][k] for _, e in parts]).view(spec.shape)
                if isinstance(v, torch.Tensor) and v.dim() >= 1
                else v
                for k, v in parts[0][1]["state"].items()
            }
        for name, buf in persistent_buffers(state.module).items():
            model[name] = buf.detach().clone()
        groups = []
        for g, group in enumerate(state.user_optimizer.param_groups):
            names = [s.name for s in state.inventory.specs if s.requires_grad and s.group == g]
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
        payload = {"model": model, "optimizer": {"state": optim_state, "param_groups": groups}}
        dcp.save(payload, checkpoint_id=out, no_dist=True)
    comm.barrier()
    return out
