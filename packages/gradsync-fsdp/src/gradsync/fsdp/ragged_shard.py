"""``RaggedShard``: a ``Shard(dim)`` placement whose pieces have given sizes, not ``torch.chunk``'s.

It overrides the hooks torch's redistribute and checkpoint code calls on a shard placement, so torch's own
``full_tensor()``, ``redistribute()`` and DCP move such pieces exactly (:mod:`gradsync.fsdp.ragged`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from .torch_internals import all_gather_single, funcol, reduce_scatter_single


class RaggedShard(Shard):
    """``Shard(dim)`` with ``sizes[i]`` entries of ``dim`` on mesh coordinate ``i`` (some may be 0)."""

    def __init__(self, dim: int, sizes: Sequence[int]) -> None:
        super().__init__(dim)
        if not sizes or any(int(size) < 0 for size in sizes):
            raise ValueError(
                f"RaggedShard: sizes must be one non-negative count per mesh coordinate, got {sizes}"
            )
        self.sizes: tuple[int, ...] = tuple(int(size) for size in sizes)

    def offset(self, index: int) -> int:
        return sum(self.sizes[:index])

    def __eq__(self, other: object) -> bool:
        """Equal to ``Shard(dim)``: torch checks a spec's placements against ``Shard(dim)`` when it builds
        one. Two ragged splits are equal only with equal sizes, and the hash tells all three apart."""
        if isinstance(other, RaggedShard):
            return other.dim == self.dim and other.sizes == self.sizes
        return isinstance(other, Shard) and other.dim == self.dim

    def __hash__(self) -> int:
        return hash((self.dim, self.sizes))

    def __reduce__(self) -> tuple[type[RaggedShard], tuple[int, tuple[int, ...]]]:
        """Pickle (and deep-copy) with the sizes: the base class's state holds only ``dim``."""
        return RaggedShard, (self.dim, self.sizes)

    def __repr__(self) -> str:
        return f"RaggedShard(dim={self.dim}, sizes={self.sizes})"

    def __str__(self) -> str:
        return f"RS({self.dim}, {list(self.sizes)})"

    def _check(self, dim_size: int, num_chunks: int) -> None:
        if num_chunks != len(self.sizes) or dim_size != sum(self.sizes):
            raise ValueError(
                f"{self!r} describes {len(self.sizes)} pieces of {sum(self.sizes)} entries, but the tensor "
                f"has {dim_size} entries along dim {self.dim} over {num_chunks} mesh coordinates"
            )

    def local_shard_size_and_offset(  # type: ignore[override]
        self, curr_local_size: int, num_chunks: int, rank: int
    ) -> tuple[int, int]:
        self._check(int(curr_local_size), num_chunks)
        return self.sizes[rank], self.offset(rank)

    def _local_shard_size_and_offset(
        self, curr_local_size: int, num_chunks: int, rank: Any
    ) -> tuple[int, Any]:
        return self.local_shard_size_and_offset(curr_local_size, num_chunks, int(rank))

    def _local_shard_size_on_dim(
        self, size_on_dim: int, num_chunks: int, rank: int, return_offset: bool = False
    ) -> tuple[int, int]:
        """torch 2.6's name for :meth:`local_shard_size_and_offset` (its DCP and redistribute call it on
        the placement instance)."""
        size, offset = self.local_shard_size_and_offset(size_on_dim, num_chunks, rank)
        return size, offset if return_offset else -1

    def _split_tensor(
        self, tensor: torch.Tensor, num_chunks: int, *, with_padding: bool = True, contiguous: bool = True
    ) -> tuple[list[torch.Tensor], list[int]]:
        """The pieces (padded to the largest when ``with_padding``, as collectives want equal sizes)."""
        self._check(tensor.size(self.dim), num_chunks)
        widest = max(self.sizes)
        pieces, pads = [], []
        for index, size in enumerate(self.sizes):
            piece = tensor.narrow(self.dim, self.offset(index), size)
            pad = widest - size if with_padding else 0
            if pad:
                piece = torch.cat([piece, _zeros_along(piece, self.dim, pad)], self.dim)
            pieces.append(piece.contiguous() if contiguous else piece)
            pads.append(pad)
        return pieces, pads

    def _select_split_tensor(
        self,
        tensor: torch.Tensor,
        num_chunks: int,
        index: Any,
        *,
        with_padding: bool = True,
        contiguous: bool = True,
        clone: bool = True,
    ) -> torch.Tensor:
        pieces, _ = self._split_tensor(tensor, num_chunks, with_padding=with_padding, contiguous=False)
        piece = pieces[int(index)]
        if clone:
            return piece.clone()
        return piece.contiguous() if contiguous else piece

    def _to_replicate_tensor(
        self,
        local_tensor: torch.Tensor,
        mesh: DeviceMesh,
        mesh_dim: int,
        current_logical_shape: Sequence[Any],
    ) -> torch.Tensor:
        """All-gather the pieces, padded to the widest, and drop each one's padding."""
        self._check(int(current_logical_shape[self.dim]), mesh.size(mesh_dim))
        widest = max(self.sizes)
        pad = widest - local_tensor.size(self.dim)
        if pad:
            local_tensor = torch.cat([local_tensor, _zeros_along(local_tensor, self.dim, pad)], self.dim)
        gathered = _wait(
            all_gather_single(local_tensor.contiguous(), gather_dim=self.dim, group=(mesh, mesh_dim))
        )
        pieces = [gathered.narrow(self.dim, index * widest, size) for index, size in enumerate(self.sizes)]
        return torch.cat(pieces, self.dim)

    def _reduce_shard_tensor(
        self, tensor: torch.Tensor, mesh: DeviceMesh, reduce_op: str, mesh_dim: int
    ) -> torch.Tensor:
        """Reduce-scatter the padded pieces (a ``Partial`` DTensor turned into this placement)."""
        if mesh.get_coordinate() is None:
            return tensor
        pieces, pads = self._split_tensor(tensor, mesh.size(mesh_dim), with_padding=True, contiguous=True)
        reduced = _wait(
            reduce_scatter_single(
                torch.cat(pieces, self.dim), reduce_op, scatter_dim=self.dim, group=(mesh, mesh_dim)
            )
        )
        index = mesh.get_local_rank(mesh_dim)
        return reduced.narrow(self.dim, 0, reduced.size(self.dim) - pads[index])

    def _to_new_shard_dim(
        self,
        local_tensor: torch.Tensor,
        mesh: DeviceMesh,
        mesh_dim: int,
        current_logical_shape: Sequence[Any],
        new_shard_dim: int,
    ) -> torch.Tensor:
        """Through a whole copy (an all-gather), then torch's chunk of ``new_shard_dim``: exact, not the
        all-to-all torch uses between even shards."""
        whole = self._to_replicate_tensor(local_tensor, mesh, mesh_dim, current_logical_shape)
        return Shard(new_shard_dim)._replicate_to_shard(whole, mesh, mesh_dim, mesh.get_local_rank(mesh_dim))


def _zeros_along(tensor: torch.Tensor, dim: int, count: int) -> torch.Tensor:
    shape = list(tensor.shape)
    shape[dim] = count
    return tensor.new_zeros(shape)


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.wait() if isinstance(tensor, funcol.AsyncCollectiveTensor) else tensor


def shard_placement(sizes: Sequence[int], dim: int = 0) -> Shard:
    """``Shard(dim)`` when ``sizes`` are ``torch.chunk``'s split of their sum, else ``RaggedShard``: torch's
    own placement wherever it describes the pieces."""
    total, count = sum(sizes), len(sizes)
    step = -(-total // count) if count else 0
    chunked = [max(0, min(step, total - index * step)) for index in range(count)]
    return Shard(dim) if list(sizes) == chunked else RaggedShard(dim, sizes)
