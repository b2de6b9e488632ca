"""Codecs for compressed collectives, and the compressed exchanges built on them.

[Note: compressed reduce-scatter]
Quantized values are never summed inside a collective: an int8 sum overflows
and a sum of signs is meaningless. Each rank instead splits its (error-
corrected) gradient into one chunk per destination rank, encodes every chunk,
and exchanges them with one all-to-all; the destination decodes the N chunks
it received and sums them in fp32. With error feedback, what compression lost
this step (input minus its decoded self) is kept and added to the next
step's input, so the error does not accumulate (Seide et al. 2014; the 1-bit
Adam paper, Tang et al. 2021, analyses it with Adam).

[Note: hierarchical gradient reduce-scatter]
ZeRO++'s qgZ (``ZeroConfig.hierarchical_reduce`` k > 1, stages 2–3). The N
ranks form m = N/k node groups of k consecutive ranks (worker/stages.py
[Note: hierarchical partitioning]); rank r = a·k + j is place j of node a. A
bucket of P (padded) elements has shards of s = P/N, and rank r owns elements
``[r·s, (r+1)·s)``, as without qgZ. Two legs land each rank's own shard:

1. Within the node, a reduce-scatter of the bucket permuted so that place j's
   chunk is the shards of the ranks at place j of every node. Viewed as
   (m, k, s), [node b, place i, element e], the bucket is element
   (b·k + i)·s + e; the node leg sends its transpose (k, m, s), so place j
   receives, summed over its node's k ranks, the m shards j, k + j, 2k + j, ...
   in node order: element b·s + e of what it receives is element
   (b·k + j)·s + e of the bucket.
2. Across nodes, among the m ranks at place j, ``{j, k + j, 2k + j, ...}``
   (:meth:`Collectives.across`; rank b·k + j is rank b there), the compressed
   reduce-scatter of [Note: compressed reduce-scatter] on that node sum of m·s
   elements: its chunk b, world shard b·k + j, goes to rank b·k + j. Rank
   r = a·k + j thus receives chunk a of the node sums at place j of every node,
   which is world shard r summed over all N ranks.

Only the second leg crosses nodes: each rank sends (m−1)/m of P/k encoded
elements, against (N−k)/N of P in the reduce dtype for the flat
reduce-scatter; as (m−1)/(m·k) = (N−k)/(N·k), that is 1/k of the elements, and
int8 (≈1 byte an element against fp32's 4) makes it ≈1/(4k) of the bytes.
The first leg is full precision, in the reduce dtype: the node's link is the
fast one (NVLink; loopback in bench/zeropp.py), where a second quantization
would save little time, and it would add a second rounding, of each rank's
gradient rather than of the node's sum, and a second residual. (ZeRO++
quantizes within the node too, for GPUs whose node link is itself the
bottleneck.) With error feedback, a rank keeps what encoding its node sum
lost, P/k elements per bucket (the flat path keeps P), and adds it to the next
step's node sum. Each element of the result is within half a step of the
exact sum for each node's payload (int8: the block's absmax / 254, the block
taken over that rank's node sum plus its residual).

Leg 2 needs leg 1's result. A bucket's node leg is issued at its launch; its
cross leg starts at a later bucket's launch if the node leg has finished by
then, else when the bucket is waited on. A group's collectives must be issued
in the same order on each of its ranks, so the cross legs start in launch
order: one whose node leg is still running holds back those after it.
``comm_report(by_group=True)`` books the node leg under ``node``
(``reduce_scatter``, the bucket's bytes) and the cross leg under ``cross``
(``reduce_scatter``: the node sum's bytes, and the payloads' as
``wire_bytes``); nothing of qgZ's runs on the world group.

[Note: quantized parameter gathers]
ZeRO++'s qwZ (Wang et al. 2023) at every sharded stage: the parameter
all-gather, after the optimizer step at stages 1–2 (worker/stages.py
``ParamStorage.start_publish``) and before each unit's forward and backward
at stage 3 (worker/flat.py ``GatherUnit``), sends each rank's shard encoded
(``ZeroConfig.stage3_gather_compression``: ``int8`` blocks with an fp32 scale,
≈0.25× the bytes of fp32; ``bf16``) and every rank decodes it into its compute
parameters. Only the compute copy is rounded: the fp32 master partition is
never encoded, so the optimizer steps exact values on exact gradients. The
owner's own slot is its exact value (the master, cast to the compute dtype),
not the decoded payload: at stages 1–2 in fp32 the master *is* that slot of
``full`` (worker/stages.py ``ParamStorage.place``), so decoding over it would
round the master itself; and it saves one decode. DeepSpeed's qwZ decodes
every slot, so there all ranks compute on the same rounded weights; here a
rank's copy of another rank's slice differs from the owner's by at most the
codec's bound (int8: half a step, the block's absmax / 254). No error
feedback: every gather encodes the current master, so rounding errors do not
build up from step to step. ``comm_report()`` books the gather at the compute
parameters' bytes (``bytes``) and the payloads' (``wire_bytes``).

Payloads are flat ``uint8`` tensors: the per-block fp32 scales, then the
packed values. Their size depends only on the element count, so every rank
can size the exchange without asking.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from coordinator.core.layout import Bucket
from worker.collectives import Collectives, Handle

__all__ = [
    "CastCodec",
    "Codec",
    "Int8Codec",
    "NonFiniteError",
    "OneBitCodec",
    "PendingAllGather",
    "PendingHierarchicalReduceScatter",
    "PendingReduceScatter",
    "WireBuffers",
    "make_codec",
    "start_all_gather",
    "start_hierarchical_reduce_scatter",
    "start_reduce_scatter",
]

Method = Literal["none", "bf16", "fp16", "int8", "onebit"]


class NonFiniteError(ValueError):
    """The input to a codec held NaN or inf."""


def _check_finite(x: torch.Tensor, nonfinite: str) -> None:
    if nonfinite == "raise" and x.numel() and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise NonFiniteError(f"{bad} of {x.numel()} values to compress are NaN or inf")


@dataclass(frozen=True)
class Codec:
    """Encodes fp32 vectors into byte payloads and back."""

    name: str

    def wire_bytes(self, numel: int) -> int:
        raise NotImplementedError

    def encode(self, x: torch.Tensor, out: torch.Tensor, *, nonfinite: str = "raise") -> None:
        """Write ``x`` (1-D fp32) into ``out`` (``wire_bytes(x.numel())`` uint8).

        ``nonfinite="raise"`` raises :class:`NonFiniteError` on NaN/inf input;
        ``"nan"`` encodes a block holding any as all-NaN, so the receiver
        sees the overflow (and fp16 loss scaling skips the step) instead of
        silently quantized garbage.
        """
        raise NotImplementedError

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """The fp32 vector of ``numel`` elements that ``payload`` encodes."""
        raise NotImplementedError

    def ratio(self, numel: int) -> float:
        """Compression ratio against fp32 for a vector of ``numel`` elements."""
        return 4 * numel / self.wire_bytes(numel) if numel else 1.0

    # A codec whose payload depends on the bucket and on whose shard it is (float8
    # weights among other parameters, worker/float8.py) overrides these; the
    # others encode every shard alike.

    def bind(self, spec: Bucket, dtype: torch.dtype) -> Codec | None:
        """The codec for parameter gathers of the bucket ``spec`` in ``dtype``; None:
        the bucket gathers as it is."""
        del spec, dtype
        return self

    def begin(self, comm: Collectives, x: torch.Tensor) -> None:
        """Before encoding this rank's shard ``x`` of a gather (every rank calls it)."""

    def encode_part(self, x: torch.Tensor, out: torch.Tensor, part: int) -> None:
        """:meth:`encode` of rank ``part``'s shard."""
        self.encode(x, out, nonfinite="nan")

    def decode_part(self, payload: torch.Tensor, numel: int, part: int) -> torch.Tensor:
        """:meth:`decode` of rank ``part``'s payload."""
        return self.decode(payload, numel)


