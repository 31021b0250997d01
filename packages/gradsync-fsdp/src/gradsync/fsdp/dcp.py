"""Uneven-shard metadata for ``torch.distributed.checkpoint`` (DCP).

Each rank knows its shard's first row from the layout, so the chunk (offset and size) is attached to the
local tensor (:func:`gradsync.buffers.checkpointing.describe_chunk`); no collective is needed. DCP then
saves and loads across world sizes: a load reads, for this rank's rows, whichever saved chunks overlap
them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.distributed.tensor import DTensor

from gradsync.buffers.checkpointing import describe_chunk

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
