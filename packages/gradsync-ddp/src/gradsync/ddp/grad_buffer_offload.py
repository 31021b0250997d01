"""Giving a DistributedDataParallel's grad buffers' device memory back between training phases, and
taking it again.

The host waits for the device first (``synchronize``), so that no kernel still writing a grad is left
pointing at freed memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradsync.buffers import ParamAndGradBuffer


def offload_grad_buffers(
    buffers: Sequence[ParamAndGradBuffer], *, synchronize: bool, empty_cache: bool
) -> None:
    """Free every buffer's grads (their ``main_grad`` views survive); ``empty_cache`` returns the memory
    to the device, not only to torch's caching allocator."""
    device = buffers[0].device if buffers else None
    if synchronize:
        _synchronize(device)
    for buffer in buffers:
        buffer.offload_to_cpu(move_params=False, move_grads=True)
    if empty_cache and device is not None and device.type == "cuda":
        torch.cuda.empty_cache()


def restore_grad_buffers(buffers: Sequence[ParamAndGradBuffer], *, synchronize: bool) -> None:
    """Re-allocate the grads :func:`offload_grad_buffers` freed, zeroed."""
    for buffer in buffers:
        buffer.reload_from_cpu(move_params=False, move_grads=True)
    if synchronize and buffers:
        _synchronize(buffers[0].device)


def _synchronize(device: torch.device | None) -> None:
    if device is not None and device.type != "cpu":
        torch.accelerator.synchronize(device)
