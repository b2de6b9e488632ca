"""A model cut into pipeline stages by layer index: :func:`split_gpt` for
worker.models GPT, :func:`split_decoder` for a Hugging Face decoder laid out as
Llama, or the caller's ``split(model, stage, stages) -> nn.Module``;
:func:`split_for` picks one of the first two. Each stage module keeps the model's
parameter names."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "DecoderStage",
    "GPTStage",
    "Split",
    "layer_bounds",
    "lm_loss",
    "split_decoder",
    "split_for",
    "split_gpt",
    "splittable",
]

Split = Callable[[nn.Module, int, int], nn.Module]


def layer_bounds(layers: int, stage: int, stages: int) -> tuple[int, int]:
    """Layers ``[lo, hi)`` of ``stage``: as even as possible, earlier stages one more."""
    if layers < stages:
        raise ValueError(f"{layers} layers cannot fill {stages} pipeline stages")
    base, extra = divmod(layers, stages)
    lo = stage * base + min(stage, extra)
    return lo, lo + base + (1 if stage < extra else 0)


class GPTStage(nn.Module):
    """One pipeline stage of worker.models GPT, under the model's parameter names:
    the embeddings on the first, ``blocks.{lo..hi-1}``, the norm and head on the last."""

    def __init__(self, model: nn.Module, stage: int, stages: int) -> None:
        super().__init__()
        if getattr(model.cfg, "tie_weights", False) and stages > 1:
            raise ValueError(
                "a GPT with tie_weights=True cannot be split into pipeline stages: its "
                "embedding and head are one parameter on the first and last stage"
            )
        lo, hi = layer_bounds(len(model.blocks), stage, stages)
        self.first, self.last = stage == 0, stage == stages - 1
        if self.first:
            self.wte, self.wpe = model.wte, model.wpe
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(lo, hi)})
        if self.last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def split_gpt(model: nn.Module, stage: int, stages: int) -> nn.Module:
    return GPTStage(model, stage, stages)


class DecoderStage(nn.Module):
    """One pipeline stage of a Hugging Face causal decoder laid out as Llama (Llama,
    Qwen2, Mistral: ``model.embed_tokens``, ``model.layers``, ``model.rotary_emb``,
    ``model.norm``, ``lm_head``), under the model's parameter names: the embedding on
    the first stage, ``model.layers.{lo..hi-1}``, the norm and head on the last. It
    takes token ids (first stage) or hidden states and returns hidden states or the
    logits; a stage computes the rotary embedding of its positions itself and runs
    its layers under a causal mask (no padding mask: a pipeline's micro-batches are
    whole sequences)."""

    def __init__(self, model: nn.Module, stage: int, stages: int) -> None:
        super().__init__()
        if stages > 1 and getattr(model.config, "tie_word_embeddings", False):
            raise ValueError(
                "a decoder with tie_word_embeddings=True cannot be split into pipeline "
                "stages: its embedding and head are one parameter on the first and last stage"
            )
        inner = model.model
        lo, hi = layer_bounds(len(inner.layers), stage, stages)
        self.first, self.last = stage == 0, stage == stages - 1
        body = nn.Module()
        if self.first:
            body.embed_tokens = inner.embed_tokens
        body.layers = nn.ModuleDict({str(i): inner.layers[i] for i in range(lo, hi)})
        body.rotary_emb = inner.rotary_emb
        if self.last:
            body.norm = inner.norm
        self.model = body
        if self.last:
            self.lm_head = model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        body = self.model
        if self.first:
            x = body.embed_tokens(x)
        seq = x.shape[1]
        positions = torch.arange(seq, device=x.device).unsqueeze(0)
        rotary = body.rotary_emb(x, positions)
        blocked = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        mask = torch.zeros(seq, seq, dtype=x.dtype, device=x.device)
        mask = mask.masked_fill(blocked, torch.finfo(x.dtype).min)[None, None]
        for layer in body.layers.values():
            out = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
            x = out[0] if isinstance(out, tuple) else out  # a tuple before transformers 4.54
        return self.lm_head(body.norm(x)) if self.last else x


def split_decoder(model: nn.Module, stage: int, stages: int) -> nn.Module:
    return DecoderStage(model, stage, stages)


def _decoder_layout(model: nn.Module) -> bool:
    inner = getattr(model, "model", None)
    return (
        hasattr(model, "config")
        and hasattr(model, "lm_head")
        and all(hasattr(inner, n) for n in ("embed_tokens", "layers", "rotary_emb", "norm"))
    )


def splittable(model: nn.Module) -> bool:
    """Whether a built-in split takes ``model`` into stages (a tied embedding and
    head cannot be split)."""
    from worker.models import GPT

    if isinstance(model, GPT):
        return not model.cfg.tie_weights
    return _decoder_layout(model) and not getattr(model.config, "tie_word_embeddings", False)


def split_for(model: nn.Module, split: Split | None = None) -> Split:
    """``split``, or the built-in one for ``model``: :func:`split_gpt` for
    worker.models GPT, :func:`split_decoder` for a Hugging Face decoder laid out as
    Llama; any other model needs its own ``split(model, stage, stages)``."""
    from worker.models import GPT

    if split is not None:
        return split
    if isinstance(model, GPT):
        return split_gpt
    if _decoder_layout(model):
        return split_decoder
    raise ValueError(
        f"no built-in pipeline split for {type(model).__name__}: pass "
        "split=fn(model, stage, stages) -> the stage's nn.Module (worker.pipeline."
        "split_gpt and split_decoder are examples)"
    )


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, as worker.models GPT computes it."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
