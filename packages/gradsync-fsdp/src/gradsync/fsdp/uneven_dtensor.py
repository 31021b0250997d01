"""Helpers for DTensors whose shards are uneven, as MegatronFSDP's optimizer params are.

Each rank owns a contiguous row range of every param (from the flat-buffer layout), possibly empty, so the
shards are not the even ``torch.chunk`` split DTensor assumes: native ops that redistribute
(``full_tensor()``, ``redistribute()``) send mismatched byte counts and fail inside torch (or the gloo
transport aborts). These helpers take the names, signatures and behaviour of Megatron-FSDP's
``uneven_dtensor`` module and run real collectives over the DTensor's own mesh (gloo or NCCL), for any mesh
of ``Shard`` / ``_StridedShard`` / ``Replicate`` placements (gradsync's ``(shard)`` and ``(outer, shard)``
meshes included), and for ranks that own nothing.

Where each rank's chunk starts: the chunk attached to the local tensor (``__create_chunk_list__``:
gradsync's :func:`~gradsync.fsdp.ragged.describe_shard` puts it on every sharded optimizer param, and
:func:`update_uneven_dtensor_chunk_metadata` on anything it has seen), else computed by
:func:`gather_and_compute_chunk_metadata` (a collective), as the reference does.

Every rank of the mesh must call a collective helper for the same DTensors in the same order, and they must
agree on which DTensors carry metadata (true of gradsync's params: every rank describes its shard).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from gradsync.buffers.checkpointing import contiguous_stride, describe_chunk
from gradsync.buffers.torch_internals import local_tensor

from .torch_internals import _StridedShard

__all__ = [
    "gather_and_compute_chunk_metadata",
    "gather_uneven_dtensor_to_full_tensor",
    "preprocess_state_dict_for_uneven_dtensor",
    "redistribute_uneven_dtensor_to_replicated",
    "split_dtensor",
    "uneven_dtensor_to_full_tensor",
    "update_uneven_dtensor_chunk_metadata",
    "validate_uneven_dtensor",
]


def _is_sharded(placement: Placement) -> bool:
    return isinstance(placement, (Shard, _StridedShard))


def _shard_dim(placement: Placement) -> int:
    assert isinstance(placement, (Shard, _StridedShard))
    return placement.dim


def _check_placements(dtensor: DTensor) -> None:
    for mesh_dim, placement in enumerate(dtensor.placements):
        if not (_is_sharded(placement) or isinstance(placement, Replicate)):
            raise ValueError(
                f"uneven DTensor helpers: placement {placement} at mesh dimension {mesh_dim} is neither "
                "Shard, _StridedShard nor Replicate (reduce a Partial DTensor first)"
            )


def _gather_rows(row: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """``row`` (same shape on every rank of ``group``) from every rank, in group-rank order."""
    gathered = [torch.empty_like(row) for _ in range(group.size())]
    dist.all_gather(gathered, row, group=group)
    return gathered


def _gather_order(dtensor: DTensor) -> list[int]:
    """The mesh dims in the order chunk offsets are accumulated (the reference's convention): the mesh's
    ``_shard_order`` reversed if it has one, else a ``_StridedShard`` dim first, then the mesh dims in
    order, so mesh dim 0 varies fastest along a dimension sharded twice. That is gradsync's HFSDP layout:
    inner shard i, outer piece o is chunk i*M + o."""
    shard_order = getattr(dtensor.device_mesh, "_shard_order", None)
    if shard_order is not None:
        return list(reversed(list(shard_order)))
    strided = [d for d, p in enumerate(dtensor.placements) if isinstance(p, _StridedShard)]
    if len(strided) > 1:
        raise ValueError(
            f"uneven DTensor helpers: {len(strided)} _StridedShard placements in {dtensor.placements}; at "
            "most one is supported"
        )
    return strided + [d for d in range(len(dtensor.placements)) if d not in strided]


def gather_and_compute_chunk_metadata(dtensor: DTensor) -> ChunkStorageMetadata:
    """This rank's chunk of ``dtensor`` (global offsets and local sizes), computed from every rank's local
    shape: along each sharded mesh dim, the chunk starts after the rows of the lower group ranks. A
    collective over each sharded mesh dim; ignores metadata already attached."""
    _check_placements(dtensor)
    local_shape = list(dtensor.to_local().shape)
    offsets = [0] * len(local_shape)
    cumulative = list(local_shape)
    for mesh_dim in _gather_order(dtensor):
        placement = dtensor.placements[mesh_dim]
        if not _is_sharded(placement):
            continue
        dim = _shard_dim(placement)
        group = dtensor.device_mesh.get_group(mesh_dim)
        row = torch.tensor(cumulative, dtype=torch.int64, device=dtensor.device)
        sizes = [int(r[dim]) for r in _gather_rows(row, group)]
        offsets[dim] += sum(sizes[: dist.get_rank(group)])
        cumulative[dim] = sum(sizes)
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(local_shape))


def _known_chunk(dtensor: DTensor) -> ChunkStorageMetadata | None:
    """The chunk already known for ``dtensor`` without a collective, or None."""
    local: Any = local_tensor(dtensor)
    if hasattr(local, "__create_chunk_list__"):
        chunks = local.__create_chunk_list__()
        if len(chunks) != 1:
            raise ValueError(f"Expected exactly one chunk metadata per rank, got {len(chunks)}.")
        return ChunkStorageMetadata(offsets=torch.Size(chunks[0].offsets), sizes=dtensor.to_local().shape)
    return None


def _attach(dtensor: DTensor, chunk: ChunkStorageMetadata) -> None:
    describe_chunk(dtensor, chunk.offsets)  # a DTensor with no Shard placement needs no description


def update_uneven_dtensor_chunk_metadata(dtensor: DTensor) -> None:
    """Attach ``dtensor``'s true chunk to its local tensor, where DTensor's DCP hooks read it (and an empty
    shard writes nothing). Uses the chunk already attached when there is one, else
    :func:`gather_and_compute_chunk_metadata` (a collective)."""
    chunk = _known_chunk(dtensor)
    _attach(dtensor, chunk if chunk is not None else gather_and_compute_chunk_metadata(dtensor))


def _chunk(dtensor: DTensor) -> ChunkStorageMetadata:
    """This rank's chunk: known metadata, else computed (a collective) and attached, as the reference."""
    chunk = _known_chunk(dtensor)
    if chunk is None:
        chunk = gather_and_compute_chunk_metadata(dtensor)
        _attach(dtensor, chunk)
    return chunk


def _gather_chunk_table(dtensor: DTensor, row: torch.Tensor) -> torch.Tensor:
    """Every sharded mesh dim's ranks' ``row`` (one row per chunk): after the loop, this rank holds the
    rows of every rank it shares a replica with (all ranks for an all-sharded mesh)."""
    table = row.reshape(1, -1)
    for mesh_dim, placement in enumerate(dtensor.placements):
        if _is_sharded(placement):
            group = dtensor.device_mesh.get_group(mesh_dim)
            if group.size() > 1:
                table = torch.cat(_gather_rows(table.contiguous(), group))
    return table


def _describe_layout(dtensor: DTensor, offsets: Sequence[int], sizes: Sequence[int]) -> str:
    return (
        f"Offsets: {tuple(offsets)}, Sizes: {tuple(sizes)}, Global shape: {tuple(dtensor.shape)}, "
        f"Local shape: {tuple(dtensor.to_local().shape)}, Device mesh: {dtensor.device_mesh}."
    )


def uneven_dtensor_to_full_tensor(dtensor: DTensor) -> torch.Tensor:
    """The whole tensor of ``dtensor`` (its global shape), gathered from shards of any sizes, empty ones
    included: every rank of the mesh calls it and gets the same plain tensor on ``dtensor.device``.

    Along each sharded mesh dim the ranks exchange their chunks' offsets and sizes, then their data (as
    bytes, padded to the largest, so any dtype works on gloo and NCCL); the chunks are placed at their
    offsets into zeros. Metadata comes from the local tensor's chunk, gradsync's first row, or is computed
    and attached (see the module docstring). The result is not differentiable.

    Raises TypeError for a non-DTensor, ValueError for a local tensor describing other than one chunk, a
    Partial placement, or a chunk outside the global shape (on every rank alike)."""
    if not isinstance(dtensor, DTensor):
        raise TypeError(f"Input must be a DTensor, got {type(dtensor).__name__}.")
    _check_placements(dtensor)
    chunk = _chunk(dtensor)
    local = dtensor.to_local().detach()
    shape = dtensor.shape
    ndim = len(shape)
    device = dtensor.device
    meta = torch.tensor([*chunk.offsets, *local.shape], dtype=torch.int64, device=device).reshape(1, -1)
    data = local.contiguous().reshape(-1).view(torch.uint8)  # bytes: every dtype through every backend
    for mesh_dim, placement in enumerate(dtensor.placements):
        if not _is_sharded(placement):
            continue
        group = dtensor.device_mesh.get_group(mesh_dim)
        if group.size() == 1:
            continue
        metas = _gather_rows(meta.contiguous(), group)
        counts = [int(m[:, ndim:].prod(dim=1).sum()) * local.element_size() for m in metas]
        padded = torch.zeros(max(*counts, 1), dtype=torch.uint8, device=device)
        padded[: data.numel()] = data
        pieces = _gather_rows(padded, group)
        data = torch.cat([piece[:count] for piece, count in zip(pieces, counts, strict=True)])
        meta = torch.cat(metas)
    full = torch.zeros(shape, dtype=dtensor.dtype, device=device)
    start = 0
    for entry in meta.tolist():
        offsets, sizes = entry[:ndim], entry[ndim:]
        if any(o < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape, strict=True)):
            raise ValueError(
                "uneven_dtensor_to_full_tensor: a rank's chunk lies outside the global shape; "
                + _describe_layout(dtensor, offsets, sizes)
            )
        count = math.prod(sizes) * local.element_size()
        piece = data[start : start + count].view(dtensor.dtype).view(sizes)
        start += count
        full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))] = piece
    return full


