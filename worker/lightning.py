"""A PyTorch Lightning strategy that trains a ``LightningModule`` with zeroplane's engine.

    import worker.lightning  # registers "zeroplane" and "zeroplane_stage_0".."_3"
    trainer = L.Trainer(strategy="zeroplane_stage_2", accelerator="cpu", devices=2)
    trainer = L.Trainer(strategy=ZeroplaneStrategy(config=ZeroConfig(stage=3)), ...)

What Lightning's pieces become (docs/lightning.md has the user's view):

    configure_optimizers   one optimizer, handed to ``worker.initialize``; a scheduler
                           stepped every optimizer step goes with it (the engine steps,
                           saves and restores it), any other stays Lightning's
    precision              "32-true" / "bf16-mixed" / "16-mixed" set ZeroConfig.dtype
                           (the engine's compute dtype with fp32 master weights and, for
                           fp16, its loss scaler); anything else is refused
    training_step          runs inside ``engine.forward`` (stage 3 gathers, inputs cast)
    backward / step        ``engine.backward`` / ``engine.step``; gradient clipping by
                           norm and gradient accumulation are the engine's
    checkpoints            a zeroplane checkpoint directory (any world size, any stage)
                           holding Lightning's own state beside the engine's

The process group is the one Lightning forms, from its launcher's environment or
from what ``zeroplane run`` sets (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT). Under ``zeroplane run`` ``worker.initialize`` then attaches to the
coordinator with that group (worker/attached.py): the engine reports and takes the
coordinator's stage, but workers cannot join or leave mid-run, which Lightning's
samplers could not follow anyway.

Lightning is an optional dependency: ``import worker`` never imports this module.
"""

from __future__ import annotations

import argparse
import logging
import os
import weakref
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
    from lightning.fabric.strategies import _StrategyRegistry
    from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
    from lightning.pytorch.overrides.distributed import _sync_module_states
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities import GradClipAlgorithmType
    from lightning.pytorch.utilities.model_helpers import is_overridden
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn
    from lightning.pytorch.utilities.types import LRSchedulerConfig
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "worker.lightning needs PyTorch Lightning 2.x (`pip install lightning`); "
        f"importing it failed: {exc}"
    ) from exc

from worker.config import ZeroConfig, stage_from_env
from worker.engine import ZeroEngine
from worker.entry import initialize
from worker.rendezvous import coordinator_address
from worker.sharded import mark_gathered

__all__ = ["PRECISIONS", "ZeroplanePrecision", "ZeroplaneStrategy", "engine_config"]

logger = logging.getLogger(__name__)

