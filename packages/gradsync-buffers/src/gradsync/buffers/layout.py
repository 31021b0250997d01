"""Where every parameter and gradient lives in the flat buffers: a pure function of shapes and sizes.

Params are laid out in reverse registration order (the last layer's grads are ready first in backward),
packed into buckets that close once they reach ``bucket_size`` elements. With the distributed optimizer the
layout is padded: each param starts at a multiple of 64 elements, each bucket ends at a multiple of
lcm(dp, 128) (and of 2^16 with ``pad_buckets_for_high_nccl_busbw``) so it splits into equal DP shards, and a
``shared_embedding`` param gets a bucket of its own. Nothing here needs a process group or a tensor.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar, cast

import torch

from .shard_alignment import (
    ROW,
    ShardAlignment,
    ShardBalance,
    equal_cuts,
    owned_elements,
    pack_shards,
    shard_alignment_of,
)

PARAM_START_ALIGNMENT = 64
"""Param starts are aligned to this many elements (elements, not bytes, as in the reference)."""
BUCKET_END_ALIGNMENT = 128
HIGH_BUSBW_ALIGNMENT = 2**16

ParamKey = TypeVar("ParamKey", bound=Hashable)
"""What a layout's ``param_index_map`` is keyed by: the param's position in its buffer (``int``, the pure
functions' keying), or the Parameter itself (Megatron-Core's keying)."""
TensorT = TypeVar("TensorT", bound=torch.Tensor)


def pad_to_divisor(value: int, divisor: int) -> int:
    """``value`` rounded up to a multiple of ``divisor``."""
    return -(-value // divisor) * divisor


def pad_param_start(param_start_index: int) -> int:
    return pad_to_divisor(param_start_index, PARAM_START_ALIGNMENT)


def bucket_end_divisor(data_parallel_world_size: int, pad_for_high_nccl_busbw: bool) -> int:
    """Bucket ends are multiples of lcm(dp, 128), or lcm(dp, 128, 2^16) for high NCCL bus bandwidth."""
    divisor = math.lcm(data_parallel_world_size, BUCKET_END_ALIGNMENT)
    return math.lcm(divisor, HIGH_BUSBW_ALIGNMENT) if pad_for_high_nccl_busbw else divisor


def pad_bucket_end(
    bucket_end_index: int, data_parallel_world_size: int, pad_for_high_nccl_busbw: bool
) -> int:
    return pad_to_divisor(
        bucket_end_index, bucket_end_divisor(data_parallel_world_size, pad_for_high_nccl_busbw)
    )


@dataclass(frozen=True)
class BufferKey:
    """Params sharing a buffer share these: dtypes, and whether they are expert-parallel."""

    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    is_expert_parallel: bool
    is_managed_by_layer_wise_optimizer: bool = False


@dataclass(frozen=True)
class ParamSpec:
    """What the layout needs to know about one parameter."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    is_expert_parallel: bool = False
    shared_embedding: bool = False
    shard_alignment: ShardAlignment = ROW

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def of(cls, param: torch.Tensor) -> ParamSpec:
        """Read a parameter's layout-relevant attributes."""
        return cls(
            shape=tuple(param.shape),
            dtype=param.dtype,
            is_expert_parallel=is_expert_parallel(param),
            shared_embedding=bool(getattr(param, "shared_embedding", False)),
            shard_alignment=shard_alignment_of(param),
        )


def is_expert_parallel(param: torch.Tensor) -> bool:
    """Megatron's marker: an expert param carries ``allreduce=False`` and is reduced over expt_dp only."""
    return not getattr(param, "allreduce", True)


@dataclass(frozen=True)
class ShardParamRange:
    """The part of one param that a DP rank's shard of a bucket holds (the distributed-optimizer contract).

    All ranges are half-open. ``param_range`` indexes the flattened param, ``gbuf_world`` the whole
    buffer, ``gbuf_world_in_bucket`` the bucket, and ``local`` the shard.
    """

    param_index: int
    param_range: tuple[int, int]
    gbuf_world: tuple[int, int]
    gbuf_world_in_bucket: tuple[int, int]
    local: tuple[int, int]


