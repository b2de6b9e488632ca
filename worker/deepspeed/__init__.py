"""DeepSpeed's calls as a training script makes them: ``import worker.deepspeed as
deepspeed`` in place of ``import deepspeed``.

[Note: a drop-in for DeepSpeed scripts]
A DeepSpeed script calls ``deepspeed.add_config_arguments(parser)``,
``deepspeed.init_distributed()``, then ``deepspeed.initialize(args=, model=,
model_parameters=, training_data=, config=)``, which returns a 4-tuple, and
trains with engine members zeroplane's engine names otherwise (or not at all):
``local_rank``, ``fp16_enabled()``, ``train_batch_size()``,
``gradient_accumulation_steps()`` (a method there, a property here). This module
takes those calls as they are and answers them from a zeroplane engine
(:class:`DeepSpeedEngine`, a view of it: everything else is the engine's own).

- ``initialize`` reads the config from ``config``, ``config_params`` or
  ``args.deepspeed_config``; ``model_parameters`` (parameters or param groups)
  build the config's optimizer over those groups; ``training_data`` gives a
  ``DataLoader`` of ``train_micro_batch_size_per_gpu`` samples, each rank its
  share by its data-parallel rank (a ``DistributedSampler``: set its epoch as
  with DeepSpeed; the world it splits by is the one at ``initialize``, so an
  elastic job uses ``worker.data.StepLoader`` instead, docs/migration/deepspeed.md).
- ``init_distributed`` forms the default group from the launcher's environment
  (``zeroplane run``, torchrun) when nobody has, so a script's own
  ``torch.distributed`` calls before ``initialize`` work; the engine then trains
  on that group (an attached job: worker/placement.py).
- the package mirrors DeepSpeed's modules a script imports from, so that
  ``from deepspeed.X import Y`` becomes ``from worker.deepspeed.X import Y``:
  ``comm`` (``torch.distributed`` under DeepSpeed's names), ``utils``
  (``set_z3_leaf_modules``, zeroplane's own: worker/leaves.py; ``logger``,
  ``log_dist``), ``accelerator`` (``get_accelerator()``), ``zero`` (``Init``: the
  model built on the meta device and born sharded; ``GatheredParameters``) and
  ``moe`` (``layer.MoE``, DeepSpeed's MoE layer: its ``ep_size`` becomes
  ``ParallelConfig(expert_parallel=ep_size)``; ``utils.
  split_params_into_different_moe_groups_for_optimizer``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from worker import ds_sections
from worker.deepspeed import accelerator, comm, moe, utils, zero
from worker.deepspeed.comm import init_distributed
from worker.deepspeed.moe.layer import expert_parallel_of
from worker.engine import ZeroEngine
from worker.entry import initialize as _initialize
from worker.parallel import ParallelConfig
from worker.spec import read_deepspeed_config

__all__ = [
    "DeepSpeedEngine",
    "accelerator",
    "add_config_arguments",
    "comm",
    "init_distributed",
    "initialize",
    "moe",
    "utils",
    "zero",
]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's ``--deepspeed`` and ``--deepspeed_config`` (and their old
    ``--deepscale`` names), on ``parser``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="train with it")
    group.add_argument("--deepspeed_config", default=None, type=str, help="its JSON config")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Dataset | None = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Mapping[str, Any] | str | os.PathLike | None = None,
    mesh_param: Any = None,
    config_params: Mapping[str, Any] | None = None,
) -> tuple[DeepSpeedEngine, Any, DataLoader | None, Any]:
    """``deepspeed.initialize``: (engine, optimizer, training data loader or None, LR
    scheduler or None), the engine a :class:`DeepSpeedEngine` over zeroplane's."""
    if model is None:
        raise ValueError("deepspeed.initialize needs model=")
    if mpu is not None or mesh_param is not None:
        raise ValueError(
            "deepspeed.initialize(mpu=/mesh_param=): zeroplane forms its mesh from "
            "worker.mesh.ParallelConfig (docs/guides/mesh.md); pass neither"
        )
    config = config if config is not None else config_params
    if config is None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is None:
        raise ValueError(
            "deepspeed.initialize: no config (config=, config_params= or args.deepspeed_config)"
        )
    raw = read_deepspeed_config(config)
    if optimizer is None and model_parameters is not None and "optimizer" in raw:
        # the config's optimizer over the script's param groups, as DeepSpeed builds it
        groups = list(model_parameters)
        optimizer = ds_sections.optimizer_from_deepspeed(raw.pop("optimizer"), groups)
        config = raw
    parallel = _parallel_for(model)
    engine = _initialize(
        model, optimizer, config=config, lr_scheduler=lr_scheduler, parallel=parallel
    )
    zero.ENGINES.add(engine)  # zero.GatheredParameters finds a parameter's engine here
    ds = DeepSpeedEngine(engine, raw)
    loader = None
    if training_data is not None:
        share, shares = engine.data_rank
        sampler = DistributedSampler(training_data, num_replicas=shares, rank=share)
        loader = DataLoader(
            training_data,
            batch_size=ds.train_micro_batch_size_per_gpu(),
            sampler=sampler,
            collate_fn=collate_fn,
        )
    return ds, engine.optimizer, loader, engine.lr_scheduler


