"""Data for zeroplane jobs: batches addressed by the global step, prepared ahead.

- :mod:`worker.data.sampler`: :class:`GlobalBatchSampler`, each step's global
  batch as a pure function of (seed, epoch, step);
- :mod:`worker.data.loader`: :class:`StepLoader`, a prefetching loader over a
  map-style dataset that any rank can ask for any step;
- :mod:`worker.data.stream`: :class:`StreamLoader`, the same over an iterable
  source (a streaming ``datasets.IterableDataset``) with a resumable position;
- :mod:`worker.data.packing`: tokenize-and-pack for language models, cached on disk.

The shipped demo corpus lives in this package's folder too (``corpus.txt.gz``).
"""

from worker.data.loader import LoaderConfig, LoaderStats, StepLoader
from worker.data.packing import (
    PackedTokens,
    Tokenizer,
    byte_tokenizer,
    hf_tokenizer,
    pack_documents,
    pack_text_files,
    read_text,
)
from worker.data.sampler import (
    BatchPlan,
    GlobalBatchSampler,
    micro_batch_counts,
    share_of,
    split_global_batch,
)
from worker.data.stream import StreamLoader

__all__ = [
    "BatchPlan",
    "GlobalBatchSampler",
    "LoaderConfig",
    "LoaderStats",
    "PackedTokens",
    "StepLoader",
    "StreamLoader",
    "Tokenizer",
    "byte_tokenizer",
    "hf_tokenizer",
    "micro_batch_counts",
    "pack_documents",
    "pack_text_files",
    "read_text",
    "share_of",
    "split_global_batch",
]
