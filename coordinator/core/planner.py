"""The planner: memory per rank for each ZeRO stage, and the stage to run.

Model states come from ``coordinator.core.memory`` (the ZeRO paper's formulas).
Activations are not derivable from a parameter inventory, so they enter as a
stated per-rank term (``PlanConfig.activation_bytes``), or are estimated
from the transformer's shape (``PlanConfig.activations``, see
[Note: activation memory]); every estimate shows them beside the model
states. A stage fits when model states plus activations stay within the
device memory less a headroom fraction (CUDA context, allocator
fragmentation, communication buffers). When no stage fits with every
activation kept but one does with activation checkpointing, the plan says
that checkpointing is what makes the model fit.

[Note: activation memory]
Per transformer layer, a micro-batch of ``b`` sequences of ``s`` tokens with
hidden size ``h`` and ``a`` attention heads keeps ``s*b*h*(34 + 5*a*s/h)``
bytes for backward in 16-bit training (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", eq. 1: 34 bytes per
token and hidden unit for the linear layers, norms and dropout masks, and
``5*a*s/h`` for the attention scores, their softmax and its dropout). fp32
doubles it. With every layer checkpointed a layer keeps only its input,
``2*s*b*h`` bytes (16-bit), and backward recomputes one layer at a time, so
one layer's full activations come on top. Attention kernels that never
store the score matrix (flash attention) drop the ``5*a*s/h`` term; the
estimate keeps it, erring high.

The choice is the lowest stage that fits the smallest worker: a lower stage
moves fewer bytes (stage 3 gathers parameters every step). With one rank no
stage saves anything and each costs time, so the planner picks stage 0 and
says why.

[Note: planning offload]
When no stage fits the device, with activation checkpointing or without, the
planner proposes offload (worker/offload.py), in this order: optimizer
offload at stage 1, 2, then 3, then optimizer and parameter offload at stage
3; the first whose device bytes fit (coordinator/core/memory.py [Note: offloaded
state bytes]) and, where the host memory is known
(``PlanConfig.host_memory_bytes``), whose host bytes fit it too. It states
the host memory needed and the step-time cost of the copies: the bytes each
rank moves over PCIe per step over ``PlanConfig.pcie_bytes_per_s``
(:data:`PCIE_BYTES_PER_S`, 25 GB/s: what a PCIe 4.0 x16 link sustains; 5.0
links and NVLink-C2C hosts are faster). The host optimizer step comes on
top (torch's fused CPU AdamW stepped about 175M elements/s on one core here).
Activation bytes of the units in flight at stage 3 are not counted. The
proposal is advice: the workers offload as their ZeroConfig says.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Literal

from coordinator.core.memory import (
    DTYPE_BYTES,
    ModelStateBytes,
    Offload,
    offload_transfer_bytes,
    offloaded_state_bytes,
)

__all__ = [
    "OFFLOAD_LADDER",
    "PCIE_BYTES_PER_S",
    "STAGES",
    "ActivationShape",
    "MemoryEstimate",
    "PlanConfig",
    "StageChoice",
    "choose_stage",
    "estimate_memory",
    "format_bytes",
    "format_seconds",
    "parse_bytes",
    "parse_count",
]

logger = logging.getLogger(__name__)

STAGES = (0, 1, 2, 3)
Precision = Literal["fp32", "bf16", "fp16"]

# [Note: planning offload]
PCIE_BYTES_PER_S = 25e9
OFFLOAD_LADDER: tuple[tuple[int, Offload], ...] = (
    (1, "optimizer"),
    (2, "optimizer"),
    (3, "optimizer"),
    (3, "optimizer+params"),
)


@dataclass(frozen=True, kw_only=True)
class ActivationShape:
    """A transformer's shape and micro-batch, for [Note: activation memory]."""

    layers: int
    hidden: int
    seq: int
    micro_batch: int = 1
    # attention heads; None: hidden // 64, the usual head size
    heads: int | None = None

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "seq", "micro_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ActivationShape.{name} must be an integer >= 1, got {value!r}")
        if self.heads is not None and (not isinstance(self.heads, int) or self.heads < 1):
            raise ValueError(f"ActivationShape.heads must be None or >= 1, got {self.heads!r}")

    def layer_bytes(self, precision: str) -> float:
        """One layer's activations kept for backward, every one of them kept."""
        s, b, h = self.seq, self.micro_batch, self.hidden
        a = self.heads or max(1, h // 64)
        return s * b * h * (34 + 5 * a * s / h) * _ACT_SCALE[precision]

    def mesh_layer_bytes(self, precision: str, tp: int) -> float:
        """One layer's kept activations under tensor parallelism over ``tp`` ranks
        (no sequence parallelism): the linear layers' inner activations and the
        attention scores split over tp, the norms' and residuals' ``10*s*b*h`` do
        not (Korthikanti et al. 2022, eq. 2): ``s*b*h*(10 + 24/t + 5*a*s/(h*t))``."""
        s, b, h = self.seq, self.micro_batch, self.hidden
        a = self.heads or max(1, h // 64)
        return s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp)) * _ACT_SCALE[precision]

    def pipeline_bytes(
        self, precision: str, *, tp: int = 1, pp: int = 1, microbatches: int = 1,
        schedule: str = "1f1b",
    ) -> float:  # fmt: skip
        """Activations one rank keeps with ``pp`` stages of ``layers/pp`` layers each,
        its ``micro_batch`` sequences split into ``microbatches`` pipeline
        micro-batches: GPipe keeps every micro-batch's until its backward; 1F1B at
        most ``pp`` in flight on the first stage (Narayanan et al. 2021). ``tp`` as
        :meth:`mesh_layer_bytes`."""
        in_flight = microbatches if schedule == "gpipe" else min(pp, microbatches)
        layers = math.ceil(self.layers / pp)
        return layers * in_flight * self.mesh_layer_bytes(precision, tp) / microbatches

    def bytes(self, precision: str, *, checkpointing: bool) -> float:
        """Activation bytes per rank, with or without checkpointing every layer."""
        if not checkpointing:
            return self.layers * self.layer_bytes(precision)
        inputs = self.layers * 2 * self.seq * self.micro_batch * self.hidden
        return inputs * _ACT_SCALE[precision] + self.layer_bytes(precision)


