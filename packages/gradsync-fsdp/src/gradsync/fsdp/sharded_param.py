"""One record per param of a MegatronFSDP model: everything the wrapper knows about it, in one place.

A param lives as two tensors. The compute param is the module's own, a view of its bucket's weights, with
``main_grad`` on it, where Megatron's code reads it. The optimizer's param is a DTensor over the bucket's
main weights. Lookups from either tensor go through one map to the record, so no other place keeps a
per-param map that could drift from it, and nothing gradsync reads is stamped on the params (Megatron's
``_megatron_fsdp_model`` is written for Megatron's code alone).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from gradsync.buffers.torch_internals import local_tensor

from .bucket import FlatParamBucket


@dataclass(eq=False)
class ShardedParam:
    """A param as the wrapper holds it: its name in the wrapped module, its compute param (item ``index``
    of ``bucket``), the optimizer's sharded param and the local tensor under it (a view of the bucket's
    buffers: a conversion of the module that swaps the param for a copy leaves another one there),
    whether it was frozen when wrapped (it then has no grad buffer or hook, so an optimizer step that
    finds it trainable is refused), and the module slots that hold it (``(module, attribute)``: a tied
    param has several)."""

    name: str
    compute: nn.Parameter
    bucket: FlatParamBucket
    index: int
    sharded: nn.Parameter
    frozen_at_wrap: bool
    slots: list[tuple[nn.Module, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.local = local_tensor(self.sharded)

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

    def frozen_at_wrap(self) -> list[tuple[str, nn.Parameter]]:
        """Both tensors of every param frozen when wrapped: the module shows either one."""
        return [(r.name, t) for r in self.records if r.frozen_at_wrap for t in (r.compute, r.sharded)]
