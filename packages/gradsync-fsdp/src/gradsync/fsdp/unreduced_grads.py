"""ZeRO-2/3's whole-bucket grads of one backward: borrowed from the grads allocator when the first grad
arrives, handed back once their reduce-scatter has landed in the shard, so a bucket holds whole-bucket
grads only while its reduction is pending. Each param's record keeps its view of them
(:meth:`~gradsync.fsdp.sharded_param.ShardedParam.unreduced_grad`)."""

from __future__ import annotations

import torch

from .allocators import BucketAllocator, BufferRequest
from .layout import BucketLayout


class UnreducedGrads:
    """One bucket's borrowed whole-bucket grads."""

    def __init__(
        self,
        allocator: BucketAllocator,
        bucket_id: int,
        layout: BucketLayout,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """``dtype``: the wire's, as the buffer is reduced in place."""
        self.allocator, self.bucket_id = allocator, bucket_id
        self.request = BufferRequest(layout.size, dtype, device)
        self._buffer: torch.Tensor | None = None

    def buffer(self) -> torch.Tensor:
        """This backward's whole-bucket grads, zeroed when first asked for."""
        if self._buffer is None:
            self._buffer = self.allocator.allocate(self.bucket_id, self.request).zero_()
        return self._buffer

    def can_take(self) -> bool:
        """Whether the first grad of this backward would get a buffer now (double buffers can be full)."""
        return self._buffer is not None or self.allocator.can_allocate(self.bucket_id)

    def drop(self) -> None:
        """Hand the buffer back (its grads were reduced, or zeroed)."""
        if self._buffer is not None:
            self._buffer = None
            self.allocator.free(self.bucket_id)
