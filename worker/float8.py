"""Parameter all-gathers in float8 for torchao's ``Float8Linear`` weights
(``ZeroConfig(stage3_gather_compression="float8")``).

[Note: float8 parameter gathers]
torchao's float8 training (``convert_to_float8_training``) casts a
``Float8Linear``'s weight to float8 e4m3 in its forward, with one dynamic scale
for the whole tensor: ``448 / amax(|w|)``. A gather of that weight in the
compute dtype moves 4 (fp32) or 2 (bf16) bytes an element only for the module
to round each to one. As FSDP2 with torchao's ``enable_fsdp_float8_all_gather``,
each rank instead casts its own shard of such a weight to e4m3 with the whole
tensor's scale (the shards' amaxes agreed by one all-reduce of a vector of
maxima per bucket) and sends one byte an element; the other parameters of the
bucket travel in the compute dtype. A receiver writes ``q / scale`` into the
compute weight, which the module casts again: the amax of the received
values is the scale's own up to float rounding (``max |q| = 448``), so the
module's cast gives back ``q`` exactly, and its matmul differs from one
process's only by that rounding of the scale (about 1e-7 relative). This rank's
own slice keeps its exact values and the fp32 master weights are untouched, as
for the other gather codecs (worker/compression.py [Note: quantized parameter
gathers]). Only weights cast with torchao's default recipe (dynamic, one scale
per tensor, e4m3) are gathered so; any other parameter or recipe travels as
it is. A bucket's payload is laid out per rank (each rank's shard covers its
own mix of weights and other parameters), so every rank's is as long as the
longest one's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from coordinator.core.layout import Bucket, Slot
from worker.collectives import Collectives
from worker.compression import Codec, align4

__all__ = ["BucketFloat8", "Float8Gather", "float8_gather", "float8_weights"]

E4M3 = torch.float8_e4m3fn
_MAX = torch.finfo(E4M3).max
_EPS = 1e-12  # torchao's floor under an amax (float8_utils.EPS)


def float8_weights(model: nn.Module) -> frozenset[str]:
    """The names of ``model``'s parameters that are torchao ``Float8Linear`` weights cast
    with one dynamic scale per tensor to e4m3 (its default recipe)."""
    names = []
    for name, module in model.named_modules():
        if type(module).__name__ != "Float8Linear" or not _tensorwise_e4m3(module):
            continue
        names.append(f"{name}.weight" if name else "weight")
    return frozenset(names)


def _tensorwise_e4m3(module: nn.Module) -> bool:
    cast = getattr(getattr(module, "config", None), "cast_config_weight", None)
    if cast is None:
        return False
    dynamic = str(getattr(cast, "scaling_type", "")).lower().endswith("dynamic")
    whole = str(getattr(cast, "scaling_granularity", "")).lower().endswith("tensorwise")
    e4m3 = getattr(cast, "target_dtype", None) in (None, E4M3)
    power_of_2 = getattr(module.config, "round_scales_to_power_of_2", False)
    return dynamic and whole and e4m3 and not power_of_2


@dataclass(frozen=True)
class Float8Gather(Codec):
    """The gather codec of ``stage3_gather_compression="float8"``: bound to each bucket
    (:meth:`bind`) as a :class:`BucketFloat8`, or None for a bucket holding none of
    ``weights`` (it gathers as it is)."""

    weights: frozenset[str] = frozenset()
    # by the spec's id, with the spec itself (an id is reused once its object is gone)
    _bound: dict[int, tuple[Bucket, BucketFloat8 | None]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def bind(self, spec: Bucket, dtype: torch.dtype) -> Codec | None:
        held = self._bound.get(id(spec))
        if held is None or held[0] is not spec:
            slots = [s for s in spec.slots if s.name in self.weights]
            held = self._bound[id(spec)] = (
                spec,
                BucketFloat8(spec, slots, dtype) if slots else None,
            )
        return held[1]


class BucketFloat8(Codec):
    """One bucket's float8 gather ([Note: float8 parameter gathers]): per rank, the
    runs of its shard that are float8 weights (one byte an element) or other
    parameters (the compute dtype's bytes). Its scales change at every gather, so
    unlike the stateless codecs it is not frozen."""

    __setattr__ = object.__setattr__

    def __init__(self, spec: Bucket, slots: list[Slot], dtype: torch.dtype) -> None:
        self.name = "float8"
        self.dtype, self.size = dtype, torch.empty((), dtype=dtype).element_size()
        self.weight_index = {s.name: i for i, s in enumerate(slots)}
        shard = spec.shard_numel
        # per rank, the runs covering its shard: (start, stop, weight index or -1,
        # byte offset in the payload)
        self.runs: list[list[tuple[int, int, int, int]]] = []
        for rank in range(spec.world_size):
            runs, at = [], 0
            for piece in spec.slot_shards(rank):
                i = self.weight_index.get(piece.slot.name, -1)
                if i < 0:
                    continue
                if piece.shard_start > at:
                    runs.append((at, piece.shard_start, -1))
                runs.append((piece.shard_start, piece.shard_start + piece.numel, i))
                at = piece.shard_start + piece.numel
            if at < shard:
                runs.append((at, shard, -1))
            self.runs.append(self._placed(runs))
        self.wire = align4(max(self._end(runs) for runs in self.runs))
        self.scales = torch.ones(len(slots))

    def _end(self, runs: list[tuple[int, int, int, int]]) -> int:
        return max((p + (b - a) * self._width(i) for a, b, i, p in runs), default=0)

    def _width(self, weight: int) -> int:
        return 1 if weight >= 0 else self.size

    def _placed(self, runs: list[tuple[int, int, int]]) -> list[tuple[int, int, int, int]]:
        """Each run with its byte offset in the payload: a run in the compute dtype
        starts at a multiple of its element size (so the payload can be viewed so)."""
        placed, at = [], 0
        for a, b, i in runs:
            width = self._width(i)
            at = -(-at // width) * width
            placed.append((a, b, i, at))
            at += (b - a) * width
        return placed

    def wire_bytes(self, numel: int) -> int:
        return self.wire

    def begin(self, comm: Collectives, x: torch.Tensor) -> None:
        """The whole weights' scales from every rank's shard ``x`` (a collective)."""
        amax = torch.zeros(len(self.weight_index), dtype=torch.float32, device=x.device)
        for a, b, i, _ in self.runs[comm.rank]:
            if i >= 0 and b > a:
                amax[i] = torch.maximum(amax[i], x[a:b].abs().max().float())
        comm.all_reduce(amax, op="max", control=True)
        # as torchao's amax_to_scale: the division in float64, the scale in float32
        self.scales = (_MAX / amax.double().clamp(min=_EPS)).float()

    def encode_part(self, x: torch.Tensor, out: torch.Tensor, part: int) -> None:
        for a, b, i, at in self.runs[part]:
            if i >= 0:
                q = (x[a:b].float() * self.scales[i].to(x.device)).clamp(-_MAX, _MAX)
                out[at : at + b - a].view(E4M3).copy_(q.to(E4M3))
            else:
                out[at : at + (b - a) * self.size].view(self.dtype).copy_(x[a:b])

    def decode_part(self, payload: torch.Tensor, numel: int, part: int) -> torch.Tensor:
        out = torch.empty(numel, dtype=torch.float32, device=payload.device)
        for a, b, i, at in self.runs[part]:
            if i >= 0:
                q = payload[at : at + b - a].view(E4M3).float()
                out[a:b] = q / self.scales[i].to(q.device)
            else:
                out[a:b] = payload[at : at + (b - a) * self.size].view(self.dtype).float()
        return out


def float8_gather(model: nn.Module) -> Float8Gather:
    """The gather codec for ``model``, or a ValueError naming why it would gather
    nothing in float8."""
    weights = float8_weights(model)
    if not weights:
        raise ValueError(
            'stage3_gather_compression="float8" gathers the weights of torchao\'s '
            "Float8Linear modules (dynamic, one scale per tensor, e4m3), and the model has "
            "none: convert it first (torchao.float8.convert_to_float8_training), or pick "
            "another compression"
        )
    return Float8Gather("float8", weights)
