"""Checkpoints that do not depend on the world size or the stage.

[Note: checkpoint format]
A checkpoint directory holds ``latest`` (the name of the newest step folder)
and ``step-NNNNNNNN/`` folders. A step folder holds one file per rank that
wrote it, ``rankNNNNN.pt``, and ``manifest.json``. Rank r writes the
elements of range r of every bucket of the layout it trained with, whatever
its stage (at stage 0 every rank holds everything, but each writes only its
range, so writes still run in parallel). Every entry is addressed by
parameter name and element range of the flattened parameter: the fp32 master
values and each optimizer state tensor sliced to the same range. Rank 0's
file also holds what is not sharded: frozen parameters, the persistent
buffers (those in ``module.state_dict()``; buffers registered with
``persistent=False`` are the model's to recompute, as in torch), the
optimizer's param-group hyperparameters, the caller's ``client_state`` and
the ``extras``: the state of objects registered with the engine
(``engine.register_state``, e.g. a data loader's position), by name.
Checkpoints written before extras existed have none and load as before.

The manifest lists every file with its size, SHA-256 and the ranges it
holds, so a loader at any world size reads only the files that overlap the
ranges it owns. Files load with ``torch.load(weights_only=True)``. The
manifest carries its own ``checksum``: ``sha256:`` and the SHA-256 of the
canonical JSON (sorted keys, no spaces, ASCII) of every other field
(coordinator/core/manifest.py ``manifest_checksum``). Manifests written before
the checksum existed have none; they still load, checked structurally only
(``validate_manifest``), which finds every inconsistent edit but not a
consistent one such as another loss scale.

Commit is atomic: ranks write into a hidden temporary folder; rank 0 writes
the manifest, fsyncs, renames the folder to ``step-N`` and then replaces
``latest`` by rename. A crash at any point leaves the previous checkpoint
as ``latest``.

[Note: loading all or nothing]
A load is a collective and changes nothing until every rank knows that every
rank can finish it. Each rank, in this order: resolves the folder; reads the
manifest and validates all of it (checksum, types, ranges covering every
trainable element exactly once, files, counters; deterministic, so ranks
reading the same manifest agree); checks that it fits this model and
optimizer; verifies the size and SHA-256 of each file it needs; loads them
and checks their entries against the manifest (the keys are exactly the
file's ranges, master values fp32 of each range's length, optimizer state
scalars or one value per element; rank 0's frozen parameters, buffers and
param groups fit). Any failure, including an unexpected exception, becomes a
message. Then one all-reduce carries a failure flag and the manifest's
checksum (as max and min, so ranks that read different manifests find out);
if any rank failed, the failing rank's message is broadcast and every rank
raises the same :class:`CheckpointError`. Only then is state assigned.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from coordinator.core.manifest import (
    FORMAT,
    CheckpointError,
    index_ranges,
    manifest_checksum,
    rank_file,
    read_manifest,
    resolve,
)
from coordinator.core.ranges import Range
from worker.entries import MissingRange
from worker.inventory import dtype_name, persistent_buffers
from worker.state import ShardState

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "FORMAT",
    "CheckpointError",
    "Planned",
    "export_consolidated",
    "load_checkpoint",
    "persistent_buffers",
    "resolve",
    "save_checkpoint",
    "sha256_of",
    "write_safetensors_shards",
]

logger = logging.getLogger(__name__)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, write) -> None:
    with path.open("wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------- save


def save_checkpoint(
    state: ShardState,
    path: str | os.PathLike,
    client_state: dict | None = None,
    extras: Mapping[str, dict] | None = None,
) -> Path:
    """Write this rank's part of a checkpoint of ``state``; a collective.

    ``extras``: named states (plain values and tensors) kept with rank 0's
    unsharded state; :func:`load_checkpoint` hands each to its object."""
    root = Path(path)
    step_dir = root / f"step-{state.global_steps:08d}"
    tmp = root / f".tmp-step-{state.global_steps:08d}"
    rank = state.rank
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash mid-save
        tmp.mkdir()
    state.comm.barrier()

    try:
        entries = state.export_ranges()
    except MissingRange as exc:
        raise CheckpointError(str(exc)) from None
    ranges = state.written_ranges()
    payload: dict[str, Any] = {"entries": entries}
    if rank == 0:
        payload["unsharded"] = _export_unsharded(state, client_state)
        payload["unsharded"]["extras"] = dict(extras or {})
    file = tmp / rank_file(rank)
    _write_durably(file, lambda f: torch.save(payload, f))
    info = {
        "bytes": file.stat().st_size,
        "sha256": sha256_of(file),
        "ranges": [[r.name, r.start, r.stop] for r in ranges],
    }
    _write_durably(tmp / f"rank{rank:05d}.json", lambda f: f.write(json.dumps(info).encode()))
    state.comm.barrier()

    if rank == 0:
        files = {}
        for r in range(state.world_size):
            sidecar = tmp / f"rank{r:05d}.json"
            files[rank_file(r)] = json.loads(sidecar.read_text())
            sidecar.unlink()
        frozen = payload["unsharded"]["frozen"]
        manifest = {
            "format": FORMAT,
            "global_steps": state.global_steps,
            "world_size": state.world_size,
            "stage": state.stage.number,
            "dtype": state.config.dtype,
            "optimizer": type(state.user_optimizer).__name__,
            "loss_scale": state.scaler.scale,
            "params": {
                s.name: {
                    "shape": list(s.shape),
                    # a frozen parameter's is the dtype of the tensor saved for it
                    "dtype": dtype_name(frozen[s.name].dtype) if s.name in frozen else s.dtype,
                    "requires_grad": s.requires_grad,
                    "group": s.group,
                }
                for s in state.inventory.specs
            },
            # tied parameters: every other name a parameter is reachable under
            "aliases": {a: n for a, n in state.inventory.aliases.items() if a != n},
            "files": files,
        }
        manifest["checksum"] = manifest_checksum(manifest)
        _write_durably(
            tmp / "manifest.json", lambda f: f.write(json.dumps(manifest, indent=1).encode())
        )
        _fsync_dir(tmp)
        if step_dir.exists():
            shutil.rmtree(step_dir)
        os.rename(tmp, step_dir)
        latest_tmp = root / ".latest.tmp"
        _write_durably(latest_tmp, lambda f: f.write(step_dir.name.encode()))
        os.replace(latest_tmp, root / "latest")
        _fsync_dir(root)
    state.comm.barrier()
    return step_dir


def _export_unsharded(state: ShardState, client_state: dict | None) -> dict[str, Any]:
    in_bucket = state.bucket_of
    return {
        "frozen": {
            name: p.detach().clone()
            for name, p in state.inventory.params.items()
            if p not in in_bucket
        },
        "buffers": {n: b.detach().clone() for n, b in persistent_buffers(state.module).items()},
        "param_groups": [
            {k: v for k, v in g.items() if k != "params"} for g in state.user_optimizer.param_groups
        ],
        "micro_steps": state.micro_steps,
        "skipped_steps": state.skipped_steps,
        "loss_scaler": list(state.scaler.position()),
        "client_state": client_state or {},
    }


# ---------------------------------------------------------------------------- load


def load_checkpoint(
    state: ShardState, path: str | os.PathLike, extras: Mapping[str, Stateful] | None = None
) -> dict:
    """Load a checkpoint saved at any world size and stage; a collective.

    All or nothing on every rank ([Note: loading all or nothing]): if any rank
    finds the manifest or a file damaged or unfit, every rank raises the same
    :class:`CheckpointError` naming it and the engine keeps the state it had.
    Each of ``extras`` whose name the checkpoint holds a state for is checked
    (``validate_state_dict``, if it has one) with the rest and then loaded;
    one the checkpoint lacks (an older checkpoint) is left as it is.
    """
    extras = extras or {}
    error, digest = "", 0
    try:
        step_dir = resolve(path)
        manifest = read_manifest(step_dir)
        digest = int(manifest_checksum(manifest)[7:22], 16)
        _check_inventory(state, manifest, step_dir / "manifest.json")
        index = index_ranges(manifest)
        needed = sorted({rank_file(0)} | index.sources(state.owned()))
        # straight to where the state lives (host memory with offload)
        loaded = _read_files(step_dir, manifest, needed, state.master_device)
        unsharded = loaded[rank_file(0)]["unsharded"]
        _check_fits(state, step_dir / rank_file(0), unsharded)
        saved_extras = _check_extras(step_dir / rank_file(0), unsharded, extras)
    except CheckpointError as exc:
        error = str(exc)
    except Exception as exc:  # a rank that stops here must not leave the others waiting
        logger.warning("loading checkpoint %s failed unexpectedly", path, exc_info=True)
        first = (str(exc).strip().splitlines() or [""])[0]
        error = f"{path}: unexpected {type(exc).__name__}: {first}"
    _agree(state, error, digest, path)

    # every rank has everything it needs; only now change the state
    entries: dict[str, dict] = {}
    for name in needed:
        entries.update(loaded[name]["entries"])
    try:
        state.import_ranges(entries, index)
    except MissingRange as exc:  # excluded by the checks above
        raise CheckpointError(f"checkpoint lacks elements: {exc}") from None
    _import_unsharded(state, unsharded)
    state.global_steps = manifest["global_steps"]
    state.scaler.scale = manifest["loss_scale"]
    for name, saved in saved_extras.items():
        extras[name].load_state_dict(saved)
    return unsharded["client_state"]


class Stateful(Protocol):
    """What the engine saves as an extra (``validate_state_dict`` is optional)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def _check_extras(path: Path, unsharded: dict, extras: Mapping[str, Stateful]) -> dict[str, dict]:
    """The saved states of ``extras`` that the checkpoint holds, each checked by its object."""
    saved = unsharded.get("extras", {})  # absent in checkpoints older than extras
    found = {name: saved[name] for name in extras if name in saved}
    for name, value in found.items():
        validate = getattr(extras[name], "validate_state_dict", None)
        if validate is None:
            continue
        try:
            validate(value)
        except ValueError as exc:
            raise CheckpointError(f"{path}: the saved {name!r} state does not fit: {exc}") from None
    return found