@dataclass(frozen=True)
class CastCodec(Codec):
    """bf16 or fp16 on the wire: 2× against fp32."""

    dtype: torch.dtype = torch.bfloat16

    def wire_bytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, x: torch.Tensor, out: torch.Tensor, *, nonfinite: str = "raise") -> None:
        _check_finite(x, nonfinite)
        out.view(self.dtype).copy_(x)

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        return payload.view(self.dtype).float()


@dataclass(frozen=True)
class _Blockwise(Codec):
    block: int = 256

    def __post_init__(self) -> None:
        if self.block < 1:
            raise ValueError(f"compression block size must be >= 1, got {self.block}")

    def _blocks(self, numel: int) -> int:
        return math.ceil(numel / self.block)

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        nb = self._blocks(x.numel())
        pad = nb * self.block - x.numel()
        return torch.nn.functional.pad(x, (0, pad)).view(nb, self.block)

    def _value_bytes(self, numel: int) -> int:
        raise NotImplementedError

    def wire_bytes(self, numel: int) -> int:
        return align4(4 * self._blocks(numel) + self._value_bytes(numel))

    def _split(self, payload: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        nb = self._blocks(numel)
        return payload[: 4 * nb].view(torch.float32), payload[
            4 * nb : 4 * nb + self._value_bytes(numel)
        ]

    def _scales(self, x: torch.Tensor, blocks: torch.Tensor, nonfinite: str) -> torch.Tensor:
        _check_finite(x, nonfinite)
        scales = self._block_scale(blocks)
        # amax/sum carry NaN and inf into the block's scale: checking the scales
        # finds every non-finite block at a fraction of the cost of checking values
        return scales.masked_fill(~torch.isfinite(scales), math.nan)

    def _block_scale(self, blocks: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class Int8Codec(_Blockwise):
    """Symmetric int8 with an fp32 absmax scale per block: ≈3.9× at block 256."""

    def _value_bytes(self, numel: int) -> int:
        return numel

    def _block_scale(self, blocks: torch.Tensor) -> torch.Tensor:
        return blocks.abs().amax(dim=1) / 127

    def encode(self, x: torch.Tensor, out: torch.Tensor, *, nonfinite: str = "raise") -> None:
        n = x.numel()
        if n == 0:
            return
        blocks = self._padded(x)
        scales = self._scales(x, blocks, nonfinite)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales)).nan_to_num(1.0)
        q = torch.round(blocks / safe[:, None]).nan_to_num(0).clamp_(-127, 127).to(torch.int8)
        out_scales, out_values = self._split(out, n)
        out_scales.copy_(scales)
        out_values.view(torch.int8).copy_(q.view(-1)[:n])

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        if numel == 0:
            return torch.zeros(0, device=payload.device)
        scales, values = self._split(payload, numel)
        q = torch.nn.functional.pad(values.view(torch.int8).float(), (0, -numel % self.block))
        return (q.view(-1, self.block) * scales[:, None]).view(-1)[:numel]


