"""Stage-3 parameters outside forward: an error that says what to do, never a crash.

[Note: sharded parameters]
At stage 3 a parameter's values exist only while its gather unit is gathered
(inside the model's forward and backward): otherwise the storage under it is
freed, and a read would be a read of freed memory (a segfault). While its
unit is sharded, every parameter's Python class is :class:`ShardedParameter`,
whose ``__torch_function__`` lets metadata through (shape, dtype, hashing,
``.grad``) and turns any read of values (``p.sum()``, ``model.state_dict()``,
``torch.save``) into an error naming the parameter and the two ways to get
its values. Gathering a unit turns its parameters back into plain
``nn.Parameter`` objects, so forward and backward pay nothing for this.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

__all__ = ["ShardedParameter", "mark_gathered", "mark_sharded", "reads_data"]

# tensor methods and properties that look at metadata only, never at values
_METADATA = frozenset(
    {
        "size", "dim", "numel", "stride", "storage_offset", "element_size", "data_ptr",
        "untyped_storage", "is_floating_point", "is_complex", "is_contiguous",
        "register_hook", "register_post_accumulate_grad_hook", "shape", "dtype",
        "device", "requires_grad", "ndim", "is_cuda", "layout", "is_leaf", "grad_fn",
        "grad", "names", "is_sparse", "is_quantized", "is_meta", "is_nested",
        "_version", "output_nr", "itemsize", "nbytes", "__hash__", "requires_grad_",
        "get_device", "_is_view", "is_shared", "is_pinned",
    }
)  # fmt: skip

_NAME = "_zeroplane_name"


def reads_data(func: Callable) -> bool:
    """Whether calling ``func`` (as ``__torch_function__`` sees it) reads tensor values."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):  # a property: named by its descriptor
        name = getattr(getattr(func, "__self__", None), "__name__", "")
    return name not in _METADATA


class ShardedParameter(nn.Parameter):
    """A stage-3 parameter while its unit is sharded ([Note: sharded parameters])."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "__repr__":
            p = args[0]
            return (
                f"ShardedParameter({getattr(p, _NAME, '?')!r}, shape={tuple(p.shape)}, "
                f"dtype={p.dtype}: sharded by ZeRO stage 3 outside forward)"
            )
        if reads_data(func):
            sharded = next((a for a in _flat(args, kwargs) if type(a) is ShardedParameter), None)
            raise RuntimeError(
                f"parameter {getattr(sharded, _NAME, '?')!r} is sharded across the ranks "
                "(ZeRO stage 3): outside the model's forward and backward its values are "
                "not on this rank. Read them with engine.full_state_dict() (fp32, call it "
                "on every rank), or inside `with engine.gathered_params():` (every rank; "
                "clone what you keep)"
            )
        return super().__torch_function__(func, types, args, kwargs)


def _flat(args: tuple, kwargs: dict[str, Any]) -> Iterable[Any]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, list | tuple):
            yield from a
        else:
            yield a


def name_params(params: Iterable[nn.Parameter], names: Iterable[str]) -> None:
    """Remember each parameter's name, for the error above."""
    for p, name in zip(params, names, strict=True):
        setattr(p, _NAME, name)


def mark_sharded(params: Iterable[nn.Parameter]) -> None:
    for p in params:
        p.__class__ = ShardedParameter


def mark_gathered(params: Iterable[nn.Parameter]) -> None:
    for p in params:
        if type(p) is ShardedParameter:
            p.__class__ = nn.Parameter
