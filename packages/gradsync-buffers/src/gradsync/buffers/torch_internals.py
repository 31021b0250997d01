"""Every private torch name gradsync-buffers uses, each with the oldest torch it was checked on (the compat
sessions run 2.6, 2.11, 2.13 and 2.15). Imported lazily: importing gradsync.buffers must not depend on
them. Nothing else in the package touches private torch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from torch.distributed.tensor import DTensor

__all__ = ["even_chunk_shape_and_offset", "local_tensor"]

_T = TypeVar("_T")


def local_tensor(value: _T) -> _T:
    """A DTensor's local tensor (``DTensor._local_tensor``, checked on 2.6), the one helper every layer
    uses for it: the storage itself, so in-place updates land in the DTensor, without the autograd op
    of ``to_local()`` (about 1 us a call, paid per param per step); any other value is its own."""
    if isinstance(value, DTensor):
        local: Any = value._local_tensor
        return local  # type: ignore[no-any-return]
    return value


def even_chunk_shape_and_offset(
    shape: torch.Size, mesh: Any, placements: Sequence[Any]
) -> tuple[Sequence[int], Sequence[int]]:
    """This rank's local shape and global offset under torch's own even split of ``placements``
    (``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``, checked on 2.6)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(shape, mesh, placements)