def _parallel_for(model: nn.Module) -> ParallelConfig | None:
    """The launcher's layout with the expert parallelism the model's DeepSpeed MoE
    layers ask for (their ``ep_size``); None (the launcher's alone) without any."""
    ep = expert_parallel_of(model)
    if ep == 1:
        return None
    launched = ParallelConfig.from_env()
    if launched.expert_parallel not in (1, ep):
        raise ValueError(
            f"the model's MoE layers have ep_size={ep}, the launcher asks for "
            f"--ep {launched.expert_parallel}: give one size"
        )
    return ParallelConfig.from_env(expert_parallel=ep)


class DeepSpeedEngine:
    """A zeroplane engine as a DeepSpeed script calls it ([Note: a drop-in for
    DeepSpeed scripts]): DeepSpeed's members here, every other attribute the
    engine's own (``backward``, ``step``, ``save_checkpoint``, ``module``, ...)."""

    def __init__(self, engine: ZeroEngine, config: Mapping[str, Any]) -> None:
        self.engine = engine
        self._raw = dict(config)
        self._applied = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        before = (self.engine.global_steps, self.engine.skipped_steps)
        out = self.engine.step(*args, **kwargs)
        after = (self.engine.global_steps, self.engine.skipped_steps)
        if after != before:  # an accumulation boundary: applied, or skipped (fp16)
            self._applied = after[0] != before[0]
        return out

    def save_checkpoint(
        self,
        save_dir: str | os.PathLike,
        tag: Any = None,
        client_state: Mapping[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """DeepSpeed's signature: a zeroplane checkpoint in ``save_dir`` (its step
        folder is named by the step; a ``tag`` is not used), True once written."""
        self.engine.save_checkpoint(save_dir, client_state=dict(client_state or {}))
        return True

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str, dict]:
        """DeepSpeed's return value, ``(the path loaded, its client state)``, from a
        zeroplane checkpoint or a DeepSpeed ZeRO one (worker/ds_checkpoint.py)."""
        if not (load_module_strict and load_optimizer_states) or load_module_only:
            raise ValueError(
                "load_checkpoint loads the whole state (module strictly, optimizer and "
                "schedule); for the weights alone use engine.load_weights"
            )
        path = os.fspath(load_dir) if tag is None else os.path.join(load_dir, str(tag))
        return path, self.engine.load_checkpoint(path)

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    def fp16_enabled(self) -> bool:
        return self.engine.config.dtype == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.engine.config.dtype == "bf16"

    def zero_optimization_stage(self) -> int:
        return self.engine.config.stage

    def gradient_accumulation_steps(self) -> int:
        return self.engine.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        """As DeepSpeed derives it: the config's, else ``train_batch_size`` over the
        accumulation and the data-parallel world."""
        micro = self._raw.get("train_micro_batch_size_per_gpu")
        if micro is not None:
            return int(micro)
        total = self._raw.get("train_batch_size")
        if total is None:
            return 1
        return int(total) // (self.gradient_accumulation_steps() * self.engine.data_rank[1])

    def train_batch_size(self) -> int:
        return (
            self.train_micro_batch_size_per_gpu()
            * self.gradient_accumulation_steps()
            * self.engine.data_rank[1]
        )

    def was_step_applied(self) -> bool:
        """Whether the last optimizer step was taken (False: skipped on an fp16 overflow)."""
        return self._applied

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.engine.is_accumulation_boundary

    def get_global_grad_norm(self) -> float | None:
        return self.engine.last_grad_norm
