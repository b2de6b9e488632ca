"""Mixed precision: compute dtype, reduce dtype, fp32 master weights, fp16 loss scaling.

With ``dtype="bf16"`` or ``"fp16"`` the compute parameters (views into the
buckets' flat buffers) and the model's inputs are in that dtype, gradients
are reduced in ``reduce_dtype`` (default: the compute dtype), and the
optimizer runs on fp32 master weights (worker/state.py). fp16 adds loss
scaling: the loss is multiplied by the scale before backward, gradients are
divided by it before the step, and a step whose gradients overflowed is
skipped (:class:`LossScaler`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worker.config import ZeroConfig

__all__ = ["TORCH_DTYPES", "LossScaler", "MixedPrecision"]

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class MixedPrecision:
    """The dtypes one engine computes and reduces in."""

    param_dtype: torch.dtype
    reduce_dtype: torch.dtype

    @classmethod
    def from_config(cls, config: ZeroConfig) -> MixedPrecision:
        return cls(
            param_dtype=TORCH_DTYPES[config.dtype],
            reduce_dtype=TORCH_DTYPES[config.reduce_dtype or config.dtype],
        )

    @property
    def enabled(self) -> bool:
        return self.param_dtype != torch.float32

    def cast_model(self, module: nn.Module) -> None:
        """Cast frozen parameters to the compute dtype; trainable parameters get it
        from their bucket.

        Buffers keep the dtype the model gave them (as FSDP2's mixed precision
        does): a rotary embedding's fp32 ``inv_freq`` rounded to bf16 would
        change the model. The one exception is batch norm's running statistics,
        which torch's ``batch_norm`` requires in its weight's dtype.
        """
        for m in module.modules():
            self.cast_module(m)

    def cast_module(self, m: nn.Module) -> None:
        """:meth:`cast_model` for ``m``'s own tensors. Meta tensors are left as they
        are: a module built on the meta device is cast once initialized in its
        original dtype (worker/birth.py), as an ordinary construction is."""
        if not self.enabled:
            return
        with torch.no_grad():
            for p in m.parameters(recurse=False):
                if not p.requires_grad and p.is_floating_point() and not p.is_meta:
                    p.data = p.data.to(self.param_dtype)
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.affine:
                for b in m.buffers(recurse=False):
                    if b.is_floating_point() and not b.is_meta:
                        b.data = b.data.to(self.param_dtype)

    def cast_input(self, x: Any) -> Any:
        if self.enabled and isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(self.param_dtype)
        return x

    @staticmethod
    def loss_scaler(config: ZeroConfig) -> LossScaler:
        fp16 = config.dtype == "fp16"
        return LossScaler(
            scale=(config.loss_scale or 2.0**config.initial_scale_power) if fp16 else 1.0,
            dynamic=fp16 and config.loss_scale == 0,
            window=config.loss_scale_window,
            hysteresis=config.hysteresis,
            min_scale=config.min_loss_scale,
        )


@dataclass
class LossScaler:
    """fp16 loss scaling: static, or dynamic with growth window and hysteresis.

    On an overflowing step the step is skipped; after ``hysteresis``
    consecutive overflows the scale halves (not below ``min_scale``). After
    ``window`` steps without overflow the scale doubles.

    With ``hysteresis=1`` this is ``torch.amp.GradScaler`` (growth_interval =
    window), step for step (tests/test_engine_precision.py). It is kept rather
    than GradScaler because the overflow is decided once for all ranks on
    sharded gradients (GradScaler inspects the local optimizer's gradients) and
    DeepSpeed's ``hysteresis`` and ``min_loss_scale`` have no GradScaler setting.
    """

    scale: float
    dynamic: bool
    window: int = 1000
    hysteresis: int = 1
    min_scale: float = 1.0
    _good_steps: int = 0
    _overflows_left: int = 0

    def __post_init__(self) -> None:
        self._overflows_left = self.hysteresis

    def position(self) -> tuple[int, int]:
        """Where the dynamic scale is in its window and hysteresis (saved and handed
        over with the scale, so every rank changes it at the same step)."""
        return self._good_steps, self._overflows_left

    def move_to(self, good_steps: int, overflows_left: int) -> None:
        self._good_steps = good_steps
        self._overflows_left = overflows_left or self.hysteresis

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self._good_steps = 0
            self._overflows_left -= 1
            if self._overflows_left <= 0:
                self.scale = max(self.scale / 2, self.min_scale)
                self._overflows_left = self.hysteresis
                logger.info("fp16 overflow: loss scale reduced to %g", self.scale)
            return
        self._overflows_left = self.hysteresis
        self._good_steps += 1
        if self._good_steps % self.window == 0:
            self.scale *= 2
