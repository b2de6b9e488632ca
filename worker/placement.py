"""Where an engine runs: one closed set of cases (:class:`Placement`), chosen by one
pure function (:func:`place`) of what the script asked for and the process's
situation ([Note: one way in] in worker/spec.py).

| placement | coordinator | process group | tp x pp | what runs |
|---|---|---|---|---|
| ``ALONE`` | none | none, no launcher | 1 | one process |
| ``GROUP`` | none | the script's, or the launcher's (formed from its environment) | 1 | a data-parallel engine over it |
| ``MESH`` | none, or the script's group given | as ``GROUP`` | > 1 | a mesh engine over it |
| ``ATTACHED`` | yes | the script's own | 1 | a member that reports; its group cannot re-form |
| ``ELASTIC`` | yes | formed by zeroplane | 1 | an elastic member (worker/elastic/session.py) |
| ``ELASTIC_MESH`` | yes | formed by zeroplane | > 1 | elastic by whole tp x pp groups (worker/elastic/rings.py) |
| ``MESH_AUTO`` | yes (``--mesh auto``) | the launcher's | chosen by the coordinator | a member of a fixed mesh (worker/attached.py) |

``--mesh auto`` without a coordinator is refused: nobody would choose the mesh.
"""  # noqa: E501

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from coordinator.core.meshplan import MESH_ENV
from worker.compat import backend_for
from worker.spec import EngineSpec

__all__ = ["Placement", "Situation", "form_launcher_group", "place"]

logger = logging.getLogger(__name__)


class Placement(enum.Enum):
    ALONE = "alone"
    GROUP = "group"
    MESH = "mesh"
    ATTACHED = "attached"
    ELASTIC = "elastic"
    ELASTIC_MESH = "elastic mesh"
    MESH_AUTO = "mesh auto"


@dataclass(frozen=True, kw_only=True)
class Situation:
    """The inputs :func:`place` decides on, and nothing else."""

    coordinator: bool  # an address was given or $ZEROPLANE_COORDINATOR is set
    group_given: bool  # initialize(..., group=...)
    group_formed: bool  # torch.distributed is initialized already
    launcher: bool  # WORLD_SIZE > 1 and MASTER_ADDR: a launcher's group to form
    model_parallel: bool  # tp * pp > 1 asked for
    mesh_auto: bool  # $ZEROPLANE_MESH=auto

    @classmethod
    def of(cls, spec: EngineSpec) -> Situation:
        """``spec`` and this process's environment and torch.distributed state."""
        return cls(
            coordinator=spec.coordinator is not None,
            group_given=spec.group is not None,
            group_formed=dist.is_available() and dist.is_initialized(),
            launcher=int(os.environ.get("WORLD_SIZE", "1")) > 1 and "MASTER_ADDR" in os.environ,
            model_parallel=spec.model_parallel,
            mesh_auto=spec.mesh_auto,
        )


def place(s: Situation) -> Placement:
    """The one placement for ``s`` (the table in this module's docstring)."""
    if s.coordinator and not s.group_given and (s.mesh_auto or s.model_parallel):
        return Placement.MESH_AUTO if s.mesh_auto else Placement.ELASTIC_MESH
    if s.mesh_auto:
        raise ValueError(
            f"${MESH_ENV}=auto leaves the mesh to a coordinator, and this worker has none "
            "(run it under zeroplane run, or set $ZEROPLANE_COORDINATOR)"
        )
    if s.model_parallel:
        return Placement.MESH
    if not s.coordinator:
        return Placement.GROUP if s.group_given or s.group_formed or s.launcher else Placement.ALONE
    return Placement.ATTACHED if s.group_given or s.group_formed else Placement.ELASTIC


def describe(placement: Placement, spec: EngineSpec) -> str:
    """The one line a worker logs at start: which placement ran, and with what."""
    p = spec.parallel
    layout = (
        f"tp={p.tensor_parallel} pp={p.pipeline_parallel}"
        if p is not None and spec.model_parallel
        else "data parallel"
    )
    if spec.mesh_auto:
        layout = "mesh chosen by the coordinator"
    where = f", coordinator {spec.coordinator}" if spec.coordinator else ""
    return (
        f"zeroplane engine: placement {placement.value} ({layout}, stage {spec.config.stage}, "
        f"{spec.device}{where})"
    )


def form_launcher_group(device: torch.device) -> None:
    """Under torchrun (or any launcher that sets ``WORLD_SIZE`` > 1 and
    ``MASTER_ADDR``) with no process group yet, form the default group from that
    environment, as ``deepspeed.initialize`` does: a script that forgot
    ``dist.init_process_group`` must not silently train ``WORLD_SIZE`` separate
    copies of the model."""
    if not dist.is_available() or dist.is_initialized():
        return
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "MASTER_ADDR" not in os.environ:
        return
    backend = backend_for(device)
    dist.init_process_group(backend)
    logger.info(
        "formed the process group from the launcher's environment (%s, rank %d of %d)",
        backend,
        dist.get_rank(),
        dist.get_world_size(),
    )
