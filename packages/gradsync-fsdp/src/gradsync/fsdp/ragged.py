"""Uneven shards as DTensors: the ragged placement, splits cut in a mesh-dim order, the DTensor that carries
them, and their checkpoint metadata.

``RaggedShard``: a ``Shard(dim)`` placement whose pieces have given sizes, not ``torch.chunk``'s.

It overrides the hooks torch's redistribute and checkpoint code calls on a shard placement, so torch's own
``full_tensor()``, ``redistribute()`` and DCP move such pieces exactly (:mod:`gradsync.fsdp.ragged`).

Splits cut in a given mesh-dim order: torch's ``shard_order``, and DTensors placed with it.

torch reads a DTensor's placements left to right (on an (outer, inner) mesh the outer dim cuts first);
HFSDP's shards lie inner first, so gradsync names the order in which the mesh dims cut a sharded dim and
places, sizes and offsets its pieces in that order (:mod:`gradsync.fsdp.ragged`).

``RaggedDTensor``: a DTensor that dispatches ops as torch's ``Shard(dim)`` but moves its true split.

Its ``redistribute()`` (so ``full_tensor()``), DCP metadata and same-shaped op outputs keep the ragged
placements cut in its mesh-dim order; :func:`reshard` moves any DTensor between splits where torch's own
executor would skip or mis-cut the move (:mod:`gradsync.fsdp.ragged`).

Uneven-shard metadata for ``torch.distributed.checkpoint`` (DCP).

Each rank knows its shard's first row from the layout, so the chunk (offset and size) is attached to the
local tensor (:func:`gradsync.buffers.checkpointing.describe_chunk`); no collective is needed. DCP then
saves and loads across world sizes: a load reads, for this rank's rows, whichever saved chunks overlap
them.

Uneven shards torch's own DTensor machinery can gather, scatter and checkpoint.

gradsync-fsdp cuts its flat buckets where the layout says (whole rows, whole matrices, whole blocks), so a
param's rows per rank rarely follow ``torch.chunk``, the only split ``Shard(dim)`` knows: ``full_tensor()``
and ``redistribute()`` on such a shard send mismatched byte counts inside torch (on gloo the transport
aborts). Two pieces fix that:

- :class:`RaggedShard` ``(dim, sizes)``: a ``Shard(dim)`` whose piece on mesh coordinate ``i`` has
  ``sizes[i]`` entries along ``dim`` (veScale-FSDP's ``RaggedShard``, Megatron-FSDP v2's uneven ``DBuffer``
  placement). It overrides the hooks torch's redistribute and checkpoint code calls on a shard placement,
  so on a DTensor placed with it ``full_tensor()``, ``redistribute()`` (to ``Replicate``, to ``Shard(k)``
  with ``k != dim``, from ``Replicate``, from ``Partial``), DCP save / load (to and from any other
  sharding) run natively and exactly. It is a placement for moving data, not for computing on: torch's C++
  op-dispatch cache keys a placement by kind and dim only, so ops on two DTensors whose splits differ can
  share a cached output placement. Compute on the param, whose label stays torch's ``Shard(dim)``.
- :class:`RaggedDTensor`: a DTensor (gradsync's optimizer params, their grads and state) labelled
  ``Shard(dim)`` for op dispatch, exactly as before, whose ``full_tensor()``, ``redistribute()`` and DCP
  metadata use its true ``ragged_placements``, cut in its ``mesh_dim_order``. Optimizer steps,
  ``clip_grad_norm_`` and every other op run as on a plain DTensor; outputs shaped like a ragged input
  (``detach``, ``zeros_like``, arithmetic) keep its split.

``mesh_dim_order`` is the order in which mesh dims cut a sharded dim (torch's ``shard_order``). torch
reads placements left to right: on an (outer, inner) mesh the outer dim cuts first. HFSDP's shards lie the
other way round, the inner dim first (inner rank ``i``'s shard is the outer pieces ``i*M ... i*M+M-1``), so
their order is ``(1, 0)`` and the outer ``RaggedShard``'s sizes are those of this rank's inner shard: torch's
redistribute planner follows a spec's shard order, and these hooks only ever see their own inner shard.

Limits of torch's redistribute executor that this module cannot reach (it calls the *source* placement's
hook, or none): a move from a ragged split to ``Shard(dim)`` on the same ``dim``, or from ``Shard(k)`` into
a ragged split, is not carried out by ``DTensor.redistribute`` on a ``RaggedShard`` DTensor;
:func:`reshard` (and ``RaggedDTensor.redistribute``) go through ``Replicate`` there.
``distribute_tensor(t, mesh, [RaggedShard(...)])`` scatters torch's even chunks and labels them so.
:func:`reshard` moves into a ragged split, or one in another order, by cutting a whole copy locally.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from gradsync.buffers.checkpointing import contiguous_stride, describe_chunk
from gradsync.buffers.torch_internals import local_tensor

from . import torch_internals
from .torch_internals import (
    DTensorSpec,
    TensorMeta,
    all_gather_single,
    funcol,
    pytree,
    redistributes_inputs,
    reduce_scatter_single,
    require_shard_order,
    spec_shard_order,
)


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


class RaggedDTensor(DTensor):
    """A DTensor labelled with torch's ``Shard(dim)`` for op dispatch whose ``redistribute()`` (so
    ``full_tensor()``, which calls it), checkpoint metadata and same-shaped op outputs (so ``detach()`` and
    ``nn.Parameter``) keep its true, ragged split."""

    _ragged_placements: tuple[Placement, ...]
    _mesh_dim_order: tuple[int, ...]

    @staticmethod
    def wrap(
        local: torch.Tensor,
        mesh: DeviceMesh,
        shape: torch.Size,
        ragged_placements: Sequence[Placement],
        mesh_dim_order: Sequence[int] | None = None,
    ) -> RaggedDTensor:
        """``local`` (no autograd history, as gradsync's buffer views) as a shard of ``shape`` split by
        ``ragged_placements`` cut in ``mesh_dim_order`` (left to right by default): the label puts
        ``Shard(dim)`` where ``ragged_placements`` has a ragged split."""
        order = checked_order(mesh.ndim, mesh_dim_order)
        if not left_to_right(ragged_placements, order):
            require_shard_order(f"RaggedDTensor cut in mesh_dim_order {order} (HFSDP's inner-first shards)")
        label = [Shard(p.dim) if isinstance(p, RaggedShard) else p for p in ragged_placements]
        spec = DTensorSpec(mesh, tuple(label), TensorMeta(shape, contiguous_stride(shape), local.dtype))
        split = (tuple(ragged_placements), order)
        return RaggedDTensor._of(local.view_as(local), spec, split, local.requires_grad)

    def like(self, local: torch.Tensor) -> RaggedDTensor:
        """``local`` (this rank's rows of a tensor shaped like this one: a grad, optimizer state) split
        as this one is."""
        return RaggedDTensor.wrap(local, self.device_mesh, self.shape, *self._split)

    @staticmethod
    def _of(
        local: torch.Tensor,
        spec: DTensorSpec,
        split: tuple[tuple[Placement, ...], tuple[int, ...]],
        requires_grad: bool,
    ) -> RaggedDTensor:
        tensor = RaggedDTensor(local, spec, requires_grad=requires_grad)  # type: ignore[no-untyped-call]
        tensor._ragged_placements, tensor._mesh_dim_order = split
        return tensor

    def detach(self) -> RaggedDTensor:
        """Keeps the split (``nn.Parameter`` requires it) also on a torch that dispatches DTensor
        subclasses' ops in C++ without calling :meth:`__torch_dispatch__` (2.11)."""
        out: Any = super().detach()
        if isinstance(out, RaggedDTensor):
            return out
        return RaggedDTensor._of(local_tensor(out), out._spec, self._split, out.requires_grad)

    @property
    def _split(self) -> tuple[tuple[Placement, ...], tuple[int, ...]]:
        return self._ragged_placements, self._mesh_dim_order

    @property
    def ragged_placements(self) -> tuple[Placement, ...]:
        """The placements that say which rows each rank holds (``placements`` is the dispatch label)."""
        return self._ragged_placements

    @property
    def mesh_dim_order(self) -> tuple[int, ...]:
        """The order in which the mesh dims cut the rows (HFSDP: inner first)."""
        return self._mesh_dim_order

    def ragged_view(self) -> DTensor:
        """This shard placed with its ragged placements in its order (differentiable): for moving data,
        not for ops."""
        return placed(
            self.to_local(),
            self.device_mesh,
            self.shape,
            self.stride(),
            self._ragged_placements,
            self._mesh_dim_order,
        )

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
        forward_dtype: torch.dtype | None = None,
        backward_dtype: torch.dtype | None = None,
    ) -> DTensor:
        if device_mesh is not None and device_mesh != self.device_mesh:
            raise NotImplementedError(
                "RaggedDTensor.redistribute: moving to another device mesh is not supported"
            )
        if placements is None:
            raise RuntimeError("placements is needed for redistribute!")
        return reshard(
            self.ragged_view(),
            placements,
            async_op=async_op,
            forward_dtype=forward_dtype,
            backward_dtype=backward_dtype,
        )

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # DTensor's own signature
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Every op runs as on a plain DTensor; an output labelled, shaped and locally sized like a
        ragged input (an elementwise or alias op's: ``detach``, ``zeros_like``, ``clone``, ``a + b``) keeps
        that input's split, so optimizer state and results of arithmetic gather right too.

        An op whose dispatch would first move a ragged input to other placements (``chunk`` or ``cat``
        along the split dim, indexing rows, a matmul needing it whole) runs on the input made whole
        through its true split instead: torch's executor would move the label's even chunks."""
        sources: list[RaggedDTensor] = []

        def plain(tensor: RaggedDTensor) -> DTensor:
            sources.append(tensor)
            return tensor._plain()

        plain_args, plain_kwargs = (
            _map_only(RaggedDTensor, plain, args),
            _map_only(RaggedDTensor, plain, kwargs or {}),
        )
        if sources and redistributes_inputs(func, plain_args, plain_kwargs):
            if func._schema.is_mutable:
                raise NotImplementedError(
                    f"{func}: an in-place op that moves a ragged shard (gradsync's uneven DTensor) to other "
                    "placements first would write into a copy; run it out of place, or on full_tensor()"
                )
            sources.clear()
            plain_args = _map_only(RaggedDTensor, RaggedDTensor._whole, args)
            plain_kwargs = _map_only(RaggedDTensor, RaggedDTensor._whole, kwargs or {})
        out = func(*plain_args, **plain_kwargs)
        if type(out) is list:  # a foreach op: output i follows item i of the lists it was given
            lists = [arg for arg in args if type(arg) in (list, tuple) and len(arg) == len(out)]
            return [_follow_split(result, [items[i] for items in lists]) for i, result in enumerate(out)]
        return _map_only(DTensor, lambda result: _follow_split(result, sources), out)

    def _plain(self) -> DTensor:
        """A plain DTensor over the same local tensor and spec, which re-enters torch's C++ dispatch; kept
        while those stay the same (building one per op was most of a foreach optimizer step's cost)."""
        twin: DTensor | None = self.__dict__.get("_twin")
        if twin is None or local_tensor(twin) is not local_tensor(self) or twin._spec is not self._spec:
            twin = DTensor(local_tensor(self), self._spec, requires_grad=False)  # type: ignore[no-untyped-call]
            self._twin = twin
        return twin

    def _whole(self) -> DTensor:
        """This tensor replicated on every rank, gathered through its true split."""
        return reshard(self.ragged_view(), [Replicate()] * self.device_mesh.ndim)

    def _described(self) -> RaggedDTensor:
        """With this rank's true chunk attached to the local tensor, which DTensor's DCP hooks consult."""
        offsets = local_sizes_and_offsets(self.shape, self.device_mesh, *self._split)[1]
        return describe_chunk(self, offsets)

    def __create_write_items__(self, fqn: str, object: Any) -> Any:
        """DCP: this rank's rows at their true offset (torch would place the label's even chunk)."""
        return DTensor.__create_write_items__(self._described(), fqn, object)

    def __create_chunk_list__(self) -> Any:
        return DTensor.__create_chunk_list__(self._described())  # type: ignore[no-untyped-call]


def _map_only(kind: type[Any], fn: Any, tree: Any) -> Any:
    """``pytree.tree_map_only`` with plain lists, tuples and dicts (every op's arguments and most outputs)
    walked directly: the pytree machinery cost as much as the ops of a foreach optimizer step."""
    if isinstance(tree, kind):
        return fn(tree)
    container = type(tree)
    if container is list or container is tuple:
        return container(_map_only(kind, fn, item) for item in tree)
    if container is dict:
        return {key: _map_only(kind, fn, value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple, dict)):  # named tuples and other containers: pytree's rules
        return pytree.tree_map_only(kind, fn, tree)
    return tree


def _follow_split(result: Any, sources: list[Any]) -> Any:
    """``result`` with the split of the ragged sources it is labelled, shaped and locally sized like, if
    they agree on one (two same-shaped params may hold the same rows here and differ elsewhere)."""
    if not isinstance(result, DTensor) or isinstance(result, RaggedDTensor):
        return result
    splits = {
        source._split
        for source in sources
        if isinstance(source, RaggedDTensor)
        and result._spec.placements == source._spec.placements
        and result.shape == source.shape
        and local_tensor(result).shape == local_tensor(source).shape
    }
    if len(splits) != 1:
        return result
    return RaggedDTensor._of(local_tensor(result), result._spec, splits.pop(), result.requires_grad)


def reshard(
    tensor: DTensor,
    placements: Sequence[Placement],
    *,
    mesh_dim_order: Sequence[int] | None = None,
    async_op: bool = False,
    forward_dtype: torch.dtype | None = None,
    backward_dtype: torch.dtype | None = None,
) -> DTensor:
    """``tensor.redistribute(placements)``, with ``placements`` cut in ``mesh_dim_order`` (left to right by
    default). Through ``Replicate`` where torch's executor would skip or mis-cut the move (see the limits
    in :mod:`gradsync.fsdp.ragged`); into a ragged split, or one in another order, by cutting that whole
    copy locally."""
    if isinstance(tensor, RaggedDTensor):  # its placements are the dispatch label, not its split
        tensor = tensor.ragged_view()
    mesh = tensor.device_mesh
    order = checked_order(mesh.ndim, mesh_dim_order)
    kwargs: dict[str, Any] = {"async_op": async_op}
    for name, dtype in (("forward_dtype", forward_dtype), ("backward_dtype", backward_dtype)):
        if dtype is not None:  # torch 2.6's redistribute takes no dtypes
            kwargs[name] = dtype
    unchanged = tuple(placements) == tensor.placements and all(
        type(old) is type(new) for old, new in zip(tensor.placements, placements, strict=True)
    )
    if unchanged and order_of(tensor._spec) == shard_order(placements, order) and forward_dtype is None:
        return tensor
    ragged_target = not torch_describes(placements, order)
    if (
        ragged_target
        or reordered(tensor._spec)
        or any(_executor_misses(old, new) for old, new in zip(tensor.placements, placements, strict=True))
    ):
        # a plain hop: torch drops a spec's shard order where it casts (forward_dtype) on the way
        tensor = tensor.redistribute(mesh, [Replicate()] * mesh.ndim)
    if not ragged_target:
        return tensor.redistribute(mesh, placements, **kwargs)
    whole = tensor.redistribute(mesh, tensor.placements, **kwargs).to_local()
    sizes, offsets = local_sizes_and_offsets(whole.shape, mesh, placements, order)
    for dim, (size, offset) in enumerate(zip(sizes, offsets, strict=True)):
        whole = whole.narrow(dim, offset, size)
    return placed(whole, mesh, tensor.shape, tensor.stride(), placements, order)


def _executor_misses(old: Placement, new: Placement) -> bool:
    """Whether torch's redistribute executor would leave the move undone: a ragged split into an even
    one on the same dim (it calls no hook for a move between two shards of one dim)."""
    if not (isinstance(old, Shard) and isinstance(new, Shard)) or (type(old) is type(new) and old == new):
        return False
    return isinstance(old, RaggedShard) and old.dim == new.dim


def split_of(tensor: DTensor) -> tuple[Any, ...]:
    """Which rows of ``tensor`` every rank holds, as any rank can tell: a ragged split's sizes and order,
    else torch's placements and shard order."""
    if isinstance(tensor, RaggedDTensor):
        return tensor.ragged_placements, tensor.mesh_dim_order
    return tuple(tensor.placements), order_of(tensor._spec)


TensorT = TypeVar("TensorT", bound=torch.Tensor)


def describe_shard(value: TensorT, first_row: int) -> TensorT:
    """Attach ``value``'s chunk (its local rows start at global row ``first_row``) for DCP; returns it."""
    return describe_chunk(value, [first_row, *([0] * (value.dim() - 1))])


def describe_optimizer_state(
    state_dict: dict[str, Any], params: list[torch.Tensor], first_rows: Callable[[torch.Tensor], int | None]
) -> None:
    """Describe every DTensor in an optimizer state dict whose param (by index, as
    ``Optimizer.state_dict`` numbers them) is a MegatronFSDP shard (``first_rows`` gives its first row,
    or None for any other param)."""
    for index, entry in state_dict["state"].items():
        first_row = first_rows(params[index])
        if first_row is None:
            continue
        for value in entry.values():
            if isinstance(value, DTensor) and value.shape == params[index].shape:
                describe_shard(value, first_row)


# the public API, and the split helpers the package's other modules import from here
__all__ = [
    "RaggedDTensor",
    "RaggedShard",
    "checked_order",
    "left_to_right",
    "local_sizes_and_offsets",
    "placed",
    "reshard",
    "shard_order",
    "shard_placement",
    "split_of",
    "torch_describes",
]

# gradsync's params, grads and optimizer state are RaggedDTensors placed with RaggedShard; torch.load, whose
# default since torch 2.6 is weights_only=True, rebuilds only the classes allowlisted here.
torch.serialization.add_safe_globals([RaggedDTensor, RaggedShard])