@dataclass(frozen=True)
class OneBitCodec(_Blockwise):
    """Sign bits and an fp32 mean-magnitude scale per block: ≈28× at block 256.

    The mean of |x| is the scale that minimises the squared error of
    ``scale * sign(x)`` over the block.
    """

    def _value_bytes(self, numel: int) -> int:
        return math.ceil(numel / 8)

    def _block_scale(self, blocks: torch.Tensor) -> torch.Tensor:
        return blocks.abs().sum(dim=1) / self.block  # padding is zeros

    def encode(self, x: torch.Tensor, out: torch.Tensor, *, nonfinite: str = "raise") -> None:
        n = x.numel()
        if n == 0:
            return
        blocks = self._padded(x)
        scales = self._scales(x, blocks, nonfinite)
        # the last block's scale must average over its real elements only
        tail = n - (blocks.shape[0] - 1) * self.block
        if tail != self.block:
            scales[-1] = scales[-1] * self.block / tail
        bits = (x >= 0).to(torch.uint8)
        bits = torch.nn.functional.pad(bits, (0, -n % 8)).view(-1, 8)
        packed = (bits << _SHIFTS.to(bits.device)).sum(dim=1, dtype=torch.uint8)
        out_scales, out_values = self._split(out, n)
        out_scales.copy_(scales)
        out_values.copy_(packed)

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        if numel == 0:
            return torch.zeros(0, device=payload.device)
        scales, packed = self._split(payload, numel)
        bits = ((packed[:, None] >> _SHIFTS.to(packed.device)) & 1).view(-1)[:numel]
        signs = bits.float().mul_(2).sub_(1)
        per_elem = scales.repeat_interleave(self.block)[:numel]
        return signs * per_elem


_SHIFTS = torch.arange(8, dtype=torch.uint8)


