"""Picklable Python objects over a process group, without NumPy.

torch's object collectives (``all_gather_object``, ``broadcast_object_list``, ``gather_object``) turn the
received bytes back into objects through ``Tensor.numpy()``, so on an install without NumPy (torch does
not require it, and neither does gradsync) they fail with "Numpy is not available". These do the same
with byte tensors on the CPU where the group serves it, else on the device its backend takes (NCCL: the
current GPU), as torch's do: the sizes first, then every payload padded to the largest. Every rank of
``group`` must call them.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from .backend import device_for_group

__all__ = ["all_gather_objects", "broadcast_object", "gather_objects"]


def _device(group: dist.ProcessGroup | None) -> torch.device:
    return device_for_group(group, preferred="cpu")


def _as_bytes(obj: Any, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)


def _as_object(payload: torch.Tensor, size: int) -> Any:
    """The object pickled in ``payload[:size]``: one copy into a bytearray (a view's storage would be the
    whole padded buffer, and converting a storage to bytes walks it one element at a time)."""
    data = bytearray(size)
    torch.frombuffer(data, dtype=torch.uint8).copy_(payload[:size])
    return pickle.loads(data)  # from ranks of our own job


def _padded(payload: torch.Tensor, width: int) -> torch.Tensor:
    return torch.cat([payload, payload.new_zeros(width - payload.numel())])


def _sizes(payload: torch.Tensor, group: dist.ProcessGroup | None) -> list[int]:
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=payload.device)
    sizes = [torch.empty_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    return [int(s) for s in torch.cat(sizes).tolist()]


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj``, in group rank order (``dist.all_gather_object``)."""
    payload = _as_bytes(obj, _device(group))
    sizes = _sizes(payload, group)
    received = [payload.new_empty(max(sizes)) for _ in sizes]
    dist.all_gather(received, _padded(payload, max(sizes)), group=group)
    return [_as_object(tensor, size) for tensor, size in zip(received, sizes, strict=True)]


def broadcast_object(obj: Any, src: int, group: dist.ProcessGroup | None = None) -> Any:
    """Global rank ``src``'s ``obj`` on every rank (``dist.broadcast_object_list`` of one object)."""
    device = _device(group)
    payload = _as_bytes(obj, device) if dist.get_rank() == src else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    if dist.get_rank() != src:
        payload = torch.empty(int(size), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=src, group=group)
    return obj if dist.get_rank() == src else _as_object(payload, int(size))


def gather_objects(obj: Any, dst: int, group: dist.ProcessGroup | None = None) -> list[Any] | None:
    """Every rank's ``obj`` on global rank ``dst`` in group rank order, None elsewhere
    (``dist.gather_object``)."""
    payload = _as_bytes(obj, _device(group))
    sizes = _sizes(payload, group)
    mine = _padded(payload, max(sizes))
    received = [torch.empty_like(mine) for _ in sizes] if dist.get_rank() == dst else None
    dist.gather(mine, received, dst=dst, group=group)
    if received is None:
        return None
    return [_as_object(tensor, size) for tensor, size in zip(received, sizes, strict=True)]