# the activation formula counts 16-bit tensors; fp32 keeps them in 4 bytes
_ACT_SCALE = {"bf16": 1.0, "fp16": 1.0, "fp32": 2.0}


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """How the coordinator plans a generation."""

    # None: the planner chooses per generation; 0-3: always this stage.
    stage: int | None = None
    # With no stage set: use the stage the workers' own ZeroConfig asks for
    # (`zeroplane run` without --stage); the planner chooses only when they
    # ask for none (`--stage auto` turns this off).
    stage_from_workers: bool = False
    # Compute dtype; bf16/fp16 mean mixed precision with fp32 master weights.
    precision: Precision = "bf16"
    # fp32 tensors the optimizer keeps per element (Adam: 2, SGD with momentum: 1).
    optimizer_states: int = 2
    # Fraction of device memory the plan leaves free.
    headroom: float = 0.1
    # Activation bytes per rank, added to every stage's estimate.
    activation_bytes: int = 0
    # Or the transformer's shape, to estimate them with and without checkpointing.
    activations: ActivationShape | None = None
    # Layout: real elements per bucket, and the element alignment of each shard.
    bucket_numel: int = 1 << 24
    align: int = 1
    # Whether the planner may propose offload when no stage fits ([Note: planning offload]).
    offload: bool = True
    # Host memory per rank (0: unknown, not checked) and the device-host link's speed.
    host_memory_bytes: int = 0
    pcie_bytes_per_s: float = PCIE_BYTES_PER_S
    # A job that splits its model's experts over ranks: (expert_parallel, the experts'
    # elements), which the inventory (the trainable numel planned) leaves out: each
    # rank holds E/ep experts' state over world/ep ranks ([Note: experts in the plan])
    experts: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.stage is not None and self.stage not in STAGES:
            raise ValueError(f"PlanConfig.stage must be None or 0-3, got {self.stage!r}")
        if self.precision not in DTYPE_BYTES:
            raise ValueError(
                f"PlanConfig.precision must be one of {sorted(DTYPE_BYTES)}, got {self.precision!r}"
            )
        if self.optimizer_states < 0:
            raise ValueError(
                f"PlanConfig.optimizer_states must be >= 0, got {self.optimizer_states}"
            )
        if not 0 <= self.headroom < 1:
            raise ValueError(f"PlanConfig.headroom must be in [0, 1), got {self.headroom}")
        if self.activation_bytes < 0:
            raise ValueError(
                f"PlanConfig.activation_bytes must be >= 0, got {self.activation_bytes}"
            )
        if self.activations is not None and self.activation_bytes:
            raise ValueError("PlanConfig takes activation_bytes or activations, not both")
        if self.bucket_numel < 1:
            raise ValueError(f"PlanConfig.bucket_numel must be >= 1, got {self.bucket_numel}")
        if self.align < 1:
            raise ValueError(f"PlanConfig.align must be >= 1, got {self.align}")
        if self.host_memory_bytes < 0:
            raise ValueError(
                f"PlanConfig.host_memory_bytes must be >= 0, got {self.host_memory_bytes}"
            )
        if not self.pcie_bytes_per_s > 0:
            raise ValueError(
                f"PlanConfig.pcie_bytes_per_s must be > 0, got {self.pcie_bytes_per_s}"
            )
        if self.experts is not None and (self.experts[0] < 1 or self.experts[1] < 0):
            raise ValueError(
                f"PlanConfig.experts must be (ep >= 1, numel >= 0), got {self.experts}"
            )


