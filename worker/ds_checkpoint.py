"""DeepSpeed ZeRO checkpoints, read into zeroplane's form.

    engine.load_checkpoint("ds_run/")                    # DeepSpeed's directory, as it is
    zeroplane checkpoint convert ds_run/ zp_run/         # or once, ahead of time
    convert_deepspeed("ds_run/", "zp_run/", optimizer="AdamW")

[Note: reading DeepSpeed's checkpoints]
A DeepSpeed ``save_checkpoint`` directory holds ``latest`` (the tag) and the tag's
folder: ``mp_rank_00_model_states.pt`` (stages 1-2) or one
``zero_pp_rank_R_mp_rank_00_model_states.pt`` per rank (stage 3), and one
``zero_pp_rank_R_mp_rank_00_optim_states.pt`` per data-parallel rank R of the W
that saved it. The fp32 masters and the optimizer's per-element state are flat
partitions, laid out as DeepSpeed's own ``zero_to_fp32.py`` reads them back:

- stages 1-2: per param group, the group's parameters flattened one after the
  other (in ``param_shapes`` order), padded at the end, split into W equal
  contiguous parts: rank R's ``single_partition_of_fp32_groups[g]`` and the base
  optimizer's ``state[g]`` tensors. Concatenating the W parts gives the group back.
- stage 3: each parameter split on its own into W parts of ceil(numel / W)
  (the last padded); rank R's flat holds its part of every parameter, in order,
  across the groups' (sub-)groups: ``fp32_flat_groups`` and the base optimizer's
  state alike. A parameter is rank 0's part, rank 1's, ... cut to its numel.

Frozen parameters are in the module state dict (stages 1-2) or as flat fragments
of each rank (``frozen_param_fragments``, stage 3); buffers in the module state
dict; tied parameters (an output layer sharing the embedding's weight) under each
of their names in the module state dict, ``shared_params`` mapping each later name
to the first, which become the checkpoint's aliases; the client state is the model
states' keys DeepSpeed does not use itself.
The result is a :class:`~worker.foreign.WholeCheckpoint`, written as a zeroplane
checkpoint of world size 1 (worker/foreign.py), which then loads at any world size
and stage as every zeroplane checkpoint does, all or nothing. The files are read
with ``torch.load(weights_only=True)``: the few DeepSpeed classes in them (its loss
scaler, stage enum, fragment addresses) are allow-listed stand-ins here, so nothing
of DeepSpeed is imported and no other code can run. A run with ``bf16`` enabled
names its optimizer states ``bf16_zero_pp_rank_*`` (its fp32 masters and optimizer
state laid out as above; the module's own copies, frozen parameters among them, in
bf16): read the same way. Refused, with what to do: tensor- or pipeline-parallel
checkpoints (``mp_rank_01``, ``layer_*``), and a ZeRO-less (stage 0) one, whose
optimizer state names no parameter.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import torch

from coordinator.core.manifest import CheckpointError
from worker.foreign import HYPERPARAMETERS, WholeCheckpoint, write_whole

__all__ = ["convert_deepspeed", "is_deepspeed_checkpoint", "read_deepspeed"]

_OPTIM = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
# what DeepSpeed keeps in its model states itself; any other key is the client's
_DS_KEYS = frozenset(
    {
        "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
        "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler",
        "random_ltd", "sparse_tensor_module_names", "skipped_steps", "global_steps",
        "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
        "checkpoint_parallel_dimensions", "ds_checkpoint_version",
    }
)  # fmt: skip


def _stand_in(module: str, name: str, base: type = object) -> type:
    """A class named as DeepSpeed's ``module.name`` that keeps whatever state it is given."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)

    def __setstate__(self: Any, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)

    body: dict[str, Any] = {"__module__": module, "__qualname__": name}
    if base is object:
        body |= {"__init__": __init__, "__setstate__": __setstate__}
    return type(name, (base,), body)


