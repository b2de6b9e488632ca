"""Memory for long sequences: the loss and the MLPs of a transformers decoder computed
tile by tile, so that their largest activations never exist for a whole sequence.

[Note: tiles]
At long sequence lengths a decoder's largest tensors are not its weights but two
activations: the logits (tokens x vocabulary: 128K tokens of a 128K vocabulary are
64 GiB in fp32) and each MLP's intermediate (tokens x 3.5 hidden). Both are
computed token by token, so they can be computed a tile of tokens at a time:

* ``ZeroConfig(tiled_loss=T)``: a transformers causal LM called with ``labels``
  runs its decoder, then its head and cross-entropy ``T`` tokens at a time, each
  tile under torch's non-reentrant ``checkpoint`` (its logits are freed after
  the tile's forward and made again for its backward): the loss, the sum over
  tiles over the number of labelled tokens, is the model's own, and no more than
  one tile's logits exist at once (DeepSpeed ALST's tiled logits loss, Liger's
  fused linear cross-entropy, without a kernel of their own);
* ``ZeroConfig(tiled_mlp=T)``: every decoder layer's MLP (a module whose class
  name ends in ``MLP``, as transformers names them) runs ``T`` tokens of each
  row at a time, each tile checkpointed, so that its intermediate exists for one
  tile only (ALST's tiled MLP).

Both trade one more run of the head or the MLP in backward for the memory. At
stage 3 each call and each recomputation runs the module's own gather hooks, as
activation checkpointing's do. Models whose head does more than a linear layer
(logit soft-capping, logit scaling) or that add a router loss keep their own
forward: the tiled loss refuses them, naming the reason.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["tile_mlps", "tiled_loss_forward"]

_IGNORE = -100
# config attributes that make a head more than its linear layer
_HEAD_EXTRAS = ("final_logit_softcapping", "logits_scaling", "logit_scale")


def _parts(model: nn.Module) -> tuple[nn.Module, nn.Linear]:
    """The decoder and the linear head of a transformers causal LM."""
    decoder = getattr(model, "get_decoder", lambda: None)()
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if decoder is None or not isinstance(head, nn.Linear):
        raise ValueError(
            f"tiled_loss needs a transformers causal LM (get_decoder(), a linear "
            f"get_output_embeddings()); {type(model).__name__} is not one"
        )
    config = getattr(model, "config", None)
    for extra in _HEAD_EXTRAS:
        if getattr(config, extra, None) not in (None, 0, 1, 1.0):
            raise ValueError(f"tiled_loss: the model's head applies {extra}, which it does not")
    if getattr(config, "output_router_logits", False):
        raise ValueError("tiled_loss: the model adds a router loss (output_router_logits)")
    return decoder, head


def _tile_loss(head: nn.Linear, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return F.cross_entropy(logits, labels, ignore_index=_IGNORE, reduction="sum")


def tiled_loss_forward(model: nn.Module, tile: int, **kwargs: Any) -> Any:
    """``model(**kwargs)`` with the loss computed ``tile`` tokens at a time ([Note:
    tiles]); returns the model's output class with ``loss`` and no logits. It runs
    as the model's own call (its hooks, stage 3's gather of its own parameters),
    with the tiled forward in place of the model's for that call."""
    decoder, head = _parts(model)
    own = model.__dict__.get("forward")
    model.forward = functools.partial(_tiled_loss, decoder, head, tile)
    try:
        return model(**kwargs)
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


def _tiled_loss(decoder: nn.Module, head: nn.Linear, tile: int, **kwargs: Any) -> Any:
    labels = kwargs.pop("labels")
    shift = kwargs.pop("shift_labels", None)
    count = kwargs.pop("num_items_in_batch", None)
    if shift is None:
        shift = F.pad(labels[:, 1:], (0, 1), value=_IGNORE)
    hidden = decoder(**kwargs).last_hidden_state
    flat, targets = hidden.reshape(-1, hidden.shape[-1]), shift.reshape(-1).to(hidden.device)
    if count is None:
        count = (targets != _IGNORE).sum()
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, flat.shape[0], tile):
        part = slice(start, start + tile)
        total = total + checkpoint(_tile_loss, head, flat[part], targets[part], use_reentrant=False)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(loss=total / count, logits=None)


def tile_mlps(model: nn.Module, tile: int) -> int:
    """Run every decoder MLP of ``model`` ``tile`` tokens at a time ([Note: tiles]);
    returns how many it tiled."""
    tiled = 0
    for module in model.modules():
        if type(module).__name__.endswith("MLP") and "forward" not in module.__dict__:
            module.forward = functools.partial(_tiled, type(module).forward, module, tile)
            tiled += 1
    return tiled


def _tiled(forward: Any, module: nn.Module, tile: int, x: torch.Tensor) -> torch.Tensor:
    if x.dim() < 2 or x.shape[-2] <= tile:
        return forward(module, x)
    parts = [
        checkpoint(forward, module, part, use_reentrant=False) for part in x.split(tile, dim=-2)
    ]
    return torch.cat(parts, dim=-2)
