"""``deepspeed.moe``: ``layer.MoE`` (DeepSpeed's MoE layer over zeroplane's experts and
expert parallelism: worker/deepspeed/moe/sharded_moe.py [Note: DeepSpeed's gates]) and
``utils`` for scripts that split their param groups for it."""

from worker.deepspeed.moe import experts, layer, sharded_moe, utils

__all__ = ["experts", "layer", "sharded_moe", "utils"]
