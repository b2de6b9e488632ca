"""Pretrained weights into a sharded model: each rank reads only the elements it owns.

[Note: weights by range]
A checkpoint of a model larger than one rank cannot be loaded whole on each
rank and sharded afterwards. :func:`load_weights` asks the shard state which
element ranges of each flattened parameter this rank's optimizer owns
(``ShardState.owned``, the same ranges checkpoints and hand-overs use) and
reads just those from the files: safetensors' lazy slices read the rows that
hold a range (a range of a flattened ``[rows, ...]`` tensor lies in
consecutive rows, at most two of them partly), and a torch file is
memory-mapped, so only the pages of the range are read. A range that lies
within one row is read within that row, and so on down the dimensions, so a
tensor-parallel rank's runs (a column-wise slice of a row-major weight, one
run per row) read only their own elements (worker/tp_checkpoint.py: the state
a mesh rank passes addresses full parameters). Peak memory is the rank's
share plus one range's worth of I/O buffer. Frozen parameters and persistent
buffers are replicated, so every rank reads them whole.

Names are matched before anything changes: a tied parameter needs one of its
names in the files (Hugging Face saves the first), a prefix that the files and
the model disagree on (a ``LlamaModel``'s weights into a ``LlamaForCausalLM``,
or the other way round) is found once for every name, and a name the model
needs and the files lack, a name the files hold and the model does not, or a
shape that differs is an error naming it, with the model untouched.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from coordinator.core.ranges import Range
from worker.checkpoint import DEFAULT_SHARD_BYTES, Planned, write_safetensors_shards
from worker.inventory import persistent_buffers
from worker.moe.hf_layout import renamed_keys, stacked_keys

if TYPE_CHECKING:
    from worker.moe.shards import ExpertShards
    from worker.tp_checkpoint import FullExport

__all__ = ["WeightFiles", "WeightsError", "load_weights", "save_weights"]

logger = logging.getLogger(__name__)

_SAFETENSORS_INDEX = "model.safetensors.index.json"
_TORCH_INDEX = "pytorch_model.bin.index.json"
_TORCH_SUFFIXES = (".bin", ".pt", ".pth")


ADAPTER_CONFIG = "adapter_config.json"


def adapter_directory(path: Path) -> str:
    """What to say of a PEFT adapter directory given where a model's weights belong."""
    return (
        f"{path} holds PEFT adapters ({ADAPTER_CONFIG}), not a model's weights: build "
        "the base model, load its own weights, then peft.PeftModel.from_pretrained(base, "
        f"{str(path)!r}) (or save with engine.save_pretrained(dir, merged=True) for one "
        "model with the adapters merged)"
    )


class WeightsError(ValueError):
    """Pretrained weights that do not fit the model: names, shapes or files."""


class _Tensors(Protocol):
    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def whole(self, name: str) -> torch.Tensor: ...

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor: ...


class _SafetensorsFile:
    def __init__(self, path: Path, stack: ExitStack) -> None:
        from safetensors import safe_open

        self.file = stack.enter_context(safe_open(str(path), framework="pt"))

    def names(self) -> list[str]:
        return list(self.file.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.file.get_slice(name).get_shape())

    def whole(self, name: str) -> torch.Tensor:
        return self.file.get_tensor(name)

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self.file.get_slice(name)[index]


class _TorchFile:
    def __init__(self, path: Path) -> None:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # a pickle that is not a state dict, a torn file
            raise WeightsError(f"cannot read {path} as a torch state dict: {exc}") from exc
        if not isinstance(state, Mapping):
            raise WeightsError(f"{path} holds a {type(state).__name__}, not a state dict")
        self.state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}

    def names(self) -> list[str]:
        return list(self.state)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.state[name].shape)

    def whole(self, name: str) -> torch.Tensor:
        return self.state[name]

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self.state[name][index]


