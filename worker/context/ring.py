"""Ring attention: key and value blocks passed round the cp group, the softmax
accumulated online.

[Note: ring attention]
Each rank holds its zig-zag shard of every sequence ([Note: sequence shards] in
worker/context/shards.py). The forward runs k steps: at step t a rank attends
with its queries to the key/value block of rank r - t (its own first, so every
query has a key from the start), masked by the blocks' positions in the whole
sequence (causal, within documents, within a sliding window), and merges the block's result into its
running output by log-sum-exp, while the block travels on to rank r + 1. Only
the output and the log-sum-exp are kept. The backward runs the ring again: each
block travels with its key and value gradients, to which every rank adds its
queries' share (the softmax rebuilt from the saved log-sum-exp, as flash
attention's backward does); after k steps one more pass brings each block's
gradients home. Key/value heads travel as they are (grouped-query attention
repeats them per block, and folds their gradients back), so the heads need not
divide by k. Accumulation is in float32. Where the mask is the plain causal one, a
block is two zig-zag chunks against two, each pair whole, causal or empty: the
CPU's flash kernel runs the pairs that see anything (the empty ones skipped; its
backward takes the merged output and log-sum-exp, as flash attention's ring
does), and the zig-zag shards give every rank the same pairs to run. With
documents or a sliding window (and on other devices) a block runs as masked
matmuls, whole.
"""

from __future__ import annotations

from typing import Any

import torch

from worker.collectives import Collectives, Handle
from worker.context.shards import SequenceBatch, shard_index

__all__ = ["ring_attention"]


def _pass_on(comm: Collectives, x: torch.Tensor) -> tuple[torch.Tensor, Handle]:
    """Send ``x`` to the next rank of the ring; receive the previous rank's (same size)."""
    n, r = comm.world_size, comm.rank
    flat = x.contiguous().reshape(-1)
    out = torch.empty_like(flat)
    sends = [flat.numel() if d == (r + 1) % n else 0 for d in range(n)]
    recvs = [flat.numel() if d == (r - 1) % n else 0 for d in range(n)]
    handle = comm.all_to_all(
        out, flat, async_op=True, input_split_sizes=sends, output_split_sizes=recvs
    )
    return out, handle


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    return s.masked_fill(~mask, float("-inf"))


def _fold(grad: torch.Tensor, rep: int) -> torch.Tensor:
    """Gradients of repeated key/value heads summed back onto their heads."""
    if rep == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // rep, rep, s, d).sum(2)


def _merge(
    out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial softmax-attention results of the same queries, merged by their
    log-sum-exps (a row no key reached has -inf: it adds nothing)."""
    merged = torch.logaddexp(lse, part_lse)
    keep = torch.where(torch.isfinite(merged), torch.exp(lse - merged), 0.0)
    take = torch.where(torch.isfinite(merged), torch.exp(part_lse - merged), 0.0)
    return out * keep[..., None] + part.float() * take[..., None], merged


def _chunk_pairs(r: int, src: int, n: int) -> list[tuple[int, int, bool]]:
    """(query chunk, key chunk, causal) of this rank's two zig-zag chunks against the
    block of rank ``src`` that can see anything: a later chunk sees an earlier one
    whole, a chunk itself causally, an earlier one nothing (two pairs a step, three
    on the diagonal step: the balance of [Note: sequence shards])."""
    mine, theirs = (r, 2 * n - 1 - r), (src, 2 * n - 1 - src)
    return [
        (a, b, qc == kc) for a, qc in enumerate(mine) for b, kc in enumerate(theirs) if qc >= kc
    ]


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """The CPU's flash-attention kernel: (output, log-sum-exp)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale
    )


