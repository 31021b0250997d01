"""Uneven-shard metadata for ``torch.distributed.checkpoint`` (DCP).

Each rank knows its shard's first row from the layout, so the chunk (offset and size) is attached to the
local tensor (:func:`gradsync.buffers.checkpointing.describe_chunk`); no collective is needed. DCP then
saves and loads across world sizes: a load reads, for this rank's rows, whichever saved chunks overlap
them.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch.distributed.tensor import DTensor

from gradsync.buffers.checkpointing import describe_chunk

TensorT = TypeVar("TensorT", bound=torch.Tensor)
FIRST_ROW = "_gradsync_first_row"
"""Attribute of a sharded optimizer param: the global row its local shard starts at."""


def describe_shard(value: TensorT, first_row: int) -> TensorT:
    """Attach ``value``'s chunk (its local rows start at global row ``first_row``) for DCP; returns it."""
    return describe_chunk(value, [first_row, *([0] * (value.dim() - 1))])


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
