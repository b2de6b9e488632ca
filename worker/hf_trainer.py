"""Hugging Face ``Trainer`` on zeroplane: :class:`ZeroplaneTrainer`.

    from worker.hf_trainer import ZeroplaneTrainer

    args = TrainingArguments("out", per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, max_grad_norm=1.0)
    trainer = ZeroplaneTrainer(model=model, args=args, train_dataset=data,
                               zeroplane_config="ds_config.json")  # or a ZeroConfig
    trainer.train()
    trainer.save_model("out/final")     # consolidated safetensors, from_pretrained loads it

Run it as it is (one process), under torchrun, or under ``zeroplane run --nproc N``.

[Note: a Trainer subclass, not a TrainingArguments route]
accelerate's distributed backends are a closed list (``DistributedType``: DDP,
FSDP, DeepSpeed, Megatron, XLA, ...), and the Trainer hands backward, gradient
synchronisation, clipping and the optimizer step to it. ``TrainingArguments``
has no switch that names another engine: ``deepspeed=`` turns on accelerate's
DeepSpeed plugin, which imports and runs DeepSpeed itself. So zeroplane comes
in as a subclass that replaces the one piece where all of that happens, the
training loop (``_inner_training_loop``), and keeps the rest of the Trainer:
``create_optimizer`` / ``create_scheduler`` (``optim``, ``learning_rate``,
``weight_decay``, ``lr_scheduler_type``, ``warmup_*``), ``compute_loss``
(label smoothing, ``compute_loss_func``), the data collator and the removal of
unused columns, callbacks and their control flow (logging, saving, evaluation,
early stopping), ``TrainerState``, ``evaluate``. The loop:

- builds the engine with ``worker.initialize`` over the process group of the
  launcher's environment ([Note: whose process group]);
- feeds it from a step-addressed loader (worker/data/loader.py): the global batch
  is ``per_device_train_batch_size x world size x gradient_accumulation_steps``
  samples, the same on every rank, and each rank takes its contiguous share, cut
  into micro-batches of ``per_device_train_batch_size``;
- calls ``engine(...)`` through ``compute_loss``, ``engine.backward`` and
  ``engine.step`` for each micro-batch: the engine accumulates, reduces, clips
  to ``max_grad_norm`` and steps the optimizer and the Trainer's LR scheduler
  (which it owns: nobody else steps it);
- retries a step that an elastic job aborted (``worker.StepAborted``) at the
  engine's step, which is also the loader's position.

What differs from ``Trainer``: each micro-batch's loss is the model's own mean
and the step's gradient is the mean over micro-batches and ranks (DeepSpeed's
engine does the same; the Trainer's ``num_items_in_batch`` token weighting is
not used, which is the same thing when every micro-batch has as many label
tokens). An epoch is ``len(train_dataset) // global batch`` steps: the
incomplete last global batch of each epoch is left out (a different few
samples each epoch). ``training_step`` is not called (override ``compute_loss``
instead). The train dataset must be map-style (with ``__len__``).

[Note: whose process group]
Building ``TrainingArguments`` sets up accelerate's ``PartialState``, which
calls ``init_process_group`` from the launcher's environment (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``: torchrun and ``zeroplane run``
both set them) before any code of ours runs, on a CPU as on a GPU. The engine
trains in that group: under torchrun as a plain engine, under ``zeroplane run``
as a member attached to the coordinator's job (worker/attached.py: it
registers, reports, shows progress and metrics, and takes the coordinator's
stage and layout, but its membership is fixed: a lost rank ends the job, as
under torchrun). With one process and no launcher there is no group at all.
Rank and world size come from the engine, not from accelerate (which, on a
CPU, counts one process per group member).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers.trainer_callback import ExportableState, TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput, speed_metrics

import worker
from worker import ds_sections
from worker.birth import skip_init
from worker.config import ZeroConfig, stage_from_env
from worker.data import LoaderConfig, StepLoader
from worker.engine import ZeroEngine
from worker.hf import build_on_meta
from worker.spec import read_deepspeed_config

__all__ = ["ZeroplaneTrainer", "resolve_zeroplane_config"]

logger = logging.getLogger(__name__)

ConfigArg = ZeroConfig | Mapping[str, Any] | str | os.PathLike | None

# where ZeroplaneTrainer keeps the engine's checkpoint inside a checkpoint-N folder
ENGINE_DIR = "zeroplane"
TRAINER_STATE = "trainer_state.json"


def _precision(args: transformers.TrainingArguments) -> str:
    if args.fp16 and args.bf16:
        raise ValueError("TrainingArguments: fp16 and bf16 are both set; choose one")
    return "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"


def _hidden_size(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    size = getattr(config, "hidden_size", None)
    sizes = getattr(config, "hidden_sizes", None)
    if sizes:
        return max(sizes)
    return size if isinstance(size, int) else None


def _agree(ds: Mapping[str, Any], key: str, want: Any, arg: str) -> None:
    """A DeepSpeed key that TrainingArguments also sets: "auto", absent, or the same
    value (Hugging Face's DeepSpeed integration refuses a mismatch the same way)."""
    value = ds.get(key, "auto")
    if value == "auto" or value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or value != want:
        raise ValueError(
            f"zeroplane_config: {key!r} is {value!r} but TrainingArguments.{arg} gives {want!r}; "
            f'make it "auto" or the same'
        )


def _resolve_section(
    section: Any, name: str, values: Mapping[str, Any], where: str
) -> dict[str, Any]:
    """A DeepSpeed ``optimizer`` / ``scheduler`` section with its "auto" params filled
    in from ``values`` (as ``HfTrainerDeepSpeedConfig`` does)."""
    if not isinstance(section, Mapping) or not isinstance(section.get("params", {}), Mapping):
        raise ValueError(f"zeroplane_config: {name!r} must be an object with 'type' and 'params'")
    params = dict(section.get("params") or {})
    for key, value in params.items():
        if value == "auto":
            if key not in values:
                raise ValueError(
                    f'zeroplane_config: {name}.params.{key} is "auto" and no TrainingArguments '
                    f"field resolves it ({where}); give its value"
                )
            params[key] = values[key]
    return {**section, "params": params}


def resolve_zeroplane_config(
    config: ConfigArg,
    args: transformers.TrainingArguments,
    *,
    model: nn.Module | None = None,
    max_steps: int | None = None,
) -> tuple[ZeroConfig, dict[str, Any] | None, dict[str, Any] | None]:
    """The engine's :class:`ZeroConfig` for a Trainer run, and the DeepSpeed
    ``optimizer`` and ``scheduler`` sections (None when absent) with their "auto"
    values filled in.

    ``config``: None (a ZeroConfig from ``TrainingArguments`` alone, at
    ``$ZEROPLANE_STAGE`` or stage 3), a :class:`ZeroConfig`, or a DeepSpeed config
    (a dict or the path of its JSON file; Hugging Face's templates with "auto"
    work). ``TrainingArguments`` is the source of ``gradient_accumulation_steps``,
    ``max_grad_norm`` (gradient clipping) and ``fp16`` / ``bf16``: a DeepSpeed
    value other than "auto", or a ZeroConfig field other than its default, that
    disagrees with it raises. "auto" sizes (``reduce_bucket_size``,
    ``stage3_prefetch_bucket_size``) come from the model's hidden size, as in
    ``HfTrainerDeepSpeedConfig``; ``optimizer`` / ``scheduler`` "auto" params from
    ``learning_rate``, ``adam_beta1/2``, ``adam_epsilon``, ``weight_decay``,
    ``warmup_*`` and the number of steps (``max_steps``).
    """
    accum = args.gradient_accumulation_steps
    clip = float(args.max_grad_norm or 0.0)
    dtype = _precision(args)
    if config is None:
        return (
            ZeroConfig(
                stage=stage_from_env(3),
                gradient_accumulation_steps=accum,
                gradient_clipping=clip,
                dtype=dtype,
            ),
            None,
            None,
        )
    if isinstance(config, ZeroConfig):
        default = ZeroConfig()
        mine = {"gradient_accumulation_steps": accum, "gradient_clipping": clip, "dtype": dtype}
        args_name = {
            "gradient_accumulation_steps": "gradient_accumulation_steps",
            "gradient_clipping": "max_grad_norm",
            "dtype": "fp16/bf16",
        }
        for field, want in mine.items():
            have = getattr(config, field)
            if have != getattr(default, field) and have != want:
                raise ValueError(
                    f"zeroplane_config: ZeroConfig.{field}={have!r} but TrainingArguments."
                    f"{args_name[field]} gives {want!r}; leave the field at its default "
                    "(TrainingArguments sets it) or make them agree"
                )
        return config.replace(**mine), None, None
    if isinstance(config, str | os.PathLike | Mapping):
        try:
            ds = read_deepspeed_config(config)
        except ValueError as exc:
            raise ValueError(f"zeroplane_config: {exc}") from exc
    else:
        raise TypeError(
            "zeroplane_config must be a ZeroConfig, a DeepSpeed config dict or the path of its "
            f"JSON file, got {type(config).__name__}"
        )
    per_device = args.per_device_train_batch_size
    _agree(ds, "gradient_accumulation_steps", accum, "gradient_accumulation_steps")
    _agree(ds, "gradient_clipping", clip, "max_grad_norm")
    _agree(ds, "train_micro_batch_size_per_gpu", per_device, "per_device_train_batch_size")
    _agree(ds, "train_batch_size", per_device * _expected_world() * accum,
           "per_device_train_batch_size x world size x gradient_accumulation_steps")  # fmt: skip
    optimizer = ds.pop("optimizer", None)
    scheduler = ds.pop("scheduler", None)
    for key in (
        "gradient_accumulation_steps",
        "gradient_clipping",
        "train_micro_batch_size_per_gpu",
        "train_batch_size",
    ):
        ds.pop(key, None)  # TrainingArguments sets them (checked above)
    if optimizer is not None:
        optimizer = _resolve_section(
            optimizer,
            "optimizer",
            {
                "lr": args.learning_rate,
                "betas": [args.adam_beta1, args.adam_beta2],
                "eps": args.adam_epsilon,
                "weight_decay": args.weight_decay,
            },
            "learning_rate, adam_beta1/2, adam_epsilon, weight_decay",
        )
    if scheduler is not None:
        values: dict[str, Any] = {"warmup_min_lr": 0.0, "warmup_max_lr": args.learning_rate}
        if max_steps is not None:
            values["warmup_num_steps"] = args.get_warmup_steps(max_steps)
            values["total_num_steps"] = max_steps
        scheduler = _resolve_section(
            scheduler, "scheduler", values, "learning_rate, warmup_*, max_steps"
        )
    zero = ZeroConfig.from_deepspeed(
        ds,
        hidden_size=_hidden_size(model) if model is not None else None,
        fp16=bool(args.fp16),
        bf16=bool(args.bf16),
        gradient_accumulation_steps=accum,
        gradient_clipping=clip,
    )
    return zero, optimizer, scheduler


def _expected_world() -> int:
    """The world size a launcher announced (``$WORLD_SIZE``: torchrun, ``zeroplane run``),
    or the formed group's; 1 for one process."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


class _EngineForward(nn.Module):
    """What ``compute_loss`` calls as its model: ``engine(...)`` (stage 3 gathers,
    mixed-precision casts), under the wrapped model's name (label smoothing reads it)."""

    def __init__(self, engine: ZeroEngine) -> None:
        super().__init__()
        self.engine = engine  # not a Module: its model is not registered twice

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def train(self, mode: bool = True) -> _EngineForward:
        self.engine.train(mode)
        return super().train(mode)

    def _get_name(self) -> str:
        return self.engine.module._get_name()


class ZeroplaneTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` whose model and optimizer train in a zeroplane
    engine; see the module docstring [Note: a Trainer subclass, not a
    TrainingArguments route].

    ``model``: a model (every rank builds it; rank 0's values are broadcast), or
    the local directory that ``save_pretrained`` wrote: the model is then built on
    the meta device from its ``config.json`` (``model_class``, an auto class or a
    model class, ``AutoModelForCausalLM`` by default) and each rank reads only the
    weights it owns (``worker.from_pretrained``), so no rank holds it whole.

    ``zeroplane_config``: a :class:`ZeroConfig`, a DeepSpeed config (dict or JSON
    path, "auto" values welcome) or None; see :func:`resolve_zeroplane_config`.
    Its ``optimizer`` / ``scheduler`` sections, if any, replace the Trainer's own
    (as with ``--deepspeed``). Other arguments are the Trainer's.

    After ``train()``, ``trainer.engine`` is the :class:`~worker.ZeroEngine`.
    ``save_model`` is a collective under several ranks: every rank calls it.
    """

    def __init__(
        self,
        model: nn.Module | str | os.PathLike | None = None,
        args: transformers.TrainingArguments | None = None,
        *positional: Any,
        zeroplane_config: ConfigArg = None,
        model_class: Any = None,
        **kwargs: Any,
    ) -> None:
        if zeroplane_config is not None and not isinstance(
            zeroplane_config, ZeroConfig | Mapping | str | os.PathLike
        ):
            raise TypeError(
                "zeroplane_config must be a ZeroConfig, a DeepSpeed config dict or the path "
                f"of its JSON file, got {type(zeroplane_config).__name__}"
            )
        if args is not None and getattr(args, "deepspeed", None):
            raise ValueError(
                "TrainingArguments(deepspeed=...) runs accelerate's DeepSpeed plugin; give "
                "the config to ZeroplaneTrainer(zeroplane_config=...) instead"
            )
        self.pretrained: Path | None = None
        if isinstance(model, str | os.PathLike):
            self.pretrained = Path(model)
            model = build_on_meta(self.pretrained, model_class)
        elif model_class is not None:
            raise ValueError("model_class is for a model given as a directory path")
        self.zeroplane_config = zeroplane_config
        self.engine: ZeroEngine | None = None
        super().__init__(model, args, *positional, **kwargs)

    # ------------------------------------------------------------ what accelerate did

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        # the engine places the model (worker/birth.py); a model on the meta device
        # comes to life sharded there
        return None

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> Any:
        # evaluation and prediction run the engine's forward (stage 3 gathers); before
        # train() there is no engine and the model is whole
        if self.engine is None:
            return super()._wrap_model(model, training, dataloader)
        return _EngineForward(self.engine)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        # the engine loads its own checkpoint in the training loop
        return None

    def is_world_process_zero(self) -> bool:
        if self.engine is not None:
            return self.engine.rank == 0
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank() == 0
        return int(os.environ.get("RANK", "0")) == 0

    def is_local_process_zero(self) -> bool:
        local = os.environ.get("LOCAL_RANK")
        return int(local) == 0 if local is not None else self.is_world_process_zero()

    # ------------------------------------------------------------ the engine

    def _train_dataset(self) -> Any:
        dataset = self.train_dataset
        if dataset is None:
            raise ValueError("ZeroplaneTrainer: training requires a train_dataset")
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
            raise ValueError(
                "ZeroplaneTrainer needs a map-style train_dataset (with __len__ and "
                f"__getitem__), got {type(dataset).__name__}"
            )
        try:
            import datasets
        except ImportError:
            datasets = None
        if datasets is not None and isinstance(dataset, datasets.Dataset):
            return self._remove_unused_columns(dataset, description="training")
        return dataset

    def _collator(self, dataset: Any) -> Any:
        try:
            import datasets
        except ImportError:
            datasets = None
        if datasets is not None and isinstance(dataset, datasets.Dataset):
            return self.data_collator
        return self._get_collator_with_removed_columns(self.data_collator, description="training")

    def _build_engine(self, max_steps: int) -> ZeroEngine:
        """``worker.initialize`` on the Trainer's model, optimizer and LR scheduler."""
        args = self.args
        zero, opt_section, sched_section = resolve_zeroplane_config(
            self.zeroplane_config, args, model=self.model, max_steps=max_steps
        )
        if opt_section is not None and self.optimizer is not None:
            raise ValueError(
                "an optimizer was passed to the Trainer and zeroplane_config has an "
                "'optimizer' section: give one of them"
            )
        if sched_section is not None and self.lr_scheduler is not None:
            raise ValueError(
                "an LR scheduler was passed to the Trainer and zeroplane_config has a "
                "'scheduler' section: give one of them"
            )
        if opt_section is not None:
            ds_sections.optimizer_from_deepspeed(opt_section, [torch.zeros(1)])  # checked now
            self.optimizer = ds_sections.optimizer_from_deepspeed(
                opt_section, [p for p in self.model.parameters() if p.requires_grad]
            )
        else:
            self.create_optimizer()
        if sched_section is not None:
            self.lr_scheduler = ds_sections.scheduler_from_deepspeed(sched_section)(self.optimizer)
        else:
            self.create_scheduler(num_training_steps=max_steps, optimizer=self.optimizer)
        engine = worker.initialize(
            self.model,
            self.optimizer,
            config=zero,
            lr_scheduler=self.lr_scheduler,
            init=skip_init if self.pretrained is not None else None,
        )
        if self.pretrained is not None:
            engine.load_weights(self.pretrained)
        return engine

    # ------------------------------------------------------------ the loop

    def _inner_training_loop(
        self,
        batch_size: int | None = None,
        args: transformers.TrainingArguments | None = None,
        resume_from_checkpoint: str | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> TrainOutput:
        args = args or self.args
        if args.auto_find_batch_size:
            raise ValueError("ZeroplaneTrainer does not support auto_find_batch_size")
        dataset = self._train_dataset()
        per_device, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
        world = _expected_world()
        global_batch = per_device * world * accum
        steps_per_epoch = len(dataset) // global_batch
        if steps_per_epoch < 1:
            raise ValueError(
                f"the train dataset has {len(dataset)} samples, fewer than one global batch of "
                f"{global_batch} (per_device_train_batch_size {per_device} x world size "
                f"{world} x gradient_accumulation_steps {accum})"
            )
        if args.max_steps > 0:
            max_steps = args.max_steps
            num_epochs = math.ceil(max_steps / steps_per_epoch)
        else:
            max_steps = math.ceil(args.num_train_epochs * steps_per_epoch)
            num_epochs = math.ceil(args.num_train_epochs)

        if self.engine is None:
            self.engine = self._build_engine(max_steps)
        engine = self.engine
        if engine.world_size != world:
            logger.warning(
                "the job formed %d ranks, not the %d its launcher announced: the global "
                "batch stays %d samples, shared among %d",
                engine.world_size,
                world,
                global_batch,
                engine.world_size,
            )
        engine.progress(total=max_steps)
        seed = args.data_seed if args.data_seed is not None else args.seed
        workers = args.dataloader_num_workers
        loader = StepLoader(
            dataset,
            LoaderConfig(
                global_batch=global_batch,
                micro_batch=per_device,
                seed=seed,
                prefetch=2 if workers else 0,
                num_workers=workers,
            ),
            collate=self._collator(dataset),
        )
        loader.attach(engine, "hf_trainer_data")

        self.state = TrainerState(
            stateful_callbacks=[
                cb
                for cb in [*self.callback_handler.callbacks, self.control]
                if isinstance(cb, ExportableState)
            ]
        )
        self.state.is_hyper_param_search = trial is not None
        self.state.train_batch_size = per_device
        self.state.compute_steps(args, max_steps)
        if resume_from_checkpoint is not None:
            engine.load_checkpoint(Path(resume_from_checkpoint) / ENGINE_DIR)
            state_file = Path(resume_from_checkpoint) / TRAINER_STATE
            if state_file.is_file():
                self.state = TrainerState.load_from_json(str(state_file))
        self.state.init_training_references(self, max_steps, num_epochs, trial)
        self.state.global_step = engine.global_steps
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.model_wrapped = self.model
        forward = _EngineForward(engine)

        logger.info(
            "zeroplane: %d steps of %d samples (%d per rank in micro-batches of %d) at stage %d "
            "over %d ranks",
            max_steps,
            global_batch,
            global_batch // max(1, engine.world_size),
            per_device,
            engine.stage,
            engine.world_size,
        )
        start = time.time()
        first_step = engine.global_steps
        loss_since_log, logged_at, loss_total = 0.0, engine.global_steps, 0.0
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        try:
            while engine.global_steps < max_steps:
                step = engine.global_steps
                if step % steps_per_epoch == 0 or step == first_step:
                    self.control = self.callback_handler.on_epoch_begin(
                        args, self.state, self.control
                    )
                self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
                try:
                    lr = self._train_one_step(engine, loader, forward)
                except worker.StepAborted:
                    logger.info("step %d aborted; retrying at step %d", step, engine.global_steps)
                    continue
                self.state.global_step = engine.global_steps
                self.state.epoch = engine.global_steps / steps_per_epoch
                loss = engine.mean_loss()
                loss_since_log += loss if loss is not None else 0.0
                self.control = self.callback_handler.on_step_end(args, self.state, self.control)
                epoch_done = engine.global_steps % steps_per_epoch == 0
                if epoch_done or engine.global_steps >= max_steps:
                    self.control = self.callback_handler.on_epoch_end(
                        args, self.state, self.control
                    )
                if self.control.should_log and engine.global_steps > logged_at:
                    steps = engine.global_steps - logged_at
                    logs = {"loss": loss_since_log / steps, "learning_rate": lr}
                    if engine.last_grad_norm is not None:
                        logs["grad_norm"] = engine.last_grad_norm
                    loss_total += loss_since_log
                    loss_since_log, logged_at = 0.0, engine.global_steps
                    self.log(logs, start)
                if self.control.should_evaluate:
                    self._evaluate(trial, ignore_keys_for_eval, skip_scheduler=True)
                if self.control.should_save:
                    self._save_checkpoint(self.model, trial)
                    self.control = self.callback_handler.on_save(args, self.state, self.control)
                if self.control.should_training_stop:
                    break
        finally:
            loader.close()
        loss_total += loss_since_log
        trained = engine.global_steps - first_step
        train_loss = loss_total / max(trained, 1)
        metrics = speed_metrics(
            "train", start, num_samples=trained * global_batch, num_steps=trained
        )
        metrics["train_loss"] = train_loss
        self._memory_tracker.stop_and_update_metrics(metrics)
        self.log(metrics)
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        self.is_in_train = False
        return TrainOutput(engine.global_steps, train_loss, metrics)

    def _train_one_step(self, engine: ZeroEngine, loader: StepLoader, forward: nn.Module) -> float:
        """One optimizer step of this rank's micro-batches; the learning rate it used."""
        args = self.args
        micro = loader.current()
        lr = engine.get_lr()[0]
        self.model.train()
        for i, inputs in enumerate(micro):
            with self.compute_loss_context_manager():
                loss = self.compute_loss(forward, inputs)
            engine.backward(loss)
            last = i == len(micro) - 1
            if last:
                self.control = self.callback_handler.on_pre_optimizer_step(
                    args, self.state, self.control
                )
            ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else None
            engine.step(
                samples=len(ids) if ids is not None else 0,
                tokens=ids.numel() if isinstance(ids, torch.Tensor) else 0,
            )
            if last:
                self.control = self.callback_handler.on_optimizer_step(
                    args, self.state, self.control
                )
            else:
                self.control = self.callback_handler.on_substep_end(args, self.state, self.control)
        return lr

    # ------------------------------------------------------------ saving

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """``checkpoint-N/``: the engine's checkpoint (any world size and stage can
        resume it), the model as ``save_model`` writes it, and the TrainerState."""
        run_dir = Path(self._get_output_dir(trial=trial))
        folder = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        self.save_model(str(folder), _internal_call=True)
        assert self.engine is not None
        self.engine.save_checkpoint(folder / ENGINE_DIR)
        if self.is_world_process_zero():
            for cb in [*self.callback_handler.callbacks, self.control]:
                if isinstance(cb, ExportableState):
                    name = cb.__class__.__name__
                    self.state.stateful_callbacks[name] = cb.state()
            self.state.save_to_json(str(folder / TRAINER_STATE))
            transformers.trainer_utils.rotate_checkpoints(
                str(run_dir), self.args.save_total_limit, self.state.best_model_checkpoint
            )

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The model's weights as consolidated safetensors with its ``config.json``
        (``engine.save_pretrained``: gathered a bucket at a time, rank 0 writes),
        ``AutoModel*.from_pretrained`` loads them strictly; the tokenizer or processor
        and ``training_args.bin`` beside them. A collective: every rank calls it."""
        out = Path(output_dir if output_dir is not None else self.args.output_dir)
        if self.engine is None:
            if any(p.is_meta for p in self.model.parameters()):
                raise RuntimeError(
                    "save_model before train(): the model is still on the meta device"
                )
            if self.is_world_process_zero():
                self.model.save_pretrained(out)
        else:
            self.engine.save_pretrained(out)
        if not self.is_world_process_zero():
            return
        if self.processing_class is not None:
            self.processing_class.save_pretrained(out)
        torch.save(self.args, out / "training_args.bin")