def _check_inventory(state: ShardState, manifest: dict, where: Path) -> None:
    """The manifest's parameters and optimizer are this model's and optimizer's."""
    saved = manifest["params"]
    for spec in state.inventory.specs:
        if spec.name not in saved:
            raise CheckpointError(f"{where}: parameter {spec.name!r} is not in the checkpoint")
        want = saved[spec.name]
        if tuple(want["shape"]) != tuple(spec.shape):
            raise CheckpointError(
                f"{where}: parameter {spec.name!r} has shape {tuple(spec.shape)} here "
                f"but {tuple(want['shape'])} in the checkpoint"
            )
        if want["requires_grad"] != spec.requires_grad:
            raise CheckpointError(
                f"{where}: parameter {spec.name!r} is frozen in one but not the other"
            )
        if spec.requires_grad and want["group"] != spec.group:
            raise CheckpointError(
                f"{where}: parameter {spec.name!r} is in optimizer param group {spec.group} "
                f"here but {want['group']} in the checkpoint"
            )
    extra = set(saved) - {s.name for s in state.inventory.specs}
    if extra:
        raise CheckpointError(f"{where} has parameters the model lacks: {sorted(extra)[:5]}")
    if manifest["optimizer"] != type(state.user_optimizer).__name__:
        raise CheckpointError(
            f"{where}: the checkpoint was trained with {manifest['optimizer']}, "
            f"not {type(state.user_optimizer).__name__}"
        )