_NOTHING = ModelStateBytes(0, 0, 0, 0)


def _plus(a: ModelStateBytes, b: ModelStateBytes) -> ModelStateBytes:
    return ModelStateBytes(
        a.params + b.params, a.grads + b.grads, a.master + b.master, a.optimizer + b.optimizer
    )


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds at ``stage`` on ``world_size`` ranks."""

    stage: int
    world_size: int
    # on the device
    model_states: ModelStateBytes
    activation_bytes: float
    # what offload puts in host memory (all zero without offload)
    offload: Offload = "none"
    host_states: ModelStateBytes = _NOTHING
    # bytes moved between device and host per step (offload)
    transfer_bytes: float = 0.0

    @property
    def total(self) -> float:
        """Device bytes: model states there plus activations."""
        return self.model_states.total + self.activation_bytes

    @property
    def host_total(self) -> float:
        return self.host_states.total


@dataclass(frozen=True)
class StageChoice:
    stage: int
    reason: str
    # One per stage, 0-3.
    estimates: tuple[MemoryEstimate, ...]
    # Device memory less headroom; 0 when the device memory is unknown.
    usable_bytes: float
    fits: bool
    # Whether the plan checkpoints activations (only what makes a model fit does).
    checkpointing: bool = False
    # The offload that makes the model fit, its estimate (device and host bytes),
    # and the seconds per step its copies take at PlanConfig.pcie_bytes_per_s.
    offload: Offload = "none"
    offload_estimate: MemoryEstimate | None = None
    offload_seconds: float = 0.0


def estimate_memory(
    numel: int,
    *,
    stage: int,
    world_size: int,
    config: PlanConfig = PlanConfig(),
    checkpointing: bool = False,
    offload: Offload = "none",
) -> MemoryEstimate:
    """Model states by the ZeRO formulas plus the activations (stated, or estimated
    from ``config.activations`` with or without ``checkpointing``), split between
    device and host by ``offload``.

    [Note: experts in the plan]
    Under expert parallelism the inventory holds every parameter but the experts
    (worker/moe/shards.py: each rank shards its E/ep experts over the world/ep
    ranks holding the same ones), so ``config.experts`` adds them: the ZeRO formulas
    of Ψ_experts/ep elements over world/ep ranks, at the same stage and offload.
    At stages 1-3 that is the dense share per element (Ψ_experts/world); at stage 0
    each rank holds its experts whole."""
    device, host = offloaded_state_bytes(
        numel,
        stage=stage,
        world_size=world_size,
        dtype=config.precision,
        optimizer_states=config.optimizer_states,
        offload=offload,
    )
    if config.experts is not None:
        ep, experts = config.experts
        more = offloaded_state_bytes(
            experts // ep,
            stage=stage,
            world_size=max(1, world_size // ep),
            dtype=config.precision,
            optimizer_states=config.optimizer_states,
            offload=offload,
        )
        device, host = _plus(device, more[0]), _plus(host, more[1])
    activations = float(config.activation_bytes)
    if config.activations is not None:
        activations = config.activations.bytes(config.precision, checkpointing=checkpointing)
    moved = offload_transfer_bytes(
        numel, stage=stage, world_size=world_size, dtype=config.precision, offload=offload
    )
    return MemoryEstimate(stage, world_size, device, activations, offload, host, moved)


_OFFLOAD_CONFIG = {
    "optimizer": "offload_optimizer='cpu'",
    "optimizer+params": "offload_optimizer='cpu', offload_params='cpu'",
}


def _offload_choice(
    numel: int,
    world_size: int,
    config: PlanConfig,
    usable: float,
    estimates: tuple[MemoryEstimate, ...],
    checkpointing: bool,
    short_of: str,
) -> StageChoice | None:
    """The first offload of :data:`OFFLOAD_LADDER` that fits ([Note: planning offload])."""
    host_usable = config.host_memory_bytes * (1 - config.headroom)
    for stage, offload in OFFLOAD_LADDER:
        e = estimate_memory(
            numel,
            stage=stage,
            world_size=world_size,
            config=config,
            checkpointing=checkpointing,
            offload=offload,
        )
        if e.total > usable or (config.host_memory_bytes and e.host_total > host_usable):
            continue
        seconds = e.transfer_bytes / config.pcie_bytes_per_s
        reason = (
            f"{short_of}; stage {stage} with {offload} offload"
            f"{' and activation checkpointing' if checkpointing else ''} fits: "
            f"{format_bytes(e.total)} per rank on the device, {format_bytes(e.host_total)} "
            f"in host memory; its copies move {format_bytes(e.transfer_bytes)} per rank "
            f"per step, about {format_seconds(seconds)} at "
            f"{config.pcie_bytes_per_s / 1e9:.3g} GB/s PCIe, plus the host optimizer step "
            f"(ZeroConfig(stage={stage}, {_OFFLOAD_CONFIG[offload]}))"
        )
        return StageChoice(
            stage,
            reason,
            estimates,
            usable,
            True,
            checkpointing=checkpointing,
            offload=offload,
            offload_estimate=e,
            offload_seconds=seconds,
        )
    return None


def choose_stage(
    numel: int, *, world_size: int, device_memory_bytes: int, config: PlanConfig = PlanConfig()
) -> StageChoice:
    """The stage for ``numel`` trainable elements on ``world_size`` ranks, with the reason.

    ``device_memory_bytes`` is the smallest worker's device memory (0: unknown).
    """
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if device_memory_bytes < 0:
        raise ValueError(f"device_memory_bytes must be >= 0, got {device_memory_bytes}")
    estimates = tuple(
        estimate_memory(numel, stage=s, world_size=world_size, config=config) for s in STAGES
    )
    usable = device_memory_bytes * (1 - config.headroom)

    def fits(stage: int) -> bool:
        return device_memory_bytes > 0 and estimates[stage].total <= usable

    def need(stage: int) -> str:
        return f"{format_bytes(estimates[stage].total)} per rank"

    have = f"{format_bytes(usable)} usable ({format_bytes(device_memory_bytes)} less "
    have += f"{config.headroom:.0%} headroom)"

    if config.stage is not None:
        stage = config.stage
        reason = f"stage {stage} set by configuration: {need(stage)}"
        if device_memory_bytes > 0:
            reason += f", {have}" + ("" if fits(stage) else " -- does not fit")
        if world_size == 1 and stage > 0:
            logger.warning(
                "stage %d on one rank saves no memory and costs time; stage 0 is the "
                "better choice for a single rank",
                stage,
            )
            reason += "; on one rank no stage saves memory"
        return StageChoice(stage, reason, estimates, usable, fits(stage))

    if world_size == 1:
        reason = (
            "one rank: no stage partitions anything, each only adds work, so stage 0; "
            "mixed precision and activation checkpointing are the memory levers"
        )
        if device_memory_bytes > 0 and not fits(0):
            if config.activations is not None:
                saved = tuple(
                    estimate_memory(numel, stage=s, world_size=1, config=config, checkpointing=True)
                    for s in STAGES
                )
                if saved[0].total <= usable:
                    reason += (
                        f"; with activation checkpointing it fits: "
                        f"{format_bytes(saved[0].total)} of {have}"
                    )
                    return StageChoice(0, reason, saved, usable, True, checkpointing=True)
            if config.offload:
                for ckpt in (False, True) if config.activations is not None else (False,):
                    offloaded = _offload_choice(
                        numel,
                        1,
                        config,
                        usable,
                        estimates,
                        ckpt,
                        f"one rank: stage 0 needs {need(0)}, more than {have}",
                    )
                    if offloaded is not None:
                        return offloaded
            reason += f" (needs {need(0)}, more than {have})"
        return StageChoice(0, reason, estimates, usable, fits(0))
    if device_memory_bytes == 0:
        reason = "device memory unknown: stage 0 (no sharding, least communication)"
        return StageChoice(0, reason, estimates, usable, False)
    for stage in STAGES:
        if fits(stage):
            if stage == 0:
                reason = f"stage 0 fits without sharding: {need(0)} of {have}"
            else:
                reason = (
                    f"stage {stage} is the lowest that fits: {need(stage)} of {have}; "
                    f"stage {stage - 1} needs {need(stage - 1)}"
                )
            return StageChoice(stage, reason, estimates, usable, True)
    if config.activations is not None:
        saved = tuple(
            estimate_memory(
                numel, stage=s, world_size=world_size, config=config, checkpointing=True
            )
            for s in STAGES
        )
        for stage in STAGES:
            if saved[stage].total <= usable:
                reason = (
                    f"stage {stage} with activation checkpointing: "
                    f"{format_bytes(saved[stage].total)} per rank of {have}; with every "
                    f"activation kept even stage 3 needs {need(3)} "
                    f"({format_bytes(estimates[3].activation_bytes)} of it activations)"
                )
                return StageChoice(stage, reason, saved, usable, True, checkpointing=True)
    if config.offload:
        for ckpt in (False, True) if config.activations is not None else (False,):
            offloaded = _offload_choice(
                numel,
                world_size,
                config,
                usable,
                estimates,
                ckpt,
                f"no stage fits the device: even stage 3 needs {need(3)}, more than {have}",
            )
            if offloaded is not None:
                return offloaded
    reason = (
        f"no stage fits: even stage 3 needs {need(3)}, more than {have}; "
        "stage 3 comes closest (add ranks, offload, or checkpoint activations)"
    )
    return StageChoice(3, reason, estimates, usable, False)


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_bytes(text: str) -> int:
    """``"80GB"`` -> 80e9, ``"16GiB"`` -> 16 * 2**30, ``"1e9"`` -> 1e9 (GB = 1e9 bytes)."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*([a-z]*)\s*", text.lower())
    if not match or match.group(2) not in _UNITS:
        raise ValueError(f"not a byte size: {text!r} (e.g. 80GB, 16GiB, 512MB)")
    value = float(match.group(1)) * _UNITS[match.group(2)]
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"not a byte size: {text!r}")
    return int(value)


def parse_count(text: str) -> int:
    """``"7.5e9"``, ``"7.5B"``, ``"350M"``, ``"125k"`` -> an element count."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*([a-z]?)\s*", text.lower())
    if not match or match.group(2) not in _COUNT_SUFFIX:
        raise ValueError(f"not a parameter count: {text!r} (e.g. 7.5e9, 7.5B, 350M)")
    value = float(match.group(1)) * _COUNT_SUFFIX[match.group(2)]
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"not a parameter count: {text!r}")
    return round(value)


def format_seconds(t: float) -> str:
    return f"{t:.3g} s" if t >= 1 else f"{t * 1e3:.3g} ms"


def format_bytes(n: float) -> str:
    """Decimal units, as the ZeRO paper counts them (1 GB = 1e9 bytes)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n:.0f} B"
