"""Every private torch name gradsync-buffers uses, each with the oldest torch it was checked on (the compat
sessions run 2.6, 2.11, 2.13 and 2.15). Imported lazily: importing gradsync.buffers must not depend on
them. Nothing else in the package touches private torch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["even_chunk_shape_and_offset"]


def even_chunk_shape_and_offset(
    shape: torch.Size, mesh: Any, placements: Sequence[Any]
) -> tuple[Sequence[int], Sequence[int]]:
    """This rank's local shape and global offset under torch's own even split of ``placements``
    (``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``, checked on 2.6)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(shape, mesh, placements)