# The DeepSpeed classes its checkpoints pickle (0.14-0.19), as allow-listed stand-ins.
_STAND_INS = [
    _stand_in("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    _stand_in("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    _stand_in("deepspeed.runtime.zero.config", "ZeroStageEnum", int),
    _stand_in("deepspeed.utils.tensor_fragment", "fragment_address"),
    _stand_in("deepspeed.checkpoint.constants", "ZeroStageEnum", int),
]


def _load(path: Path) -> Any:
    try:
        with torch.serialization.safe_globals(_STAND_INS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise CheckpointError(f"{path}: cannot read it ({type(exc).__name__}: {first})") from None


def _holds_states(tag: Path) -> bool:
    """Whether ``tag`` holds a DeepSpeed save's optimizer states (or, without ZeRO,
    its one model states file)."""
    return (
        any(_OPTIM.fullmatch(f.name) for f in tag.glob("*_optim_states.pt"))
        or (tag / "mp_rank_00_model_states.pt").is_file()
    )


def _step_dir(path: str | os.PathLike) -> Path:
    p = Path(path)
    if _holds_states(p):
        return p
    latest = p / "latest"
    if latest.is_file():
        tag = latest.read_bytes().decode(errors="replace").strip()
        if tag and "/" not in tag and "\ufffd" not in tag and _holds_states(p / tag):
            return p / tag
    raise CheckpointError(
        f"{p} is not a DeepSpeed checkpoint: no *_optim_states.pt and no 'latest' naming a tag"
    )


def is_deepspeed_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a DeepSpeed checkpoint directory (or one of its tags)."""
    try:
        _step_dir(path)
    except (CheckpointError, OSError):
        return False
    return True


def read_deepspeed(path: str | os.PathLike) -> WholeCheckpoint:
    """Read a DeepSpeed ZeRO (stages 1-3) checkpoint whole ([Note: reading DeepSpeed's
    checkpoints]); CheckpointError names what does not fit."""
    step_dir = _step_dir(path)
    if list(step_dir.glob("layer_*-model_states.pt")):
        raise CheckpointError(
            f"{step_dir} is a DeepSpeed pipeline checkpoint (layer_*-model_states.pt): "
            "not read here; export its weights with DeepSpeed and load them with "
            "engine.load_weights"
        )
    optim: dict[int, Path] = {}
    prefixes: set[str] = set()
    for f in step_dir.glob("*_optim_states.pt"):
        match = _OPTIM.fullmatch(f.name)
        if match is None:
            continue
        if int(match[3]) != 0:
            raise CheckpointError(
                f"{f.name}: a tensor-parallel DeepSpeed checkpoint (mp_rank "
                f"{int(match[3])}) is not read here"
            )
        prefixes.add(match[1] or "")
        optim[int(match[2])] = f
    if len(prefixes) > 1:
        raise CheckpointError(
            f"{step_dir}: both bf16_zero_pp_rank_* and zero_pp_rank_* optimizer states; "
            "one run writes one kind"
        )
    world = len(optim)
    if world == 0 and (step_dir / "mp_rank_00_model_states.pt").exists():
        raise CheckpointError(
            f"{step_dir}: a DeepSpeed checkpoint without ZeRO (stage 0): its optimizer "
            "state is by position, naming no parameter; save the weights, "
            "torch.load(mp_rank_00_model_states.pt)['module'], to a file of their own and "
            "load that with engine.load_weights"
        )
    if world == 0 or sorted(optim) != list(range(world)):
        raise CheckpointError(f"{step_dir}: optimizer states of ranks {sorted(optim)}, not 0..N-1")
    states = [_load(optim[r])["optimizer_state_dict"] for r in range(world)]
    stage = int(states[0]["zero_stage"])
    if stage == 3:
        models = [
            _load(step_dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt") for r in range(world)
        ]
    else:
        models = [_load(step_dir / "mp_rank_00_model_states.pt")]
    model = models[0]
    if int(model.get("dp_world_size", world)) != world:
        raise CheckpointError(
            f"{step_dir}: saved by {model['dp_world_size']} ranks but holds {world} "
            "optimizer states"
        )
    shapes_by_group = [dict(g) for g in model["param_shapes"]]
    groups = [list(g) for g in shapes_by_group]
    shapes = {n: torch.Size(s) for g in shapes_by_group for n, s in g.items()}
    if stage == 3:
        base = [s["optimizer_state_dict"] for s in states]
        master, state = _stage3(states, base, groups, shapes, world, step_dir)
    else:
        base = [s["base_optimizer_state"] for s in states]
        master, state = _stage12(states, base, groups, shapes, step_dir)
    ds_config = model.get("ds_config") or {}
    accumulation = int(ds_config.get("gradient_accumulation_steps", 1) or 1)
    global_steps = int(model["global_steps"])
    scaler = states[0].get("loss_scaler")
    shared = {str(a): str(n) for a, n in (model.get("shared_params") or {}).items()}
    return WholeCheckpoint(
        source=f"deepspeed {step_dir.name}, {world} ranks, stage {stage}",
        stage=stage,
        global_steps=global_steps,
        skipped_steps=int(model.get("skipped_steps", 0)),
        micro_steps=global_steps * accumulation,
        groups=groups,
        shapes=shapes,
        master=master,
        state=state,
        param_groups=_hyperparameters(base[0]["param_groups"], len(groups), step_dir),
        frozen=_frozen(models, stage, set(shapes) | set(shared)),
        aliases=shared,
        buffers={n: model["module"][n] for n in model.get("buffer_names", [])},
        loss_scale=float(getattr(scaler, "cur_scale", 1.0)),
        client_state={k: v for k, v in model.items() if k not in _DS_KEYS},
    )


def _split(held: dict, numel: int) -> tuple[list[str], dict[str, Any]]:
    """The optimizer state of a flat partition of ``numel`` elements: the keys of its
    per-element tensors, and its scalars (``step``) as tensors, as torch keeps them."""
    per = [k for k, v in held.items() if isinstance(v, torch.Tensor) and v.numel() == numel > 1]
    scalars = {
        k: v.clone() if isinstance(v, torch.Tensor) else torch.tensor(float(v))
        for k, v in held.items()
        if k not in per
    }
    return per, scalars


def _stage12(
    states: list[dict], base: list[dict], groups: list[list[str]], shapes: dict, where: Path
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    master: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    for g, names in enumerate(groups):
        parts = [s["single_partition_of_fp32_groups"][g].float() for s in states]
        flat = torch.cat(parts)
        held = [b["state"].get(g, {}) for b in base]
        keys, scalars = _split(held[0], parts[0].numel())
        per = {k: torch.cat([h[k].float() for h in held]) for k in keys}
        offset = 0
        for name in names:
            n = math.prod(shapes[name])
            if offset + n > flat.numel():
                raise CheckpointError(f"{where}: param group {g} is shorter than its shapes")
            master[name] = flat[offset : offset + n].clone().reshape(shapes[name])
            state[name] = {k: v[offset : offset + n].clone() for k, v in per.items()} | scalars
            offset += n
    return master, state


def _stage3(
    states: list[dict],
    base: list[dict],
    groups: list[list[str]],
    shapes: dict,
    world: int,
    where: Path,
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    flat_groups = [s["fp32_flat_groups"] for s in states]
    flats = [torch.cat([t.float() for t in f]) for f in flat_groups]
    subgroups = range(len(flat_groups[0]))
    per_keys, scalars = _split(base[0]["state"].get(0, {}), flat_groups[0][0].numel())
    per = [
        {k: torch.cat([b["state"][s][k].float() for s in subgroups]) for k in per_keys}
        for b in base
    ]
    master: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    offset = 0
    for names in groups:
        for name in names:
            n = math.prod(shapes[name])
            part = math.ceil(n / world)
            if offset + part > flats[0].numel():
                raise CheckpointError(f"{where}: the flat partitions are shorter than the shapes")
            whole = torch.cat([f[offset : offset + part] for f in flats])[:n]
            master[name] = whole.clone().reshape(shapes[name])
            state[name] = {
                k: torch.cat([p[k][offset : offset + part] for p in per])[:n].clone()
                for k in per_keys
            } | scalars
            offset += part
    if offset != flats[0].numel():
        raise CheckpointError(
            f"{where}: the flat partitions hold {flats[0].numel()} elements a rank, the "
            f"shapes {offset}"
        )
    return master, state


def _hyperparameters(saved: list[dict], count: int, where: Path) -> list[dict[str, Any]]:
    """One dict of hyperparameters per param group (stage 3's sub-groups folded back,
    which DeepSpeed makes from a group with the group's hyperparameters)."""
    groups = [{k: v for k, v in g.items() if k in HYPERPARAMETERS} for g in saved]
    if len(groups) == count:
        return groups
    distinct = [g for i, g in enumerate(groups) if g not in groups[:i]]
    if len(distinct) == 1:
        return distinct * count
    raise CheckpointError(
        f"{where}: {len(groups)} optimizer sub-groups with different hyperparameters for "
        f"{count} param groups; cannot tell which is which"
    )


def _frozen(models: list[dict], stage: int, trainable: set[str]) -> dict[str, torch.Tensor]:
    shapes = models[0].get("frozen_param_shapes") or {}
    if stage != 3:
        # stage 1 records no frozen shapes: what the module holds besides the rest
        buffers = set(models[0].get("buffer_names", []))
        names = shapes or [n for n in models[0]["module"] if n not in trainable | buffers]
        return {n: models[0]["module"][n] for n in names}
    out = {}
    for name, shape in shapes.items():
        pieces = [m["frozen_param_fragments"][name].reshape(-1) for m in models]
        out[name] = torch.cat(pieces)[: math.prod(shape)].reshape(shape).clone()
    return out


def convert_deepspeed(path: str | os.PathLike, out: str | os.PathLike, *, optimizer: str) -> Path:
    """Write the DeepSpeed checkpoint ``path`` as a zeroplane checkpoint in ``out``
    (``out/step-N`` and ``out/latest``), for an engine whose optimizer class is
    named ``optimizer``; returns the step folder."""
    return write_whole(read_deepspeed(path), out, optimizer=optimizer)
