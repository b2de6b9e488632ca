"""Modules whose parts run on some ranks and not others, gathered whole at stage 3
(DeepSpeed's "leaf modules": :func:`set_z3_leaf_modules` under that name).

[Note: data-dependent modules at stage 3]
A stage-3 gather is a collective: every rank must gather the same units in the
same order. A mixture of experts breaks that when its experts are modules of
their own, each called only for the tokens routed to it (Mixtral in
transformers 4.x, DeepSeek's and most research MoE code): as soon as one rank
routes no token to an expert another rank uses, that rank skips the expert's
gather and the ranks' gathers fall out of step (a hang until the collective
timeout). A *leaf* module is gathered as one unit: its whole subtree's
parameters are one gather unit (worker/inventory.py ``_assign_units``), gathered
before its forward and its backward, so the data-dependent choice of which
experts run happens inside a module every rank runs. The ranks then issue the
same gathers whatever the routing; the experts no token reached get no
gradient (zero, as in torch: the used-parameter ballot keeps their optimizer
state as it was when no rank used them).

A module is a leaf when :func:`set_z3_leaf_modules` marked it, or, unless
:func:`unset_z3_leaf_modules` said otherwise, when it holds its experts as a
list: a child ``nn.ModuleList``/``nn.ModuleDict`` named ``*expert*`` with two
or more members (``MixtralSparseMoeBlock.experts``, ``Qwen2MoeSparseMoeBlock``,
``DeepseekV3MoE``, a research ``MoE`` block). The units are part of the
inventory every rank registers, so every rank marks the same modules (the
coordinator refuses a worker whose inventory differs). Stages 0-2 gather
nothing and need no leaves: a parameter no rank used keeps its value and state.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = [
    "get_z3_leaf_modules",
    "is_leaf",
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
]

# DeepSpeed marks a leaf module with this attribute; so does zeroplane, so a model
# marked for one is marked for the other
LEAF_ATTR = "_z3_leaf"


def set_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Iterable[type[nn.Module] | str]
) -> list[nn.Module]:
    """Mark every module of ``model`` whose class is one of ``leaf_module_classes``
    (classes, or class names) as a leaf: at stage 3 it is gathered whole, its
    parts never alone ([Note: data-dependent modules at stage 3]). Call it before
    ``worker.initialize``. Returns the modules marked; raises if none matched."""
    return _mark(model, leaf_module_classes, True)


def unset_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Iterable[type[nn.Module] | str]
) -> list[nn.Module]:
    """Mark the modules of those classes as not leaves, automatic detection
    included (a script whose experts run on every rank, say). Returns them."""
    return _mark(model, leaf_module_classes, False)


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that stage 3 gathers whole, in module order."""
    return [m for m in model.modules() if is_leaf(m)]


def z3_leaf_module(module: nn.Module) -> bool:
    """Whether ``module`` was marked a leaf by :func:`set_z3_leaf_modules`."""
    return getattr(module, LEAF_ATTR, False) is True


def is_leaf(module: nn.Module) -> bool:
    """Whether stage 3 gathers ``module`` whole: marked so, or holding its experts
    as a list of modules (and not marked otherwise)."""
    marked = getattr(module, LEAF_ATTR, None)
    if marked is not None:
        return bool(marked)
    return any(
        "expert" in name.lower() and isinstance(child, nn.ModuleList | nn.ModuleDict)
        and len(child) >= 2
        for name, child in module.named_children()
    )  # fmt: skip


def _mark(
    model: nn.Module, classes: Iterable[type[nn.Module] | str], value: bool
) -> list[nn.Module]:
    wanted = list(classes)
    names = {c for c in wanted if isinstance(c, str)}
    types = tuple(c for c in wanted if isinstance(c, type))
    if len(names) + len(types) != len(wanted):
        raise TypeError("leaf_module_classes holds module classes or class names")
    marked = [
        m for m in model.modules() if (types and isinstance(m, types)) or type(m).__name__ in names
    ]
    if not marked:
        given = ", ".join(c if isinstance(c, str) else c.__name__ for c in wanted)
        raise ValueError(f"no module of the model is of the classes given ({given})")
    for m in marked:
        setattr(m, LEAF_ATTR, value)
    return marked