def align4(nbytes: int) -> int:
    """Payloads are concatenated per rank; keeping each 4-byte aligned lets the
    receiver view its fp32 scales in place."""
    return -(-nbytes // 4) * 4


def make_codec(method: Method, block: int = 256) -> Codec | None:
    """The codec for a ``ZeroConfig.compression`` method (``None`` for ``"none"``)."""
    if method == "none":
        return None
    if method in ("bf16", "fp16"):
        return CastCodec(method, torch.bfloat16 if method == "bf16" else torch.float16)
    if method == "int8":
        return Int8Codec("int8", block)
    if method == "onebit":
        return OneBitCodec("onebit", block)
    raise ValueError(f"unknown compression method {method!r}")


class WireBuffers:
    """The payload buffers of one exchange site (a bucket, a gather unit), reused
    from one step to the next instead of allocated per call. An exchange's
    buffers are reused only after it finished, which the callers guarantee:
    a site has at most one exchange in flight."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, nbytes: int, device: torch.device) -> torch.Tensor:
        t = self._buffers.get(name)
        if t is None or t.numel() != nbytes or t.device != device:
            t = self._buffers[name] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return t

    def nbytes(self) -> int:
        return sum(t.numel() for t in self._buffers.values())


@dataclass
class PendingReduceScatter:
    """A compressed reduce-scatter in flight; ``finish()`` returns this rank's fp32 sum."""

    handle: Handle
    recv: torch.Tensor
    codec: Codec
    comm: Collectives
    shard_numel: int

    def finish(self) -> torch.Tensor:
        self.handle.wait()
        wire = self.codec.wire_bytes(self.shard_numel)
        out = torch.zeros(self.shard_numel, device=self.recv.device)
        with self.comm.codec_time("decode"):
            for r in range(self.comm.world_size):
                out += self.codec.decode(self.recv[r * wire : (r + 1) * wire], self.shard_numel)
        return out


def _encode_with_feedback(
    codec: Codec, x: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None
) -> None:
    """Encode ``x`` (already including the residual) and keep what was lost in ``residual``.

    Runs inside the caller's ``codec_time("encode")``: error feedback's decode is
    part of the cost of encoding."""
    codec.encode(x, out, nonfinite="nan")
    if residual is not None:
        torch.sub(x, codec.decode(out, x.numel()), out=residual)
        # a NaN/inf step is skipped or fails loudly; it must not poison later steps
        residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


def start_reduce_scatter(
    comm: Collectives,
    codec: Codec,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    *,
    logical_bytes: int,
    buffers: WireBuffers | None = None,
) -> PendingReduceScatter:
    """Start a compressed reduce-scatter of ``x`` (see [Note: compressed reduce-scatter])."""
    n = comm.world_size
    shard = x.numel() // n
    x = x.float() if residual is None else x.float() + residual
    wire = codec.wire_bytes(shard)
    buffers = buffers or WireBuffers()
    send = buffers.get("rs_send", n * wire, x.device)
    recv = buffers.get("rs_recv", n * wire, x.device)
    with comm.codec_time("encode"):
        for r in range(n):
            chunk_residual = None if residual is None else residual[r * shard : (r + 1) * shard]
            _encode_with_feedback(
                codec,
                x[r * shard : (r + 1) * shard],
                send[r * wire : (r + 1) * wire],
                chunk_residual,
            )
    handle = comm.all_to_all(
        recv, send, async_op=True, as_op="reduce_scatter", logical_bytes=logical_bytes
    )
    return PendingReduceScatter(handle, recv, codec, comm, shard)


@dataclass(eq=False)
class PendingHierarchicalReduceScatter:
    """qgZ's reduce-scatter in flight ([Note: hierarchical gradient
    reduce-scatter]): the node leg issued, the cross leg started by
    :meth:`start_cross` once the node leg is done; ``finish()`` returns this
    rank's fp32 sum."""

    node_handle: Handle
    node_sum: torch.Tensor
    codec: Codec
    cross: Collectives
    residual: torch.Tensor | None
    buffers: WireBuffers
    _cross: PendingReduceScatter | None = None

    def node_done(self) -> bool:
        """Whether the cross leg can start without waiting."""
        return self._cross is not None or self.node_handle.done()

    def start_cross(self) -> None:
        """Wait for the node leg and start the cross leg (once)."""
        if self._cross is not None:
            return
        self.node_handle.wait()
        self._cross = start_reduce_scatter(
            self.cross,
            self.codec,
            self.node_sum,
            self.residual,
            logical_bytes=self.node_sum.numel() * self.node_sum.element_size(),
            buffers=self.buffers,
        )

    def finish(self) -> torch.Tensor:
        self.start_cross()
        assert self._cross is not None
        return self._cross.finish()


def start_hierarchical_reduce_scatter(
    node: Collectives,
    cross: Collectives,
    codec: Codec,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    *,
    dtype: torch.dtype,
    buffers: WireBuffers | None = None,
) -> PendingHierarchicalReduceScatter:
    """Start qgZ's reduce-scatter of ``x`` over the ``node`` and ``cross`` groups
    (see [Note: hierarchical gradient reduce-scatter]): the node leg in ``dtype``,
    now; the cross leg, encoded with ``codec`` and ``residual`` (P/k elements),
    by the result's :meth:`~PendingHierarchicalReduceScatter.start_cross`."""
    k, m = node.world_size, cross.world_size
    shard = x.numel() // (k * m)
    buffers = buffers or WireBuffers()
    size = torch.empty(0, dtype=dtype).element_size()
    permuted = buffers.get("node_in", x.numel() * size, x.device).view(dtype).view(k, m, shard)
    # [node b, place i, element e] -> [place i, node b, element e]: place j's chunk
    # holds the world shards b·k + j of every node b
    permuted.copy_(x.view(m, k, shard).transpose(0, 1))
    node_sum = buffers.get("node_out", m * shard * size, x.device).view(dtype)
    handle = node.reduce_scatter(node_sum, permuted.view(-1), async_op=True)
    return PendingHierarchicalReduceScatter(handle, node_sum, codec, cross, residual, buffers)


@dataclass
class PendingAllGather:
    """A compressed all-gather in flight; ``finish()`` (or ``wait()``, as for a
    :class:`~worker.collectives.Handle`) decodes into ``out``. ``own``: this rank's
    exact values, written into its own slot instead of its decoded payload
    ([Note: quantized parameter gathers])."""

    handle: Handle
    recv: torch.Tensor
    codec: Codec
    comm: Collectives
    out: torch.Tensor
    own: torch.Tensor | None = None

    def finish(self) -> None:
        self.handle.wait()
        n, rank = self.comm.world_size, self.comm.rank
        shard = self.out.numel() // n
        wire = self.codec.wire_bytes(shard)
        with self.comm.codec_time("decode"):
            for r in range(n):
                slot = self.out[r * shard : (r + 1) * shard]
                if r == rank and self.own is not None:
                    if slot.data_ptr() != self.own.data_ptr():
                        slot.copy_(self.own.view(-1))
                    continue
                slot.copy_(self.codec.decode_part(self.recv[r * wire : (r + 1) * wire], shard, r))
        self.own = None

    def wait(self) -> None:
        self.finish()


def start_all_gather(
    comm: Collectives,
    codec: Codec,
    shard: torch.Tensor,
    out: torch.Tensor,
    residual: torch.Tensor | None = None,
    buffers: WireBuffers | None = None,
    *,
    exact_own: bool = False,
) -> PendingAllGather:
    """Start a compressed all-gather of every rank's ``shard`` into ``out``.

    ``exact_own``: this rank's slot of ``out`` gets ``shard`` itself, not its
    decoded payload (parameters: [Note: quantized parameter gathers]); the
    caller leaves ``shard`` unchanged until the gather is finished. Gradients
    leave it off: at stage 0 every rank must step on the same values."""
    x = shard.float() if residual is None else shard.float() + residual
    wire = codec.wire_bytes(x.numel())
    buffers = buffers or WireBuffers()
    send = buffers.get("ag_send", wire, x.device)
    recv = buffers.get("ag_recv", comm.world_size * wire, x.device)
    codec.begin(comm, x)
    with comm.codec_time("encode"):
        if residual is None:
            codec.encode_part(x, send, comm.rank)
        else:
            _encode_with_feedback(codec, x, send, residual)
    handle = comm.all_gather(
        recv, send, async_op=True, logical_bytes=out.numel() * out.element_size()
    )
    return PendingAllGather(handle, recv, codec, comm, out, shard if exact_own else None)