# Lightning's precision flags that zeroplane's engine implements, and its dtype for each.
# "-mixed" means what DeepSpeed's strategy makes of it: compute in the low dtype with
# fp32 master weights (worker/precision.py), not autocast over fp32 parameters.
PRECISIONS: dict[str, str] = {"32-true": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16"}

# the key of Lightning's own checkpoint state in the engine checkpoint's client_state
_CLIENT_KEY = "lightning"

# the strategy whose live engine holds each module: a later fit (another Trainer's
# strategy included) releases it first, so that no two engines hook one module
_HOLDERS: weakref.WeakKeyDictionary[pl.LightningModule, weakref.ref[ZeroplaneStrategy]] = (
    weakref.WeakKeyDictionary()
)


def _precision_name(plugin: Precision) -> str:
    """The precision flag of one of Lightning's stock plugins that zeroplane can run,
    or a ValueError naming the flag (or plugin) it cannot."""
    name = getattr(plugin, "precision", None)
    stock = type(plugin) in (Precision, MixedPrecision, ZeroplanePrecision)
    if not stock or name not in PRECISIONS:
        raise ValueError(
            f"ZeroplaneStrategy does not support Trainer(precision={name!r}) "
            f"({type(plugin).__name__}): choose one of {', '.join(map(repr, PRECISIONS))} "
            "(zeroplane computes in that dtype with fp32 master weights)"
        )
    return name


def engine_config(
    config: ZeroConfig,
    *,
    precision: str,
    gradient_clip_val: float | None = None,
    gradient_clip_algorithm: str | None = None,
    accumulate_grad_batches: int = 1,
    automatic_optimization: bool = True,
) -> ZeroConfig:
    """``config`` with what the Trainer decides: the dtype from its precision, the
    clipping norm from ``gradient_clip_val`` and, with automatic optimization, the
    accumulation from ``accumulate_grad_batches``.

    A value set both ways must agree: a ZeroConfig field left at its default
    takes the Trainer's, and one that differs from the Trainer's is an error that
    names both, never a silent choice.
    """
    if precision not in PRECISIONS:
        raise ValueError(
            f"ZeroplaneStrategy does not support precision={precision!r}: choose one of "
            f"{', '.join(map(repr, PRECISIONS))}"
        )
    dtype = PRECISIONS[precision]
    if config.dtype not in ("fp32", dtype):
        wanted = next(k for k, v in PRECISIONS.items() if v == config.dtype)
        raise ValueError(
            f"ZeroConfig(dtype={config.dtype!r}) disagrees with Trainer(precision="
            f"{precision!r}): set Trainer(precision={wanted!r}) instead"
        )
    changes: dict[str, Any] = {"dtype": dtype}
    if gradient_clip_val:
        if gradient_clip_algorithm not in (None, GradClipAlgorithmType.NORM, "norm"):
            raise ValueError(
                f"ZeroplaneStrategy clips the global gradient norm only, got "
                f"Trainer(gradient_clip_algorithm={str(gradient_clip_algorithm)!r})"
            )
        clip = float(gradient_clip_val)
        if config.gradient_clipping not in (0.0, clip):
            raise ValueError(
                f"ZeroConfig(gradient_clipping={config.gradient_clipping}) disagrees with "
                f"Trainer(gradient_clip_val={gradient_clip_val}): set one of them"
            )
        changes["gradient_clipping"] = clip
    if automatic_optimization:
        k = accumulate_grad_batches
        if config.gradient_accumulation_steps not in (1, k):
            raise ValueError(
                f"ZeroConfig(gradient_accumulation_steps={config.gradient_accumulation_steps}) "
                f"disagrees with Trainer(accumulate_grad_batches={k}): with automatic "
                "optimization set Trainer(accumulate_grad_batches=...) only"
            )
        changes["gradient_accumulation_steps"] = k
    return config.replace(**changes)


class ZeroplanePrecision(Precision):
    """Lightning's precision hooks routed to the engine: backward and the optimizer
    step are the engine's, clipping is its config's, and no autocast (the engine's
    parameters and inputs are already in the compute dtype)."""

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in PRECISIONS:
            raise ValueError(
                f"ZeroplanePrecision: precision must be one of {', '.join(map(repr, PRECISIONS))}, "
                f"got {precision!r}"
            )
        self.precision = precision  # type: ignore[assignment]

    @property
    def dtype(self) -> str:
        """The ZeroConfig dtype this precision maps to."""
        return PRECISIONS[self.precision]

    def backward(  # type: ignore[override]
        self,
        tensor: torch.Tensor,
        model: pl.LightningModule,
        optimizer: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        if is_overridden("backward", model, pl.LightningModule):
            rank_zero_warn(
                "LightningModule.backward is overridden, but ZeroplaneStrategy runs "
                "engine.backward instead: the override is not called"
            )
        trainer = model.trainer
        if model.automatic_optimization and trainer.accumulate_grad_batches > 1:
            # Lightning divided the loss by accumulate_grad_batches; the engine divides
            # by its gradient_accumulation_steps (the same number) itself
            tensor = tensor * trainer.accumulate_grad_batches
        _engine_of(model).backward(tensor, *args, **kwargs)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        result = closure()  # training_step and backward (automatic optimization)
        self._after_closure(model, optimizer)
        if model.automatic_optimization and result is None:
            raise RuntimeError(
                "training_step returned None (skipping backward), which ZeroplaneStrategy "
                "does not support: every rank must run backward for the engine's reductions"
            )
        return _engine_of(model).step(**kwargs)

    def clip_gradients(
        self, optimizer: Any, clip_val: Any = 0.0, gradient_clip_algorithm: Any = None
    ) -> None:
        """The engine clips the global norm (ZeroConfig.gradient_clipping, set from
        Trainer(gradient_clip_val=...)): local gradients are partial at stages 2-3."""


def _engine_of(model: pl.LightningModule) -> ZeroEngine:
    strategy = model.trainer.strategy
    if not isinstance(strategy, ZeroplaneStrategy):
        raise TypeError(
            f"ZeroplanePrecision runs under ZeroplaneStrategy, not {type(strategy).__name__}"
        )
    return strategy.engine


class ZeroplaneStrategy(DDPStrategy):
    """Train a ``LightningModule`` with zeroplane's ZeRO engine (stages 0-3).

    ``config``: the engine's :class:`ZeroConfig`; ``stage``: shorthand for its stage
    (both may be given only if they agree). With neither, the stage is
    ``$ZEROPLANE_STAGE`` (``zeroplane run --stage``) or 0. The Trainer's precision,
    ``gradient_clip_val`` and ``accumulate_grad_batches`` set the matching fields
    (:func:`engine_config`). Under ``zeroplane run`` the coordinator's plan applies.

    The engine exists from ``Trainer.fit``'s setup on (:attr:`engine`) and stays after
    fit, so that ``trainer.save_checkpoint(dir)`` and ``engine.full_state_dict()``
    work then; the next fit releases it.
    """

    strategy_name = "zeroplane"

    def __init__(
        self,
        config: ZeroConfig | None = None,
        *,
        stage: int | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        if config is not None and not isinstance(config, ZeroConfig):
            raise TypeError(
                f"ZeroplaneStrategy(config=...) takes a worker.ZeroConfig, got "
                f"{type(config).__name__} (a DeepSpeed config: ZeroConfig.from_deepspeed(...))"
            )
        if stage is not None:
            if config is not None and config.stage != stage:
                raise ValueError(
                    f"ZeroplaneStrategy(stage={stage}) disagrees with its "
                    f"config's stage {config.stage}: give one of them"
                )
            config = (config or ZeroConfig()).replace(stage=stage)  # validates the stage
        self._config = config or ZeroConfig(stage=stage_from_env(ZeroConfig().stage))
        self._engine: ZeroEngine | None = None
        self._default_precision = ZeroplanePrecision()
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method="popen",
        )

    # ------------------------------------------------------------ what it holds

    @property
    def config(self) -> ZeroConfig:
        """The engine's config once it exists (the Trainer's settings and any
        coordinator's plan applied); before, the one given."""
        return self._engine.config if self._engine is not None else self._config

    @property
    def engine(self) -> ZeroEngine:
        if self._engine is None:
            raise RuntimeError(
                "ZeroplaneStrategy has no engine yet: Trainer.fit builds it when it sets up"
            )
        return self._engine

    @property
    def precision_plugin(self) -> Precision:
        return (
            self._precision_plugin
            if self._precision_plugin is not None
            else self._default_precision
        )

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning's connector hands over the plugin of the Trainer's precision flag;
        # its autocast and grad scaler are replaced by the engine's dtypes
        if plugin is not None and not isinstance(plugin, ZeroplanePrecision):
            plugin = ZeroplanePrecision(_precision_name(plugin))
        self._precision_plugin = plugin

    @property
    def handles_gradient_accumulation(self) -> bool:
        # Lightning calls optimizer_step on every batch; engine.step knows the boundary
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the checkpoint loads into the engine, built in setup

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine's checkpoint holds the (sharded) optimizer state

    # ------------------------------------------------------------ setup

    def setup_environment(self) -> None:
        if coordinator_address(None) and "WORLD_SIZE" in os.environ:
            launched = int(os.environ["WORLD_SIZE"])
            if launched != self.num_nodes * self.num_processes:
                raise ValueError(
                    f"zeroplane run started {launched} workers, but Trainer(devices="
                    f"{self.num_processes}, num_nodes={self.num_nodes}) makes a world of "
                    f"{self.num_nodes * self.num_processes}: set devices to $LOCAL_WORLD_SIZE"
                )
        super().setup_environment()

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        holder_ref = _HOLDERS.get(self.lightning_module)
        holder = holder_ref() if holder_ref is not None else None
        if holder is not None and holder._engine is not None and (fitting or holder is not self):
            # a new fit builds a new engine; another Trainer gets the module back whole
            holder._release_engine()
        if not fitting:
            if self._engine is None:
                # evaluation without an engine: the module replicated, as DDP evaluates
                self.model_to_device()
                assert self.model is not None
                _sync_module_states(self.model)
            self.setup_precision_plugin()
            return
        module = self.lightning_module
        assert module is not None
        if self._layer_sync is not None:
            raise ValueError(
                "ZeroplaneStrategy does not support Trainer(sync_batchnorm=True): "
                "batch norm statistics stay per rank"
            )
        optimizer, scheduler = self._take_optimizer(module)
        config = engine_config(
            self._config,
            precision=self.precision_plugin.precision,
            gradient_clip_val=trainer.gradient_clip_val,
            gradient_clip_algorithm=trainer.gradient_clip_algorithm,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            automatic_optimization=module.automatic_optimization,
        )
        if is_overridden("configure_gradient_clipping", module, pl.LightningModule):
            rank_zero_warn(
                "configure_gradient_clipping is overridden, but ZeroplaneStrategy clips in "
                "the engine (Trainer(gradient_clip_val=...)): the override's clipping does nothing"
            )
        self.model_to_device()
        self._engine = initialize(
            module, optimizer, config=config, lr_scheduler=scheduler, device=self.root_device
        )
        _HOLDERS[module] = weakref.ref(self)
        if (self._engine.rank, self._engine.world_size) != (self.global_rank, self.world_size):
            raise RuntimeError(
                f"the engine runs as rank {self._engine.rank} of {self._engine.world_size}, "
                f"Lightning as rank {self.global_rank} of {self.world_size}"
            )
        logger.info(
            "zeroplane engine: stage %d, dtype %s, rank %d of %d",
            self._engine.stage,
            self._engine.config.dtype,
            self._engine.rank,
            self._engine.world_size,
        )
        # Lightning keeps the user's optimizer for its hooks and LightningOptimizer;
        # its step goes to the engine (ZeroplanePrecision.optimizer_step)
        self.optimizers = [optimizer]
        self.setup_precision_plugin()

    def _take_optimizer(self, module: pl.LightningModule) -> tuple[torch.optim.Optimizer, Any]:
        """The one optimizer of ``configure_optimizers``, and the scheduler the engine
        takes: one stepped every optimizer step under automatic optimization. Any
        other scheduler stays in ``lr_scheduler_configs`` for Lightning to step."""
        optimizers, configs = _init_optimizers_and_lr_schedulers(module)
        if len(optimizers) != 1:
            raise ValueError(
                f"ZeroplaneStrategy trains with one optimizer; configure_optimizers returned "
                f"{len(optimizers)}"
            )
        if len(configs) > 1:
            raise ValueError(
                f"ZeroplaneStrategy takes at most one LR scheduler; configure_optimizers "
                f"returned {len(configs)}"
            )
        self.lr_scheduler_configs = list(configs)
        if configs and _engine_steps(configs[0], module):
            self.lr_scheduler_configs = []
            return optimizers[0], configs[0].scheduler
        return optimizers[0], None

    def _release_engine(self) -> None:
        """Put the trained values back into the module's parameters (fp32) and close the
        engine; a collective."""
        engine, self._engine = self._engine, None
        assert engine is not None and self.lightning_module is not None
        _HOLDERS.pop(self.lightning_module, None)
        full = engine.full_state_dict()
        engine.close()
        # stage 3: plain parameters again (worker/sharded.py [Note: sharded parameters])
        mark_gathered(self.lightning_module.parameters())
        with torch.no_grad():
            for name, p in self.lightning_module.named_parameters():
                if name in full:
                    p.data = full[name].clone()

    # ------------------------------------------------------------ steps: through engine.forward

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("training_step", self.precision_plugin.train_step_context, args, kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("predict_step", self.precision_plugin.predict_step_context, args, kwargs)

    def _step(self, name: str, context: Callable, args: tuple, kwargs: dict) -> Any:
        """``LightningModule.<name>`` called from inside ``engine.forward`` (Lightning's
        forward redirection, as its DDP and DeepSpeed strategies do): the engine casts
        the batch to its compute dtype and, at stage 3, gathers and frees parameters
        around each unit's forward."""
        module = self.lightning_module
        assert module is not None
        with context():
            if self._engine is None:
                return getattr(module, name)(*args, **kwargs)
            return self._forward_redirection(self._engine, module, name, *args, **kwargs)  # type: ignore[arg-type]

    # ------------------------------------------------------------ checkpoints

    def lightning_module_state_dict(self) -> dict[str, Any]:
        # the engine's checkpoint holds the parameters (sharded at stage 3 on the module)
        return {} if self._engine is not None else super().lightning_module_state_dict()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike, storage_options: Any = None
    ) -> None:
        """Write a zeroplane checkpoint directory at ``filepath`` (every rank calls this):
        the engine's sharded state, with Lightning's loops, callbacks and the rest of
        ``checkpoint`` in its client state."""
        if storage_options is not None:
            raise TypeError(
                "ZeroplaneStrategy writes checkpoint directories itself: "
                "Trainer.save_checkpoint(storage_options=...) is not supported"
            )
        filepath = self.broadcast(filepath)  # one directory, named by rank 0
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        self.engine.save_checkpoint(filepath, client_state={_CLIENT_KEY: _plain(rest)})

    def load_checkpoint(
        self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load a directory that :meth:`save_checkpoint` wrote, at any world size and
        stage, into the engine; returns Lightning's part for it to restore."""
        checkpoint_path = self.broadcast(checkpoint_path)
        if self._engine is None:
            raise RuntimeError(
                f"ZeroplaneStrategy loads {checkpoint_path} into its engine, which only "
                "Trainer.fit builds; to evaluate a zeroplane checkpoint, resume it with fit, "
                "or export its weights (`zeroplane checkpoint export DIR model.safetensors`) "
                "and load them into the module"
            )
        if Path(checkpoint_path).is_file():
            raise ValueError(
                f"{checkpoint_path} is a file; ZeroplaneStrategy resumes from the checkpoint "
                "directories it writes (trainer.save_checkpoint(DIR))"
            )
        client = self._engine.load_checkpoint(checkpoint_path)
        state = client.get(_CLIENT_KEY)
        if not isinstance(state, dict):
            raise ValueError(
                f"{checkpoint_path} is a zeroplane checkpoint without Lightning's state: "
                "it was not written by ZeroplaneStrategy"
            )
        return state

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._engine is None:
            super().load_model_state_dict(checkpoint, strict=strict)
        # otherwise the engine loaded the parameters in load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # the engine loaded the optimizer state in load_checkpoint

    # ------------------------------------------------------------ teardown

    def teardown(self) -> None:
        if self._engine is None:
            super().teardown()
            return
        # Strategy.teardown would move the module to the CPU, off the engine's buffers
        # its parameters view; the engine and module stay as they are until the next fit
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            "zeroplane",
            cls,
            description="zeroplane ZeRO engine (stage from $ZEROPLANE_STAGE, else 0)",
        )
        for stage in range(4):
            strategy_registry.register(
                f"zeroplane_stage_{stage}",
                cls,
                description=f"zeroplane ZeRO engine at stage {stage}",
                stage=stage,
            )


def _engine_steps(config: LRSchedulerConfig, module: pl.LightningModule) -> bool:
    """Whether the engine steps this scheduler: it steps after every optimizer step,
    which is what Lightning's automatic optimization does with interval "step" and
    frequency 1 (worker/schedule.py [Note: a scheduler that follows the step])."""
    return (
        module.automatic_optimization
        and config.interval == "step"
        and config.frequency == 1
        and not config.reduce_on_plateau
    )


def _plain(value: Any) -> Any:
    """``value`` with dict subclasses (Lightning's ``AttributeDict`` hyperparameters)
    and ``argparse.Namespace`` as plain dicts: the engine's checkpoints load with
    ``torch.load(weights_only=True)``."""
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_plain(v) for v in value)
    return value


if "zeroplane" not in StrategyRegistry:
    ZeroplaneStrategy.register_strategies(StrategyRegistry)
