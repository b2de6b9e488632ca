"""The backward's gradient hooks: each gradient, as autograd accumulates it, goes
into its bucket, and a bucket whose gradients are all in starts its reduction,
in bucket order. worker/engine.py's ``backward`` drives it: :meth:`GradHooks.walk`
before autograd runs, :meth:`GradHooks.arm` and :meth:`GradHooks.drain` around it.

[Note: bucket order]
Collectives must be issued in the same order on every rank, but which
parameters get gradients, and when, can differ by rank. Buckets are
therefore launched strictly in index order: a bucket whose gradients are
complete waits for every bucket before it. Parameters that are not in this
micro-step's autograd graph are known before backward starts (a walk over
``loss.grad_fn``) and count as complete from the start.

[Note: graphs that grow during backward]
The walk is exact unless the graph holds a custom autograd Function whose
backward may run a backward of its own: reentrant activation checkpointing
(``checkpoint(..., use_reentrant=True)``, Hugging Face's
``gradient_checkpointing_enable`` with it) recomputes its block inside its
backward node, and the block's parameters enter autograd only then, in a
nested graph the walk cannot see. Counting on the walk there launched their
buckets before their gradients existed: silently wrong training. So when
the walk meets such a node, what backward actually produced decides: the
gradient hooks mark the parameters used, every bucket is reduced once
``backward()`` has returned (when all nested backwards have finished), and
the step-boundary ballot is cast then. Only overlap is lost, and only for
those graphs. Known-safe Functions (non-reentrant checkpointing's
``_NoopSaveInputs``, and the identity a module's full backward hook adds) keep the
walk: a model with such a hook kept its buckets until the backward ended, all of
them staged at once. A gradient that still arrives after its
bucket was reduced is an error naming the parameter, never a silent loss.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.autograd.function import BackwardCFunction
from torch.profiler import record_function

from worker.ballot import Ballot
from worker.flat import BucketState
from worker.state import ShardState
from worker.whereabouts import TRACKER

__all__ = ["GradHooks"]


class GradHooks:
    """A gradient hook on each of ``params`` that requires grad, and the launch of
    ``state``'s buckets as their gradients come in ([Note: bucket order]); the
    parameters a backward used are marked in ``ballot``."""

    def __init__(self, state: ShardState, ballot: Ballot, params: Iterable[nn.Parameter]) -> None:
        self.state, self.ballot = state, ballot
        self.next_bucket = 0
        # whether the last walk saw all that backward can produce
        self.exact = True
        # the hooks live in autograd (C++), where the garbage collector cannot see
        # them: a strong reference to the engine's hooks would keep them, the state
        # and all its buffers alive for as long as the model is
        hooks = weakref.ref(self)

        def on_grad_ready(p: nn.Parameter) -> None:
            live = hooks()
            if live is not None:
                live.on_grad_ready(p)

        self.handles = [
            p.register_post_accumulate_grad_hook(on_grad_ready) for p in params if p.requires_grad
        ]

    def walk(self, root: Any) -> set[torch.Tensor]:
        """Before a backward from ``root`` (a loss's ``grad_fn``): the parameters it
        reaches, each marked used in the ballot; :attr:`exact` says whether that is
        all backward can produce ([Note: graphs that grow during backward])."""
        in_graph, self.exact = _params_in_graph(root)
        for p in in_graph:
            hit = self.state.bucket_of.get(p)
            if hit is not None:
                self.ballot.mark_used(hit[0].param_index[hit[1]])
        return in_graph

    def arm(self, in_graph: set[torch.Tensor], *, reduce_now: bool) -> None:
        """Get the buckets ready for the backward of the graph :meth:`walk` saw:
        ``reduce_now``, each counts the gradients it waits for, and those that wait for
        none are launched at once (with ``overlap_comm`` and an exact walk)."""
        st = self.state
        if st.reducer.grads_in_place:
            # A user's model.zero_grad() sets .grad to None; put the views back.
            for b in st.buckets:
                if any(p.grad is None for p in b.params):
                    b.grad_views()
        self.next_bucket = 0
        for b in st.buckets:
            b.pending = sum(1 for p in b.params if p in in_graph)
            b.state = BucketState.FILLING if reduce_now else BucketState.IDLE
        if reduce_now and st.config.overlap_comm and self.exact:
            for b in st.buckets:
                if b.pending == 0:
                    b.state = BucketState.READY
            self.launch_ready()

    def drain(self) -> None:
        """After the backward: every bucket still filling is complete; launch them all
        in order and finish every reduction."""
        st = self.state
        for b in st.buckets:
            if b.state is BucketState.FILLING:
                b.state = BucketState.READY
        self.launch_ready()
        with record_function("zeroplane.reduce"):
            for b in st.buckets:
                st.reducer.finish(b)

    def on_grad_ready(self, p: nn.Parameter) -> None:
        b, pos = self.state.bucket_of[p]
        if b.state in (BucketState.REDUCING, BucketState.REDUCED):
            raise RuntimeError(
                f"parameter {b.spec.slots[pos].name!r} received a gradient after its bucket "
                "was reduced: this backward produced it outside the autograd graph that "
                "engine.backward() could see (see worker/grad_hooks.py [Note: graphs that "
                "grow during backward]); please report the model"
            )
        self.state.reducer.on_grad(b, pos, p)
        if not self.exact:
            self.ballot.mark_used(b.param_index[pos])
            return
        if b.state is not BucketState.FILLING:
            return
        b.pending -= 1
        if b.pending == 0:
            b.state = BucketState.READY
            if self.state.config.overlap_comm:
                self.launch_ready()

    def launch_ready(self) -> None:
        """Launch buckets in index order (see [Note: bucket order])."""
        st = self.state
        while self.next_bucket < len(st.buckets):
            b = st.buckets[self.next_bucket]
            if b.state is not BucketState.READY:
                return
            with record_function("zeroplane.reduce"), TRACKER.labelled(b.label):
                b.state = BucketState.REDUCING
                st.reducer.launch(b, st.comm)
            st.params.after_launch(b)
            self.next_bucket += 1

    def remove(self) -> None:
        """Unhook the model."""
        for handle in self.handles:
            handle.remove()
        self.handles = []


# custom autograd Functions known not to run a backward of their own: non-reentrant
# checkpointing's, and the identity a module's full backward hook puts in the graph
# (``register_full_backward_hook``: it calls the hook with the gradients, no backward)
_SAFE_FUNCTIONS = frozenset({"_NoopSaveInputsBackward", "BackwardHookFunctionBackward"})


def _params_in_graph(root: Any) -> tuple[set[torch.Tensor], bool]:
    """The leaf tensors (parameters) whose AccumulateGrad nodes ``root`` reaches, and
    whether that is all backward can produce ([Note: graphs that grow during backward])."""
    seen, stack, found = set(), [root], set()
    exact = True
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)
        if var is not None:
            found.add(var)
        elif isinstance(fn, BackwardCFunction) and type(fn).__name__ not in _SAFE_FUNCTIONS:
            exact = False
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return found, exact