class WeightFiles:
    """The tensors of a checkpoint by name, read lazily: a safetensors file, a torch
    state-dict file (``.bin``/``.pt``/``.pth``), or a directory holding either, one
    file or sharded with its index (``model.safetensors.index.json``,
    ``pytorch_model.bin.index.json``), as ``save_pretrained`` and
    ``zeroplane checkpoint export`` write them. Local files only."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._stack = ExitStack()
        self._where: dict[str, _Tensors] = {}
        try:
            for file in self._files():
                opened: _Tensors = (
                    _SafetensorsFile(file, self._stack)
                    if file.suffix == ".safetensors"
                    else _TorchFile(file)
                )
                for key in opened.names():
                    self._where.setdefault(key, opened)
        except Exception:
            self._stack.close()
            raise
        # fused experts tensors made of per-expert ones (worker/moe/hf_layout.py
        # [Note: stacked expert weights]), each name by its parts; a key the files
        # hold is read as it is
        self._stacked: dict[str, list[str]] = {}
        self._renamed: dict[str, str] = {}
        self._stacked = {
            name: parts
            for name, parts in stacked_keys(set(self._where)).items()
            if name not in self._where and _stackable([self.shape(p) for p in parts])
        }
        # and a tensor under the model's name where the files use an older one
        self._renamed = {
            name: key
            for name, key in renamed_keys(set(self._where)).items()
            if name not in self._where
        }

    def _files(self) -> list[Path]:
        path = self.path
        if not path.exists():
            raise WeightsError(
                f"no weights at {path}: give a local safetensors or torch file, or a "
                "directory that save_pretrained wrote (downloads are not made here)"
            )
        if path.is_file():
            if path.suffix == ".safetensors" or path.suffix in _TORCH_SUFFIXES:
                return [path]
            raise WeightsError(f"{path}: not a .safetensors, .bin, .pt or .pth file")
        for index in (_SAFETENSORS_INDEX, _TORCH_INDEX):
            if (path / index).is_file():
                try:
                    weight_map = json.loads((path / index).read_text())["weight_map"]
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    raise WeightsError(f"cannot read the index {path / index}: {exc}") from exc
                files = [path / name for name in dict.fromkeys(weight_map.values())]
                lost = [str(f) for f in files if not f.is_file()]
                if lost:
                    raise WeightsError(f"{path / index} names files that are not there: {lost}")
                return files
        for single in ("model.safetensors", "pytorch_model.bin"):
            if (path / single).is_file():
                return [path / single]
        if (path / ADAPTER_CONFIG).is_file():
            raise WeightsError(adapter_directory(path))
        found = sorted(path.glob("*.safetensors"))
        if found:
            return found
        raise WeightsError(
            f"{path} holds no model.safetensors, pytorch_model.bin or index of either"
        )

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> WeightFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def names(self) -> list[str]:
        """The tensors the files hold, and the fused experts tensors they make, and
        the model's names of those the files name otherwise."""
        return [*self._where, *self._stacked, *self._renamed]

    def derived(self, used: set[str]) -> set[str]:
        """The names that are not tensors of the files on their own: every fused or
        renamed one :meth:`names` lists, and the keys read for those in ``used``."""
        read = {self._renamed.get(name, name) for name in used}
        parts = {p for name in read & set(self._stacked) for p in self._stacked[name]}
        return set(self._stacked) | set(self._renamed) | parts | (read - used)

    def shape(self, name: str) -> tuple[int, ...]:
        name = self._renamed.get(name, name)
        parts = self._stacked.get(name)
        if parts is not None:
            return _stacked_shape([self.shape(p) for p in parts], parts)
        return self._where[name].shape(name)

    def whole(self, name: str) -> torch.Tensor:
        name = self._renamed.get(name, name)
        if name in self._stacked:
            return self.flat_range(name, 0, math.prod(self.shape(name))).view(self.shape(name))
        return self._where[name].whole(name)

    def flat_range(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened tensor ``name``, reading only
        the rows that hold them; a range within one row, only that row's part (and
        so on down the dimensions). A fused experts tensor reads the ranges of the
        per-expert tensors the range crosses."""
        name = self._renamed.get(name, name)
        if name in self._stacked:
            pieces, offset = [], 0
            for part in self._stacked[name]:
                n = math.prod(self.shape(part))
                lo, hi = max(start, offset), min(stop, offset + n)
                if lo < hi:
                    pieces.append(self.flat_range(part, lo - offset, hi - offset))
                offset += n
            return torch.cat(pieces) if pieces else torch.empty(0)
        shape = self.shape(name)
        if not shape:
            return self.whole(name).reshape(-1)[start:stop]
        index: list[slice] = []
        for dim in range(len(shape) - 1):
            row = math.prod(shape[dim + 1 :])
            first, last = start // row, (stop - 1) // row + 1
            index.append(slice(first, last))
            start, stop = start - first * row, stop - first * row
            if last - first > 1:  # the range spans rows here: read them whole
                return self._where[name].read(name, tuple(index)).reshape(-1)[start:stop]
        index.append(slice(start, stop))  # within one row of the last dimension
        return self._where[name].read(name, tuple(index)).reshape(-1)


def _stackable(shapes: list[tuple[int, ...]]) -> bool:
    """Whether per-expert matrices fuse: every expert's parts alike, 2-D."""
    return bool(shapes) and all(len(s) == 2 and s[1:] == shapes[0][1:] for s in shapes)


