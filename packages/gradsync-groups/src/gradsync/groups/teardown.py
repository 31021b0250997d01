"""Dropping a process group without deadlocking on torch < 2.8.

Before torch 2.8 the Python ``ProcessGroup`` object destroys its backends with the GIL held. Gloo's
destructor waits, under its work lock, for its worker threads; a worker still freeing the last
collective's tensors takes that lock and may need the GIL too (to free a tensor whose Python object died
first). Each waits for the other, forever: a rank hangs in the line that drops the group.

The backend objects' own bindings release the GIL when they die. Holding a reference to each backend
until the group's object has gone makes that reference the last one, so the backend is destroyed with the
GIL released and the worker finishes. torch 2.8 releases the GIL in the group's own destructor, and there
this is not needed.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from .torch_internals import backends_of

__all__ = ["guard_group_teardown"]

_GROUP_DESTRUCTOR_HOLDS_GIL = torch.torch_version.TorchVersion(torch.__version__) < "2.8"


def _release(*backends: object) -> None:
    """Called once the group's object is gone; the backends die when this call's arguments do."""


def guard_group_teardown(group: dist.ProcessGroup | None) -> None:
    """Make dropping ``group`` safe on torch < 2.8 (see the module docstring); a no-op elsewhere, and for
    ``None`` or a rank's non-member placeholder."""
    if _GROUP_DESTRUCTOR_HOLDS_GIL and isinstance(group, dist.ProcessGroup):
        # A weakref callback runs after the object's C++ holder is freed, so the group's destructor has
        # already dropped its own references to the backends when these go.
        weakref.finalize(group, _release, *backends_of(group))
