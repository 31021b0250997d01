"""Zeroing a bucket's grads only when something may have written them since they were last zeroed.

Loops that call ``optimizer.zero_grad()`` (which zeros the buffers under fully_shard_optimizer) and then
``model.zero_grad_buffer()`` as Megatron's do would otherwise write every grad byte twice. Any in-place
torch op on the buffer or a view of it (a grad hook's add, a user's write through ``main_grad`` or a
DTensor grad) moves its version counter; a collective does not, so a reduction into the buffer is noted.
"""

from __future__ import annotations

import torch

from .torch_internals import version_counter


class GradZeroing:
    """Whether one grad buffer may hold anything but zeros."""

    def __init__(self) -> None:
        self._reduced_into = True
        self._zeroed_version = -1

    def needed(self, grad: torch.Tensor) -> bool:
        """Whether ``grad`` may have been written since :meth:`note_zeroed`."""
        return self._reduced_into or version_counter(grad) != self._zeroed_version

    def note_zeroed(self, grad: torch.Tensor) -> None:
        """``grad`` holds zeros now. Called once every bucket is zeroed: coalesced buckets' grads share one
        storage and so one version counter, which a sibling's zeroing moves."""
        self._zeroed_version, self._reduced_into = version_counter(grad), False

    def note_reduction(self) -> None:
        """A collective is about to write the grads."""
        self._reduced_into = True
