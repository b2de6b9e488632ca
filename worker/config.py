"""``ZeroConfig``: every switch of the engine, validated at construction."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from coordinator.core.dsjson import to_deepspeed
from worker.config_sections import (
    SECTIONS,
    ActivationSection,
    CompressionSection,
    FieldError,
    LossScaling,
    MetricsSection,
    OffloadSection,
    Precision,
    PrecisionSection,
    ReplicaSection,
    ShardingSection,
    Stage3Section,
    StepSection,
)
from worker.ds_config import read_deepspeed

__all__ = ["Precision", "ZeroConfig", "stage_from_env"]

# Fields of other sections that only some stages run, the stages that do, and what a
# value other than "none" must be elsewhere: ZeroConfig refuses it there
# (_check_across_sections), and ZeroConfig.with_plan turns it to "none" when a
# coordinator plans such a stage.
_STAGE_BOUND: tuple[tuple[str, tuple[int, ...], str], ...] = (
    (
        "stage3_gather_compression",
        (1, 2, 3),
        "'none' at stage 0 (its optimizer holds every parameter: nothing is gathered)",
    ),
    ("offload_optimizer", (1, 2, 3), "'none' at stage 0 (offload needs stage 1, 2 or 3)"),
    ("offload_params", (3,), "'none' unless stage is 3 (only stage 3 shards parameters)"),
)


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """How the engine shards, reduces and steps.

    Attributes:
        stage: 0 = replicated (DDP); 1 = shard optimizer state and fp32 master
            weights; 2 = also shard gradients; 3 = also shard parameters.
        dtype: compute dtype of parameters and gradients. With ``bf16`` or
            ``fp16`` the optimizer runs on fp32 master weights.
        reduce_dtype: dtype gradients are reduced in; ``None`` = ``dtype``.
        gradient_accumulation_steps: micro-batches per optimizer step. The
            engine scales each micro-batch loss by its inverse, as DeepSpeed does.
        gradient_clipping: clip the global gradient norm to this value; 0 = off.
        bucket_numel: elements per gradient bucket (stages 0–2).
        overlap_comm: reduce buckets during backward as they fill; otherwise
            all reductions run after backward.
        stage3_prefetch: how many gather units to fetch ahead (0 = none).
        stage3_max_reuse_distance: a stage-3 gather unit whose backward comes
            within this many parameter elements (of the units whose forward ends
            after its own) stays gathered from its forward into its backward,
            saving one all-gather per step for more memory held during the
            step (see worker/stages.py [Note: units kept gathered into
            backward]). 0: only the root and the last unit to finish, whose
            backward comes first; DeepSpeed's default 1e9 keeps every unit of a
            model under a billion parameters.
        stage3_max_live_parameters: a prefetch starts only while the parameter
            elements gathered (and gathering) stay within this many; the unit
            needed now is always gathered. DeepSpeed's key and default (1e9);
            0 prefetches nothing.
        stage3_check_gathers: before each stage-3 gather (and at the end of each
            forward and backward) the ranks agree on which unit they gather, in
            one tiny all-reduce on a CPU group: ranks whose gathers fell out of step
            (a module run on some ranks and not others) all raise at once, naming
            the modules, instead of waiting until the collective timeout
            (worker/gather_check.py [Note: gathers the ranks agree on]).
            ``"first"`` (the default): through the first forward and backward
            only, where a branch that differs by rank from the start shows; True:
            at every step, for a job that hangs later (each check makes the ranks
            wait for each other: a 10M GPT's stage-3 step on 2 ranks goes from
            1.07x to 1.20x DDP's, bench/README.md); False: never.
        stage3_min_unit_numel: a module whose not-yet-assigned parameters
            reach this many elements becomes its own gather unit. Modules held
            in an ``nn.ModuleList`` or ``nn.Sequential`` are units regardless.
        loss_scale: fp16 only; 0 = dynamic loss scaling, otherwise a static scale.
        initial_scale_power: fp16 dynamic scaling starts at 2**this.
        loss_scale_window: good steps before the dynamic scale doubles.
        hysteresis: consecutive overflows before the scale halves (1 = on every
            overflow, as torch's GradScaler; DeepSpeed's default is 2).
        min_loss_scale: the dynamic scale never drops below this.
        compression: how gradients travel: ``none``; ``bf16``/``fp16`` (2×);
            ``int8`` blockwise (≈3.9×); ``onebit`` signs with a scale per block
            (≈28×). Reductions still sum in fp32 (see worker/compression.py).
        compression_block: elements per scale block for ``int8``/``onebit``.
        compression_warmup_steps: optimizer steps exchanged uncompressed first.
        error_feedback: carry each step's compression error into the next.
        hierarchical_reduce: ZeRO++'s qgZ (quantized hierarchical gradient
            reduce-scatter), stages 2–3 with a ``compression`` codec; 1 = off
            (the flat compressed reduce-scatter). The ranks per node, k, as
            ``hpz_partition_size`` counts them (consecutive ranks ``[0, k)``,
            ``[k, 2k)``, ...; with hpZ on, the same k): each bucket is
            reduce-scattered in full precision within the node, then, encoded
            with ``compression`` (and error feedback), among the ranks holding
            the same node-local part in every node, so only 1/k of the
            gradient's elements cross nodes, encoded (int8: ≈1/(4k) of the
            fp32 bytes). Each rank ends with its shard of the layout, as
            without it. Must divide the world size (see worker/compression.py
            [Note: hierarchical gradient reduce-scatter]). DeepSpeed's
            ``zero_quantized_gradients: true`` reads as ``compression="int8"``
            with k from ``zero_hpz_partition_size``.
        stage3_gather_compression: how parameter all-gathers travel (ZeRO++'s
            qwZ), at stages 1–3 despite the name (stage 3 had it first): at
            stages 1–2 the all-gather of the updated shards after the optimizer
            step, at stage 3 each unit's gathers. ``int8``: blockwise int8 with
            an fp32 scale per ``compression_block`` elements (≈0.25× fp32's
            bytes); ``bf16``: 2 bytes an element; ``float8``: the weights of
            torchao's ``Float8Linear`` modules in e4m3 with each whole tensor's
            scale, as the module casts them (FSDP2's float8 all-gather; the
            other parameters in the compute dtype; worker/float8.py [Note:
            float8 parameter gathers]); ``none``: the compute dtype.
            Only other ranks' slices of the compute parameters are rounded: the
            fp32 master weights and this rank's own slice stay exact (see
            worker/compression.py [Note: quantized parameter gathers]).
            DeepSpeed's ``zero_quantized_weights: true`` reads as ``int8``.
        hpz_partition_size: ZeRO++'s hpZ (hierarchical partitioning), stage 3
            only; 1 = off. The ranks per node, k: consecutive ranks ``[0, k)``,
            ``[k, 2k)``, ... form a node group, and each rank keeps, besides its
            1/N shard, a secondary copy of 1/k of every gather unit, taken from
            the forward's all-gather; the backward then gathers a unit within
            its node group only. Costs p·Ψ/k bytes per rank (p: the compute
            dtype's bytes), counted under ``params``; the results are those of
            plain stage 3 exactly. Must divide the world size (see
            worker/stages.py [Note: hierarchical partitioning]). DeepSpeed's
            ``zero_hpz_partition_size``.
        replica_interval: with a coordinator, every this many optimizer steps each
            rank keeps a copy of its state and of its neighbour's, so a crashed
            rank's shards are restored from memory (0 = off: checkpoints only).
        replica_gradient_log: with replicas (stages 1-3, optimizer not offloaded),
            each rank also sends its final gradient partition to the neighbour
            that keeps its replica at every step, so a recovery brings a lost
            rank's replica forward to the survivors' step instead of rolling
            everyone back and training the steps again. Costs 4 bytes per
            parameter / world size sent per step, and held per step since the
            last refresh (see worker/live/replicas.py [Note: rolling a lost rank forward]).
        metrics_port: serve Prometheus metrics on this port (0: a free one;
            see worker/metrics.py); None: as ``$ZEROPLANE_METRICS_PORT`` says,
            which launchers set, and off when it is unset.
        activation_checkpointing: which modules' activations are recomputed in
            backward instead of kept (see worker/activations.py). ``"none"``:
            off. ``"units"``: every gather unit's module (the blocks of an
            ``nn.ModuleList``/``nn.Sequential`` and modules of at least
            ``stage3_min_unit_numel`` parameters; never the root), each run
            under torch's non-reentrant ``checkpoint``. An int ``k >= 1``:
            every k-th of those units (1 = all of them). A callable
            ``policy(module) -> bool``: each module for which it is True.
        offload_activations: keep the activations autograd saves outside the
            checkpointed regions (with ``activation_checkpointing``, each
            checkpointed unit's input) in host memory between forward and
            backward, pinned on CUDA (DeepSpeed's ``activation_checkpointing.
            cpu_checkpointing``); on the CPU it changes nothing.
        tiled_loss: a transformers causal LM called with ``labels`` computes its head
            and cross-entropy this many tokens at a time, each tile recomputed in
            backward, so the logits never exist for the whole batch (see
            worker/tiling.py [Note: tiles]); 0: off.
        tiled_mlp: every transformers decoder MLP runs this many tokens of each row
            at a time, each tile recomputed in backward (worker/tiling.py); 0: off.
        compile: compile the model with ``torch.compile`` once the engine is built:
            whole at stages 0-2, each gather unit's forward at stage 3 with its
            gathers and releases at its edges (worker/factory.py [Note: compiling
            at stage 3]); what ``torch.compile(model)`` before ``initialize`` does.
            DeepSpeed's ``compile.deepcompile``.
        offload_optimizer: ``"cpu"`` keeps this rank's fp32 master partition and
            optimizer state in host memory and runs the optimizer there
            (ZeRO-Offload; stages 1-3). Reduced gradient shards are copied to
            the host as each bucket finishes, the updated partition comes back
            in the compute dtype (see worker/offload.py). ``"none"``: off.
        offload_params: ``"cpu"`` keeps this rank's stage-3 parameter shards in
            host memory; each gather unit's shard is copied to the device for
            its all-gather, the next unit's prefetched (stage 3 only).
        pin_memory: page-lock the host buffers offload copies through (CUDA
            only; makes the copies asynchronous). Ignored without offload or
            without a GPU.
    """

    stage: Literal[0, 1, 2, 3] = 0
    dtype: Precision = "fp32"
    reduce_dtype: Precision | None = None
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0
    bucket_numel: int = 2**22
    overlap_comm: bool = True
    stage3_prefetch: int = 1
    stage3_max_reuse_distance: int = 0
    stage3_max_live_parameters: int = 10**9
    stage3_min_unit_numel: int = 2**20
    stage3_check_gathers: bool | Literal["first"] = "first"
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 1
    min_loss_scale: float = 1.0
    compression: Literal["none", "bf16", "fp16", "int8", "onebit"] = "none"
    compression_block: int = 256
    compression_warmup_steps: int = 0
    error_feedback: bool = True
    hierarchical_reduce: int = 1
    stage3_gather_compression: Literal["none", "bf16", "int8", "float8"] = "none"
    hpz_partition_size: int = 1
    metrics_port: int | None = None
    replica_interval: int = 0
    replica_gradient_log: bool = True
    # torch-free annotation: the callable takes an nn.Module
    activation_checkpointing: Literal["none", "units"] | int | Callable[[Any], bool] = "none"
    offload_activations: bool = False
    tiled_loss: int = 0
    tiled_mlp: int = 0
    compile: bool = False
    offload_optimizer: Literal["none", "cpu"] = "none"
    offload_params: Literal["none", "cpu"] = "none"
    pin_memory: bool = True

    def __post_init__(self) -> None:
        # Each section checks its own fields (worker/config_sections.py), in SECTIONS'
        # order; then the rules between sections.
        for section in SECTIONS:
            section(**self._fields_of(section))
        self._check_across_sections()

    def _fields_of(self, section: type) -> dict[str, Any]:
        """This config's values of ``section``'s fields, by name."""
        return {f.name: getattr(self, f.name) for f in fields(section)}

    def _check_across_sections(self) -> None:
        """The rules that tie fields of different sections together (each section has
        checked its own fields): what a stage rules out (``_STAGE_BOUND``), hpZ's
        secondary copies, which live on the device beside the gathered units, and
        qgZ's stages, codec and ranks per node."""
        for name, stages, want in _STAGE_BOUND:
            if getattr(self, name) != "none" and self.stage not in stages:
                raise FieldError(
                    f"ZeroConfig.{name} must be {want}, got {getattr(self, name)!r}", name
                )
        if self.hpz_partition_size != 1 and self.stage != 3:
            raise FieldError(
                "ZeroConfig.hpz_partition_size must be 1 unless stage is 3 (only stage 3 "
                f"gathers parameters for its backward), got {self.hpz_partition_size!r}",
                "hpz_partition_size",
            )
        k = self.hierarchical_reduce
        if k != 1 and self.stage not in (2, 3):
            raise FieldError(
                "ZeroConfig.hierarchical_reduce must be 1 unless stage is 2 or 3 (qgZ "
                f"reduce-scatters gradients into shards), got {k!r}",
                "hierarchical_reduce",
            )
        if k != 1 and self.compression == "none":
            raise FieldError(
                "ZeroConfig.hierarchical_reduce must be 1 with compression='none' (in full "
                "precision a hierarchical reduce-scatter crosses nodes with as many bytes "
                f"as the flat one; qgZ is compression='int8'), got {k!r}",
                "hierarchical_reduce",
            )
        if k != 1 and self.hpz_partition_size not in (1, k):
            raise FieldError(
                "ZeroConfig.hierarchical_reduce must equal hpz_partition_size="
                f"{self.hpz_partition_size} when both are on (both are the ranks per node), "
                f"got {k!r}",
                "hierarchical_reduce",
            )
        if self.hpz_partition_size != 1 and self.offload_params != "none":
            raise FieldError(
                "ZeroConfig.hpz_partition_size must be 1 with offload_params="
                f"{self.offload_params!r} (hpZ keeps its secondary copies on the device, "
                f"beside shards offloaded to the host), got {self.hpz_partition_size!r}",
                "hpz_partition_size",
            )

    # ------------------------------------------------------------ the sections

    @property
    def sharding(self) -> ShardingSection:
        return ShardingSection(**self._fields_of(ShardingSection))

    @property
    def precision(self) -> PrecisionSection:
        return PrecisionSection(**self._fields_of(PrecisionSection))

    @property
    def step(self) -> StepSection:
        return StepSection(**self._fields_of(StepSection))

    @property
    def loss_scaling(self) -> LossScaling:
        return LossScaling(**self._fields_of(LossScaling))

    @property
    def gradient_compression(self) -> CompressionSection:
        """The ``compression*`` and ``error_feedback`` fields (``compression`` is the
        codec's own field)."""
        return CompressionSection(**self._fields_of(CompressionSection))

    @property
    def stage3(self) -> Stage3Section:
        return Stage3Section(**self._fields_of(Stage3Section))

    @property
    def replicas(self) -> ReplicaSection:
        return ReplicaSection(**self._fields_of(ReplicaSection))

    @property
    def offload(self) -> OffloadSection:
        return OffloadSection(**self._fields_of(OffloadSection))

    @property
    def metrics(self) -> MetricsSection:
        return MetricsSection(**self._fields_of(MetricsSection))

    @property
    def activations(self) -> ActivationSection:
        return ActivationSection(**self._fields_of(ActivationSection))

    @property
    def mixed_precision(self) -> bool:
        return self.dtype != "fp32"

    @classmethod
    def from_deepspeed(
        cls,
        ds: Mapping[str, Any],
        *,
        hidden_size: int | None = None,
        fp16: bool | None = None,
        bf16: bool | None = None,
        **overrides: Any,
    ) -> ZeroConfig:
        """Read the ZeRO-related keys of a DeepSpeed JSON config.

        Keys that would change what training computes and that zeroplane does
        not implement (NVMe offload, for example) raise ``ValueError``
        naming them.

        ``zero_optimization.offload_optimizer`` and ``offload_param`` with
        ``device: "cpu"`` set ``offload_optimizer="cpu"`` /
        ``offload_params="cpu"`` (and the legacy ``cpu_offload: true`` the
        former); ``"none"`` or null leaves them off; ``"nvme"`` is refused.
        ``pin_memory`` (DeepSpeed's default: false) sets ``pin_memory``, true
        if either offloading section says so. As in DeepSpeed, ``offload_param``
        is ignored (with a warning) unless the stage is 3. Their NVMe and buffer-tuning
        keys are logged as ignored. ``zero_optimization.zero_quantized_weights: true``
        (ZeRO++'s qwZ) sets ``stage3_gather_compression="int8"``; DeepSpeed quantizes
        stage 3's gathers only, zeroplane also the all-gather after the step at stages
        1-2; at stage 0 it is ignored with a warning.
        ``zero_optimization.zero_hpz_partition_size`` (ZeRO++'s hpZ) sets
        ``hpz_partition_size``; below stage 3 it is ignored, as in DeepSpeed (with a
        warning unless it is 1). ``zero_optimization.zero_quantized_gradients: true``
        (ZeRO++'s qgZ) sets ``compression="int8"`` and ``hierarchical_reduce`` to
        ``zero_hpz_partition_size`` (at stage 2 too, where hpZ itself is ignored;
        without it 1: zeroplane cannot tell the node size, and the int8
        reduce-scatter is flat); DeepSpeed runs qgZ at stage 3 only, zeroplane at
        stages 2-3; below stage 2 it is ignored with a warning. Known DeepSpeed keys that
        belong to other parts of a training script (optimizer, scheduler, batch
        sizes, logging) are logged as ignored, ``"auto"`` or not. Unknown keys raise.

        ``"auto"`` values (Hugging Face Trainer's templates) are resolved from
        keywords, as ``HfTrainerDeepSpeedConfig`` resolves them from
        ``TrainingArguments`` and the model's config:

        - ``**overrides``: ZeroConfig field names. Each sets that field,
          whatever the file says, and so also resolves an ``"auto"`` of the
          DeepSpeed key the field is read from: ``gradient_accumulation_steps``,
          ``gradient_clipping``, ``stage`` (``zero_optimization.stage``),
          ``bucket_numel`` (``zero_optimization.reduce_bucket_size``),
          ``overlap_comm``, ``stage3_prefetch``
          (``zero_optimization.stage3_prefetch_bucket_size``), ``loss_scale``,
          ``initial_scale_power``, ``loss_scale_window``, ``hysteresis``,
          ``min_loss_scale`` (``fp16.*``) and ``dtype`` (``fp16.enabled`` and
          ``bf16.enabled``: ``dtype="bf16"`` reads as bf16 on, fp16 off).
        - ``hidden_size``: the model's hidden size (the largest of
          ``hidden_sizes`` where a model has several), as HF's trainer uses
          it: ``reduce_bucket_size = hidden_size**2`` and
          ``stage3_prefetch_bucket_size = 0.9 * hidden_size**2`` when they are
          ``"auto"`` (the latter only says whether to prefetch: zeroplane
          prefetches whole units). ``stage3_param_persistence_threshold`` is
          ignored, ``"auto"`` or not; ``stage3_max_reuse_distance`` and
          ``stage3_max_live_parameters`` set the fields of those names
          (``"auto"`` leaves the latter at DeepSpeed's default).
        - ``fp16``, ``bf16``: ``TrainingArguments``-style booleans for
          ``fp16.enabled`` / ``bf16.enabled``; giving one makes the other
          False unless given too. Like HF, a file value that is not ``"auto"``
          and disagrees with the keyword raises. They must agree with
          ``dtype`` when both are given.

        A key mapped to a ZeroConfig field that is still ``"auto"`` after that
        raises ``ValueError`` naming the key and the keyword that resolves it
        (all such keys at once).

        Values are converted as DeepSpeed 0.19 converts them, or refused with
        the key in the error (the notes above ``_ds_bool`` in worker/ds_config.py
        say why): in ``zero_optimization``, ``fp16`` and ``bf16`` a boolean may be
        true/false, 0/1 or a string such as ``"false"``, and an integer an
        integral number (``5e8``) or a decimal string (``"500000000"``), not
        ``"5e8"`` or ``1.5``; top-level ``gradient_accumulation_steps`` and
        ``gradient_clipping`` and the ``activation_checkpointing`` section take
        JSON numbers and booleans only. ``null`` is refused, except where
        DeepSpeed's own default is null (``gradient_accumulation_steps``,
        ``zero_optimization.overlap_comm``): there it means unset.

        A top-level ``"zeroplane"`` dict (what :meth:`to_deepspeed` writes for fields
        DeepSpeed has no key for, such as ``compression``; DeepSpeed does not read
        it) sets those ZeroConfig fields by name; a name that is not a field raises.

        A top-level ``activation_checkpointing`` dict sets
        ``activation_checkpointing="units"``; its keys that tune DeepSpeed's
        own implementation are logged as ignored, and ``cpu_checkpointing:
        true`` is refused.
        """
        kw, sources = read_deepspeed(
            ds,
            overrides,
            field_names=[f.name for f in fields(cls)],
            hidden_size=hidden_size,
            fp16=fp16,
            bf16=bf16,
        )
        try:
            return cls(**kw)
        except FieldError as error:
            source = sources.get(error.field)
            if source is None or error.field in overrides:
                raise
            raise ValueError(f"{error} (read from DeepSpeed key {source!r})") from None

    def as_dict(self, *, changed_only: bool = False) -> dict[str, Any]:
        """The fields by name (``ZeroConfig(**d)`` rebuilds it): JSON-ready unless
        ``activation_checkpointing`` is a callable. ``changed_only``: only fields that
        differ from the defaults."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        if changed_only:
            values = {k: v for k, v in values.items() if v != _DEFAULTS[k]}
        return values

    def to_deepspeed(
        self, *, micro_batch: int | None = None, world_size: int | None = None
    ) -> dict[str, Any]:
        """This config as a DeepSpeed JSON config; ``from_deepspeed`` reads it back to
        an equal ZeroConfig. Fields DeepSpeed has no key for (compression, ...) go in
        a ``"zeroplane"`` section that DeepSpeed does not read (coordinator/core/dsjson.py).
        ``micro_batch`` (and ``world_size``) add DeepSpeed's batch-size keys."""
        fields_ = {"stage": self.stage, "dtype": self.dtype} | self.as_dict(changed_only=True)
        ds = to_deepspeed(fields_, micro_batch=micro_batch, world_size=world_size)
        if self._is_deepspeed_qgz():
            # ZeRO++'s qgZ under DeepSpeed's key, which reads back as int8 with k
            # from zero_hpz_partition_size (written above)
            extra = ds["zeroplane"]
            del extra["compression"], extra["hierarchical_reduce"]
            if not extra:
                del ds["zeroplane"]
            ds["zero_optimization"]["zero_quantized_gradients"] = True
        return ds

    def _is_deepspeed_qgz(self) -> bool:
        """Whether DeepSpeed's ``zero_quantized_gradients: true`` says this config's
        gradient compression: int8, hierarchical over hpZ's node groups at stage 3."""
        return (
            self.stage == 3
            and self.compression == "int8"
            and self.hierarchical_reduce == self.hpz_partition_size > 1
        )

    def replace(self, **changes: Any) -> ZeroConfig:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return ZeroConfig(**values)

    def with_plan(self, *, stage: int, bucket_numel: int) -> ZeroConfig:
        """This config with a coordinator's planned ``stage`` and ``bucket_numel`` (its
        plan for the whole job). A ``stage`` other than this config's also turns off
        what that stage does not run (``_STAGE_BOUND``): below stage 3 the stage-3
        parameter offload, at stage 0 optimizer offload and gather compression. The
        same stage changes ``bucket_numel`` only. Logs nothing: saying that another
        stage applies is the caller's. Below stage 3 hpZ is off too
        (``hpz_partition_size=1``), and qgZ below stage 2 (``hierarchical_reduce=1``)."""
        changes: dict[str, Any] = {"bucket_numel": bucket_numel}
        if stage != self.stage:
            changes["stage"] = stage
            changes.update({name: "none" for name, ok, _ in _STAGE_BOUND if stage not in ok})
            if stage != 3:
                changes["hpz_partition_size"] = 1
            if stage not in (2, 3):
                changes["hierarchical_reduce"] = 1
        return self.replace(**changes)


_DEFAULTS = {f.name: f.default for f in fields(ZeroConfig)}


def stage_from_env(default: int) -> int:
    """``$ZEROPLANE_STAGE`` (set by ``zeroplane run --stage``) as a script's default
    stage; ``auto`` or unset gives ``default`` (the coordinator then plans it)."""
    raw = os.environ.get("ZEROPLANE_STAGE", "auto")
    if raw == "auto":
        return default
    if raw not in ("0", "1", "2", "3"):
        raise ValueError(f"$ZEROPLANE_STAGE must be 0-3 or auto, got {raw!r}")
    return int(raw)