def _read_files(
    step_dir: Path, manifest: dict, names: list[str], device: torch.device | str = "cpu"
) -> dict[str, dict]:
    """The files ``names`` of a validated manifest, verified and loaded (memory-mapped),
    their entries checked against the manifest."""
    out = {}
    for name in names:
        path = step_dir / name
        info = manifest["files"][name]
        if not path.is_file():
            raise CheckpointError(f"{path} is missing")
        size = path.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(f"{path} has {size} bytes, the manifest says {info['bytes']}")
        if sha256_of(path) != info["sha256"]:
            raise CheckpointError(
                f"{path} does not match its SHA-256 in the manifest (altered or corrupt)"
            )
        try:
            payload = torch.load(path, weights_only=True, mmap=True, map_location=device)
        except Exception as exc:  # pickle, zip and weights_only errors alike
            first = (str(exc).strip().splitlines() or [""])[0]
            raise CheckpointError(f"{path} cannot be read: {type(exc).__name__}: {first}") from None
        _check_entries(path, info["ranges"], payload)
        if name == rank_file(0):
            _check_unsharded(path, manifest, payload.get("unsharded"))
        out[name] = payload
    return out


def _check_entries(path: Path, ranges: list, payload: Any) -> None:
    """The file holds exactly the ranges the manifest lists for it, each with fp32
    master values of its length and optimizer state that is scalars or one value
    per element (only elementwise optimizers run on shards)."""
    if not isinstance(payload, dict) or not isinstance(payload.get("entries"), dict):
        raise CheckpointError(f"{path} holds no element-range entries")
    want = {Range(n, a, b).key: b - a for n, a, b in ranges}
    got = payload["entries"]
    if got.keys() != want.keys():
        extra, missing = sorted(got.keys() - want.keys()), sorted(want.keys() - got.keys())
        what = f"holds {extra[0]!r}, which the manifest does not list" if extra else ""
        what = what or f"lacks {missing[0]!r}, which the manifest lists"
        raise CheckpointError(f"{path} {what}")
    for key, numel in want.items():
        entry = got[key]
        master = entry.get("master") if isinstance(entry, dict) else None
        if not (
            isinstance(master, torch.Tensor)
            and master.dtype == torch.float32
            and master.shape == (numel,)
        ):
            raise CheckpointError(
                f"{path}: {key} holds {_describe(master)}, not {numel} float32 values"
            )
        opt_state = entry.get("state")
        if not isinstance(opt_state, dict):
            raise CheckpointError(f"{path}: {key} has no optimizer state table")
        for k, v in opt_state.items():
            if isinstance(v, torch.Tensor) and v.dim() != 0 and v.shape != (numel,):
                raise CheckpointError(
                    f"{path}: {key}'s optimizer state {k!r} is {_describe(v)}, "
                    f"not a scalar or {numel} values"
                )


