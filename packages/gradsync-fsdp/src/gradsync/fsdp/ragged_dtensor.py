"""``RaggedDTensor``: a DTensor that dispatches ops as torch's ``Shard(dim)`` but moves its true split.

Its ``redistribute()`` (so ``full_tensor()``), DCP metadata and same-shaped op outputs keep the ragged
placements cut in its mesh-dim order; :func:`reshard` moves any DTensor between splits where torch's own
executor would skip or mis-cut the move (:mod:`gradsync.fsdp.ragged`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from gradsync.buffers.checkpointing import contiguous_stride, describe_chunk
from gradsync.buffers.torch_internals import local_tensor

from .mesh_dim_order import (
    checked_order,
    left_to_right,
    local_sizes_and_offsets,
    order_of,
    placed,
    reordered,
    shard_order,
    torch_describes,
)
from .ragged_shard import RaggedShard
from .torch_internals import DTensorSpec, TensorMeta, pytree, redistributes_inputs, require_shard_order


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
