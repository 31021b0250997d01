"""One record per param of a MegatronFSDP model: everything the wrapper knows about it, in one place.

A param lives as two tensors. The compute param is the module's own, a view of its bucket's weights, with
``main_grad`` on it, where Megatron's code reads it. The optimizer's param is a DTensor over the bucket's
main weights. Lookups from either tensor go through one map to the record, so no other place keeps a
per-param map that could drift from it, and nothing gradsync reads is stamped on the params (Megatron's
``_megatron_fsdp_model`` is written for Megatron's code alone).

The record also holds every view of the param's grads, each built once: the one a backward's grad is
added into, and the optimizer param's grad DTensor over the reduced rows. A grad hook then does one add
into a view it already has, and a step attaches grads that already exist.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from gradsync.buffers.torch_internals import local_tensor

from .bucket import FlatParamBucket
from .flat_views import item_view
from .optimizer_params import optimizer_grad


@dataclass(eq=False)
class ShardedParam:
    """A param as the wrapper holds it: its name in the wrapped module, its compute param (item ``index``
    of ``bucket``), the optimizer's sharded param and the local tensor under it (a view of the bucket's
    buffers: a conversion of the module that swaps the param for a copy leaves another one there),
    whether it was frozen when wrapped (it then has no grad buffer or hook, so an optimizer step that
    finds it trainable is refused), and the module slots that hold it (``(module, attribute)``: a tied
    param has several).

    Its grads: ``main_grad``, its view of the bucket's persistent grads where the backward adds into them
    (no_shard, ZeRO-1; None under ZeRO-2/3, which add into borrowed whole-bucket grads, and when frozen),
    and ``optimizer_grad``, the sharded param's grad (see :func:`optimizer_grad`)."""

    name: str
    compute: nn.Parameter
    bucket: FlatParamBucket
    index: int
    sharded: nn.Parameter
    frozen_at_wrap: bool
    slots: list[tuple[nn.Module, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.local = local_tensor(self.sharded)
        bucket, item = self.bucket, self.bucket.layout.items[self.index]
        self._span = (0, item.offset, item.end, item.shape)  # its coordinates in a whole-bucket buffer
        self.main_grad: torch.Tensor | None = None
        if bucket.grad is not None and not bucket.sharding.shard_grads:
            self.main_grad = item_view(bucket.grad, *self._span)
            self.compute.main_grad = self.main_grad  # type: ignore[attr-defined]
        self._unreduced: torch.Tensor | None = None  # ZeRO-2/3: its view of the borrowed buffer ...
        self._unreduced_of: torch.Tensor | None = None  # ... that this is
        self.optimizer_grad, self._cast = optimizer_grad(bucket, self.index, self.sharded)

    def unreduced_grad(self) -> torch.Tensor:
        """ZeRO-2/3: where this backward's grad is added, the param's view of the bucket's borrowed
        whole-bucket grads (no_shard and ZeRO-1 add into ``main_grad``). The view is kept while the
        allocator lends the same tensor (the default storage-resize one does, every backward), so a later
        backward adds into it again."""
        buffer = self.bucket.unreduced.buffer()
        if buffer is not self._unreduced_of:
            self._unreduced_of, self._unreduced = buffer, item_view(buffer, *self._span)
        assert self._unreduced is not None
        return self._unreduced

    def attach_grad(self) -> None:
        """Give the sharded param its reduced grad (a cast copy refreshed from the reduced rows first)."""
        if self._cast is not None:
            self._cast[1].copy_(self._cast[0])
        self.sharded.grad = self.optimizer_grad

    @property
    def first_row(self) -> int | None:
        """The global row this rank's shard starts at, where the main weights are sharded (else None)."""
        return self.bucket.first_row(self.index)

    @property
    def swapped_for_a_copy(self) -> bool:
        """Whether torch put another tensor in the sharded param (``module.to()`` and the like)."""
        return local_tensor(self.sharded) is not self.local


class ShardedParams:
    """Every record, in the wrapped module's ``named_parameters()`` order, and the one map from a tensor
    (compute or sharded param) to its record."""

    def __init__(
        self,
        root: nn.Module,
        named: Sequence[tuple[str, nn.Parameter]],
        buckets: Sequence[FlatParamBucket],
        optimizer_params: Sequence[Sequence[nn.Parameter]],
    ) -> None:
        """The records of ``root``'s params ``named`` (in its order), each item of ``buckets`` with its
        optimizer param, and every slot of ``root``'s modules that holds one."""
        where = {
            param: (bucket, index, sharded)
            for bucket, params in zip(buckets, optimizer_params, strict=True)
            for index, (param, sharded) in enumerate(zip(bucket.spec.params, params, strict=True))
        }
        self.records = [
            ShardedParam(name, param, *where[param][:2], where[param][2], not param.requires_grad)
            for name, param in named
        ]
        self._of: dict[torch.Tensor, ShardedParam] = {
            tensor: record for record in self.records for tensor in (record.compute, record.sharded)
        }
        for owner in root.modules():
            for leaf, param in owner._parameters.items():
                if param is not None and param in self._of:
                    self._of[param].slots.append((owner, leaf))
        self.buckets = list(buckets)
        self._with_grads = [r for r in self.records if r.bucket.spec.requires_grad]

    def __iter__(self) -> Iterator[ShardedParam]:
        return iter(self.records)

    def __contains__(self, tensor: object) -> bool:
        return tensor in self._of

    def of(self, tensor: torch.Tensor) -> ShardedParam:
        """The record of a compute param, an optimizer param, or an alias given to :meth:`alias`."""
        return self._of[tensor]

    def first_row(self, tensor: torch.Tensor) -> int | None:
        """The first row of ``tensor``'s shard if it is one of these params' and the main weights are
        sharded, else None."""
        record = self._of.get(tensor)
        return record.first_row if record is not None else None

    def alias(self, tensor: torch.Tensor, known: torch.Tensor) -> None:
        """Let ``tensor`` (a meta param the caller still holds) stand for ``known``'s record."""
        self._of[tensor] = self._of[known]

    def attach_grads(self) -> None:
        """Give the optimizer's params their reduced grads (those of frozen buckets keep theirs)."""
        for record in self._with_grads:
            record.attach_grad()

    def drop_grads(self) -> None:
        for record in self.records:
            record.sharded.grad = None

    def scale_grads(self, factor: float | torch.Tensor) -> None:
        """Multiply every grad by ``factor``: the grad buffers, and attached grads that are copies of them."""
        in_buffers = set()
        for bucket in self.buckets:
            if bucket.grad is not None:
                bucket.grad.mul_(factor)
                in_buffers.add(bucket.grad.untyped_storage().data_ptr())
        for record in self.records:
            grad = local_tensor(record.sharded.grad)
            if grad is not None and grad.untyped_storage().data_ptr() not in in_buffers:
                grad.mul_(factor)

    def frozen_at_wrap(self) -> list[tuple[str, nn.Parameter]]:
        """Both tensors of every param frozen when wrapped: the module shows either one."""
        return [(r.name, t) for r in self.records if r.frozen_at_wrap for t in (r.compute, r.sharded)]