def _check_unsharded(path: Path, manifest: dict, unsharded: Any) -> None:
    """Rank 0's unsharded part has every field, and its frozen parameters are the
    manifest's, with their shapes and dtypes."""
    kinds = {
        "frozen": dict,
        "buffers": dict,
        "param_groups": list,
        "micro_steps": int,
        "skipped_steps": int,
        "client_state": dict,
    }
    if not isinstance(unsharded, dict):
        raise CheckpointError(f"{path} lacks the unsharded state rank 0 writes")
    for key, kind in kinds.items():
        if not isinstance(unsharded.get(key), kind) or isinstance(unsharded.get(key), bool):
            raise CheckpointError(f"{path}: unsharded {key!r} is {_describe(unsharded.get(key))}")
    extras = unsharded.get("extras", {})  # absent in checkpoints older than extras
    if not isinstance(extras, dict) or not all(isinstance(k, str) for k in extras):
        raise CheckpointError(f"{path}: unsharded 'extras' is not a table of named states")
    if unsharded["micro_steps"] < 0 or unsharded["skipped_steps"] < 0:
        raise CheckpointError(f"{path}: a negative step counter")
    scaler = unsharded.get("loss_scaler", [0, 0])
    if not (
        isinstance(scaler, list | tuple)
        and len(scaler) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in scaler)
    ):
        raise CheckpointError(f"{path}: unsharded 'loss_scaler' is {_describe(scaler)}")
    if not all(isinstance(g, dict) and "params" not in g for g in unsharded["param_groups"]):
        raise CheckpointError(f"{path}: param groups are not hyperparameter tables")
    frozen = {n for n, info in manifest["params"].items() if not info["requires_grad"]}
    if unsharded["frozen"].keys() != frozen:
        odd = sorted(unsharded["frozen"].keys() ^ frozen)[0]
        raise CheckpointError(f"{path}: its frozen parameters are not the manifest's ({odd!r})")
    for name, value in unsharded["frozen"].items():
        info = manifest["params"][name]
        if not (
            isinstance(value, torch.Tensor)
            and list(value.shape) == info["shape"]
            and dtype_name(value.dtype) == info["dtype"]
        ):
            raise CheckpointError(
                f"{path}: frozen {name!r} is {_describe(value)}, the manifest says "
                f"{info['dtype']} of shape {tuple(info['shape'])}"
            )
    if not all(isinstance(b, torch.Tensor) for b in unsharded["buffers"].values()):
        raise CheckpointError(f"{path}: a buffer is not a tensor")


