"""Hugging Face models that come to life sharded: ``worker.from_pretrained``.

    engine = worker.from_pretrained(
        "path/to/llama",                       # what save_pretrained wrote
        lambda groups: torch.optim.AdamW(groups, lr=1e-5),
        config=worker.ZeroConfig(stage=3, dtype="bf16"),
    )
    model = engine.module                      # the LlamaForCausalLM

The model is built from its ``config.json`` with its parameters on the meta
device (:func:`worker.meta_parameters`; buffers such as rotary tables keep
their values), comes to life one module at a time without initializing
(worker/birth.py), and each rank reads only the elements of the weights it
owns (worker/pretrained.py [Note: weights by range]). No rank ever holds the
whole model. Local directories only: nothing is downloaded at run time.

On a device mesh (tensor parallelism beside ZeRO) the same call takes
``parallel=``:

    engine = worker.from_pretrained(
        "path/to/llama", optimizer, config=worker.ZeroConfig(stage=3),
        parallel=ParallelConfig(tensor_parallel=2),   # worker.mesh
    )                                      # a MeshEngine; plan: worker.tp.hf_plan

and each rank reads only the elements of its tp slice that it owns.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from worker.birth import meta_parameters, skip_init
from worker.engine import OptimizerArg, ZeroEngine
from worker.entry import initialize
from worker.pretrained import ADAPTER_CONFIG, WeightsError, adapter_directory

if TYPE_CHECKING:
    from worker.mesh import MeshEngine, ParallelConfig

__all__ = ["build_on_meta", "from_pretrained"]


def build_on_meta(path: str | os.PathLike, model_class: Any = None) -> nn.Module:
    """The model that ``path``'s ``config.json`` describes, its parameters on the meta
    device: ``model_class`` (a transformers model class, or an auto class such as
    ``AutoModelForSequenceClassification``; ``AutoModelForCausalLM`` by default)."""
    try:
        import transformers
    except ImportError:  # pragma: no cover - the test extra installs it
        raise ImportError(
            "worker.from_pretrained needs transformers: pip install transformers"
        ) from None
    directory = Path(path)
    if (directory / ADAPTER_CONFIG).is_file() and not (directory / "config.json").is_file():
        raise WeightsError(adapter_directory(directory))
    if not (directory / "config.json").is_file():
        raise WeightsError(
            f"{directory} has no config.json: give the local directory save_pretrained "
            "wrote (downloads are not made here)"
        )
    hf_config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    model_class = model_class or transformers.AutoModelForCausalLM
    with meta_parameters():
        if hasattr(model_class, "from_config"):  # an auto class
            return model_class.from_config(hf_config)
        return model_class(hf_config)


def from_pretrained(
    path: str | os.PathLike,
    optimizer: OptimizerArg | None = None,
    *,
    model_class: Any = None,
    parallel: ParallelConfig | None = None,
    plan: Any = None,
    **kwargs: Any,
) -> ZeroEngine | MeshEngine:
    """A Hugging Face model from the local directory ``path``, sharded from birth and
    loaded by range, in an engine: :func:`worker.initialize`'s engine, with its
    keyword arguments (``config=``, ``lr_scheduler=``, ``device=``, ...).

    ``parallel``: a :class:`worker.mesh.ParallelConfig` with expert parallelism:
    :func:`worker.initialize`'s engine for it, each rank reading only the rows of
    its experts (docs/guides/moe.md); or with tensor parallelism
    (``pipeline_parallel`` 1): the engine is :func:`worker.mesh.parallelize`'s
    (``config`` a ZeroConfig; ``lr_scheduler``, ``device``, ``mesh`` as it takes
    them) with ``plan`` (default :func:`worker.tp.hf_plan`: GPT-2 and Llama-style
    decoders), each rank reading only the elements of its tp slices it owns.

    ``optimizer`` is a callable that builds the optimizer from param groups (the
    model does not exist before this call), or None with a DeepSpeed config whose
    ``optimizer`` section builds it. Every rank calls it; under ``zeroplane run``
    the coordinator's job forms first, as with ``initialize``."""
    model = build_on_meta(path, model_class)
    engine: ZeroEngine | MeshEngine
    if parallel is None or parallel.tensor_parallel * parallel.pipeline_parallel == 1:
        if plan is not None:
            raise ValueError("plan= is a tensor-parallel plan: pass parallel= with it")
        # expert parallelism (or none): each rank reads its experts' rows only
        engine = initialize(model, optimizer, init=skip_init, parallel=parallel, **kwargs)
    else:
        from worker.mesh import parallelize
        from worker.tp import hf_plan

        if optimizer is None:
            raise ValueError("from_pretrained(..., parallel=...) needs an optimizer factory")
        engine = parallelize(
            model, optimizer, parallel=parallel, plan=plan or hf_plan, init=skip_init, **kwargs
        )
    engine.load_weights(path)
    return engine
