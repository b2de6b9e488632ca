"""``deepspeed.moe``: ``utils`` for scripts that split their param groups for DeepSpeed's
MoE layers. zeroplane's expert parallelism is ``ParallelConfig(expert_parallel=k)``
(docs/guides/moe.md); DeepSpeed's ``moe.layer.MoE`` is not reproduced."""

from worker.deepspeed.moe import utils

__all__ = ["utils"]