def redistribute_uneven_dtensor_to_replicated(dtensor: DTensor) -> DTensor:
    """``dtensor`` as a fully replicated DTensor on the same mesh (:func:`uneven_dtensor_to_full_tensor`)."""
    full = uneven_dtensor_to_full_tensor(dtensor)
    return DTensor.from_local(
        full, dtensor.device_mesh, [Replicate()] * len(dtensor.placements), run_check=False
    )


def gather_uneven_dtensor_to_full_tensor(dtensor: DTensor) -> DTensor:
    """Deprecated alias of :func:`redistribute_uneven_dtensor_to_replicated` (a replicated DTensor, as in
    the reference; for a plain tensor use :func:`uneven_dtensor_to_full_tensor`)."""
    return redistribute_uneven_dtensor_to_replicated(dtensor)


def validate_uneven_dtensor(dtensor: DTensor) -> None:
    """Check that the chunks of ``dtensor``'s ranks tile its global shape: every chunk within bounds and
    of its local tensor's size, no two overlapping, together covering every element (so every boundary of
    every dim is touched). Collective over the sharded mesh dims; every rank of a replica sees every
    chunk, so they all raise together.

    Raises AssertionError (as the reference) naming the offending chunk."""
    _check_placements(dtensor)
    chunk = _known_chunk(dtensor) or gather_and_compute_chunk_metadata(dtensor)
    shape = list(dtensor.shape)
    ndim = len(shape)
    row = torch.tensor(
        [*chunk.offsets, *chunk.sizes, *dtensor.to_local().shape, *shape], dtype=torch.int64
    ).to(dtensor.device)
    if dist.is_initialized() and dist.get_backend() == "fake":  # its collectives move no data
        table = [[int(v) for v in row.tolist()]]
    else:
        table = [[int(v) for v in entry] for entry in _gather_chunk_table(dtensor, row).tolist()]
    boxes = []
    for entry in table:
        offsets, sizes, local_shape, global_shape = (entry[i * ndim : (i + 1) * ndim] for i in range(4))
        where = _describe_layout(dtensor, offsets, sizes)
        if global_shape != shape:
            raise AssertionError(
                f"[gradsync-fsdp] DTensor chunk metadata is invalid: ranks disagree on the global shape "
                f"({tuple(global_shape)} elsewhere). {where}"
            )
        if sizes != local_shape or any(
            o < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape, strict=True)
        ):
            raise AssertionError(
                "[gradsync-fsdp] DTensor chunk metadata is invalid: a chunk lies outside the global shape "
                f"or differs from its local tensor ({tuple(local_shape)}). {where}"
            )
        if math.prod(sizes):
            boxes.append((offsets, sizes))
    for i, (a_off, a_size) in enumerate(boxes):
        for b_off, b_size in boxes[i + 1 :]:
            if all(
                max(ao, bo) < min(ao + a, bo + b)
                for ao, a, bo, b in zip(a_off, a_size, b_off, b_size, strict=True)
            ):
                raise AssertionError(
                    "[gradsync-fsdp] DTensor chunk metadata is invalid: chunks overlap. "
                    f"{_describe_layout(dtensor, a_off, a_size)} Other chunk: offsets {tuple(b_off)}, "
                    f"sizes {tuple(b_size)}."
                )
    covered = sum(math.prod(size) for _, size in boxes)
    if covered != math.prod(shape):
        raise AssertionError(
            f"[gradsync-fsdp] DTensor chunk metadata boundary check failed: the chunks cover {covered} of "
            f"{math.prod(shape)} elements. {_describe_layout(dtensor, chunk.offsets, chunk.sizes)}"
        )