def _stacked_shape(shapes: list[tuple[int, ...]], parts: list[str]) -> tuple[int, ...]:
    """The fused tensor's shape: experts x (the rows of one expert's parts) x columns."""
    experts = len({p.rsplit(".", 3)[-3] for p in parts})
    per_expert = len(parts) // experts
    return (experts, sum(s[0] for s in shapes[:per_expert]), *shapes[0][1:])


def _match(wanted: list[list[str]], available: set[str]) -> tuple[str, str]:
    """The prefix to strip from the model's names and the one to add to find them
    in ``available`` (``("", "")`` when they agree): ``wanted`` lists each tensor's
    names (a tied parameter has several), one of which must be there."""

    def hits(strip: str, add: str) -> int:
        return sum(
            any(n.startswith(strip) and add + n[len(strip) :] in available for n in names)
            for names in wanted
        )

    heads = {n.split(".", 1)[0] + "." for names in wanted for n in names if "." in n}
    heads |= {k.split(".", 1)[0] + "." for k in available if "." in k}
    choices = [("", "")] + [(h, "") for h in sorted(heads)] + [("", h) for h in sorted(heads)]
    return max(choices, key=lambda c: hits(*c))


def load_weights(state: Any, module: nn.Module, path: str | os.PathLike) -> None:
    """Load the weights at ``path`` into a built shard state (``engine.load_weights``):
    master values of this rank's owned ranges, frozen parameters and persistent
    buffers whole ([Note: weights by range]). Converts dtypes on the way in. Every
    name and shape is checked before anything changes. ``state`` is a
    :class:`~worker.state.ShardState`, or a tensor-parallel rank's
    :class:`~worker.tp_checkpoint.FullView` of one (its shapes and ranges those of
    the full parameters)."""
    if state.global_steps or state.optimizer.inner.state:
        raise RuntimeError(
            f"load_weights sets the weights of a model that has not trained; this one "
            f"is at step {state.global_steps}: load_checkpoint resumes training"
        )
    inventory = state.inventory
    names_of: dict[str, list[str]] = {}
    for name, first in inventory.aliases.items():
        names_of.setdefault(first, []).append(name)
    buffers = persistent_buffers(module)
    with WeightFiles(path) as files:
        available = set(files.names())
        wanted = [names_of[first] for first in inventory.params] + [[b] for b in buffers]
        strip, add = _match(wanted, available)

        def key_for(names: list[str]) -> str | None:
            for n in names:
                if n.startswith(strip) and add + n[len(strip) :] in available:
                    return add + n[len(strip) :]
            return None

        keys: dict[str, str] = {}  # model name (a parameter's first, or a buffer's) -> file key
        missing = []
        for first, names in [*names_of.items(), *((b, [b]) for b in buffers)]:
            key = key_for(names)
            if key is None:
                missing.append(first)
            else:
                keys[first] = key
        # a tied parameter saved under several of its names is expected under each
        expected = {k for names in names_of.values() for n in names if (k := key_for([n]))}
        used = set(keys.values())
        unexpected = sorted(available - used - expected - files.derived(used))
        if missing or unexpected:
            raise WeightsError(
                f"the weights at {path} do not fit the model: "
                + "; ".join(
                    part
                    for part in (
                        f"missing {missing[:10]}" if missing else "",
                        f"unexpected {unexpected[:10]}" if unexpected else "",
                    )
                    if part
                )
            )
        shapes = {s.name: tuple(s.shape) for s in inventory.specs}
        shapes.update((name, tuple(b.shape)) for name, b in buffers.items())
        for first, key in keys.items():
            want, have = shapes[first], files.shape(key)
            if want != have:
                raise WeightsError(
                    f"{key!r} in {path} has shape {list(have)}, the model's {first!r} {list(want)}"
                )

        entries: dict[str, dict[str, Any]] = {}
        owned: list[Range] = state.owned()
        for rng in owned:
            values = files.flat_range(keys[rng.name], rng.start, rng.stop)
            entries[rng.key] = {"master": values, "state": {}}
        state.import_ranges(entries)
        trainable = set(inventory.trainable)
        with torch.no_grad():
            for first, p in inventory.params.items():
                if first not in trainable:
                    p.data = files.whole(keys[first]).to(dtype=p.dtype, device=p.device)
            for name, b in buffers.items():
                b.copy_(files.whole(keys[name]))
    logger.info("loaded %d tensors from %s (%d ranges on this rank)", len(keys), path, len(owned))


