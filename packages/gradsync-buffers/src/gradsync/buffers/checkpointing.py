"""What sharded optimizers need to go through ``torch.distributed.checkpoint`` (DCP) and reshard.

DTensor tells DCP where its local shard sits by assuming torch.chunk's even split, which neither
gradsync-ddp's flat bucket shards nor gradsync-fsdp's row-aligned shards are. The owner knows the true
offset of its local chunk, so :func:`describe_chunk` attaches it to the local tensor, which DTensor's DCP
hooks consult first; no collective is needed, and an empty shard writes nothing. A load then reads, for
each rank's chunk, whichever saved chunks overlap it, so a checkpoint loads at another data-parallel size.

DCP loads into existing tensors, and optimizers create their state lazily at the first step, so
:func:`materialize_optimizer_state` gives every param its state before a load.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Shard

from .torch_internals import local_tensor

TensorT = TypeVar("TensorT", bound=torch.Tensor)


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (as torch gives them: a 0-sized dim counts as 1),
    for a DTensor built from a shard whose global shape is given (``DTensor.from_local(shape=...)``)."""
    strides: list[int] = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def describe_chunk(value: TensorT, offsets: Sequence[int]) -> TensorT:
    """Attach to the DTensor ``value`` that its local tensor starts at global ``offsets``; returns it.
    Replicated DTensors and plain tensors are returned as they are (DCP's own description is right)."""
    if not isinstance(value, DTensor) or not any(isinstance(p, Shard) for p in value.placements):
        return value
    local: Any = local_tensor(value)
    start = torch.Size(offsets)
    if len(start) != value.dim():
        raise ValueError(f"describe_chunk: {len(start)} offsets for a {value.dim()}-dimensional tensor")
    chunk = ChunkStorageMetadata(offsets=start, sizes=local.size())
    local.__create_chunk_list__ = _ChunkList(chunk)
    local.__create_write_items__ = _WriteItems(chunk)
    return value


class _ChunkList:
    """DCP's chunk list of a described local tensor: a class, not a closure, so that ``torch.save`` can
    pickle the tensor that carries it."""

    def __init__(self, chunk: ChunkStorageMetadata) -> None:
        self.chunk = chunk

    def __call__(self) -> list[ChunkStorageMetadata]:
        return [self.chunk]


class _WriteItems:
    """DCP's write items of a described local tensor (none when it is empty); picklable, as
    :class:`_ChunkList`. ``value`` is the DTensor being saved."""

    def __init__(self, chunk: ChunkStorageMetadata) -> None:
        self.chunk = chunk

    def __call__(self, fqn: str, value: Any) -> list[WriteItem]:
        local = local_tensor(value)
        if local.numel() == 0:
            return []
        properties = TensorProperties.create_from_tensor(local)
        data = TensorWriteData(chunk=self.chunk, properties=properties, size=value.size())
        index = MetadataIndex(fqn, self.chunk.offsets)
        return [WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data)]


# A described tensor carries these into torch.save's file; torch.load, whose default since torch 2.6 is
# weights_only=True, rebuilds only the classes allowlisted here.
torch.serialization.add_safe_globals([ChunkStorageMetadata, _ChunkList, _WriteItems])


def materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """One step with zero grads, learning rate and weight decay, then step counters back to 0: every
    param this rank holds gets its optimizer state, so that a checkpoint load has tensors to fill, and
    the next real step behaves as a first one. Params with no local elements get their (empty) state too,
    as a training step gives it them: a load then fills the same entries a save wrote."""
    saved: list[dict[str, Any]] = [
        {k: g[k] for k in ("lr", "weight_decay") if k in g} for g in optimizer.param_groups
    ]
    for group in optimizer.param_groups:
        for key in ("lr", "weight_decay"):
            if key in group:
                value = group[key]
                group[key] = torch.zeros_like(value) if isinstance(value, torch.Tensor) else 0.0
        for param in group["params"]:
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
    optimizer.step()
    for group, values in zip(optimizer.param_groups, saved, strict=True):
        group.update(values)
    for state in optimizer.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"].zero_()
        elif "step" in state:
            state["step"] = 0
    optimizer.zero_grad()
