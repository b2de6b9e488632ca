"""A proposed generation: who is in it, where it meets, the stage and mesh it runs,
and the generation built from it (coordinator/control/membership.py [Note: atomic
formation]). Nothing here changes the membership.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from coordinator.control.roster import WorkerEntry
from coordinator.core.layout import ParamSpec, layout_steps
from coordinator.core.meshplan import MeshShape, choose_mesh, tp_sharded_numel
from coordinator.core.messages import Generation, Member, WorkerInfo
from coordinator.core.planner import PlanConfig, StageChoice, choose_stage
from coordinator.core.ports import free_port
from coordinator.core.reshard import LazyMoves, ReshardSchedule, check_reshardable
from coordinator.core.steps import Steps, finish

__all__ = [
    "Proposal",
    "build_generation",
    "build_steps",
    "plan_generation",
    "rendezvous_endpoint",
]

# its lines are the membership's (a launcher shows them as the job's events)
logger = logging.getLogger("coordinator.control.membership")


@dataclass(frozen=True, kw_only=True)
class Proposal:
    """Who is in the next generation, decided on the server's loop (see [Note: atomic
    formation]); everything ``build_generation`` needs, so it can run anywhere."""

    id: int
    previous: Generation | None
    # In rank order, with the info each registered with.
    workers: tuple[WorkerEntry, ...]
    infos: tuple[WorkerInfo, ...]
    admitted: tuple[str, ...]
    lost: frozenset[str]
    left: frozenset[str]
    choice: StageChoice
    rendezvous_endpoint: str
    inventory: tuple[ParamSpec, ...]
    digest: str
    bucket_numel: int
    align: int
    created_unix_s: float
    epoch: str
    mesh: MeshShape | None = None
    mesh_reason: str = ""
    # survivors of the previous generation left out (an elastic mesh job's broken group)
    standby: tuple[str, ...] = ()


def build_generation(p: Proposal) -> Generation:
    """The generation ``p`` proposes: its layout, and the reshard schedule from the previous
    one. Pure and linear in the inventory (see [Note: atomic formation])."""
    return finish(build_steps(p))


def build_steps(p: Proposal) -> Steps[Generation]:
    """``build_generation`` in steps (coordinator/core/steps.py [Note: steps])."""
    layout = yield from layout_steps(
        p.inventory,
        len(p.infos),
        bucket_numel=p.bucket_numel,
        align=p.align,
        by_unit=p.choice.stage == 3,
    )
    previous = p.previous
    reshard = None
    if previous is not None:
        # the moves are built when asked for, whole or per worker
        # (coordinator/core/reshard.py [Note: incremental schedule])
        check_reshardable(previous.layout, layout)
        yield
        reshard = ReshardSchedule(
            from_generation_id=previous.id,
            from_world_size=previous.world_size,
            from_stage=previous.stage,
            moves=LazyMoves(previous.layout, layout),
            lost_ranks=tuple(
                sorted(
                    m.rank
                    for m in previous.members
                    if m.worker_id in p.lost and m.worker_id not in p.left
                )
            ),
            left_ranks=tuple(sorted(m.rank for m in previous.members if m.worker_id in p.left)),
        )
    # a lost member that registered again is a joiner: its state is gone
    survivors = () if previous is None else previous.members
    previous_rank = {m.worker_id: m.rank for m in survivors if m.worker_id not in p.lost}
    members = tuple(
        Member(
            worker_id=info.worker_id,
            rank=rank,
            host=info.host,
            previous_rank=previous_rank.get(info.worker_id),
            device_memory_bytes=info.device_memory_bytes,
        )
        for rank, info in enumerate(p.infos)
    )
    return Generation(
        id=p.id,
        members=members,
        rendezvous_endpoint=p.rendezvous_endpoint,
        stage=p.choice.stage,
        stage_reason=p.choice.reason,
        layout=layout,
        bucket_numel=p.bucket_numel,
        align=p.align,
        reshard=reshard,
        inventory_digest=p.digest,
        created_unix_s=p.created_unix_s,
        epoch=p.epoch,
        mesh=p.mesh,
        mesh_reason=p.mesh_reason,
    )


def plan_generation(
    plan: PlanConfig,
    trainable_numel: int,
    inventory: Sequence[ParamSpec],
    infos: Sequence[WorkerInfo],
) -> tuple[StageChoice, MeshShape | None, str]:
    """The stage a generation of ``infos`` runs, and its mesh and why (None, "": data
    parallel only)."""
    memories = [i.device_memory_bytes for i in infos if i.device_memory_bytes > 0]
    if infos[0].experts is not None:  # planner.py [Note: experts in the plan]
        plan = dataclasses.replace(plan, experts=infos[0].experts)
    job_plan, asked = plan, _asked_stage(plan, infos, memory_known=bool(memories))
    if asked is not None:
        plan = dataclasses.replace(plan, stage=asked)
    # The generation's stage must be one the workers can run as they are
    # configured; offload is their ZeroConfig's, so it is planned without and,
    # where only offload fits, proposed in the reason (planner.py [Note:
    # planning offload]).
    choice = choose_stage(
        trainable_numel,
        world_size=len(infos),
        device_memory_bytes=min(memories, default=0),
        config=dataclasses.replace(plan, offload=False),
    )
    if not choice.fits and memories and plan.offload and plan.stage is None:
        advice = choose_stage(
            trainable_numel,
            world_size=len(infos),
            device_memory_bytes=min(memories),
            config=plan,
        )
        if advice.offload != "none":
            proposal = advice.reason.split("; ", 1)[-1]
            choice = dataclasses.replace(choice, reason=f"{choice.reason}; {proposal}")
    if asked is not None:
        why = "asked for by the workers"
        if not job_plan.stage_from_workers:
            why += " (device memory unknown: nothing to choose another by)"
        choice = dataclasses.replace(
            choice, reason=choice.reason.replace("set by configuration", why)
        )
    mesh, mesh_reason = None, ""
    if infos[0].mesh is not None:
        mesh, mesh_reason, choice = _plan_mesh(
            job_plan, trainable_numel, inventory, infos[0].mesh, len(infos), memories, choice, asked
        )
    return choice, mesh, mesh_reason


def _plan_mesh(
    plan: PlanConfig,
    trainable_numel: int,
    inventory: Sequence[ParamSpec],
    asked: tuple[int, int],
    world: int,
    memories: list[int],
    choice: StageChoice,
    stage_asked: int | None,
) -> tuple[MeshShape, str, StageChoice]:
    """The mesh of a generation of ``world`` ranks, why, and the stage it runs.

    The degrees the workers ask for stand; one they leave to the coordinator (0:
    ``--mesh auto``) is :func:`~coordinator.core.meshplan.choose_mesh`'s choice
    from the inventory and the smallest device memory, and so is the stage unless
    one was configured or asked for. With the device memory unknown nothing is
    chosen: a degree left open is 1, and a pipeline's stage at most 2 (what
    worker/mesh.py runs with pp > 1)."""
    tp, pp = asked
    stage_free = plan.stage is None and stage_asked is None
    if not memories:
        shape = MeshShape.for_world(world, tp=tp or 1, pp=pp or 1)
        reason = (
            f"tp={shape.tp}, pp={shape.pp} as asked"
            if tp and pp
            else f"device memory unknown: tp={shape.tp}, pp={shape.pp}, no model "
            "parallelism that was not asked for"
        )
        if stage_free and shape.pp > 1 and choice.stage > 2:
            choice = dataclasses.replace(
                choice, stage=2, reason="stage 2, the highest a pipeline runs"
            )
        return shape, reason, choice
    picked = choose_mesh(
        trainable_numel,
        sharded_numel=tp_sharded_numel((p.name, p.numel) for p in inventory),
        world_size=world,
        device_memory_bytes=min(memories),
        config=dataclasses.replace(plan, offload=False, stage=None),
        tp=tp or None,
        pp=pp or None,
        # tp must divide the heads, pp at most the layers, where the plan knows them
        heads=None if plan.activations is None else plan.activations.heads,
        layers=None if plan.activations is None else plan.activations.layers,
    )
    best = picked.chosen
    if stage_free:
        choice = dataclasses.replace(
            choice, stage=best.stage, reason=f"stage {best.stage} on the mesh", fits=picked.fits
        )
    who = "as asked" if tp and pp else "chosen by the coordinator"
    return best.shape, f"{who}: {picked.reason}", choice


def _asked_stage(
    plan: PlanConfig, infos: Sequence[WorkerInfo], *, memory_known: bool
) -> int | None:
    """The stage the workers' ZeroConfig asks for, when the coordinator has none: where
    it takes the workers' stage (``zeroplane run`` without ``--stage``), or where it
    would choose (``--stage auto``) but knows no device memory to choose by (on CPUs:
    its choice would be stage 0 for want of a reason, over the script's own)."""
    if plan.stage is not None or not (plan.stage_from_workers or not memory_known):
        return None
    asked = sorted({i.stage for i in infos if i.stage is not None})
    if len(asked) > 1:
        logger.warning(
            "the workers ask for different stages (%s): stage %d, the highest, applies",
            ", ".join(map(str, asked)),
            asked[-1],
        )
    return asked[-1] if asked else None


def rendezvous_endpoint(
    rank0: WorkerEntry, previous: Generation | None, recent: Iterable[str]
) -> str:
    """Where the generation after ``previous`` meets: a port rank 0 reported free."""
    # A fresh port per generation: an old store may still be up while ranks move
    # over, and a broken generation's for as long as its group is held after an
    # abort (worker/compat.py abort_default_group): not one of the last few.
    used = set(recent)
    if previous is not None:
        used.add(previous.rendezvous_endpoint)
    for port in rank0.free_ports:
        endpoint = _endpoint(rank0.info.host, port)
        if endpoint not in used:
            return endpoint
    # Correct only when rank 0 runs beside the coordinator (local runs).
    while True:
        endpoint = _endpoint(rank0.info.host, free_port())
        if endpoint not in used:
            logger.warning(
                "rank 0 (%s) reported no free port; using %s, free on the coordinator's host",
                rank0.info.worker_id,
                endpoint,
            )
            return endpoint


def _endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