def _dtensor_paths(tree: dict[Any, Any], prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _dtensor_paths(value, (*prefix, key))
        elif isinstance(value, DTensor):
            yield (*prefix, key)


def _path_order(path: tuple[Any, ...]) -> list[tuple[str, str]]:
    return [(type(key).__name__, str(key)) for key in path]  # total order, even over mixed key types


def preprocess_state_dict_for_uneven_dtensor(state_dict: dict[Any, Any]) -> dict[Any, Any]:
    """Make every DTensor of a nested state dict ready for ``torch.distributed.checkpoint`` with uneven
    shards: each gets its true chunk attached (:func:`update_uneven_dtensor_chunk_metadata`), in sorted
    key order so that ranks run any collectives in the same order. Modifies the DTensors in place and
    returns ``state_dict`` itself.

    A collective for DTensors without gradsync metadata: every rank must hold those under the same keys.
    gradsync's ``MegatronFSDP.state_dict()`` and a ``fully_shard_optimizer`` optimizer's state dict are
    already described (no collective)."""
    for path in sorted(_dtensor_paths(state_dict), key=_path_order):
        value: Any = state_dict
        for key in path:
            value = value[key]
        update_uneven_dtensor_chunk_metadata(value)
    return state_dict


def _split_points(size: int, split_size_or_sections: int | Sequence[int]) -> list[int]:
    if isinstance(split_size_or_sections, int):
        if split_size_or_sections <= 0:
            raise ValueError(f"split_dtensor: split size must be positive, got {split_size_or_sections}")
        return [*range(0, size, split_size_or_sections), size] if size else [0, 0]
    points = [0]
    for section in split_size_or_sections:
        if section < 0:
            raise ValueError(f"split_dtensor: negative section {section} in {split_size_or_sections}")
        points.append(points[-1] + section)
    if points[-1] != size:
        raise ValueError(
            f"split_dtensor: sections {list(split_size_or_sections)} sum to {points[-1]}, not to the "
            f"dimension's size {size}"
        )
    return points


def split_dtensor(
    dtensor: DTensor,
    split_size_or_sections: int | list[int],
    dim: int = 0,
    update_uneven_dtensor_chunk_meta: bool = False,
) -> Iterator[DTensor]:
    """Yield the pieces of ``dtensor`` split along ``dim`` as ``torch.split`` would split its global
    tensor, without redistributing anything: each piece is a DTensor on the same mesh and placements whose
    local tensor is a view of the part of this rank's chunk that falls in the piece (possibly empty).
    ``Replicate`` placements stay replicated (no gather, unlike native DTensor split).

    This rank's chunk comes from its metadata (a collective only if it has none); with
    ``update_uneven_dtensor_chunk_meta`` each piece gets its own chunk attached for DCP (computed locally)."""
    _check_placements(dtensor)
    dim = dim % dtensor.dim() if dtensor.dim() else 0
    points = _split_points(dtensor.shape[dim], split_size_or_sections)
    chunk = _chunk(dtensor)
    local = dtensor.to_local()
    first = chunk.offsets[dim]
    last = first + local.shape[dim]
    for start, stop in itertools.pairwise(points):
        lo, hi = max(start, first), min(stop, last)
        if lo >= hi:
            lo = hi = first  # no overlap: an empty view
        piece = local.narrow(dim, lo - first, hi - lo)
        shape = list(dtensor.shape)
        shape[dim] = stop - start
        global_shape = torch.Size(shape)
        sub = DTensor.from_local(
            piece,
            dtensor.device_mesh,
            dtensor.placements,
            run_check=False,
            shape=global_shape,
            stride=contiguous_stride(global_shape),
        )
        if update_uneven_dtensor_chunk_meta:
            offsets = list(chunk.offsets)
            offsets[dim] = lo - start if hi > lo else 0
            _attach(sub, ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=piece.shape))
        yield sub
