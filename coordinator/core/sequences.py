"""Planning long sequences: activation memory per rank by sequence length and
context-parallel degree, the longest sequence that fits, and the cp it needs.

[Note: sequences in the plan]
Under context parallelism (worker/context/parallel.py) the k ranks of a cp group
each keep the activations of S/k tokens of every sequence, and the model state is
sharded over every rank (dp x cp), as in plain ZeRO over the world. With attention
that never materializes the score matrix (flash attention, the ring's blocks) a
layer keeps ``34·s·b·h`` bytes at 16 bits for s tokens (Korthikanti et al. 2022
without the ``5·a·s²·b`` scores), and with activation checkpointing each layer its
input (``2·s·b·h``) plus one layer recomputed at a time; the logits, where the
vocabulary is known and the loss is not tiled, add ``8·s·b·V`` (fp32 logits and
their log-softmax). Every term is linear in the tokens a rank holds, so the
longest sequence at cp = k is k times the longest at cp = 1 for the same state
(rounded down to a multiple of 2k, the ring's chunks), and the cp a length needs
is the smallest divisor of the world size that fits it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from coordinator.core.planner import ActivationShape, PlanConfig, estimate_memory

__all__ = ["SequencePlan", "activation_bytes_per_token", "plan_sequence"]

# bytes per element of the 16-bit activations the formula counts, by precision
_SCALE = {"bf16": 1.0, "fp16": 1.0, "fp32": 2.0}


def activation_bytes_per_token(
    shape: ActivationShape,
    precision: str,
    *,
    checkpointing: bool,
    vocab: int | None = None,
    tiled_loss: bool = False,
) -> float:
    """Bytes one rank keeps for backward per token it holds ([Note: sequences in the
    plan]); ``shape.seq`` is not used."""
    b, h, layers = shape.micro_batch, shape.hidden, shape.layers
    layer = 34 * b * h * _SCALE[precision]
    kept = layers * 2 * b * h * _SCALE[precision] + layer if checkpointing else layers * layer
    if vocab and not tiled_loss:
        kept += 8 * b * vocab
    return kept


@dataclass(frozen=True)
class SequencePlan:
    """For one world size: the longest sequence that fits at each cp that divides it,
    and the smallest cp at which ``seq`` fits (None: none does)."""

    world_size: int
    seq: int
    state_bytes: float
    longest: dict[int, int]
    needs: int | None

    def describe(self) -> str:
        at = ", ".join(f"cp={cp}: {n:,}" for cp, n in self.longest.items())
        if self.needs is None:
            head = f"{self.seq:,} tokens fit at no cp"
        else:
            head = f"{self.seq:,} tokens need cp >= {self.needs}"
        return f"N={self.world_size}: {head}; the longest sequence at {at}"


def plan_sequence(
    numel: int,
    shape: ActivationShape,
    *,
    world_size: int,
    device_memory_bytes: int,
    config: PlanConfig,
    stage: int = 3,
    checkpointing: bool = True,
    vocab: int | None = None,
    tiled_loss: bool = False,
) -> SequencePlan:
    """The longest sequence per cp group that fits a rank's device beside its share of
    the model state at ``stage`` over ``world_size`` ranks, for every cp dividing it."""
    state = estimate_memory(numel, stage=stage, world_size=world_size, config=config)
    budget = device_memory_bytes * (1 - config.headroom) - state.model_states.total
    per_token = activation_bytes_per_token(
        shape, config.precision, checkpointing=checkpointing, vocab=vocab, tiled_loss=tiled_loss
    )
    longest: dict[int, int] = {}
    for cp in (k for k in range(1, world_size + 1) if world_size % k == 0):
        tokens = max(0, math.floor(budget / per_token)) if budget > 0 else 0
        chunk = 2 * cp if cp > 1 else 1
        longest[cp] = tokens * cp // chunk * chunk
    needs = next((cp for cp, n in longest.items() if n >= shape.seq), None)
    return SequencePlan(world_size, shape.seq, state.model_states.total, longest, needs)