class _Ring(torch.autograd.Function):
    """[Note: ring attention]'s forward and backward. Blocks run on the CPU's flash
    kernel chunk pair by chunk pair where the mask is the plain causal one (no
    documents, no window: each pair is whole, causal or empty, and the empty ones
    are skipped); otherwise, and on other devices, as masked matmuls."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        comm: Collectives,
        batch: SequenceBatch,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        n, r = comm.world_size, comm.rank
        rep = q.shape[1] // k.shape[1]
        fast = batch.docs is None and window is None and q.device.type == "cpu"
        # the positions of every rank's shard, for the masks (the fast path has none)
        index = (
            [] if fast else [shard_index(batch.length, i, n, "ring").to(q.device) for i in range(n)]
        )
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        c = q.shape[2] // 2  # a zig-zag chunk
        block = torch.cat([k.reshape(-1), v.reshape(-1)])
        for t in range(n):
            src = (r - t) % n
            ahead = _pass_on(comm, block) if t < n - 1 else None
            kb, vb = block[: k.numel()].view_as(k), block[k.numel() :].view_as(v)
            kr = kb.repeat_interleave(rep, dim=1) if rep > 1 else kb
            vr = vb.repeat_interleave(rep, dim=1) if rep > 1 else vb
            if fast:
                for a, b, causal in _chunk_pairs(r, src, n):
                    qa, kc = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
                    part, part_lse = _flash(q[:, :, qa], kr[:, :, kc], vr[:, :, kc], causal, scale)
                    out[:, :, qa], lse[:, :, qa] = _merge(
                        out[:, :, qa], lse[:, :, qa], part, part_lse
                    )
            else:
                s = _scores(q, kr, batch.mask(index[r], index[src], window).to(q.device), scale)
                m = s.amax(-1, keepdim=True)
                m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
                p = torch.exp(s - m)
                total = p.sum(-1, keepdim=True)
                part = torch.matmul(p, vr.float()) / total.clamp_min(1e-30)
                out, lse = _merge(out, lse, part, (m + torch.log(total)).squeeze(-1))
            if ahead is not None:
                block, handle = ahead
                handle.wait()
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.comm, ctx.batch, ctx.scale, ctx.index, ctx.window = comm, batch, scale, index, window
        ctx.fast = fast
        return result

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        comm, batch, scale, index, window = ctx.comm, ctx.batch, ctx.scale, ctx.index, ctx.window
        n, r = comm.world_size, comm.rank
        rep = q.shape[1] // k.shape[1]
        c = q.shape[2] // 2
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1, keepdim=True)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        sizes = [k.numel(), v.numel(), k.numel(), v.numel()]
        block = torch.cat(
            [
                k.float().reshape(-1),
                v.float().reshape(-1),
                torch.zeros(k.numel() + v.numel(), device=q.device),
            ]
        )
        for t in range(n):
            src = (r - t) % n
            kb, vb, dk, dv = (
                part.view_as(like)
                for part, like in zip(block.split(sizes), (k, v, k, v), strict=True)
            )
            kr = kb.repeat_interleave(rep, dim=1) if rep > 1 else kb
            vr = vb.repeat_interleave(rep, dim=1) if rep > 1 else vb
            if ctx.fast:
                dkr, dvr = torch.zeros_like(kr), torch.zeros_like(vr)
                for a, b, causal in _chunk_pairs(r, src, n):
                    qa, kc = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
                    got = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                        dout[:, :, qa], q[:, :, qa], kr[:, :, kc].to(q.dtype),
                        vr[:, :, kc].to(q.dtype), out[:, :, qa], lse[:, :, qa], 0.0, causal,
                        scale=scale,
                    )  # fmt: skip
                    dq[:, :, qa] += got[0]
                    dkr[:, :, kc] += got[1]
                    dvr[:, :, kc] += got[2]
                dk += _fold(dkr, rep)
                dv += _fold(dvr, rep)
            else:
                s = _scores(q, kr, batch.mask(index[r], index[src], window).to(q.device), scale)
                p = torch.exp(s - lse[..., None])  # (masked: exp(-inf) = 0)
                df = dout.float()
                dv += _fold(torch.matmul(p.transpose(-1, -2), df), rep)
                ds = p * (torch.matmul(df, vr.transpose(-1, -2)) - delta)
                dq += torch.matmul(ds, kr) * scale
                dk += _fold(torch.matmul(ds.transpose(-1, -2), q.float()), rep) * scale
            # the block and its gradients on to the next rank; after the last step the
            # gradients alone, home to the block's rank
            block, handle = _pass_on(comm, block if t < n - 1 else block[k.numel() + v.numel() :])
            handle.wait()
        home = block.split([k.numel(), v.numel()])
        return (
            dq.to(q.dtype),
            home[0].view_as(k).to(k.dtype),
            home[1].view_as(v).to(v.dtype),
            None,
            None,
            None,
            None,
        )


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    comm: Collectives,
    batch: SequenceBatch,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's zig-zag shard (B x H x S/k x D queries, B x H_kv x
    S/k x D keys and values) over the whole sequence ([Note: ring attention]); ``window``:
    a sliding window's tokens."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _Ring.apply(q, k, v, comm, batch, scale, window)