def _check_fits(state: ShardState, path: Path, unsharded: dict) -> None:
    """Rank 0's unsharded state fits this model and optimizer: every persistent buffer
    is saved with its shape, every saved buffer is one of the model's (older
    checkpoints also hold non-persistent ones, which are not loaded) and the
    param groups are as many as the optimizer's."""
    saved, groups = unsharded["buffers"], state.user_optimizer.param_groups
    model = dict(state.module.named_buffers(remove_duplicate=False))
    for name, buf in persistent_buffers(state.module).items():
        if name not in saved:
            raise CheckpointError(f"{path} lacks the model's buffer {name!r}")
        if saved[name].shape != buf.shape:
            raise CheckpointError(
                f"{path}: buffer {name!r} has shape {tuple(saved[name].shape)}, "
                f"the model's {tuple(buf.shape)}"
            )
    unknown = sorted(set(saved) - set(model))
    if unknown:
        raise CheckpointError(f"{path} holds buffers the model lacks: {unknown[:5]}")
    if len(unsharded["param_groups"]) != len(groups):
        raise CheckpointError(
            f"{path} has {len(unsharded['param_groups'])} optimizer param groups, "
            f"the optimizer {len(groups)}"
        )


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{dtype_name(value.dtype)} of shape {tuple(value.shape)}"
    return type(value).__name__


