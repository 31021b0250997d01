"""Uneven-shard metadata for ``torch.distributed.checkpoint`` (DCP).

DTensor tells DCP where its local shard sits by assuming torch.chunk's even split, which MegatronFSDP's
row-aligned shards are not. Each rank knows its shard's first row from the layout, so the chunk (offset
and size) is attached to the local tensor, which DTensor's DCP hooks consult first; no collective is
needed. An empty shard writes nothing. DCP then saves and loads across world sizes: a load reads, for this
rank's rows, whichever saved chunks overlap them.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Shard

TensorT = TypeVar("TensorT", bound=torch.Tensor)
FIRST_ROW = "_gradsync_first_row"
"""Attribute of a sharded optimizer param: the global row its local shard starts at."""


def describe_shard(value: TensorT, first_row: int) -> TensorT:
    """Attach ``value``'s chunk (its local rows start at global row ``first_row``) for DCP; returns it."""
    if not isinstance(value, DTensor) or not any(isinstance(p, Shard) for p in value.placements):
        return value  # replicated: DTensor's own description is right
    local: Any = value._local_tensor
    offsets = torch.Size([first_row, *([0] * (value.dim() - 1))])
    chunk = ChunkStorageMetadata(offsets=offsets, sizes=local.size())

    def write_items(fqn: str, obj: Any) -> list[WriteItem]:
        if local.numel() == 0:
            return []
        data = TensorWriteData(
            chunk=chunk, properties=TensorProperties.create_from_tensor(local), size=obj.size()
        )
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD, tensor_data=data)]

    local.__create_chunk_list__ = lambda: [chunk]
    local.__create_write_items__ = write_items
    return value


def describe_optimizer_state(state_dict: dict[str, Any], params: list[torch.Tensor]) -> None:
    """Describe every DTensor in an optimizer state dict whose param (by index, as
    ``Optimizer.state_dict`` numbers them) is a MegatronFSDP shard."""
    for index, entry in state_dict["state"].items():
        first_row = getattr(params[index], FIRST_ROW, None)
        if first_row is None:
            continue
        for value in entry.values():
            if isinstance(value, DTensor) and value.shape == params[index].shape:
                describe_shard(value, first_row)
