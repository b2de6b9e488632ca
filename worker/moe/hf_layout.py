"""A transformers 5.x fused experts parameter read from checkpoints that store each
expert apart, as the Hub's Mixtral, Qwen-MoE and DeepSeek checkpoints do.

[Note: stacked expert weights]
transformers 5.x holds a layer's experts as one parameter per projection
(``experts.gate_up_proj`` of E x 2I x H, ``experts.down_proj`` of E x H x I), but
the checkpoints people load (and transformers 4.x, and 5.x's own
``save_pretrained``) store every expert's matrices apart:
``experts.{e}.gate_proj.weight`` and ``up_proj`` (I x H each), ``down_proj``;
Mixtral's as ``block_sparse_moe.experts.{e}.w1``, ``w3``, ``w2``. The fused
parameter's flattened elements are those files' tensors one after another:
expert 0's gate then up, expert 1's, ... So :func:`stacked_keys` names, for the
keys a checkpoint holds, each fused tensor they make, with its parts in that
order, and worker/pretrained.py reads a range of the fused tensor as ranges of
the parts it crosses: a rank of an expert-parallel job reads only its experts'
rows (worker/moe/dispatch.py), a ZeRO rank only its range. A checkpoint that
already holds the fused tensors (zeroplane's ``save_pretrained``, which
transformers 5.x loads) is read as it is.
"""

from __future__ import annotations

import re
from collections import defaultdict

__all__ = ["renamed_keys", "stacked_keys"]

# a fused parameter's name -> the per-expert matrices it concatenates (along the
# expert's first dimension), by the names families give them
RECIPES: dict[str, tuple[tuple[str, ...], ...]] = {
    "gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")),
    "down_proj": (("down_proj",), ("w2",)),
    "up_proj": (("up_proj",),),
}
# what a checkpoint calls a part of the model's names (Mixtral's MoE block, router
# and experts)
_FILE_NAMES = ((".mlp.", ".block_sparse_moe."),)
_PER_EXPERT = re.compile(r"^(?P<pre>.*\.experts)\.(?P<e>\d+)\.(?P<part>\w+)\.weight$")


def stacked_keys(keys: set[str]) -> dict[str, list[str]]:
    """Each fused experts tensor the per-expert ``keys`` make, by the name the model
    gives it, with its parts in flattened order ([Note: stacked expert weights])."""
    found: dict[str, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
    for key in keys:
        m = _PER_EXPERT.match(key)
        if m:
            found[m["pre"]][int(m["e"])].add(m["part"])
    out: dict[str, list[str]] = {}
    for pre, experts in found.items():
        count = len(experts)
        if sorted(experts) != list(range(count)):
            continue  # not every expert's matrices: nothing to fuse
        model_pre = _model_name(pre)
        for fused, variants in RECIPES.items():
            for parts in variants:
                if all(set(parts) <= experts[e] for e in range(count)):
                    out[f"{model_pre}.{fused}"] = [
                        f"{pre}.{e}.{part}.weight" for e in range(count) for part in parts
                    ]
                    break
    return out


def renamed_keys(keys: set[str]) -> dict[str, str]:
    """The keys a checkpoint names otherwise than transformers 5.x's model does
    (Mixtral's ``block_sparse_moe``), by the model's name for each."""
    out = {}
    for key in keys:
        name = _model_name(key)
        if name != key and not _PER_EXPERT.match(key):
            out[name] = key
    return out


def _model_name(key: str) -> str:
    for model_part, file_part in _FILE_NAMES:
        key = key.replace(file_part, model_part)
    return key
