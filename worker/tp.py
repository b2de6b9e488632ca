"""Tensor parallelism with torch's own ``parallelize_module``, under ZeRO.

[Note: local parameters, DTensor forward]
``parallelize_module`` turns a planned module's parameters into DTensors and
puts DTensor conversions on its inputs and outputs (torch's ColwiseParallel /
RowwiseParallel). ZeRO's flat buffers, gradient hooks and stage-3 storage
(worker/flat.py, worker/stages.py) work on plain tensors, so
:func:`apply_tp` then gives each planned module back a plain ``nn.Parameter``
holding the local shard, under the same name. While that module runs its
forward, a pre-hook puts ``DTensor.from_local(local, mesh, placements)`` in
the module's instance ``__dict__`` (which attribute lookup reads before
``nn.Module.__getattr__`` consults ``_parameters``) and a post-hook removes
it: the forward computes with DTensors exactly as torch's plan intends (the
row-wise all-reduce, the column-wise input gradient's all-reduce in backward),
and the DTensor's backward hands the plain local parameter a plain local
gradient. ZeRO then sees an ordinary model whose parameters are the local
shards: it shards each local tensor across the data-parallel ranks.
The hooks are activated after the engine's own (:meth:`TensorParallel.activate`),
so at stage 3 a unit is gathered before its DTensor view is made.

[Note: replicated parameters under TP]
Parameters no plan entry shards (layer norms, embeddings here, a row-wise
layer's bias) are replicated across the tp ranks, and so are their gradients:
their inputs and the gradients flowing into them are replicated (a row-wise
layer's output is all-reduced in forward, a column-wise layer's input
gradient in backward), so every tp rank computes the same gradient from the
same data. They are reduced across dp only, like everything else; the
parity tests check this against a single-process reference.

[Note: where a local shard sits in its full parameter]
Checkpoints and ``full_state_dict`` address the FULL parameter.
:class:`TPSlice` says where a local shard's elements are: sharded along
``dim`` into ``size`` chunks (``torch.chunk``), chunk ``rank`` held here;
``parts > 1`` for a fused projection (GPT's ``attn`` holds q, k and v stacked
along dim 0): each part is chunked separately and the local shard is the
concatenation of chunk ``rank`` of every part, so a rank holds whole heads of
q, k and v. Its elements are runs of ``run`` contiguous full elements;
:meth:`TPSlice.full_runs` maps a local element range to full element ranges.

[Note: birth under tensor parallelism]
A model built on the meta device is planned on the meta device (torch's
styles shard meta tensors without moving data), so each rank holds meta
local shards, and the engine brings them to life a module at a time
(worker/birth.py). A module initialized on its local shard would not draw
what it draws whole (``nn.Linear``'s bound comes from its full fan-in, and a
shard's draws are not a slice of the whole's), so for the duration of a
planned module's initialization :meth:`TensorParallel.whole` puts whole
tensors in place of its local ones; on the way out each local shard takes
its part (:meth:`TPSlice.take`). Every rank draws the same whole tensors
from its default generator, as an ordinary construction with the same seed
does, and keeps its slice: a rank holds one module whole at a time, and the
values equal the ordinary construction's at every tp, dp and stage
(tests/test_pretrained_mesh.py).
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
)

from worker.collectives import Collectives
from worker.compat import eager, forget_meshes, parallelize_local, rebind_hook_mesh

__all__ = [
    "Conv1DColwiseParallel",
    "Conv1DRowwiseParallel",
    "FusedColwiseParallel",
    "LocalWidth",
    "TPSlice",
    "TensorParallel",
    "apply_tp",
    "gather_full",
    "gpt2_plan",
    "gpt_plan",
    "hf_plan",
    "llama_plan",
]

Plan = Mapping[str, ParallelStyle]


class FusedColwiseParallel(ColwiseParallel):
    """Column-wise over a projection that stacks ``parts`` outputs along dim 0
    (a fused q/k/v): each part is sharded on its own, so every rank holds the
    same heads of each ([Note: where a local shard sits in its full parameter])."""

    def __init__(self, parts: int, **kwargs) -> None:
        super().__init__(**kwargs)
        if parts < 1:
            raise ValueError(f"FusedColwiseParallel parts must be >= 1, got {parts}")
        self.parts = parts

    def _partition_linear_fn(self, name, module, device_mesh):
        rank, size = device_mesh.get_local_rank(), device_mesh.size()
        for pname, param in list(module.named_parameters()):
            local = TPSlice(tuple(param.shape), 0, rank, size, self.parts).take(param.detach())
            dist_param = nn.Parameter(
                DTensor.from_local(local, device_mesh, [Shard(0)], run_check=False),
                requires_grad=param.requires_grad,
            )
            module.register_parameter(pname, dist_param)


class Conv1DColwiseParallel(ColwiseParallel):
    """Column-wise over a GPT-2 ``Conv1D`` (``x @ weight + bias``, ``weight`` of
    shape ``[in, out]``): the output features are the weight's dim 1 and the
    bias's dim 0; ``parts`` > 1 for a fused projection (GPT-2's ``c_attn`` stacks
    q, k and v), each part sharded on its own as :class:`FusedColwiseParallel`."""

    def __init__(self, parts: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        if parts < 1:
            raise ValueError(f"Conv1DColwiseParallel parts must be >= 1, got {parts}")
        self.parts = parts

    def _partition_conv1d_fn(self, name, module, device_mesh):
        rank, size = device_mesh.get_local_rank(), device_mesh.size()
        for pname, dim in (("weight", 1), ("bias", 0)):
            param = module._parameters.get(pname)
            if param is None:
                continue
            local = TPSlice(tuple(param.shape), dim, rank, size, self.parts).take(param.detach())
            dist_param = nn.Parameter(
                DTensor.from_local(local, device_mesh, [Shard(dim)], run_check=False),
                requires_grad=param.requires_grad,
            )
            module.register_parameter(pname, dist_param)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            self._partition_conv1d_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class Conv1DRowwiseParallel(RowwiseParallel):
    """Row-wise over a GPT-2 ``Conv1D``: the input features are the weight's dim 0;
    the bias is replicated and the partial outputs all-reduced, as torch's
    ``RowwiseParallel`` does for ``nn.Linear``."""

    def _partition_conv1d_fn(self, name, module, device_mesh):
        rank, size = device_mesh.get_local_rank(), device_mesh.size()
        weight = module.weight
        local = TPSlice(tuple(weight.shape), 0, rank, size).take(weight.detach())
        module.register_parameter(
            "weight",
            nn.Parameter(
                DTensor.from_local(local, device_mesh, [Shard(0)], run_check=False),
                requires_grad=weight.requires_grad,
            ),
        )
        bias = module._parameters.get("bias")
        if bias is not None:
            module.register_parameter(
                "bias",
                nn.Parameter(
                    DTensor.from_local(bias.detach(), device_mesh, [Replicate()], run_check=False),
                    requires_grad=bias.requires_grad,
                ),
            )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module,
            device_mesh,
            self._partition_conv1d_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class LocalWidth(ParallelStyle):
    """Divide a module's integer attributes by tp: for a module that splits a
    column-wise output at a width of its own (GPT-2's attention splits ``c_attn``'s
    output at ``split_size``), which under tp is the local width. No parameter moves."""

    def __init__(self, *attributes: str) -> None:
        self.attributes = attributes

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        size = device_mesh.size()
        for attr in self.attributes:
            value = getattr(module, attr)
            if not isinstance(value, int) or value % size:
                raise ValueError(
                    f"{type(module).__name__}.{attr} = {value!r} does not split into {size} "
                    "equal tensor-parallel parts"
                )
            setattr(module, attr, value // size)
        return module


def gpt_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """worker.models.GPT: Megatron-style blocks (fused q/k/v and the MLP's first
    layer column-wise, the projections back row-wise); embeddings, norms and the
    (tied) head replicated."""
    del model
    return {
        "blocks.*.attn": FusedColwiseParallel(3),
        "blocks.*.proj": RowwiseParallel(),
        "blocks.*.fc": ColwiseParallel(),
        "blocks.*.fc_out": RowwiseParallel(),
    }


def llama_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """A Hugging Face Llama-style decoder (``model.layers.*.self_attn.{q,k,v,o}_proj``,
    ``mlp.{gate,up,down}_proj``): q/k/v and gate/up column-wise, o and down
    row-wise; the embedding row-wise and the head column-wise with replicated
    outputs, as torch's TP examples do (when they are not tied). The head counts
    must divide by tp; HF's attention reshapes with ``-1`` heads, so it runs on
    the local heads as it is."""
    plan: dict[str, ParallelStyle] = {
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": ColwiseParallel(),
        "model.layers.*.self_attn.v_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
    }
    if not _tied(model):
        if _has(model, "model.embed_tokens"):
            plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
        if _has(model, "lm_head"):
            plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    return plan


def gpt2_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """A Hugging Face GPT-2 (``GPT2LMHeadModel`` or ``GPT2Model``; its ``Conv1D``
    layers hold ``[in, out]`` weights): the fused ``c_attn`` column-wise per part
    (a rank holds whole heads of q, k and v) and the MLP's ``c_fc`` column-wise,
    both ``c_proj`` row-wise; the attention splits the local width; embeddings,
    norms and the tied head replicated."""
    h = "transformer.h" if _has(model, "transformer") else "h"
    return {
        f"{h}.*.attn": LocalWidth("split_size"),
        f"{h}.*.attn.c_attn": Conv1DColwiseParallel(parts=3),
        f"{h}.*.attn.c_proj": Conv1DRowwiseParallel(),
        f"{h}.*.mlp.c_fc": Conv1DColwiseParallel(),
        f"{h}.*.mlp.c_proj": Conv1DRowwiseParallel(),
    }


def moe_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """A Hugging Face mixture-of-experts decoder laid out as Llama (Mixtral,
    Qwen2-MoE, Qwen3-MoE): the attention, embedding and head as :func:`llama_plan`;
    each MoE layer (router, experts, a shared expert) whole on every tp rank, its
    experts split over ep instead (worker/moe/dispatch.py [Note: experts on a
    mesh])."""
    return {k: v for k, v in llama_plan(model).items() if ".mlp." not in k}


# the tested ones (tests/test_pretrained_mesh.py, tests/test_moe_job.py); a decoder
# laid out as Llama (Mistral, Qwen2) takes plan=llama_plan
_HF_PLANS: dict[str, Callable[[nn.Module], dict[str, ParallelStyle]]] = {
    "gpt2": gpt2_plan,
    "llama": llama_plan,
    "mixtral": moe_plan,
    "qwen2_moe": moe_plan,
    "qwen3_moe": moe_plan,
}


def hf_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """The plan of a Hugging Face model by its ``config.model_type``: GPT-2
    (:func:`gpt2_plan`), Llama (:func:`llama_plan`), Mixtral or Qwen2/3-MoE
    (:func:`moe_plan`); any other model needs a plan of its own."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in _HF_PLANS:
        raise ValueError(
            f"no tensor-parallel plan for model_type {model_type!r} (known: "
            f"{sorted(_HF_PLANS)}): pass plan={{module pattern: ParallelStyle}}"
        )
    return _HF_PLANS[model_type](model)


