"""The device mesh ``(pp, dp, tp)`` over a job's ranks: shape, coordinates, groups.

Torch-free: the coordinator plans and checks meshes with it, and the workers
(worker/mesh.py) build torch's ``DeviceMesh`` in the same rank order.

[Note: mesh rank order]
Ranks are laid out with tp innermost, then dp, then pp, as torchtitan and
Megatron do: ``rank = (pp_i * dp + dp_i) * tp + tp_i``. The ranks of one
tensor-parallel group are consecutive (on a GPU machine, one node's NVLink
domain), and a model-parallel group (the ``tp * pp`` ranks that together
hold one replica of the model) is the ranks with the same ``dp_i``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from coordinator.core.memory import (
    DTYPE_BYTES,
    ModelStateBytes,
    model_parallel_numel,
    model_state_bytes,
)
from coordinator.core.planner import PlanConfig, format_bytes

__all__ = [
    "CP_ENV",
    "CP_KIND_ENV",
    "EP_ENV",
    "MESH_ENV",
    "PP_ENV",
    "TP_ENV",
    "TP_PATTERNS",
    "GroupArrangement",
    "MeshCandidate",
    "MeshChangeRefused",
    "MeshChoice",
    "MeshCoords",
    "MeshShape",
    "arrange_groups",
    "check_resize",
    "choose_mesh",
    "tp_sharded_numel",
    "words_moved",
]


# What launchers set in every worker (`zeroplane run --tp/--pp`, the job spec);
# worker/parallel.py ParallelConfig.from_env reads them, and each rank takes its
# coordinates from its RANK by [Note: mesh rank order].
TP_ENV = "ZEROPLANE_TP"
PP_ENV = "ZEROPLANE_PP"
# the experts' degree a launcher hands its workers (zeroplane run --ep): not a mesh
# dimension the coordinator forms; ranks split it within data parallelism
EP_ENV = "ZEROPLANE_EP"
# the context-parallel degree and kind (zeroplane run --cp/--cp-kind): blocks of
# ranks within data parallelism that split each sequence (worker/context/)
CP_ENV = "ZEROPLANE_CP"
CP_KIND_ENV = "ZEROPLANE_CP_KIND"
# "auto" (`zeroplane run --mesh auto`): the coordinator chooses tp and pp
# (coordinator/control/membership.py ``_plan_mesh``) and the workers build its mesh.
MESH_ENV = "ZEROPLANE_MESH"


class MeshChangeRefused(ValueError):
    """A membership change that would break a tensor/pipeline-parallel group."""


@dataclass(frozen=True, slots=True)
class MeshCoords:
    """One rank's position in the mesh."""

    pp: int
    dp: int
    tp: int

    def labels(self) -> dict[str, str]:
        """Prometheus labels (low cardinality: bounded by the mesh's shape)."""
        return {"pp": str(self.pp), "dp": str(self.dp), "tp": str(self.tp)}


