"""Context parallelism beside ZeRO: the cp groups, the batch split by sequence, the
attention every model of the job calls, and the loss over the whole batch.

[Note: context parallelism]
``ParallelConfig(context_parallel=k)`` makes blocks of k consecutive ranks cp
groups (the same layout as ep groups): the ranks of one hold the same batch and
each computes a shard of every sequence ([Note: sequence shards]). The ZeRO state
is sharded over the whole world, dp x cp, as every rank holds the whole model:
each rank's gradients are those of its tokens, and their sum over a cp group is
the gradient of its batch. So the loss of every rank is its tokens' summed loss
over the number of tokens of the whole global batch (every rank and cp shard),
times the world size, which the engine's mean over the world divides back: the
step is the mean over every token of the global batch, as one process takes it,
whatever cp is (not a mean of the shards' means).

Hugging Face decoders need no edit: the engine registers an attention function
with transformers' attention interface and switches the model to it; a forward
called with ``input_ids`` (and ``labels``, ``position_ids``) gets this rank's
shard of each, the labels shifted over the whole sequence first (a shard's last
token predicts the next shard's first), and the token count of the whole batch
as ``num_items_in_batch``. A user's model calls :func:`worker.context.attention`
and splits its inputs with :meth:`ContextParallel.split`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker.activations import without_kv_cache
from worker.collectives import Collectives
from worker.compat import eager
from worker.context.ring import ring_attention
from worker.context.shards import Kind, SequenceBatch, documents, shard_index
from worker.context.ulysses import ulysses_attention

__all__ = ["ATTENTION_NAME", "ContextParallel", "active", "attention"]

# the name under which transformers' attention interface finds zeroplane's
ATTENTION_NAME = "zeroplane_context_parallel"
_IGNORE = -100

# the context of this process's engine (one engine a process)
_ACTIVE: list[ContextParallel] = []


def active() -> ContextParallel:
    if not _ACTIVE:
        raise RuntimeError(
            "worker.context.attention is called outside a context-parallel engine: build "
            "the engine with ParallelConfig(context_parallel=k)"
        )
    return _ACTIVE[-1]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's tokens over the whole sequence, for a model of
    a context-parallel job: ``q`` B x H x s x D, ``k`` and ``v`` B x H_kv x s x D (s =
    this rank's tokens of the batch :meth:`ContextParallel.split` split last),
    returning B x H x s x D. Documents packed in a row (position ids restarting)
    never attend across; ``window``: each token attends to the last ``window`` only
    (a sliding window). Equal to ``F.scaled_dot_product_attention(q, k, v,
    is_causal=True)`` on the whole sequence."""
    return active().attention(q, k, v, scale=scale, window=window)


