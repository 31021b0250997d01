"""Where a wrapper's buffers live, chosen the same way by every entry point (``MegatronFSDP``,
``fully_shard_model`` and the FSDP2-style ``fully_shard``): the device the caller named, else the mesh's
when the params cannot tell (on the meta device, or the FSDP2 API, which moves the module to its mesh as
torch does), else the params' own."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def mesh_device(device_type: str) -> torch.device:
    """The device a mesh of ``device_type`` computes on in this process: the CPU, or the current
    accelerator."""
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.accelerator.current_device_index())


def choose_device(
    asked: torch.device | None, params: Iterable[torch.Tensor], mesh_type: str | None = None
) -> torch.device | None:
    """``asked``, else the device of a mesh of ``mesh_type``, else the first param's; None without any."""
    if asked is not None:
        return asked
    if mesh_type is not None:
        return mesh_device(mesh_type)
    return next((param.device for param in params), None)