@dataclass(frozen=True, slots=True)
class MeshShape:
    """``pp * dp * tp`` ranks; tp innermost ([Note: mesh rank order])."""

    pp: int = 1
    dp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"mesh {name} must be an integer >= 1, got {value!r}")

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, pp: int = 1) -> MeshShape:
        """The mesh of ``world_size`` ranks with the given tp and pp; dp is the rest."""
        for name, value in (("world_size", world_size), ("tp", tp), ("pp", pp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if world_size % (tp * pp):
            raise ValueError(
                f"world size {world_size} is not a multiple of tp*pp = {tp}*{pp} = {tp * pp}: "
                "every data-parallel replica needs a whole tensor/pipeline-parallel group"
            )
        return cls(pp=pp, dp=world_size // (tp * pp), tp=tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def group_size(self) -> int:
        """Ranks per model-parallel group (one replica of the model)."""
        return self.tp * self.pp

    def coords(self, rank: int) -> MeshCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.world_size} ranks")
        rest, tp = divmod(rank, self.tp)
        pp, dp = divmod(rest, self.dp)
        return MeshCoords(pp=pp, dp=dp, tp=tp)

    def rank(self, coords: MeshCoords) -> int:
        return (coords.pp * self.dp + coords.dp) * self.tp + coords.tp

    def dp_groups(self) -> list[list[int]]:
        """The ranks of each data-parallel group (same pp and tp index)."""
        return [
            [self.rank(MeshCoords(pp, d, tp)) for d in range(self.dp)]
            for pp in range(self.pp)
            for tp in range(self.tp)
        ]

    def model_groups(self) -> list[list[int]]:
        """The ranks of each model-parallel group (same dp index)."""
        return [
            [self.rank(MeshCoords(pp, d, tp)) for pp in range(self.pp) for tp in range(self.tp)]
            for d in range(self.dp)
        ]


def check_resize(shape: MeshShape, new_world_size: int) -> MeshShape:
    """The mesh after a membership change to ``new_world_size`` ranks, or
    :class:`MeshChangeRefused` when the change would break a model-parallel group
    (dp can only change by whole groups of ``tp * pp`` ranks)."""
    if shape.group_size == 1:
        return MeshShape(pp=1, dp=new_world_size, tp=1)
    if new_world_size < shape.group_size or new_world_size % shape.group_size:
        raise MeshChangeRefused(
            f"a job with tp={shape.tp}, pp={shape.pp} changes size only by whole "
            f"model-parallel groups of {shape.group_size} ranks; {new_world_size} ranks "
            "would break one"
        )
    return MeshShape(pp=shape.pp, dp=new_world_size // shape.group_size, tp=shape.tp)


@dataclass(frozen=True, slots=True)
class GroupArrangement:
    """The next generation of an elastic mesh job: its workers in rank order, the
    newcomers placed, and the survivors left without a place (standbys)."""

    order: tuple[str, ...]
    admitted: tuple[str, ...]
    standby: tuple[str, ...]

    @property
    def world_size(self) -> int:
        return len(self.order)


def arrange_groups(
    *,
    tp: int,
    pp: int,
    survivors: Mapping[str, MeshCoords],
    joiners: Sequence[str],
    max_world: int,
    holders: Collection[str] | None = None,
    leaving: Collection[str] = (),
) -> GroupArrangement:
    """Whole model-parallel groups for the next generation of an elastic mesh job.

    [Note: arranging whole groups]
    A group is the ``tp * pp`` ranks of one dp index, one at each (pp, tp)
    position. Every survivor keeps its position: its shards are that position's,
    and each position's ring of dp ranks re-shards among itself
    (worker/elastic/rings.py [Note: elastic by whole groups]). So the
    survivors of each position are queued, those of the most complete old groups
    first (they stay together) and then in their old dp order, and group ``d``
    takes the ``d``-th of every queue; a queue too short is made up with newcomers
    (``joiners``, in order). The number of groups is the largest whose gaps the
    newcomers fill, up to ``max_world`` ranks. Survivors of broken groups whose
    positions complement each other form a group together, a scale-up keeps
    every member's coordinates, and a survivor beyond the groups formed stands
    by. ``survivors``: each surviving member's coordinates in the previous
    generation.

    ``holders``: the survivors known to hold their position's state (None: all of
    them); ``leaving``: survivors asked to leave. At each position, those staying
    go first, then holders: a member admitted to a generation that was replaced
    before it formed holds nothing, and were an old member at its position the one
    to stand by, the next generation would find that position held by nobody and
    start again."""
    size = tp * pp
    slots = [(p, t) for p in range(pp) for t in range(tp)]
    queues: dict[tuple[int, int], list[str]] = {slot: [] for slot in slots}
    whole = {d: 0 for d in (c.dp for c in survivors.values())}
    for c in survivors.values():
        whole[c.dp] += 1

    def first(kv: tuple[str, MeshCoords]) -> tuple:
        wid, c = kv
        holds = holders is None or wid in holders
        # staying holders, then the most complete old groups (they stay together),
        # then by old dp index
        return (wid in leaving, not holds, -whole[c.dp], c.dp)

    for wid, c in sorted(survivors.items(), key=first):
        queues[(c.pp, c.tp)].append(wid)
    groups = 0
    while (groups + 1) * size <= max_world and sum(
        max(0, groups + 1 - len(q)) for q in queues.values()
    ) <= len(joiners):
        groups += 1
    pool = iter(joiners)  # group by group: a group's newcomers are neighbours
    filled = [
        {slot: q[d] if d < len(q) else next(pool) for slot, q in queues.items()}
        for d in range(groups)
    ]
    order = tuple(filled[d][(p, t)] for p in range(pp) for d in range(groups) for t in range(tp))
    placed = set(order)
    return GroupArrangement(
        order=order,
        admitted=tuple(w for w in joiners if w in placed),
        standby=tuple(w for w in survivors if w not in placed),
    )


# --------------------------------------------------------------------------- planning

# Module-name patterns (``*`` per name atom) whose parameters worker/tp.py's plans
# shard, column-wise or row-wise, by model family: worker.models GPT's, and Hugging
# Face Llama-style ones (whose embedding and head are sharded too unless tied).
# A row-wise layer's bias is replicated: it is added once, after the all-reduce.
TP_PATTERNS: dict[str, tuple[tuple[str, str], ...]] = {
    "gpt": (
        ("blocks.*.attn", "col"), ("blocks.*.proj", "row"),
        ("blocks.*.fc", "col"), ("blocks.*.fc_out", "row"),
    ),
    "llama": (
        ("model.layers.*.self_attn.q_proj", "col"), ("model.layers.*.self_attn.k_proj", "col"),
        ("model.layers.*.self_attn.v_proj", "col"), ("model.layers.*.self_attn.o_proj", "row"),
        ("model.layers.*.mlp.gate_proj", "col"), ("model.layers.*.mlp.up_proj", "col"),
        ("model.layers.*.mlp.down_proj", "row"), ("model.embed_tokens", "row"),
        ("lm_head", "col"),
    ),
}  # fmt: skip


def _glob(pattern: str) -> re.Pattern[str]:
    atoms = (re.escape(a).replace(r"\*", "[^.]*") for a in pattern.split("."))
    return re.compile(r"\.".join(atoms))


def tp_sharded_numel(
    params: Iterable[tuple[str, int]], patterns: Iterable[tuple[str, str]] | None = None
) -> int:
    """Elements of the unique ``(parameter name, numel)`` pairs that a tensor-parallel
    plan of ``(module pattern, "col" | "row")`` shards; by default the plan in
    :data:`TP_PATTERNS` of the family the names belong to (a tied embedding and head
    of a Llama-style model stay replicated, as worker/tp.py's plan leaves them)."""
    pairs = list(params)
    names = {n for n, _ in pairs}
    if patterns is None:
        llama = any(n.startswith("model.layers.") for n in names)
        patterns = TP_PATTERNS["llama" if llama else "gpt"]
        if llama and "lm_head.weight" not in names:
            patterns = tuple(p for p in patterns if p[0] not in ("model.embed_tokens", "lm_head"))
    compiled = [(_glob(p), kind) for p, kind in patterns]
    total = 0
    for name, numel in pairs:
        module, _, leaf = name.rpartition(".")
        for pattern, kind in compiled:
            if pattern.fullmatch(module) and not (kind == "row" and leaf == "bias"):
                total += numel
                break
    return total


def words_moved(
    numel_rank: float,
    *,
    stage: int,
    shape: MeshShape,
    tokens_hidden: float = 0.0,
    layers: int = 0,
    microbatches: int = 1,
) -> dict[str, float]:
    """Elements one rank sends per optimizer step, by dimension (ring collectives).

    * dp (ZeRO over ``numel_rank`` elements): ``2*Ψ*(dp-1)/dp`` at stages 0-2
      (reduce-scatter + all-gather, or an all-reduce), ``3*Ψ*(dp-1)/dp`` at stage 3
      (parameters gathered for forward and again for backward);
    * tp: four all-reduces of the activations per layer and micro-batch (two in
      forward after the row-wise layers, two in backward before the column-wise
      ones), each ``2*(t-1)/t`` of ``b*s*h`` (``tokens_hidden``), over the
      ``layers/pp`` layers this rank runs;
    * pp: each micro-batch's activation sent forward and its gradient back,
      ``b*s*h`` each, at every stage boundary (a middle stage sends both).
    """
    dp, tp, pp = shape.dp, shape.tp, shape.pp
    zero = (3 if stage == 3 else 2) * numel_rank * (dp - 1) / dp
    layers_here = math.ceil(layers / pp) if layers else 0
    tensor = 4 * layers_here * microbatches * tokens_hidden * 2 * (tp - 1) / tp
    pipe = 2 * microbatches * tokens_hidden if pp > 1 else 0.0
    return {"dp": zero, "tp": tensor, "pp": pipe, "total": zero + tensor + pipe}


@dataclass(frozen=True)
class MeshCandidate:
    """One mesh and ZeRO stage, with the memory one rank holds there."""

    shape: MeshShape
    stage: int
    numel_rank: float
    model_states: ModelStateBytes
    activation_bytes: float
    # every layer's activations checkpointed (ZeRO alone only: worker/mesh.py
    # refuses activation checkpointing with tp or pp)
    checkpointing: bool = False

    @property
    def total(self) -> float:
        return self.model_states.total + self.activation_bytes

    def describe(self) -> str:
        s = self.shape
        ac = " with activation checkpointing" if self.checkpointing else ""
        return f"pp={s.pp} x dp={s.dp} x tp={s.tp}, stage {self.stage}{ac}"


@dataclass(frozen=True)
class MeshChoice:
    world_size: int
    chosen: MeshCandidate
    fits: bool
    reason: str
    candidates: tuple[MeshCandidate, ...]


def mesh_candidates(
    numel: int,
    *,
    sharded_numel: int,
    world_size: int,
    config: PlanConfig | None = None,
    microbatches: int = 4,
    schedule: str = "1f1b",
    max_tp: int = 8,
    heads: int | None = None,
    layers: int | None = None,
    tp: int | None = None,
    pp: int | None = None,
) -> list[MeshCandidate]:
    """Every mesh of ``world_size`` ranks and ZeRO stage that worker/mesh.py runs:
    tp a power of two up to ``max_tp`` dividing the heads, or pp up to the layer
    count, or both, ZeRO over the rest; stages 0-3, 0-2 with a pipeline. ``tp``,
    ``pp``: only meshes of that degree (one the job fixed)."""
    config = config or PlanConfig()
    out = []
    tps = [t for t in (1, 2, 4, 8, 16) if t <= max_tp and world_size % t == 0]
    tps = [t for t in tps if heads is None or heads % t == 0]
    pps = [p for p in range(1, world_size + 1) if world_size % p == 0]
    pps = [p for p in pps if layers is None or p <= layers]
    meshes = [(t, p) for p in pps for t in tps if world_size % (t * p) == 0]
    meshes = [(t, p) for t, p in meshes if tp in (None, t) and pp in (None, p)]
    for tp, pp in meshes:
        shape = MeshShape.for_world(world_size, tp=tp, pp=pp)
        numel_rank = model_parallel_numel(numel, sharded_numel=sharded_numel, tp=tp, pp=pp)
        act = float(config.activation_bytes)
        if config.activations is not None:
            if pp > 1:
                act = config.activations.pipeline_bytes(
                    config.precision, tp=tp, pp=pp, microbatches=microbatches, schedule=schedule
                )
            else:
                act = config.activations.layers * config.activations.mesh_layer_bytes(
                    config.precision, tp
                )
        for stage in (0, 1, 2) if pp > 1 else (0, 1, 2, 3):
            states = model_state_bytes(
                math.ceil(numel_rank),
                stage=stage,
                world_size=shape.dp,
                dtype=config.precision,
                optimizer_states=config.optimizer_states,
            )
            out.append(MeshCandidate(shape, stage, numel_rank, states, act))
            if tp * pp == 1 and config.activations is not None:
                saved = config.activations.bytes(config.precision, checkpointing=True)
                out.append(MeshCandidate(shape, stage, numel_rank, states, saved, True))
    return out


def choose_mesh(
    numel: int,
    *,
    sharded_numel: int,
    world_size: int,
    device_memory_bytes: int,
    config: PlanConfig | None = None,
    microbatches: int = 4,
    schedule: str = "1f1b",
    max_tp: int = 8,
    heads: int | None = None,
    layers: int | None = None,
    tp: int | None = None,
    pp: int | None = None,
) -> MeshChoice:
    """The mesh and stage to run: the first that fits the device memory less headroom
    of: ZeRO alone, then the smallest model-parallel group (tp*pp), each at its
    lowest stage; and only if none of those fits, ZeRO alone with every layer's
    activations checkpointed (worker/mesh.py refuses checkpointing with tp or pp).
    ZeRO over dp moves gradients and parameters once per step; tensor parallelism
    moves activations every layer and a pipeline leaves bubbles, so they come in
    only when ZeRO alone does not fit (as torchtitan composes FSDP first, TP and PP
    for scale); checkpointing recomputes every forward, about a third more compute
    every step, so it comes last."""
    config = config or PlanConfig()
    if config.precision not in DTYPE_BYTES:
        raise ValueError(f"precision must be one of {sorted(DTYPE_BYTES)}")
    candidates = mesh_candidates(
        numel,
        sharded_numel=sharded_numel,
        world_size=world_size,
        config=config,
        microbatches=microbatches,
        schedule=schedule,
        max_tp=max_tp,
        heads=heads,
        layers=layers,
        tp=tp,
        pp=pp,
    )
    if not candidates:
        raise ValueError(
            f"no mesh of {world_size} ranks has tp={tp} and pp={pp}"
            if tp or pp
            else f"no mesh of {world_size} ranks"
        )
    usable = device_memory_bytes * (1 - config.headroom)
    order = sorted(
        candidates, key=lambda c: (c.checkpointing, c.shape.group_size, c.stage, c.shape.pp)
    )
    fitting = [c for c in order if device_memory_bytes > 0 and c.total <= usable]
    if fitting:
        best = fitting[0]
        reason = (
            f"{best.describe()}: {format_bytes(best.total)} per rank "
            f"of {format_bytes(usable)} usable"
        )
        alone = [c for c in candidates if c.shape.group_size == 1 and not c.checkpointing]
        if best.shape.group_size > 1 and alone:
            dp_only = min(alone, key=lambda c: c.total)
            reason += (
                f"; ZeRO alone needs at least {format_bytes(dp_only.total)} ({dp_only.describe()})"
            )
            ac = [c for c in fitting if c.checkpointing]
            if ac:
                reason += (
                    f", or fits with activation checkpointing ({ac[0].describe()}: "
                    f"{format_bytes(ac[0].total)}, recomputing every forward in backward)"
                )
        return MeshChoice(world_size, best, True, reason, tuple(candidates))
    best = min(candidates, key=lambda c: c.total)
    why = "device memory unknown" if device_memory_bytes == 0 else "nothing fits"
    reason = f"{why}: {best.describe()} needs the least, {format_bytes(best.total)} per rank"
    return MeshChoice(world_size, best, False, reason, tuple(candidates))
