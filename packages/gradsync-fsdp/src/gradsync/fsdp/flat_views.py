"""Views of a bucket's items in its flat buffers.

Params, their grads and the optimizer's rows are views of a bucket's flat buffers, never copies, so a
collective on a buffer is seen by every param at once; these turn buffer coordinates into such views.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .layout import ItemPlacement


def item_view(tensor: torch.Tensor, base: int, start: int, end: int, shape: torch.Size) -> torch.Tensor:
    """Buffer coordinates ``[start, end)`` of ``tensor`` (whose first element is coordinate ``base``) as
    whole rows of a param shaped ``shape``: all of it, or only the rows a rank owns."""
    flat = tensor[start - base : end - base]
    if len(shape) <= 1:
        return flat.view(-1) if len(shape) == 1 else flat.view(shape)
    return flat.view(-1, *shape[1:])


def item_views(buffer: torch.Tensor, items: Sequence[ItemPlacement]) -> list[torch.Tensor]:
    """Each item's view of the whole-bucket ``buffer``, shaped as its param."""
    return [item_view(buffer, 0, item.offset, item.end, item.shape) for item in items]
