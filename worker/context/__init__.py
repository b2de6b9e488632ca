"""Context parallelism: long sequences split over the ranks of a cp group
(worker/context/parallel.py [Note: context parallelism]).

* shards.py: how a sequence splits (contiguous for all-to-all, zig-zag for the
  ring) and what attention needs of the whole batch ([Note: sequence shards]);
* ulysses.py: all-to-all attention ([Note: all-to-all attention]);
* ring.py: ring attention ([Note: ring attention]);
* parallel.py: :class:`ContextParallel`, the batch split and the loss over the
  global batch, and :func:`attention`, which a model of its own calls.
"""

from worker.context.parallel import ContextParallel, attention

__all__ = ["ContextParallel", "attention"]