def _has(model: nn.Module, name: str) -> bool:
    return name in dict(model.named_modules())


def _tied(model: nn.Module) -> bool:
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    return len(names) != len(list(model.parameters()))


@dataclass(frozen=True, slots=True)
class TPSlice:
    """Where a local shard's elements sit in the full parameter (see the module
    note); ``dim=None``: replicated, the local tensor is the full one."""

    full_shape: tuple[int, ...]
    dim: int | None
    rank: int
    size: int
    parts: int = 1

    def __post_init__(self) -> None:
        if self.dim is None:
            return
        extent = self.full_shape[self.dim]
        if extent % (self.parts * self.size):
            raise ValueError(
                f"a dimension of {extent} elements cannot be split into {self.parts} part(s) "
                f"of {self.size} equal tensor-parallel shards"
            )

    @property
    def full_numel(self) -> int:
        return math.prod(self.full_shape)

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.dim] //= self.size
        return tuple(shape)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's local shard of ``full`` (a new contiguous tensor)."""
        if self.dim is None:
            return full.clone()
        parts = full.chunk(self.parts, dim=self.dim)
        return torch.cat([p.chunk(self.size, dim=self.dim)[self.rank] for p in parts], self.dim)

    def _geometry(self) -> tuple[int, int, int, int]:
        """(run, outer stride in full, part stride in full, offset of this rank)."""
        assert self.dim is not None
        inner = math.prod(self.full_shape[self.dim + 1 :])
        extent = self.full_shape[self.dim]
        part_len = extent // self.parts
        local_len = part_len // self.size
        return local_len * inner, extent * inner, part_len * inner, self.rank * local_len * inner

    def full_runs(self, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
        """``(local_start, full_start, numel)`` for each run of local elements
        ``[start, stop)`` that is contiguous in the full parameter, in order."""
        if self.dim is None:
            if start < stop:
                yield start, start, stop - start
            return
        run, outer_stride, part_stride, offset = self._geometry()
        pos = start
        while pos < stop:
            j, within = divmod(pos, run)
            outer, part = divmod(j, self.parts)
            n = min(run - within, stop - pos)
            yield pos, outer * outer_stride + part * part_stride + offset + within, n
            pos += n


class TensorParallel:
    """A model whose planned modules hold local shards ([Note: local parameters,
    DTensor forward]); :attr:`slices` says where each sits in its full parameter."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        # this rank's place, kept: it outlives the mesh of a job that re-forms
        self._size, self._rank = mesh.size(), mesh.get_local_rank()
        self.slices: dict[str, TPSlice] = {}
        # module -> [(parameter name, placements)], and the module's name in the model
        self._views: dict[nn.Module, list[tuple[str, tuple]]] = {}
        self._names: dict[nn.Module, str] = {}
        self._hooks: list = []
        self._sharded = False  # (activate)
        # the input and output hooks torch's styles put on each planned module
        # (closures over the mesh), for :meth:`rebind`
        self._torch_hooks: list[Callable] = []

    @property
    def size(self) -> int:
        return self._size

    @property
    def rank(self) -> int:
        return self._rank

    @contextlib.contextmanager
    def whole(self, module: nn.Module) -> Iterator[None]:
        """For the duration, ``module``'s planned parameters are whole tensors
        (uninitialized, where its local ones are); on a normal exit each local
        parameter takes its part of the whole one's values ([Note: birth under
        tensor parallelism]). Any other module: nothing changes."""
        views = self._views.get(module)
        if not views:
            yield
            return
        params = module._parameters
        prefix = self._names[module]
        local: dict[str, tuple[nn.Parameter, TPSlice]] = {}
        for pname, _ in views:
            p = params[pname]
            assert p is not None
            tp_slice = self.slices[f"{prefix}.{pname}" if prefix else pname]
            local[pname] = (p, tp_slice)
            whole = torch.empty(tp_slice.full_shape, dtype=p.dtype, device=p.device)
            params[pname] = nn.Parameter(whole, requires_grad=p.requires_grad)
        try:
            yield
            with torch.no_grad():
                for pname, (p, tp_slice) in local.items():
                    p.copy_(tp_slice.take(params[pname].detach()))
        finally:
            params.update({pname: p for pname, (p, _) in local.items()})

    def rebind(self, mesh: DeviceMesh) -> None:
        """Run on ``mesh`` from now on: the tp group of a job that re-formed (an
        elastic mesh job's new generation, worker/elastic/rings.py). Each
        rank keeps its tp index, so the local shards and :attr:`slices` stand; the
        DTensor views and torch's input and output conversions take the new mesh."""
        if mesh.size() != self.size:
            raise ValueError(
                f"a tensor-parallel group of {self.size} ranks cannot move to one of {mesh.size()}"
            )
        if mesh.get_local_rank() != self.rank:
            raise ValueError(
                f"tp rank {self.rank} cannot move to tp rank {mesh.get_local_rank()}: its "
                "local shards are another slice"
            )
        for hook in self._torch_hooks:
            rebind_hook_mesh(hook, mesh)
        forget_meshes()  # cached decisions would bring back the old mesh's groups
        self.mesh = mesh
        if self._hooks:
            self.activate()

    def activate(self, *, sharded: bool | None = None) -> None:
        """Install the DTensor-view hooks (after the engine's: see the module note).
        ``sharded``: the engine holds its parameters sharded (stage 3; None: as at
        the last activation). Then the hooks stay out of compiled graphs, as the
        engine's own do (worker/factory.py [Note: compiling at stage 3]): dynamo
        would read the parameters while tracing, before a gather; at stages 0-2 it
        traces them, and a compiled model keeps its graphs whole."""
        if sharded is not None:
            self._sharded = sharded
        self.deactivate()
        wrap = eager if self._sharded else (lambda hook: hook)
        for module, views in self._views.items():
            self._hooks += [
                module.register_forward_pre_hook(wrap(self._pre(views))),
                module.register_forward_hook(wrap(self._post(views)), always_call=True),
            ]

    def deactivate(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _pre(self, views):
        mesh = self.mesh

        def hook(module: nn.Module, args) -> None:
            for name, placements in views:
                module.__dict__.pop(name, None)
                local = getattr(module, name)
                module.__dict__[name] = DTensor.from_local(local, mesh, placements, run_check=False)

        return hook

    def _post(self, views):
        def hook(module: nn.Module, args, output) -> None:
            for name, _ in views:
                module.__dict__.pop(name, None)

        return hook


def _matches(pattern: str, name: str) -> bool:
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(
        fnmatch.fnmatchcase(p, a) for a, p in zip(atoms, parts, strict=True)
    )


def stage_plan(plan: Plan, stage: nn.Module, model: nn.Module) -> Plan:
    """The entries of the whole ``model``'s ``plan`` that its pipeline ``stage``
    holds a module of (the embedding's only on the first stage, the head's only on
    the last); an entry that matches no module of the model at all stays, for
    :func:`apply_tp` to name."""
    held = [n for n, _ in stage.named_modules()]
    whole = [n for n, _ in model.named_modules()]
    return {
        pattern: style
        for pattern, style in plan.items()
        if any(_matches(pattern, n) for n in held) or not any(_matches(pattern, n) for n in whole)
    }


def apply_tp(
    model: nn.Module, mesh: DeviceMesh, plan: Plan, *, whole: tuple[str, ...] = ()
) -> TensorParallel:
    """Parallelize ``model`` over the 1-D ``mesh`` with torch's ``parallelize_module``
    and ``plan`` (module name patterns, ``*`` per name atom, as torch's), then give
    each planned module plain local parameters ([Note: local parameters, DTensor
    forward]). Every plan entry must match a module; call before the optimizer
    is built over ``model.parameters()`` (or let worker/mesh.py rebuild it).
    ``whole``: modules no entry may split, nor anything inside them (the experts
    under expert parallelism)."""
    if mesh.ndim != 1:
        raise ValueError(f"apply_tp expects a 1-D tensor-parallel mesh, got {mesh.ndim}-D")
    tp = TensorParallel(mesh)
    names = [n for n, _ in model.named_modules()]
    by_module = dict(model.named_modules())
    unmatched = [pattern for pattern in plan if not any(_matches(pattern, n) for n in names)]
    if unmatched:
        raise ValueError(f"tensor-parallel plan entries match no module of the model: {unmatched}")
    for name in names:
        styles = [s for pattern, s in plan.items() if _matches(pattern, name)]
        if not styles:
            continue
        if len(styles) > 1:
            raise ValueError(f"module {name!r} matches {len(styles)} tensor-parallel plan entries")
        kept = [w for w in whole if name == w or name.startswith(w + ".")]
        if kept:
            raise ValueError(
                f"the tensor-parallel plan splits {name!r}, inside the experts module "
                f"{kept[0]!r}, which expert parallelism keeps whole on every tp rank: "
                "leave the experts out of the plan (docs/guides/moe.md)"
            )
        module = by_module[name]
        hooks_before = {*module._forward_pre_hooks, *module._forward_hooks}
        parallelize_local(module, mesh, styles[0])
        for table in (module._forward_pre_hooks, module._forward_hooks):
            tp._torch_hooks += [h for k, h in table.items() if k not in hooks_before]
        parts = getattr(styles[0], "parts", 1)  # fused projections
        views = []
        for pname, p in list(module.named_parameters(recurse=False)):
            if not isinstance(p, DTensor):
                continue
            placement = p.placements[0]
            dim = placement.dim % p.ndim if isinstance(placement, Shard) else None
            full = f"{name}.{pname}" if name else pname
            tp.slices[full] = TPSlice(tuple(p.shape), dim, tp.rank, tp.size, parts)
            local = nn.Parameter(p.to_local().detach().clone(), requires_grad=p.requires_grad)
            setattr(module, pname, local)
            views.append((pname, tuple(p.placements)))
        if views:
            tp._views[module] = views
            tp._names[module] = name
    return tp


def gather_full(
    local: dict[str, torch.Tensor], slices: dict[str, TPSlice], comm: Collectives
) -> dict[str, torch.Tensor]:
    """Full parameters from every tp rank's local ones (by name); a collective over
    the tp group ``comm``. Replicated and unplanned parameters pass through."""
    out = {}
    for name, value in local.items():
        tp_slice = slices.get(name)
        if tp_slice is None or tp_slice.dim is None:
            out[name] = value
            continue
        flat = value.reshape(-1).contiguous()
        gathered = flat.new_empty(flat.numel() * tp_slice.size)
        comm.all_gather(gathered, flat)
        full = flat.new_empty(tp_slice.full_numel)
        for r, piece in enumerate(gathered.view(tp_slice.size, -1)):
            other = TPSlice(tp_slice.full_shape, tp_slice.dim, r, tp_slice.size, tp_slice.parts)
            for lo, fo, n in other.full_runs(0, flat.numel()):
                full[fo : fo + n] = piece[lo : lo + n]
        out[name] = full.view(tp_slice.full_shape)
    return out
