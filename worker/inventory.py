"""The model's parameter inventory: unique parameters, their groups and gather units."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from coordinator.core.layout import ParamSpec
from worker.leaves import is_leaf

__all__ = ["Inventory", "build_inventory", "dtype_name", "persistent_buffers"]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Inventory:
    """Unique parameters in registration order, with what the layout needs to know.

    Tied parameters (one ``Parameter`` reachable under several names) appear
    once, under their first name; ``aliases`` maps every name to that one.
    """

    specs: tuple[ParamSpec, ...]
    params: dict[str, nn.Parameter]
    aliases: dict[str, str]
    unit_modules: dict[int, nn.Module]

    @property
    def trainable(self) -> list[str]:
        return [s.name for s in self.specs if s.requires_grad]


def build_inventory(
    module: nn.Module,
    param_groups: list[dict],
    *,
    compute_dtype: torch.dtype,
    min_unit_numel: int | None,
    keep: Callable[[nn.Parameter], bool] | None = None,
) -> Inventory:
    """Describe ``module``'s parameters for the layout.

    ``param_groups`` are the optimizer's groups: each trainable parameter must
    be in exactly one. With ``min_unit_numel`` set (stage 3), parameters are
    also assigned to gather units (see :func:`_assign_units`); otherwise every
    parameter is in unit 0. ``keep``: the parameters this inventory holds (all by
    default); the others belong to another state (worker/moe/shards.py: the experts
    of an expert-parallel model) and are left out, optimizer groups included.
    """
    named = [
        (name, p)
        for name, p in module.named_parameters(remove_duplicate=False)
        if keep is None or keep(p)
    ]
    first_name: dict[nn.Parameter, str] = {}
    aliases: dict[str, str] = {}
    for name, p in named:
        aliases[name] = first_name.setdefault(p, name)

    group_of: dict[nn.Parameter, int] = {}
    for gi, group in enumerate(param_groups):
        for p in group["params"]:
            if keep is not None and not keep(p):
                continue
            if p not in first_name:
                raise ValueError(
                    f"optimizer param group {gi} holds a tensor of shape {tuple(p.shape)} "
                    "that is not a parameter of the model"
                )
            if p in group_of:
                raise ValueError(
                    f"parameter {first_name[p]!r} is in optimizer param groups "
                    f"{group_of[p]} and {gi}"
                )
            group_of[p] = gi

    units: dict[nn.Parameter, int] = {}
    unit_modules: dict[int, nn.Module] = {0: module}
    if min_unit_numel is not None:
        units, unit_modules = _assign_units(module, min_unit_numel, keep)

    specs, params = [], {}
    for p, name in first_name.items():
        if p.requires_grad and p not in group_of:
            raise ValueError(
                f"parameter {name!r} requires grad but is in no optimizer param group; "
                "add it to the optimizer or set requires_grad=False"
            )
        if p.requires_grad and not p.is_floating_point():
            raise ValueError(f"parameter {name!r} requires grad but has dtype {p.dtype}")
        dtype = compute_dtype if p.is_floating_point() else p.dtype
        specs.append(
            ParamSpec(
                name=name,
                shape=tuple(p.shape),
                dtype=dtype_name(dtype),
                requires_grad=p.requires_grad,
                group=group_of.get(p, 0),
                unit=units.get(p, 0),
            )
        )
        params[name] = p
    return Inventory(tuple(specs), params, aliases, unit_modules)


def _assign_units(
    root: nn.Module, min_numel: int, keep: Callable[[nn.Parameter], bool] | None = None
) -> tuple[dict[nn.Parameter, int], dict]:
    """Split the module tree into stage-3 gather units, FSDP-style.

    Walk the tree bottom-up. A module becomes a unit when it is an element of
    an ``nn.ModuleList``/``nn.Sequential`` (a repeated block) or when its
    not-yet-assigned parameters reach ``min_numel``. A unit takes only
    parameters all of whose owning modules lie inside it, so a tied weight
    used by two blocks goes to their common ancestor and is gathered while
    both run. A leaf module (worker/leaves.py [Note: data-dependent modules at
    stage 3]: a mixture of experts' block) is one unit with its whole subtree:
    nothing inside it becomes a unit of its own. The root (unit 0) takes
    everything left. Parameters ``keep`` leaves out (another state's) are not
    assigned and make no unit.
    """
    owners: dict[nn.Parameter, set[str]] = {}
    for mod_name, mod in root.named_modules(remove_duplicate=False):
        for p in mod.parameters(recurse=False):
            owners.setdefault(p, set()).add(mod_name)

    unit_of: dict[nn.Parameter, int] = {}
    unit_modules: dict[int, nn.Module] = {0: root}

    def inside(prefix: str, name: str) -> bool:
        return prefix == "" or name == prefix or name.startswith(prefix + ".")

    def visit(mod: nn.Module, prefix: str, is_block: bool, in_leaf: bool) -> None:
        is_container = isinstance(mod, nn.ModuleList | nn.Sequential)
        leaf = not in_leaf and mod is not root and is_leaf(mod)
        for child_name, child in mod.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            visit(child, name, is_container, in_leaf or leaf)
        if mod is root or in_leaf:
            return
        free = [
            p
            for p in _unique(mod.parameters())
            if p not in unit_of
            and all(inside(prefix, o) for o in owners[p])
            and (keep is None or keep(p))
        ]
        if free and (is_block or leaf or sum(p.numel() for p in free) >= min_numel):
            unit = len(unit_modules)
            unit_modules[unit] = mod
            for p in free:
                unit_of[p] = unit

    visit(root, "", False, False)
    return unit_of, unit_modules


def _unique(params) -> list[nn.Parameter]:
    return list(dict.fromkeys(params))


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``module.state_dict()`` holds, by the names it gives them:
    those not registered with ``persistent=False`` (as ``_save_to_state_dict``
    decides, without calling state-dict hooks or reading parameters)."""
    out = {}
    for prefix, mod in module.named_modules(remove_duplicate=False):
        for name, buf in mod._buffers.items():
            if buf is not None and name not in mod._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out