def _agree(state: ShardState, error: str, digest: int, path: str | os.PathLike) -> None:
    """Every rank raises if any rank found a problem, with that rank's message, or
    if the ranks read different manifests."""
    msg = torch.zeros(512, dtype=torch.uint8, device=state.device)
    raw = error.encode()[:511]
    if raw:
        msg[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(state.device)
    flag = state.rank + 1 if error else 0
    votes = torch.tensor([flag, digest, -digest], dtype=torch.int64, device=state.device)
    state.comm.all_reduce(votes, op="max", control=True)
    flag, most, least = (int(v) for v in votes.tolist())
    if flag == 0:
        if most != -least:
            raise CheckpointError(
                f"checkpoint not loaded: the ranks read different manifests from {path} "
                "(rewritten while loading, or storage that differs between nodes)"
            )
        return
    source = flag - 1
    state.comm.broadcast(msg, src=source)
    text = bytes(msg.tolist()).rstrip(b"\0").decode(errors="replace")
    raise CheckpointError(f"checkpoint not loaded (rank {source}): {text}")


def _import_unsharded(state: ShardState, unsharded: dict) -> None:
    with torch.no_grad():
        for name, value in unsharded["frozen"].items():
            state.inventory.params[name].copy_(value)
        for name, buf in persistent_buffers(state.module).items():
            buf.copy_(unsharded["buffers"][name])
    groups = zip(state.user_optimizer.param_groups, unsharded["param_groups"], strict=True)
    for group, saved in groups:
        group.update(saved)
    state.micro_steps = unsharded["micro_steps"]
    state.micro_in_step = 0
    state.skipped_steps = unsharded["skipped_steps"]
    # absent in checkpoints older than it: the window starts again, as it used to
    state.scaler.move_to(*unsharded.get("loss_scaler", (0, 0)))


# ---------------------------------------------------------------------------- export

DEFAULT_SHARD_BYTES = 5 * 10**9  # "5GB", where transformers' save_pretrained splits


@dataclass(frozen=True)
class Planned:
    """One tensor of an export: its name, its size there and how to make it."""

    name: str
    nbytes: int
    make: Callable[[], torch.Tensor]


def export_consolidated(
    path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> tuple[int, list[Path]]:
    """Write the checkpoint's full persistent state (fp32 masters; frozen parameters
    and buffers as saved; every floating tensor cast to ``dtype`` if given) as
    safetensors, for inference. Returns the tensor count and the files written.

    Up to ``max_shard_bytes`` the output is the one file ``out``; beyond, it is
    split as transformers splits it: ``{stem}-00001-of-0000N.safetensors``
    beside ``out`` and an index ``{out}.index.json``, which ``from_pretrained``
    reads. Memory is bounded by one output file (or the largest tensor): the
    tensors of a file are assembled from the memory-mapped rank files and
    handed to ``safetensors.torch.save_file``, which needs them all at once.
    """
    step_dir = resolve(path)
    manifest = read_manifest(step_dir)
    files = _read_files(step_dir, manifest, sorted(manifest["files"]))
    plan = _plan_export(manifest, files, dtype)
    metadata = {"format": "pt", "global_steps": str(manifest["global_steps"])}
    return len(plan), write_safetensors_shards(plan, out, metadata, max_shard_bytes)


def write_safetensors_shards(
    plan: Sequence[Planned],
    out: str | os.PathLike,
    metadata: dict[str, str],
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    *,
    write: bool = True,
) -> list[Path]:
    """Write ``plan``'s tensors as safetensors, as transformers' ``save_pretrained``
    lays them out: up to ``max_shard_bytes`` the one file ``out``; beyond,
    ``{stem}-00001-of-0000N.safetensors`` beside it and an index
    ``{out}.index.json``. Each file's tensors are made (``Planned.make``) just
    before it is written, so memory is bounded by one file. ``write=False``: make
    every tensor in the same order but write nothing (the other ranks of a
    collective export, whose ``make`` calls meet rank 0's); returns the files."""
    shards: list[list[Planned]] = [[]]
    size = 0
    for item in plan:
        if shards[-1] and size + item.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item.nbytes

    target = Path(out)
    index_file = target.with_name(target.name + ".index.json")
    n = len(shards)
    stem = target.name.removesuffix(".safetensors")
    targets = (
        [target]
        if n == 1
        else [target.with_name(f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors") for i in range(n)]
    )
    for shard, file in zip(shards, targets, strict=True):
        if write:
            _write_safetensors(shard, file, metadata)
        else:
            for item in shard:
                item.make()
    if not write:
        return targets if n == 1 else [*targets, index_file]
    if n == 1:
        index_file.unlink(missing_ok=True)  # from an earlier, larger export
        return targets
    weight_map = {
        item.name: f.name for shard, f in zip(shards, targets, strict=True) for item in shard
    }
    body = {"metadata": {"total_size": sum(i.nbytes for i in plan)}, "weight_map": weight_map}
    _write_durably(index_file, lambda f: f.write(json.dumps(body, indent=2).encode()))
    target.unlink(missing_ok=True)  # a single file from an earlier export would win
    return [*targets, index_file]


def _plan_export(
    manifest: dict, files: dict[str, dict], dtype: torch.dtype | None
) -> list[Planned]:
    """Every tensor of the export in order: parameters, aliases (repeating their
    parameter) and the saved buffers (persistent ones only, since they are all
    that is saved)."""
    unsharded = files[rank_file(0)]["unsharded"]
    index = index_ranges(manifest)

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    def trained(name: str) -> torch.Tensor:
        shape = manifest["params"][name]["shape"]
        flat = torch.empty(math.prod(shape), dtype=torch.float32)
        for have, a, b, file in index.overlapping(Range(name, 0, flat.numel())):
            flat[a:b] = files[file]["entries"][have.key]["master"]
        return cast(flat.view(shape))

    def planned(name: str, like: torch.Tensor, numel: int, make) -> Planned:
        return Planned(name, numel * cast(like.new_empty(())).element_size(), make)

    plan: dict[str, Planned] = {}
    for name, info in manifest["params"].items():
        numel = math.prod(info["shape"])
        if info["requires_grad"]:
            like = torch.empty((), dtype=torch.float32)
            plan[name] = planned(name, like, numel, functools.partial(trained, name))
        else:
            like = unsharded["frozen"][name]
            plan[name] = planned(name, like, numel, functools.partial(cast, like))
    for alias, name in manifest.get("aliases", {}).items():
        plan[alias] = Planned(alias, plan[name].nbytes, plan[name].make)
    for name, t in unsharded["buffers"].items():
        plan[name] = planned(name, t, t.numel(), functools.partial(cast, t))
    return list(plan.values())


def _write_safetensors(shard: list[Planned], file: Path, metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for item in shard:
        t = item.make().detach().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in storages and t.numel():  # an alias, or a cast that changed nothing
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        tensors[item.name] = t
    tmp = file.with_name(file.name + ".tmp")
    save_file(tensors, tmp, metadata=metadata)
    with tmp.open("rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, file)