def save_weights(
    state: Any,
    module: nn.Module,
    out: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    full: FullExport | None = None,
    experts: ExpertShards | None = None,
) -> list[Path]:
    """Write the model's weights into the directory ``out`` as ``save_pretrained``
    does (``model.safetensors``, or shards and their index; a Hugging Face model's
    ``config.json`` beside them), so that ``from_pretrained`` loads it strictly; a
    collective (``engine.save_pretrained``).

    No rank holds the whole model: the buckets are gathered one at a time as the
    files are written, and rank 0, which writes, holds one output file and one
    bucket at most. fp32 masters, cast to ``dtype`` if given; every name of a tied
    parameter; frozen parameters and persistent buffers as this rank has them.

    ``full``: a tensor-parallel rank's (worker/tp_checkpoint.py): each local tensor
    is gathered over tp into its full one as it is written, and ``full.writer``
    says which rank of the mesh writes. ``experts``: an expert-parallel engine's
    (worker/moe/shards.py), whose experts are written whole under the model's
    names, a layer at a time."""
    directory = Path(out)
    writer = state.comm.rank == 0 if full is None else full.writer
    if writer:
        directory.mkdir(parents=True, exist_ok=True)

    def whole(name: str, t: torch.Tensor) -> torch.Tensor:
        return t if full is None else full.full(name, t)

    def numel(name: str, local_numel: int) -> int:
        return local_numel if full is None else full.numel(name, local_numel)

    def frozen(name: str, p: torch.Tensor) -> torch.Tensor:
        return cast(whole(name, p))

    def cast(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().cpu()
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    size = torch.empty((), dtype=dtype).element_size() if dtype is not None else None
    gathered: dict[int, torch.Tensor] = {}

    def value(bucket: Any, slot: Any) -> torch.Tensor:
        if bucket.spec.index not in gathered:
            gathered.clear()  # one bucket at a time
            gathered[bucket.spec.index] = state.gather_master(bucket)
        flat = gathered[bucket.spec.index]
        return cast(whole(slot.name, flat[slot.offset : slot.offset + slot.numel].view(slot.shape)))

    names_of: dict[str, list[str]] = {}
    for name, first in state.inventory.aliases.items():
        names_of.setdefault(first, []).append(name)
    plan: list[Planned] = []
    for bucket in state.buckets:
        for slot in bucket.spec.slots:
            nbytes = numel(slot.name, slot.numel) * (size or 4)
            make = functools.partial(value, bucket, slot)
            plan += [Planned(name, nbytes, make) for name in names_of[slot.name]]
    trainable = set(state.inventory.trainable)
    for first, p in state.inventory.params.items():
        if first not in trainable:
            nbytes = numel(first, p.numel()) * (size or p.element_size())
            make = functools.partial(frozen, first, p)
            plan += [Planned(name, nbytes, make) for name in names_of[first]]
    if experts is not None:
        plan += experts.export_plan(cast, size or 4)
    for name, b in persistent_buffers(module).items():
        nbytes = b.numel() * (size if size and b.is_floating_point() else b.element_size())
        plan.append(Planned(name, nbytes, functools.partial(cast, b)))
    metadata = {"format": "pt", "global_steps": str(state.global_steps)}
    files = write_safetensors_shards(
        plan, directory / "model.safetensors", metadata, max_shard_bytes, write=writer
    )
    config = getattr(module, "config", None)
    if writer and hasattr(config, "save_pretrained"):
        config.save_pretrained(directory)
    logger.info("wrote %d tensors to %s", len(plan), directory)
    return files
