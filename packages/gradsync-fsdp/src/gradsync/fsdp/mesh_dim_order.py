"""Splits cut in a given mesh-dim order: torch's ``shard_order``, and DTensors placed with it.

torch reads a DTensor's placements left to right (on an (outer, inner) mesh the outer dim cuts first);
HFSDP's shards lie inner first, so gradsync names the order in which the mesh dims cut a sharded dim and
places, sizes and offsets its pieces in that order (:mod:`gradsync.fsdp.ragged`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

from . import torch_internals
from .ragged_shard import RaggedShard
from .torch_internals import DTensorSpec, require_shard_order, spec_shard_order


def checked_order(ndim: int, mesh_dim_order: Sequence[int] | None) -> tuple[int, ...]:
    """``mesh_dim_order`` (left to right when None), refused unless it lists each of a mesh's ``ndim``
    dims once."""
    if mesh_dim_order is None:
        return tuple(range(ndim))
    if sorted(mesh_dim_order) != list(range(ndim)):
        raise ValueError(
            f"mesh_dim_order {tuple(mesh_dim_order)} must list each of the mesh's {ndim} dims once"
        )
    return tuple(mesh_dim_order)


def torch_describes(placements: Sequence[Placement], mesh_dim_order: Sequence[int]) -> bool:
    """Whether torch's own placements say it: no ragged split, and the mesh dims cut left to right."""
    return not any(isinstance(p, RaggedShard) for p in placements) and left_to_right(
        placements, mesh_dim_order
    )


def left_to_right(placements: Sequence[Placement], mesh_dim_order: Sequence[int]) -> bool:
    """Whether ``mesh_dim_order`` cuts every sharded dim as torch's default order does (left to right)."""
    return shard_order(placements, mesh_dim_order) == shard_order(placements, range(len(placements)))


def order_of(spec: DTensorSpec) -> tuple[Any, ...]:
    """A spec's shard order (the default one where torch keeps none)."""
    order = spec_shard_order(spec)
    return shard_order(spec.placements, range(len(spec.placements))) if order is None else order


def reordered(spec: DTensorSpec) -> bool:
    """Whether a spec's mesh dims cut a sharded dim in another order than left to right."""
    return order_of(spec) != shard_order(spec.placements, range(len(spec.placements)))


def shard_order(placements: Sequence[Placement], mesh_dim_order: Sequence[int]) -> tuple[Any, ...]:
    """torch's ``shard_order``: each sharded tensor dim with the mesh dims that cut it, in
    ``mesh_dim_order`` (plain ``(dim, mesh_dims)`` pairs, equal to torch's entries, where it has none)."""
    cuts: dict[int, list[int]] = {}
    for mesh_dim in mesh_dim_order:
        placement = placements[mesh_dim]
        if isinstance(placement, Shard):
            cuts.setdefault(placement.dim, []).append(mesh_dim)
    entry: Any = torch_internals.ShardOrderEntry if torch_internals.HAS_SHARD_ORDER else _plain_entry
    return tuple(entry(tensor_dim=dim, mesh_dims=tuple(cuts[dim])) for dim in sorted(cuts))


def _plain_entry(tensor_dim: int, mesh_dims: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    return tensor_dim, mesh_dims


def local_sizes_and_offsets(
    shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement], mesh_dim_order: Sequence[int]
) -> tuple[list[int], list[int]]:
    """This rank's local shape and its global offsets when ``placements`` cut ``shape`` in
    ``mesh_dim_order`` (torch's own helper for DCP goes left to right only)."""
    sizes, offsets = [int(size) for size in shape], [0] * len(shape)
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "this rank is not in the DTensor's mesh"
    for mesh_dim in mesh_dim_order:
        placement = placements[mesh_dim]
        if isinstance(placement, Shard):
            size, offset = placement._local_shard_size_and_offset(
                sizes[placement.dim], mesh.size(mesh_dim), coordinate[mesh_dim]
            )
            sizes[placement.dim] = int(size)
            offsets[placement.dim] += int(offset)
    return sizes, offsets


def placed(
    local: torch.Tensor,
    mesh: DeviceMesh,
    shape: torch.Size,
    stride: tuple[int, ...],
    placements: Sequence[Placement],
    mesh_dim_order: Sequence[int],
) -> DTensor:
    """``DTensor.from_local`` with ``placements`` cut in ``mesh_dim_order``: from_local takes no shard
    order, so the spec it built is swapped for one that has it. Differentiable where the grad comes back
    in these placements (through ``redistribute``, which keeps the order); from_local's backward would
    redistribute any other grad without the order."""
    tensor = DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
    if left_to_right(placements, mesh_dim_order):
        return tensor
    require_shard_order(f"a split cut in mesh_dim_order {tuple(mesh_dim_order)} (HFSDP's inner-first shards)")
    order = shard_order(placements, mesh_dim_order)
    if order != tensor._spec.shard_order:
        spec = tensor._spec
        tensor._spec = DTensorSpec(spec.mesh, spec.placements, spec.tensor_meta, shard_order=order)
    return tensor