class ContextParallel:
    """This rank's cp group and the batch it is computing ([Note: context parallelism])."""

    def __init__(
        self, world: Collectives, size: int, kind: Kind, *, comm: Collectives | None = None
    ) -> None:
        """cp groups of ``size`` consecutive ranks of ``world``, or ``comm`` (this rank's
        cp group, formed by the caller: on a device mesh)."""
        if kind not in ("ulysses", "ring"):
            raise ValueError(f"context_parallel_kind must be 'ulysses' or 'ring', got {kind!r}")
        if size < 1 or world.world_size % size:
            raise ValueError(
                f"context_parallel={size} must divide the world's {world.world_size} ranks"
            )
        self.kind = kind
        if comm is None:
            self.regroup(world, size)
        else:
            self.world, self.comm = world, comm
        self.batch: SequenceBatch | None = None
        self._attend = eager(self._exchange_and_attend)
        _ACTIVE.append(self)

    def regroup(self, world: Collectives, size: int | None = None) -> None:
        """Form the cp groups over ``world`` (a collective of every rank of it: a new
        generation's, worker/elastic/blocks.py [Note: elastic blocks])."""
        size = self.size if size is None else size
        self.world = world
        self.comm = world if size == world.world_size else world.split(size)

    @property
    def size(self) -> int:
        return self.comm.world_size

    @property
    def rank(self) -> int:
        return self.comm.rank

    # ------------------------------------------------------------ the batch

    def split(
        self, *tensors: torch.Tensor, position_ids: torch.Tensor | None = None, dim: int = 1
    ) -> list[torch.Tensor]:
        """This rank's shard of each of ``tensors`` along the sequence ``dim`` (every
        rank of the cp group passes the same batch); remembers the batch for the
        forward's attention. ``position_ids`` (B x S): where packed documents start
        (else one document a row). Returns the shards, then (if given) this rank's
        position ids."""
        length = tensors[0].shape[dim]
        index = shard_index(length, self.rank, self.size, self.kind)
        docs = None if position_ids is None else documents(position_ids)
        self.batch = SequenceBatch(length, index, docs)
        index = index.to(tensors[0].device)
        out = [t.index_select(dim, index) for t in tensors]
        if position_ids is not None:
            out.append(position_ids.index_select(1, index.to(position_ids.device)))
        return out

    def token_scale(self, count: torch.Tensor | int) -> torch.Tensor:
        """What to divide this rank's summed token loss by for the step to be the mean
        over every token of the global batch: that batch's token count over the world
        size (``count``: the tokens of this rank's whole batch, before the split; a
        small all-reduce over the world)."""
        # on the group's own device (NCCL reduces CUDA tensors only); a tensor count
        # is reduced where it is, with no host synchronisation
        device = count.device if isinstance(count, torch.Tensor) else _wire(self.world)
        total = torch.as_tensor(count, dtype=torch.float64, device=device).reshape(1).clone()
        self.world.all_reduce(total, control=True)
        # every rank of a cp group counted the same batch (on a mesh, every tp rank
        # too, whose factor the world size carries: the engine averages over dp)
        return (total / self.size / self.world.world_size).to(torch.float32).squeeze(0)

    def prepare(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """A Hugging Face causal LM's call, this rank's part of it: ``input_ids``,
        ``position_ids`` and the labels (shifted over the whole sequence first)
        split; ``num_items_in_batch`` the global batch's tokens over the world."""
        if "input_ids" not in kwargs or kwargs.get("inputs_embeds") is not None:
            raise ValueError("context parallelism splits input_ids: call the model with them")
        ids = kwargs["input_ids"]
        mask = kwargs.pop("attention_mask", None)
        if mask is not None and not bool(mask.all()):
            raise ValueError(
                "context parallelism takes no padding mask: pack sequences (position ids "
                "restarting at each document) and give padded labels -100"
            )
        rows, length = ids.shape
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(length, device=ids.device).expand(rows, length)
        labels = kwargs.pop("labels", None)
        shift = None if labels is None else F.pad(labels[:, 1:], (0, 1), value=_IGNORE)
        parts = [ids] if shift is None else [ids, shift]
        split = self.split(*parts, position_ids=position_ids)
        kwargs["input_ids"], kwargs["position_ids"] = split[0], split[-1]
        if shift is not None:
            kwargs["labels"] = kwargs["shift_labels"] = split[1]
            kwargs["num_items_in_batch"] = self.token_scale((shift != _IGNORE).sum())
        return kwargs

    # ------------------------------------------------------------ attention

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        if self.batch is None:
            raise RuntimeError("context-parallel attention before any batch was split")
        return self._attend(q, k, v, scale, window)

    def _exchange_and_attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
        window: int | None,
    ) -> torch.Tensor:  # fmt: skip
        """The attention's exchanges and kernels, which torch.compile runs as they
        are, a graph break on each side (``self._attend``, worker/compat.py
        ``eager``): their collectives go through the engine's counted
        ``Collectives``, which dynamo would break inside of, many times a call."""
        assert self.batch is not None
        run = ulysses_attention if self.kind == "ulysses" or self.size == 1 else ring_attention
        return run(q, k, v, self.comm, self.batch, scale, window)

    def install(self, model: nn.Module) -> None:
        """Switch a transformers model to this context's attention (a model of its own
        calls :func:`attention`)."""
        without_kv_cache(model)  # [Note: no cache under recomputation]
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "_attn_implementation"):
            return
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION_NAME, _hf_attention)
        heads = getattr(config, "num_attention_heads", None)
        if self.kind == "ulysses" and heads is not None and heads % self.size:
            raise ValueError(
                f"all-to-all context parallelism splits the model's {heads} attention heads "
                f"over cp={self.size} ranks, which does not divide them: use "
                "context_parallel_kind='ring'"
            )
        for sub in model.modules():
            sub_config = getattr(sub, "config", None)
            if sub_config is not None and hasattr(sub_config, "_attn_implementation"):
                sub_config._attn_implementation = ATTENTION_NAME

    def close(self) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)


def _wire(comm: Collectives) -> torch.device:
    return torch.device("cuda") if comm.backend == "nccl" else torch.device("cpu")


def _hf_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: B x H x s x D in, B x s x H x D out."""
    if dropout and module.training:
        raise ValueError("attention dropout under context parallelism is not supported")
    for unsupported in ("softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(
                f"attention with {unsupported} under context parallelism is not supported"
            )
    out = active().attention(query, key, value, scale=scaling, window=kwargs.get("sliding_window"))
    return out.transpose(1, 2).contiguous(), None