@dataclass
class PerBufferParamLayout(Generic[ParamKey]):
    """The layout of one buffer.

    ``param_index_map[param] = (start, end, bucket_id)``, in layout order (reverse registration order);
    ``bucket_indices[b] = (start, end)`` including padding; ``num_optimizer_shards`` is the DP size the
    padding was computed for (None when unpadded). A layout computed over params (Megatron-Core's
    ``DistributedOptimizer.compute_full_param_layout``, :meth:`keyed_by`) is keyed by the Parameter, as
    the reference's is; the pure functions over sizes and :class:`ParamSpec` key it by the param's
    position in the buffer's param list (``PerBufferParamLayout[int]``), which is also how a buffer keeps
    its own (:meth:`by_position`).
    """

    param_index_map: dict[ParamKey, tuple[int, int, int]] = field(default_factory=dict)
    bucket_indices: list[tuple[int, int]] = field(default_factory=list)
    per_bucket_numel_unpadded: list[int] = field(default_factory=list)
    param_indices: list[int] = field(default_factory=list)
    num_optimizer_shards: int | None = None
    _by_bucket: list[list[ParamKey]] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def numel(self) -> int:
        return self.bucket_indices[-1][1] if self.bucket_indices else 0

    def is_positional(self) -> bool:
        """Whether ``param_index_map`` is keyed by positions rather than by the params themselves."""
        return all(isinstance(key, int) for key in self.param_index_map)

    def keyed_by(self: PerBufferParamLayout[int], params: Sequence[TensorT]) -> PerBufferParamLayout[TensorT]:
        """This positional layout keyed by the params themselves (``params[i]`` at position ``i``), in the
        same order: Megatron-Core's form."""
        if set(self.param_index_map) != set(range(len(params))):
            raise ValueError(
                f"the layout has positions {sorted(self.param_index_map)} but {len(params)} params were given"
            )
        return PerBufferParamLayout(
            param_index_map={params[i]: where for i, where in self.param_index_map.items()},
            bucket_indices=list(self.bucket_indices),
            per_bucket_numel_unpadded=list(self.per_bucket_numel_unpadded),
            param_indices=list(self.param_indices),
            num_optimizer_shards=self.num_optimizer_shards,
        )

    def by_position(self, params: Sequence[torch.Tensor]) -> PerBufferParamLayout[int]:
        """This layout keyed by each param's position in ``params`` (the buffer's param list), in the same
        order. A positional layout is returned as it is; one keyed by params must hold exactly
        ``params``."""
        if self.is_positional():
            return cast(PerBufferParamLayout[int], self)
        position = {id(param): i for i, param in enumerate(params)}
        strangers = sum(id(key) not in position for key in self.param_index_map)
        missing = len(params) - (len(self.param_index_map) - strangers)
        if strangers or missing:
            raise ValueError(
                f"the layout is keyed by {len(self.param_index_map)} params, {strangers} of them not among "
                f"the buffer's {len(params)}, and misses {missing} of the buffer's: compute it over the "
                "params the buffer is built from"
            )
        return PerBufferParamLayout(
            param_index_map={position[id(key)]: where for key, where in self.param_index_map.items()},
            bucket_indices=list(self.bucket_indices),
            per_bucket_numel_unpadded=list(self.per_bucket_numel_unpadded),
            param_indices=list(self.param_indices),
            num_optimizer_shards=self.num_optimizer_shards,
        )

    def bucket_params(self, bucket_id: int) -> list[ParamKey]:
        """Params of a bucket in layout order (reverse registration order, unless a shard-alignment
        policy re-packed the bucket: then by offset). The split into buckets is
        computed once, in O(P log P), on first use: a layout is not changed once built."""
        if self._by_bucket is None:
            by_bucket: list[list[ParamKey]] = [[] for _ in self.bucket_indices]
            for i in sorted(self.param_index_map, key=lambda i: self.param_index_map[i][0]):
                by_bucket[self.param_index_map[i][2]].append(i)
            self._by_bucket = by_bucket
        return self._by_bucket[bucket_id]

    def shard_range(self, bucket_id: int, rank: int, num_shards: int) -> tuple[int, int]:
        """Buffer range of ``rank``'s shard of a bucket; shards are equal and contiguous."""
        start, end = self.bucket_indices[bucket_id]
        if (end - start) % num_shards:
            raise ValueError(
                f"bucket {bucket_id} has {end - start} elements, not divisible into {num_shards} shards"
            )
        size = (end - start) // num_shards
        return start + rank * size, start + (rank + 1) * size

    def balance(self, num_shards: int) -> ShardBalance:
        """Padding, and the param elements each of ``num_shards`` shards holds, over every bucket."""
        owned = [0] * num_shards
        numel = 0
        for bucket_id, (start, end) in enumerate(self.bucket_indices):
            members = [self.param_index_map[i] for i in self.bucket_params(bucket_id)]
            numels = [hi - lo for lo, hi, _ in members]
            shard = (end - start) // num_shards
            cuts = equal_cuts(shard, num_shards)
            in_bucket = owned_elements([lo - start for lo, _, _ in members], numels, cuts)
            owned = [a + b for a, b in zip(owned, in_bucket, strict=True)]
            numel += sum(numels)
        return ShardBalance(numel, self.numel, tuple(owned))

    def shard_param_ranges(
        self: PerBufferParamLayout[int], bucket_id: int, rank: int, num_shards: int
    ) -> list[ShardParamRange]:
        """The param pieces ``rank`` owns in a bucket (padding belongs to nobody)."""
        bucket_start = self.bucket_indices[bucket_id][0]
        world_start, world_end = self.shard_range(bucket_id, rank, num_shards)
        size = world_end - world_start
        pieces = []
        for i in self.bucket_params(bucket_id):
            param_start, param_end, _ = self.param_index_map[i]
            local = (max(0, param_start - world_start), min(size, param_end - world_start))
            if local[1] <= local[0]:
                continue
            gbuf = (local[0] + world_start, local[1] + world_start)
            offset = max(0, world_start - param_start)
            pieces.append(
                ShardParamRange(
                    param_index=i,
                    param_range=(offset, offset + local[1] - local[0]),
                    gbuf_world=gbuf,
                    gbuf_world_in_bucket=(gbuf[0] - bucket_start, gbuf[1] - bucket_start),
                    local=local,
                )
            )
        return pieces


