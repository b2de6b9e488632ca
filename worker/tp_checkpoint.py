"""Checkpoints of a tensor-parallel job, addressed by FULL parameter.

[Note: tensor-parallel checkpoints]
A checkpoint holds entries keyed by (parameter name, element range of the
flattened parameter) (worker/checkpoint.py [Note: checkpoint format]). Under
tensor parallelism a rank's ZeRO state is over its local shards
(worker/tp.py), so :class:`FullView` presents a rank's :class:`ShardState`
to the checkpoint module as a state over the FULL parameters: its written
ranges are the runs of full elements its local ranges cover
(:meth:`worker.tp.TPSlice.full_runs`), entries are split at those runs, and
loading assembles each local range this rank owns from the full ranges in the
checkpoint. A replicated parameter is written by tp rank 0 only. Files are
one per rank of the whole job (``rank{global}.pt``), so the manifest is an
ordinary one: a checkpoint saved at tp=2 x dp=2 loads with plain ZeRO at
dp=4, and one saved by plain ZeRO loads at tp=2 x dp=1 (tests/test_mesh.py).
The view reads and writes the state only through ShardState's public methods.

Pretrained weights load through the same view (worker/pretrained.py
:func:`~worker.pretrained.load_weights` given a :class:`FullView`): a rank
reads from the files just the full runs that its owned local ranges cover,
so at tp x dp each rank reads about 1/(tp*dp) of every sharded tensor. An
export (``save_pretrained``) writes full tensors: :class:`FullExport`
gathers each local one over tp as the files are written, and one rank of
the whole mesh writes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from coordinator.core.ranges import Range, RangeIndex
from worker.collectives import Collectives
from worker.entries import Entries, MissingRange
from worker.inventory import Inventory
from worker.state import ShardState
from worker.tp import TPSlice, gather_full

__all__ = ["FullExport", "FullView"]


class FullView:
    """``state`` as worker/checkpoint.py sees it, addressed by full parameters
    ([Note: tensor-parallel checkpoints]); ``world``: the whole job's ranks."""

    def __init__(
        self, state: ShardState, slices: dict[str, TPSlice], world: Collectives, tp_rank: int
    ) -> None:
        self.state, self.slices, self.comm, self.tp_rank = state, slices, world, tp_rank
        inv = state.inventory
        specs = tuple(
            dataclasses.replace(s, shape=slices[s.name].full_shape) if s.name in slices else s
            for s in inv.specs
        )
        frozen = [s.name for s in specs if s.name in slices and not s.requires_grad]
        if frozen:
            raise ValueError(f"frozen tensor-parallel parameters are not checkpointed: {frozen}")
        self.inventory = Inventory(specs, inv.params, inv.aliases, inv.unit_modules)
        for name in ("module", "user_optimizer", "config", "stage", "scaler", "device"):
            setattr(self, name, getattr(state, name))
        self.bucket_of = state.bucket_of

    # counters the checkpoint module reads and sets
    global_steps = property(
        lambda self: self.state.global_steps,
        lambda self, v: setattr(self.state, "global_steps", v),
    )
    micro_steps = property(
        lambda self: self.state.micro_steps,
        lambda self, v: setattr(self.state, "micro_steps", v),
    )
    skipped_steps = property(
        lambda self: self.state.skipped_steps,
        lambda self, v: setattr(self.state, "skipped_steps", v),
    )
    micro_in_step = property(
        lambda self: self.state.micro_in_step,
        lambda self, v: setattr(self.state, "micro_in_step", v),
    )

    @property
    def master_device(self) -> torch.device:
        return self.state.master_device

    @property
    def optimizer(self) -> Any:
        return self.state.optimizer

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def _slice(self, name: str) -> TPSlice | None:
        return self.slices.get(name)

    def _runs(self, rng: Range) -> list[tuple[int, int, int]]:
        s = self._slice(rng.name)
        if s is None:
            return [(rng.start, rng.start, rng.numel)]
        return list(s.full_runs(rng.start, rng.stop))

    def _writes(self, rng: Range) -> bool:
        s = self._slice(rng.name)
        return self.tp_rank == 0 or (s is not None and s.dim is not None)

    def written_ranges(self) -> list[Range]:
        return [
            Range(r.name, fo, fo + n)
            for r in self.state.written_ranges()
            if self._writes(r)
            for _, fo, n in self._runs(r)
        ]

    def owned(self) -> list[Range]:
        return [Range(r.name, fo, fo + n) for r in self.state.owned() for _, fo, n in self._runs(r)]

    def export_ranges(self) -> Entries:
        local = self.state.export_ranges()
        out: Entries = {}
        for r in self.state.written_ranges():
            if not self._writes(r):
                continue
            entry = local[r.key]
            for lo, fo, n in self._runs(r):
                a, b = lo - r.start, lo - r.start + n
                out[Range(r.name, fo, fo + n).key] = {
                    "master": entry["master"][a:b].clone(),
                    "state": {
                        k: _per_element(v, r.numel)[a:b].clone()
                        if _per_element(v, r.numel) is not None
                        else v
                        for k, v in entry["state"].items()
                    },
                }
        return out

    def import_ranges(self, entries: Entries, index: RangeIndex | None = None) -> None:
        index = index or RangeIndex.of_keys(entries)
        local: Entries = {}
        for want in self.state.owned():
            values = torch.empty(want.numel, dtype=torch.float32, device=self.device)
            opt_state: dict[str, Any] = {}
            covered = 0
            for lo, fo, n in self._runs(want):
                for have, a, b, _ in index.overlapping(Range(want.name, fo, fo + n)):
                    entry = entries[have.key]
                    dst = slice(lo - want.start + a - fo, lo - want.start + b - fo)
                    src = slice(a - have.start, b - have.start)
                    values[dst] = entry["master"][src]
                    for k, v in entry["state"].items():
                        if _per_element(v, have.numel) is not None:
                            if k not in opt_state:
                                opt_state[k] = torch.zeros(want.numel, dtype=v.dtype)
                            opt_state[k][dst] = v[src]
                        else:
                            opt_state.setdefault(k, v.clone() if isinstance(v, torch.Tensor) else v)
                    covered += b - a
            if covered != want.numel:
                raise MissingRange(f"no state for elements of {want.key}")
            local[want.key] = {"master": values, "state": opt_state}
        self.state.import_ranges(local)


@dataclass(frozen=True, kw_only=True)
class FullExport:
    """What a tensor-parallel rank's export (:func:`worker.pretrained.save_weights`)
    needs beyond its shard state: full tensors from local ones.

    Attributes:
        slices: where each local parameter sits in its full one, by name.
        comm: the tp group; :meth:`full` is a collective over it.
        writer: whether this rank writes the files (one rank of the whole mesh).
    """

    slices: dict[str, TPSlice]
    comm: Collectives
    writer: bool

    def numel(self, name: str, local_numel: int) -> int:
        s = self.slices.get(name)
        return local_numel if s is None else s.full_numel

    def full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """``name``'s full tensor from this rank's ``local`` one (every tp rank calls)."""
        return gather_full({name: local}, self.slices, self.comm)[name]


def _per_element(v: Any, numel: int) -> torch.Tensor | None:
    if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == numel:
        return v
    return None
