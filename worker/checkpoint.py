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
file also holds what is not sharded: frozen parameters, buffers, the
optimizer's param-group hyperparameters and the caller's ``client_state``.

The manifest lists every file with its size, SHA-256 and the ranges it
holds, so a loader at any world size reads only the files that overlap the
ranges it owns. Files load with ``torch.load(weights_only=True)``.

Commit is atomic: ranks write into a hidden temporary folder; rank 0 writes
the manifest, fsyncs, renames the folder to ``step-N`` and then replaces
``latest`` by rename. A crash at any point leaves the previous checkpoint
as ``latest``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from coordinator.checkpoints import FORMAT, CheckpointError, read_manifest, resolve
from coordinator.ranges import Range, RangeIndex
from worker.state import MissingRange, ShardState

__all__ = [
    "FORMAT",
    "CheckpointError",
    "export_consolidated",
    "load_checkpoint",
    "resolve",
    "save_checkpoint",
]


def _rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def _sha256(path: Path) -> str:
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
    state: ShardState, path: str | os.PathLike, client_state: dict | None = None
) -> Path:
    """Write this rank's part of a checkpoint of ``state``; a collective."""
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
    file = tmp / _rank_file(rank)
    _write_durably(file, lambda f: torch.save(payload, f))
    info = {
        "bytes": file.stat().st_size,
        "sha256": _sha256(file),
        "ranges": [[r.name, r.start, r.stop] for r in ranges],
    }
    _write_durably(tmp / f"rank{rank:05d}.json", lambda f: f.write(json.dumps(info).encode()))
    state.comm.barrier()

    if rank == 0:
        files = {}
        for r in range(state.world_size):
            sidecar = tmp / f"rank{r:05d}.json"
            files[_rank_file(r)] = json.loads(sidecar.read_text())
            sidecar.unlink()
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
                    "dtype": s.dtype,
                    "requires_grad": s.requires_grad,
                    "group": s.group,
                }
                for s in state.inventory.specs
            },
            # tied parameters: every other name a parameter is reachable under
            "aliases": {a: n for a, n in state.inventory.aliases.items() if a != n},
            "files": files,
        }
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
        "buffers": {n: b.detach().clone() for n, b in state.module.named_buffers()},
        "param_groups": [
            {k: v for k, v in g.items() if k != "params"} for g in state.user_optimizer.param_groups
        ],
        "micro_steps": state.micro_steps,
        "skipped_steps": state.skipped_steps,
        "client_state": client_state or {},
    }


# ---------------------------------------------------------------------------- load


def load_checkpoint(state: ShardState, path: str | os.PathLike) -> dict:
    """Load a checkpoint saved at any world size and stage; a collective.

    Every file this rank needs is verified before anything is assigned; if any
    rank finds a damaged file, every rank raises :class:`CheckpointError`
    naming it and the engine keeps the state it had.
    """
    error = ""
    try:
        step_dir = resolve(path)
        manifest = read_manifest(step_dir)
        _check_inventory(state, manifest)
        index = _index_ranges(manifest)
        needed = sorted({_rank_file(0)} | index.sources(state.owned()))
        error = _verify(step_dir, manifest, needed)
    except CheckpointError as exc:
        error = str(exc)
    _agree_on_error(state, error)

    loaded = {
        name: torch.load(step_dir / name, weights_only=True, mmap=True, map_location=state.device)
        for name in needed
    }
    entries: dict[str, dict] = {}
    for name in needed:
        entries.update(loaded[name]["entries"])
    unsharded = loaded[_rank_file(0)]["unsharded"]

    # everything is read; only now change the state
    try:
        state.import_ranges(entries, index)
    except MissingRange as exc:
        raise CheckpointError(f"checkpoint lacks elements: {exc}") from None
    _import_unsharded(state, unsharded)
    state.global_steps = manifest["global_steps"]
    state.scaler.scale = manifest["loss_scale"]
    return unsharded["client_state"]


def _check_inventory(state: ShardState, manifest: dict) -> None:
    saved = manifest["params"]
    for spec in state.inventory.specs:
        if spec.name not in saved:
            raise CheckpointError(f"parameter {spec.name!r} is not in the checkpoint")
        want = saved[spec.name]
        if tuple(want["shape"]) != tuple(spec.shape):
            raise CheckpointError(
                f"parameter {spec.name!r} has shape {tuple(spec.shape)} here "
                f"but {tuple(want['shape'])} in the checkpoint"
            )
        if want["requires_grad"] != spec.requires_grad:
            raise CheckpointError(f"parameter {spec.name!r} is frozen in one but not the other")
        if spec.requires_grad and want["group"] != spec.group:
            raise CheckpointError(
                f"parameter {spec.name!r} is in optimizer param group {spec.group} here "
                f"but {want['group']} in the checkpoint"
            )
    extra = set(saved) - {s.name for s in state.inventory.specs}
    if extra:
        raise CheckpointError(f"checkpoint has parameters the model lacks: {sorted(extra)[:5]}")
    if manifest["optimizer"] != type(state.user_optimizer).__name__:
        raise CheckpointError(
            f"checkpoint was trained with {manifest['optimizer']}, "
            f"not {type(state.user_optimizer).__name__}"
        )


