"""Every private torch name gradsync-groups uses, and those the wrappers above it share, each with the
oldest torch it was checked on (the compat sessions run 2.6, 2.11, 2.13 and 2.15). Nothing else in the
package touches private torch."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "backends_of",
    "default_group",
    "drop_dtensor_mesh_caches",
    "flatten_mesh",
    "queue_backward_end_callback",
]


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


def drop_dtensor_mesh_caches() -> None:
    """Empty torch's DTensor caches, some of which are keyed by mesh or hold specs of one and so keep every
    mesh a DTensor was placed or redistributed on, and its groups, for the life of the process (checked on
    2.13: ``_redistribute._planner_cache`` and ``_gen_transform_infos``, ``MeshTopoInfo.build_from_mesh``,
    the sharding propagator's Python and C++ caches). Which caches a release has differs, so every
    ``lru_cache`` of the DTensor modules already imported, module-level or on a class, is emptied, with
    the planners' dict."""
    if "torch.distributed.tensor" not in sys.modules:
        return  # no DTensor was ever made
    from torch.distributed.tensor import DTensor

    for name, module in list(sys.modules.items()):
        if not name.startswith("torch.distributed.tensor") or module is None:
            continue
        for value in list(vars(module).values()):
            members = vars(value).values() if isinstance(value, type) else (value,)
            for member in members:
                clear = getattr(getattr(member, "__func__", member), "cache_clear", None)
                if callable(clear):
                    clear()
        planners = vars(module).get("_planner_cache")
        if isinstance(planners, dict):
            planners.clear()
    propagate = getattr(DTensor._op_dispatcher.sharding_propagator, "propagate_op_sharding", None)
    for clear in (
        getattr(propagate, "cache_clear", None),
        getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),  # the C++ fast path's (2.13)
    ):
        if callable(clear):
            clear()
