"""``deepspeed.accelerator.get_accelerator()``: the device a script's tensors go to, as
DeepSpeed's accelerator object answers for it (CUDA where torch sees a GPU, else the
CPU), with the members DeepSpeed's example scripts call."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["get_accelerator"]


class Accelerator:
    """CUDA or the CPU, under DeepSpeed's accelerator names."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()

    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"``, ``"cuda:<i>"`` or ``"cpu"`` (the CPU has no index, as DeepSpeed's)."""
        if not self.cuda:
            return "cpu"
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def current_device(self) -> int:
        return torch.cuda.current_device() if self.cuda else 0

    def current_device_name(self) -> str:
        return self.device_name(self.current_device() if self.cuda else None)

    def set_device(self, device_index: int) -> None:
        if self.cuda:
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        return torch.cuda.device_count() if self.cuda else 1

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return "nccl" if self.cuda else "gloo"

    def synchronize(self, device_index: int | None = None) -> None:
        if self.cuda:
            torch.cuda.synchronize(device_index)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self.cuda else True

    def is_fp16_supported(self) -> bool:
        return self.cuda

    def empty_cache(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self.cuda else 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self.cuda else 0

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self.cuda else tensor

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == ("cuda" if self.cuda else "cpu")

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"get_accelerator().{name} is not in zeroplane's DeepSpeed drop-in; use torch's "
            f"own call for it (torch.cuda.{name} where there is one)"
        )


_ACCELERATOR: Accelerator | None = None


def get_accelerator() -> Accelerator:
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = Accelerator()
    return _ACCELERATOR