def _index_ranges(manifest: dict) -> RangeIndex:
    """Every range of the checkpoint, with the file that holds it."""
    return RangeIndex(
        (Range(name, start, stop), file)
        for file, info in manifest["files"].items()
        for name, start, stop in info["ranges"]
    )


def _verify(step_dir: Path, manifest: dict, needed: list[str]) -> str:
    for name in needed:
        path = step_dir / name
        info = manifest["files"].get(name)
        if info is None:
            return f"{path} is not listed in the manifest"
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != info["bytes"]:
            return f"{path} has {path.stat().st_size} bytes, the manifest says {info['bytes']}"
        if _sha256(path) != info["sha256"]:
            return f"{path} does not match its SHA-256 in the manifest (altered or corrupt)"
    return ""


def _agree_on_error(state: ShardState, error: str) -> None:
    """Every rank raises if any rank found a problem, with that rank's message."""
    msg = torch.zeros(512, dtype=torch.uint8, device=state.device)
    raw = error.encode()[:511]
    if raw:
        msg[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(state.device)
    flag = torch.tensor([state.rank + 1 if error else 0], dtype=torch.int64, device=state.device)
    state.comm.all_reduce(flag, op="max", control=True)
    if int(flag) == 0:
        return
    source = int(flag) - 1
    state.comm.broadcast(msg, src=source)
    text = bytes(msg.tolist()).rstrip(b"\0").decode(errors="replace")
    raise CheckpointError(f"checkpoint not loaded (rank {source}): {text}")


def _import_unsharded(state: ShardState, unsharded: dict) -> None:
    with torch.no_grad():
        for name, value in unsharded["frozen"].items():
            state.inventory.params[name].copy_(value)
        buffers = dict(state.module.named_buffers())
        for name, value in unsharded["buffers"].items():
            if name in buffers:
                buffers[name].copy_(value)
    groups = zip(state.user_optimizer.param_groups, unsharded["param_groups"], strict=True)
    for group, saved in groups:
        group.update(saved)
    state.micro_steps = unsharded["micro_steps"]
    state.skipped_steps = unsharded["skipped_steps"]


# ---------------------------------------------------------------------------- export

_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def export_consolidated(path: str | os.PathLike, out: str | os.PathLike) -> int:
    """Write the checkpoint's full parameters (fp32 masters; frozen ones and buffers
    as saved) to one safetensors file, for inference. Returns the tensor count.

    Streams: the header is computed from the manifest, then each tensor is
    assembled from the memory-mapped rank files and written before the next,
    so memory stays bounded by the largest tensor, not the model.
    """
    step_dir = resolve(path)
    manifest = read_manifest(step_dir)
    needed = sorted(manifest["files"])
    error = _verify(step_dir, manifest, needed)
    if error:
        raise CheckpointError(error)
    files = {n: torch.load(step_dir / n, weights_only=True, mmap=True) for n in needed}
    unsharded = files[_rank_file(0)]["unsharded"]
    index = _index_ranges(manifest)

    def trained(name: str) -> torch.Tensor:
        shape = manifest["params"][name]["shape"]
        flat = torch.empty(math.prod(shape), dtype=torch.float32)
        for have, a, b, file in index.overlapping(Range(name, 0, flat.numel())):
            flat[a:b] = files[file]["entries"][have.key]["master"]
        return flat.view(shape)

    # (name, dtype, shape, producer) in output order; aliases repeat their tensor
    plan: list[tuple[str, torch.dtype, list[int], Any]] = []
    for name, info in manifest["params"].items():
        if info["requires_grad"]:
            plan.append((name, torch.float32, info["shape"], lambda n=name: trained(n)))
        else:
            t = unsharded["frozen"][name]
            plan.append((name, t.dtype, list(t.shape), lambda t=t: t))
    for alias, name in manifest.get("aliases", {}).items():
        producer = next(p for n, _, _, p in plan if n == name)
        dtype, shape = next((d, s) for n, d, s, _ in plan if n == name)
        plan.append((alias, dtype, shape, producer))
    for name, t in unsharded["buffers"].items():
        plan.append((name, t.dtype, list(t.shape), lambda t=t: t))

    header: dict[str, Any] = {
        "__metadata__": {"format": "pt", "global_steps": str(manifest["global_steps"])}
    }
    offset = 0
    for name, dtype, shape, _ in plan:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": shape,
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    target = Path(out)
    tmp = target.with_name(target.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for _, dtype, _, producer in plan:
            t = producer().detach().to(dtype).contiguous()
            f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    return len(plan)
