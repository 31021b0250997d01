"""Predicted communication, exposed time, memory and wire bytes of one training step, per strategy.

The buckets come from gradsync's own layout code with the reference's rules (bucket size, padding of each
bucket to the DP size, optionally to 2^16 for NCCL bus bandwidth), so the messages are the ones the
wrappers would send. Overlap is simulated on one communication channel that runs collectives in the
order the wrappers issue them, against a compute timeline in which the backward (or forward) processes
params at a constant rate: grads of a bucket are ready once the backward has passed all of its params;
a gather must finish before the forward reaches its params. Exposed time is how long compute waits.

Strategies (fp32 params and grads, Adam: two fp32 states per param; ``ddp``: all-reduce per bucket;
``distopt``: reduce-scatter per bucket, then the param all-gather overlapped with the next forward;
``zero3``: the model's FSDP units (``units``: each param's unit, None outside every unit), one bucket each
(ragged, as gradsync-fsdp lays it out, where it holds ``tensor`` or ``block`` params), gathered before its
forward and again before its backward (one unit prefetched; the last unit stays gathered from its forward
into the backward), its grads reduce-scattered after its backward; the params outside units form buckets
(split at the bucket size) gathered at the forward's start, held whole through the step, their grads
reduce-scattered at the backward's end. Peak memory follows gradsync-fsdp's schedule: the sharded state,
the non-unit buckets' weights and unreduced grads whole, two units' weights (one computing, one
prefetched) and three units' unreduced grads (two reductions in flight, one filling).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import default_bucket_size
from ..layout import ParamSpec, PerBufferParamLayout, compute_param_layout, shard_cut
from ..shard_alignment import ROW, ShardAlignment, drop_tail_padding, pack_shards
from .costs import LinkCosts

STRATEGIES = ("ddp", "distopt", "zero3")
FP32 = 4
ADAM_STATE_BYTES = 8


@dataclass(frozen=True)
class GradWire:
    """What a grad reduction sends per value: fp32 reduced by the backend (``bytes_per_value`` None), or a
    low-precision wire summed in fp32 (``grad_comm_dtype``): an all-to-all priced as a ring reduce-scatter
    of the packed bytes, and, for an all-reduce, an all-gather of the packed sums (never NCCL's tree). The
    packing's own compute is not priced. ``all_reduce_shares``: a comm hook's fp32 all-reduces instead
    (PowerSGD's), each as a share of the bucket's values (see :func:`powersgd_wire`)."""

    bytes_per_value: float | None = None
    all_reduce_shares: tuple[float, ...] = ()

    def collectives(self, kind: str, size: int) -> list[tuple[str, float]]:
        """The collectives, with their bytes, that reduce ``size`` values as ``kind``."""
        if self.all_reduce_shares:
            if kind != "all_reduce":
                raise ValueError("a comm hook replaces all-reduces only: price it for the ddp strategy")
            return [("all_reduce", size * FP32 * share) for share in self.all_reduce_shares]
        if self.bytes_per_value is None:
            return [(kind, size * FP32)]
        packed = size * self.bytes_per_value
        return (
            [("reduce_scatter", packed), ("all_gather", packed)]
            if kind == "all_reduce"
            else [("reduce_scatter", packed)]
        )

    def seconds(self, kind: str, size: int, costs: LinkCosts, dp: int) -> float:
        return sum(costs.time(k, nbytes, dp) for k, nbytes in self.collectives(kind, size))

    @property
    def value_bytes(self) -> float:
        if self.all_reduce_shares:
            return FP32 * sum(self.all_reduce_shares)
        return FP32 if self.bytes_per_value is None else self.bytes_per_value


def powersgd_wire(shapes: Sequence[Sequence[int]], rank: int, min_compression_rate: float = 2.0) -> GradWire:
    """torch's ``powerSGD_hook`` once compressing: three fp32 all-reduces per bucket, of the tensors it
    leaves whole (vectors, and matrices whose factors would not be ``min_compression_rate`` times
    smaller), of the P factors (rows x r per matrix) and of the Q factors (columns x r), each taken as
    the same share of every bucket as of the whole model. The matmuls and orthogonalisation, and the
    plain all-reduces before ``start_powerSGD_iter``, are not priced."""
    whole = left = right = 0
    total = 0
    for shape in shapes:
        numel = math.prod(shape)
        total += numel
        rows = shape[0] if len(shape) > 1 else 0
        cols = numel // rows if rows else 0
        r = min(rows, cols, rank)
        if rows and (rows + cols) * r * min_compression_rate < numel:
            left, right = left + rows * r, right + cols * r
        else:
            whole += numel
    if not total:
        raise ValueError("powersgd_wire: no param shapes to price")
    return GradWire(all_reduce_shares=tuple(part / total for part in (whole, left, right) if part))


FP32_WIRE = GradWire()


@dataclass(frozen=True)
class Prediction:
    strategy: str
    dp: int
    bucket_size: int
    buckets: int
    comm_seconds: float
    exposed_seconds: float
    latency_seconds: float
    wire_bytes: float
    peak_bytes: float
    padding_bytes: float  # the layout's padding (bucket ends, param starts, shard-alignment policies)

    @property
    def latency_bound(self) -> bool:
        """The α terms outweigh the β terms."""
        return self.latency_seconds > self.comm_seconds - self.latency_seconds


def bucket_sizes(
    numels: Sequence[int],
    bucket_size: int | None,
    dp: int,
    pad_for_high_nccl_busbw: bool = False,
    cuts: Sequence[tuple[int, bool]] | None = None,
) -> list[int]:
    """Padded bucket sizes (elements), in the order the backward fills them (last params first);
    ``cuts``: each param's shard-alignment rule (:func:`~gradsync.buffers.layout.shard_cut`)."""
    layout = _padded_layout(numels, bucket_size, dp, pad_for_high_nccl_busbw, cuts)
    return [end - start for start, end in layout.bucket_indices]


def _padded_layout(
    numels: Sequence[int],
    bucket_size: int | None,
    dp: int,
    pad_for_high_nccl_busbw: bool,
    cuts: Sequence[tuple[int, bool]] | None,
) -> PerBufferParamLayout[int]:
    return compute_param_layout(
        list(numels),
        bucket_size,
        padded=True,
        data_parallel_world_size=dp,
        pad_for_high_nccl_busbw=pad_for_high_nccl_busbw,
        shard_cuts=cuts,
    )


def fsdp_bucket_sizes(
    numels: Sequence[int],
    bucket_size: int | None,
    dp: int,
    pad_for_high_nccl_busbw: bool,
    cuts: Sequence[tuple[int, bool]],
) -> list[int]:
    """:func:`bucket_sizes` as gradsync-fsdp lays them out: a bucket holding ``tensor`` or ``block``
    params is ragged (packed into ``dp`` equal shards as the cuts allow, then each shard without its tail
    padding)."""
    layout = _padded_layout(numels, bucket_size, dp, pad_for_high_nccl_busbw, cuts)
    sizes = [end - start for start, end in layout.bucket_indices]
    members: dict[int, list[int]] = {}
    for index, (_, _, bucket) in layout.param_index_map.items():
        members.setdefault(bucket, []).append(index)
    for bucket, indices in members.items():
        if any(cuts[i] != (1, False) for i in indices):
            own = [numels[i] for i in indices]
            packed = pack_shards(own, [cuts[i][0] for i in indices], [cuts[i][1] for i in indices], dp)
            sizes[bucket] = drop_tail_padding(packed.offsets, own, packed.shard_size, dp)[1][-1]
    return sizes


def _channel(events: Sequence[tuple[float, float]]) -> tuple[float, list[float]]:
    """One collective at a time, in order: each (ready time, duration) starts when ready and the channel
    is free. Returns the busy time and each collective's end."""
    clock, ends = 0.0, []
    for ready, duration in events:
        clock = max(clock, ready) + duration
        ends.append(clock)
    return sum(d for _, d in events), ends


def _reduce_exposed(
    sizes: Sequence[int], kind: str, costs: LinkCosts, dp: int, backward: float, wire: GradWire
) -> float:
    """Buckets reduced as the backward fills them: how long after the backward the last one ends."""
    total = sum(sizes)
    ready, events = 0, []
    for size in sizes:
        ready += size
        events.append((backward * ready / total, wire.seconds(kind, size, costs, dp)))
    _, ends = _channel(events)
    return max(0.0, ends[-1] - backward) if ends else 0.0


def _gather_exposed(sizes: Sequence[int], costs: LinkCosts, dp: int, forward: float) -> float:
    """Gathers all issued at the step's start, in forward order (the reverse of the reduce order), each
    needed when the forward reaches its params: the total stall of the forward."""
    total, stall, needed, clock = sum(sizes), 0.0, 0, 0.0
    for size in reversed(sizes):
        clock += costs.time("all_gather", size * FP32, dp)
        reach = forward * needed / total + stall
        stall += max(0.0, clock - reach)
        needed += size
    return stall


def _zero3_exposed(
    sizes: Sequence[int],
    costs: LinkCosts,
    dp: int,
    forward: float,
    backward: float,
    wire: GradWire,
    gather_bytes: float,
) -> float:
    """Units in forward order: gather unit i+1 while unit i computes (one unit prefetched), in the
    forward and again in the backward, where each unit's reduce-scatter follows its backward."""
    units = list(reversed(sizes))
    total = sum(units)
    stall = 0.0
    for phase_time, reduce in ((forward, False), (backward, True)):
        order = units if not reduce else list(reversed(units))
        compute = 0.0
        gathered = channel_free = costs.time("all_gather", order[0] * gather_bytes, dp)
        for index, size in enumerate(order):
            start = max(compute, gathered)  # compute of this unit waits for its weights
            stall += start - compute
            if index + 1 < len(order):  # prefetch the next unit
                following = order[index + 1] * gather_bytes
                gathered = max(channel_free, start) + costs.time("all_gather", following, dp)
                channel_free = gathered
            compute = start + phase_time * size / total
            if reduce:
                channel_free = max(channel_free, compute) + wire.seconds("reduce_scatter", size, costs, dp)
        if reduce:
            stall += max(0.0, channel_free - compute)
    return stall


def predict(
    strategy: str,
    specs: Sequence[ParamSpec],
    dp: int,
    costs: LinkCosts,
    *,
    bucket_size: int | None = None,
    forward_seconds: float = 0.0,
    backward_seconds: float = 0.0,
    pad_for_high_nccl_busbw: bool = False,
    units: Sequence[int | None] | None = None,
    wire: GradWire = FP32_WIRE,
    gather_bytes: float = FP32,
) -> Prediction:
    """One step of ``strategy`` at ``dp`` ranks; ``bucket_size`` defaults to the reference's rule.
    ``units`` (``zero3`` only, required there): each spec's FSDP unit, None outside every unit. ``wire``:
    what the grad reductions send. ``gather_bytes``: the bytes per value ZeRO-3's weight gathers send
    (a packed wire's, ``param_gather_dtype``; its packing's compute is not priced); the other
    strategies gather in fp32."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    if strategy != "zero3" and gather_bytes != FP32:
        raise ValueError(  # distopt is gradsync-ddp's, whose config refuses param_gather_dtype
            f"{strategy}: packed weight gathers are priced for zero3 (param_gather_dtype is MegatronFSDP's)"
        )
    size = bucket_size if bucket_size is not None else default_bucket_size(dp)
    numels = [s.numel for s in specs]
    cuts = [shard_cut(s.shard_alignment, s.shape) for s in specs]
    psi = sum(numels)
    if strategy == "zero3":
        return _predict_zero3(numels, cuts, dp, costs, size, forward_seconds, backward_seconds,
                              pad_for_high_nccl_busbw, units, wire, gather_bytes)  # fmt: skip
    sizes = bucket_sizes(numels, size, dp, pad_for_high_nccl_busbw, cuts)
    share = (dp - 1) / dp
    padded = sum(sizes)
    collectives: list[tuple[str, float]] = []
    if strategy == "ddp":
        collectives = [c for s in sizes for c in wire.collectives("all_reduce", s)]
        sent = 2 * share * padded * wire.value_bytes
        peak: float = padded * FP32 * 2 + psi * ADAM_STATE_BYTES
        exposed = _reduce_exposed(sizes, "all_reduce", costs, dp, backward_seconds, wire)
    elif strategy == "distopt":
        collectives = [c for s in sizes for c in wire.collectives("reduce_scatter", s)]
        collectives += [("all_gather", s * FP32) for s in sizes]
        sent = share * padded * (wire.value_bytes + FP32)
        peak = padded * FP32 * 2 + padded / dp * ADAM_STATE_BYTES
        exposed = _reduce_exposed(sizes, "reduce_scatter", costs, dp, backward_seconds, wire)
        exposed += _gather_exposed(sizes, costs, dp, forward_seconds)
    return _prediction(strategy, dp, size, len(sizes), costs, collectives, exposed, sent, peak,
                       (padded - psi) * FP32,
                       overlapped=forward_seconds > 0.0 or backward_seconds > 0.0)  # fmt: skip


def _prediction(
    strategy: str,
    dp: int,
    size: int,
    buckets: int,
    costs: LinkCosts,
    collectives: list[tuple[str, float]],
    exposed: float,
    sent: float,
    peak: float,
    padding: float,
    overlapped: bool,
) -> Prediction:
    terms = [costs.terms(kind, nbytes, dp) for kind, nbytes in collectives]
    comm = sum(a + b for a, b in terms)
    latency = sum(a for a, _ in terms)
    return Prediction(
        strategy, dp, size, buckets, comm, exposed if overlapped else comm, latency, sent, peak, padding
    )


def _predict_zero3(
    numels: Sequence[int],
    cuts: Sequence[tuple[int, bool]],
    dp: int,
    costs: LinkCosts,
    size: int,
    forward: float,
    backward: float,
    pad: bool,
    units: Sequence[int | None] | None,
    wire: GradWire,
    gather_bytes: float,
) -> Prediction:
    if units is None or len(units) != len(numels):
        raise ValueError("zero3 needs each param's FSDP unit (units=[unit id or None per param])")
    unit_ids = sorted({u for u in units if u is not None})
    if not unit_ids:
        raise ValueError("zero3: no param is in an FSDP unit")

    def members(unit: int | None) -> tuple[list[int], list[tuple[int, bool]]]:
        chosen = [i for i, u in enumerate(units) if u == unit]
        return [numels[i] for i in chosen], [cuts[i] for i in chosen]

    unit_sizes = []  # one bucket per unit, padded as the layout pads it
    for unit in unit_ids:
        unit_numels, unit_cuts = members(unit)
        unit_sizes.append(sum(fsdp_bucket_sizes(unit_numels, None, dp, pad, unit_cuts)))
    outside, outside_cuts = members(None)
    other_sizes = fsdp_bucket_sizes(outside, size, dp, pad, outside_cuts) if outside else []
    share, padded = (dp - 1) / dp, sum(unit_sizes) + sum(other_sizes)
    gathered = [*unit_sizes, *unit_sizes[:-1], *other_sizes]  # the last unit is kept into the backward
    collectives: list[tuple[str, float]] = [("all_gather", s * gather_bytes) for s in gathered]
    collectives += [c for s in (*unit_sizes, *other_sizes) for c in wire.collectives("reduce_scatter", s)]
    sent = share * (sum(gathered) * gather_bytes + padded * wire.value_bytes)
    largest, whole = max(unit_sizes), sum(other_sizes)
    peak = padded / dp * (FP32 * 2 + ADAM_STATE_BYTES) + (2 * whole + 2 * largest + 3 * largest) * FP32
    exposed = _zero3_exposed(list(reversed(unit_sizes)), costs, dp, forward, backward, wire, gather_bytes)
    exposed += sum(costs.time("all_gather", s * gather_bytes, dp)
                   + wire.seconds("reduce_scatter", s, costs, dp) for s in other_sizes)  # fmt: skip
    return _prediction("zero3", dp, size, len(unit_sizes) + len(other_sizes), costs, collectives, exposed,
                       sent, peak, (padded - sum(numels)) * FP32,
                       overlapped=forward > 0.0 or backward > 0.0)  # fmt: skip


def recommend_bucket_size(
    specs: Sequence[ParamSpec],
    dp: int,
    costs: LinkCosts,
    strategy: str,
    candidates: Sequence[int],
    forward_seconds: float,
    backward_seconds: float,
    wire: GradWire = FP32_WIRE,
) -> Prediction:
    """The candidate with the least exposed time (then the least total comm time)."""
    predictions = [
        predict(strategy, specs, dp, costs, bucket_size=c, forward_seconds=forward_seconds,
                backward_seconds=backward_seconds, wire=wire)
        for c in candidates
    ]  # fmt: skip
    return min(predictions, key=lambda p: (round(p.exposed_seconds, 9), p.comm_seconds))


def specs_from_shapes(
    shapes: Sequence[Sequence[int]], matrix_alignment: ShardAlignment = ROW
) -> list[ParamSpec]:
    """fp32 specs; ``matrix_alignment`` is the shard-alignment policy of every param of 2 or more dims
    (the matrices a matrix optimizer would precondition), the others keep the default."""
    return [
        ParamSpec(tuple(int(d) for d in shape), torch.float32,
                  shard_alignment=matrix_alignment if len(shape) > 1 else ROW)
        for shape in shapes
    ]  # fmt: skip
