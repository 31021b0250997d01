"""ZeRO-2/3's whole-bucket grads of one backward: borrowed from the grads allocator when the first grad
arrives, handed back once their reduce-scatter has landed in the shard, so a bucket holds whole-bucket
grads only while its reduction is pending."""

from __future__ import annotations

import torch

from .allocators import BucketAllocator, BufferRequest
from .flat_views import item_view
from .layout import BucketLayout


class UnreducedGrads:
    """One bucket's borrowed whole-bucket grads and each param's view of them."""

    def __init__(
        self,
        allocator: BucketAllocator,
        bucket_id: int,
        layout: BucketLayout,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """``dtype``: the wire's, as the buffer is reduced in place."""
        self.allocator, self.bucket_id, self.items = allocator, bucket_id, layout.items
        self.request = BufferRequest(layout.size, dtype, device)
        self._buffer: torch.Tensor | None = None
        self._views: list[torch.Tensor | None] = []  # each param's view of it, built when used
        self._views_of: torch.Tensor | None = None  # the buffer those views are of

    def buffer(self) -> torch.Tensor:
        """This backward's whole-bucket grads, zeroed when first asked for."""
        if self._buffer is None:
            self._buffer = self.allocator.allocate(self.bucket_id, self.request).zero_()
        return self._buffer

    def item(self, index: int) -> torch.Tensor:
        """Item ``index``'s view of :meth:`buffer`. The views are kept while the allocator lends the same
        tensor (the default storage-resize one does, every backward), so the hook of a later backward
        adds into a kept view, as no_shard's and ZeRO-1's do."""
        buffer = self.buffer()
        if buffer is not self._views_of:
            self._views_of, self._views = buffer, [None] * len(self.items)
        view = self._views[index]
        if view is None:
            item = self.items[index]
            view = item_view(buffer, 0, item.offset, item.end, item.shape)
            self._views[index] = view
        return view

    def can_take(self) -> bool:
        """Whether the first grad of this backward would get a buffer now (double buffers can be full)."""
        return self._buffer is not None or self.allocator.can_allocate(self.bucket_id)

    def drop(self) -> None:
        """Hand the buffer back (its grads were reduced, or zeroed)."""
        if self._buffer is not None:
            self._buffer = None
            self.allocator.free(self.bucket_id)
