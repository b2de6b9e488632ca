"""Mixtures of experts: :class:`Experts` (a layer's expert modules behind the call
transformers 5.x's experts answer) and expert parallelism
(``ParallelConfig(expert_parallel=k)``: worker/moe/dispatch.py [Note: expert
parallelism], worker/moe/shards.py [Note: two shard states]). The guide is
docs/guides/moe.md."""

from worker.moe.experts import Experts

__all__ = ["Experts"]
