"""Every private torch name gradsync-groups uses, and those the wrappers above it share, each with the
oldest torch it was checked on (the compat sessions run 2.6, 2.11, 2.13 and 2.15). Nothing else in the
package touches private torch."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["backends_of", "default_group", "flatten_mesh", "queue_backward_end_callback"]


def default_group() -> dist.ProcessGroup:
    """The default (world) process group object itself: caches keyed to it die with the world it was
    made in (``distributed_c10d._get_default_group``, checked on 2.6)."""
    return dist.distributed_c10d._get_default_group()


def flatten_mesh(mesh: DeviceMesh, name: str | None = None) -> DeviceMesh:
    """``mesh``'s dims flattened into one (``DeviceMesh._flatten``, checked on 2.6; torch has no public
    name for it yet)."""
    return mesh._flatten(name) if name is not None else mesh._flatten()


def backends_of(group: dist.ProcessGroup) -> list[object]:
    """The backend objects (``ProcessGroupGloo``, ``ProcessGroupNCCL``, ...) behind ``group``, one per
    device type it serves (``ProcessGroup._device_types`` and ``_get_backend``, checked on 2.6)."""
    return [group._get_backend(device) for device in group._device_types]


def queue_backward_end_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the running backward has ended, and not at all if it raises: what the
    wrappers use to tell a backward that ended from one abandoned part-way (the autograd engine's
    ``queue_callback``, callable only from inside a backward; checked on 2.6)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)
