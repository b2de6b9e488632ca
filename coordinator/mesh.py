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

from dataclasses import dataclass

__all__ = ["MeshChangeRefused", "MeshCoords", "MeshShape", "check_resize"]


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
