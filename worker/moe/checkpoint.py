"""Checkpoints and weights of an expert-parallel engine, addressed by the whole model's
parameters.

[Note: expert-parallel checkpoints]
An expert-parallel engine keeps two shard states (worker/moe/shards.py [Note: two
shard states]); :class:`ExpertParallelView` presents them to worker/checkpoint.py
and worker/pretrained.py as one state over the FULL model: the dense state as it
is, and the experts' through a tensor-parallel :class:`~worker.tp_checkpoint.FullView`
whose slices put a fused module's rows where they sit in the full parameter
(dimension 0, this rank's place of ep) and leave an
:class:`~worker.moe.experts.Experts` child under its own name. Its inventory
lists every expert of every layer, held here or not, with the model's full
shapes, so the manifest rank 0 writes is the whole model's, exactly what plain
ZeRO would write: a checkpoint saved at ep=4 loads at ep=2, at another world
size, or without expert parallelism at any stage, and one saved without loads
at any ep (each rank reads only the files holding its ranges, its experts'
rows among them). Each expert element is written once: by the rank of its
expert-data-parallel group that owns it. A frozen expert parameter is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from coordinator.core.ranges import Range, RangeIndex
from worker.collectives import Collectives
from worker.entries import Entries, check_covered
from worker.inventory import Inventory
from worker.moe.experts import Experts
from worker.moe.shards import ExpertShards
from worker.state import ShardState
from worker.tp import TPSlice
from worker.tp_checkpoint import FullView

__all__ = ["ExpertParallelView"]


def _counter(name: str) -> property:
    """A step counter kept on both states (read from the dense one)."""

    def get(self: ExpertParallelView) -> int:
        return getattr(self.dense, name)

    def put(self: ExpertParallelView, value: int) -> None:
        setattr(self.dense, name, value)
        setattr(self.expert_state, name, value)

    return property(get, put)


class ExpertParallelView:
    """The dense state and the experts' as one state over the full model, for
    checkpoints and weights ([Note: expert-parallel checkpoints])."""

    global_steps = _counter("global_steps")
    micro_steps = _counter("micro_steps")
    skipped_steps = _counter("skipped_steps")
    micro_in_step = _counter("micro_in_step")

    def __init__(
        self, dense: ShardState | FullView, experts: ExpertShards, *, tp_rank: int = 0
    ) -> None:
        """``dense``: the engine's state, or on a tensor-parallel mesh its view by full
        parameter; ``tp_rank``: this rank's tp index (the experts, whole on every tp
        rank, are written by tp rank 0's)."""
        self.dense, self.expert_state = dense, experts.state
        self.writes_experts = tp_rank == 0
        self.comm: Collectives = dense.comm
        local = {s.name: s for s in experts.inventory.specs}
        specs, params = list(dense.inventory.specs), dict(dense.inventory.params)
        aliases = dict(dense.inventory.aliases)
        slices: dict[str, TPSlice] = {}
        for module in experts.modules:
            placed, prefix = module._zp_expert, experts.names[module] + "."
            fused = not isinstance(module, Experts)
            for rel, shape in placed.full_shapes.items():
                name = prefix + rel
                # an expert held elsewhere is described by one held here
                twin = name if fused else f"{prefix}{placed.first}.{rel.split('.', 1)[1]}"
                spec = local[twin]
                if not spec.requires_grad:
                    raise ValueError(f"frozen expert parameters are not checkpointed: {name!r}")
                specs.append(dataclasses.replace(spec, name=name, shape=shape, unit=0))
                params[name], aliases[name] = experts.inventory.params[twin], name
                if fused:
                    groups = placed.groups
                    slices[name] = TPSlice(shape, dim=0, rank=groups.place, size=groups.size)
        self.experts = FullView(experts.state, slices, self.comm, tp_rank=0)
        self.inventory = Inventory(tuple(specs), params, aliases, dense.inventory.unit_modules)
        self.bucket_of = {**dense.bucket_of, **experts.state.bucket_of}
        for name in ("module", "user_optimizer", "config", "stage", "scaler", "device"):
            setattr(self, name, getattr(dense, name))

    @property
    def master_device(self) -> Any:
        return self.dense.master_device

    @property
    def optimizer(self) -> Any:
        return self.dense.optimizer

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def written_ranges(self) -> list[Range]:
        experts = self.experts.written_ranges() if self.writes_experts else []
        return self.dense.written_ranges() + experts

    def owned(self) -> list[Range]:
        return self.dense.owned() + self.experts.owned()

    def export_ranges(self) -> Entries:
        experts = self.experts.export_ranges() if self.writes_experts else {}
        return {**self.dense.export_ranges(), **experts}

    def import_ranges(self, entries: Entries, index: RangeIndex | None = None) -> None:
        index = index or RangeIndex.of_keys(entries)
        check_covered(self.owned(), index)  # both, before either changes
        self.dense.import_ranges(entries, index)
        self.experts.import_ranges(entries, index)