def compute_param_layout(
    numels: Sequence[int],
    bucket_size: int | None,
    *,
    padded: bool = False,
    data_parallel_world_size: int = 1,
    pad_for_high_nccl_busbw: bool = False,
    shared_embedding: Sequence[bool] | None = None,
    shard_cuts: Sequence[tuple[int, bool]] | None = None,
) -> PerBufferParamLayout[int]:
    """Lay out params (given in registration order) in reverse order, bucketed and optionally padded.

    Unpadded (plain all-reduce DDP): params are packed back to back, no shared-embedding rule. Padded
    (distributed optimizer): 64-element param starts, bucket ends padded for ``data_parallel_world_size``
    equal shards, and ``shared_embedding`` params alone in their bucket. A param never spans two buckets.
    ``shard_cuts`` (padded only): per param, the element multiple a shard boundary may cut it at and
    whether it must stay whole (:mod:`.shard_alignment`); a bucket holding such a param is re-packed by
    :func:`~.shard_alignment.pack_shards` (same params, same bucket; offsets and padding change).
    """
    shared = list(shared_embedding) if shared_embedding is not None else [False] * len(numels)
    if len(shared) != len(numels):
        raise ValueError(f"{len(numels)} params but {len(shared)} shared_embedding flags")
    if bucket_size is not None and bucket_size <= 0:
        raise ValueError(f"bucket_size must be positive or None, got {bucket_size}")
    layout: PerBufferParamLayout[int] = PerBufferParamLayout(
        num_optimizer_shards=data_parallel_world_size if padded else None
    )
    start = bucket_start = 0
    open_params: list[int] = []
    cuts = list(shard_cuts) if shard_cuts is not None else [(1, False)] * len(numels)
    if len(cuts) != len(numels):
        raise ValueError(f"{len(numels)} params but {len(cuts)} shard cuts")
    quantum = (
        bucket_end_divisor(data_parallel_world_size, pad_for_high_nccl_busbw) // data_parallel_world_size
    )

    def close_bucket(at: int) -> None:
        nonlocal start, bucket_start, open_params
        if padded and any(cuts[i] != (1, False) for i in open_params):
            packed = pack_shards(
                [numels[i] for i in open_params],
                [cuts[i][0] for i in open_params],
                [cuts[i][1] for i in open_params],
                data_parallel_world_size,
                start_multiple=PARAM_START_ALIGNMENT,
                shard_quantum=quantum,
                first_rank=len(layout.bucket_indices),
            )
            bucket_id = len(layout.bucket_indices)
            for i, offset in zip(open_params, packed.offsets, strict=True):
                layout.param_index_map[i] = (
                    bucket_start + offset,
                    bucket_start + offset + numels[i],
                    bucket_id,
                )
            at = bucket_start + max(
                offset + numels[i] for i, offset in zip(open_params, packed.offsets, strict=True)
            )
            end = bucket_start + packed.shard_size * data_parallel_world_size
        else:
            end = pad_bucket_end(at, data_parallel_world_size, pad_for_high_nccl_busbw) if padded else at
        layout.bucket_indices.append((bucket_start, end))
        layout.per_bucket_numel_unpadded.append(at - bucket_start)
        start = bucket_start = end
        open_params = []

    for i in reversed(range(len(numels))):
        if padded:
            start = pad_param_start(start)
            if shared[i] and open_params:
                close_bucket(start)
        end = start + numels[i]
        layout.param_index_map[i] = (start, end, len(layout.bucket_indices))
        open_params.append(i)
        if (bucket_size is not None and end - bucket_start >= bucket_size) or (padded and shared[i]):
            close_bucket(end)
        else:
            start = end
    if open_params:
        close_bucket(start)
    return layout


def shard_cut(policy: ShardAlignment, shape: Sequence[int]) -> tuple[int, bool]:
    """A flat shard's rule for one param: the multiple a cut must fall on, and whether it may be cut."""
    return policy.flat_multiple(shape), policy.whole


def buffer_key(spec: ParamSpec, grad_reduce_in_fp32: bool) -> BufferKey:
    return BufferKey(
        param_dtype=spec.dtype,
        grad_dtype=torch.float32 if grad_reduce_in_fp32 else spec.dtype,
        is_expert_parallel=spec.is_expert_parallel,
    )


def group_specs_for_buffers(
    specs: Sequence[ParamSpec], grad_reduce_in_fp32: bool
) -> dict[BufferKey, list[int]]:
    """Positions of the params of each buffer, buffers ordered by first appearance."""
    groups: dict[BufferKey, list[int]] = {}
    for i, spec in enumerate(specs):
        groups.setdefault(buffer_key(spec, grad_reduce_in_fp32), []).append(i)
    return groups


def group_params_for_buffers(
    params: Sequence[torch.Tensor], grad_reduce_in_fp32: bool
) -> dict[BufferKey, tuple[list[torch.Tensor], list[int]]]:
    """Megatron-Core's grouping: per buffer, its params in input order and each one's index within the
    buffer (0, 1, ... per buffer; gradsync has no quantized storage that would make them differ)."""
    frozen = [i for i, p in enumerate(params) if not p.requires_grad]
    if frozen:
        raise ValueError(f"group_params_for_buffers: params at positions {frozen} do not require grad")
    grouped = group_specs_for_buffers([ParamSpec.of(p) for p in params], grad_reduce_in_fp32)
    return {
        key: ([params[i] for i in members], list(range(len(members)))) for key, members in grouped.items()
    }


@dataclass
class FullParamLayout(Generic[ParamKey]):
    """One layout per buffer; ``members[key]`` maps the buffer's positions back to the input params.

    :func:`compute_full_param_layout` (over :class:`ParamSpec`) keys each layout by position;
    :meth:`keyed_by` (what ``DistributedOptimizer.compute_full_param_layout`` returns) by the Parameter,
    as Megatron-Core does.
    """

    layouts: dict[BufferKey, PerBufferParamLayout[ParamKey]] = field(default_factory=dict)
    members: dict[BufferKey, list[int]] = field(default_factory=dict)

    def keyed_by(self: FullParamLayout[int], params: Sequence[TensorT]) -> FullParamLayout[TensorT]:
        """This layout with each buffer's ``param_index_map`` keyed by the params (``params`` being the
        list the layout was computed over)."""
        return FullParamLayout(
            layouts={
                key: layout.keyed_by([params[i] for i in self.members[key]])
                for key, layout in self.layouts.items()
            },
            members={key: list(members) for key, members in self.members.items()},
        )


def compute_full_param_layout(
    specs: Sequence[ParamSpec],
    bucket_size: int | None,
    *,
    grad_reduce_in_fp32: bool = False,
    padded: bool = False,
    data_parallel_world_size: int = 1,
    expert_data_parallel_world_size: int | None = None,
    pad_for_high_nccl_busbw: bool = False,
) -> FullParamLayout[int]:
    """Group params into buffers and lay out each, keyed by position; expert buffers pad for the expert
    DP size."""
    full: FullParamLayout[int] = FullParamLayout()
    for key, members in group_specs_for_buffers(specs, grad_reduce_in_fp32).items():
        dp = data_parallel_world_size
        if key.is_expert_parallel and expert_data_parallel_world_size is not None:
            dp = expert_data_parallel_world_size
        layout = compute_param_layout(
            [specs[i].numel for i in members],
            bucket_size,
            padded=padded,
            data_parallel_world_size=dp,
            pad_for_high_nccl_busbw=pad_for_high_nccl_busbw,
            shared_embedding=[specs[i].shared_embedding for i in members],
            shard_cuts=[shard_cut(specs[i].shard_alignment, specs[i].shape) for i in members],
        )
        layout.param_indices = list(range(len(members)))
        full.layouts[key] = layout
        full.members[key] = members
    return full
