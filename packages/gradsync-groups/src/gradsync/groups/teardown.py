"""Dropping process groups safely: without deadlocking on torch < 2.8, and before the interpreter exits.

Before torch 2.8 the Python ``ProcessGroup`` object destroys its backends with the GIL held. Gloo's
destructor waits, under its work lock, for its worker threads; a worker still freeing the last
collective's tensors takes that lock and may need the GIL too (to free a tensor whose Python object died
first). Each waits for the other, forever: a rank hangs in the line that drops the group.

The backend objects' own bindings release the GIL when they die. Holding a reference to each backend
until the group's object has gone makes that reference the last one, so the backend is destroyed with the
GIL released and the worker finishes. torch 2.8 releases the GIL in the group's own destructor, and there
this is not needed.

**At exit.** ``destroy_process_group`` forgets the groups, but a gloo group lives, with its worker threads,
as long as anything holds it. A worker frees each collective's work after it has completed, and so after
the caller's wait returned; if the tensors' Python objects died first, that free needs the GIL. Once the
interpreter is finalizing, a thread asking for the GIL is ended by ``pthread_exit``, whose unwinding meets
the work's ``noexcept`` destructor: ``terminate called without an active exception``, SIGABRT, after a
good run (seen with gdb: ``ProcessGroupGloo::runLoop`` -> ``~AsyncWork`` -> ``decref_pyobject`` ->
``take_gil`` -> ``PyThread_exit_thread``). Destroying a group joins its workers, so a group destroyed while
the interpreter is alive cannot do this. gradsync therefore holds no group past its world: its caches of
groups hold the world's default group weakly, and at exit, after the program destroyed the default group,
:func:`release_groups_at_exit` drops every group a gradsync cache still holds and collects the reference
cycles that hold others (wrappers, meshes), so those groups are destroyed, their workers joined, before
finalization; it also empties torch's DTensor caches keyed by mesh, which would hold a mesh's groups to
the end (torch's own FSDP2 keeps them so). Groups the program itself still holds (a model in a module
global) stay its to drop.
"""

from __future__ import annotations

import atexit
import gc
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from .torch_internals import backends_of, drop_dtensor_mesh_caches

__all__ = ["guard_group_teardown", "release_at_exit", "release_groups_at_exit"]

_RELEASERS: list[Callable[[], None]] = [drop_dtensor_mesh_caches]  # torch's own caches of meshes
_BUILT: list[
    bool
] = []  # holds True once gradsync built a group in this process: else exit has nothing of ours

_GROUP_DESTRUCTOR_HOLDS_GIL = torch.torch_version.TorchVersion(torch.__version__) < "2.8"


def _release(*backends: object) -> None:
    """Called once the group's object is gone; the backends die when this call's arguments do."""


def guard_group_teardown(group: dist.ProcessGroup | None) -> None:
    """Make dropping ``group`` safe on torch < 2.8 (see the module docstring); a no-op elsewhere, and for
    ``None`` or a rank's non-member placeholder. Every group gradsync builds comes here, which also arms
    :func:`release_groups_at_exit`."""
    if not _BUILT:
        _BUILT.append(True)
    if _GROUP_DESTRUCTOR_HOLDS_GIL and isinstance(group, dist.ProcessGroup):
        # A weakref callback runs after the object's C++ holder is freed, so the group's destructor has
        # already dropped its own references to the backends when these go.
        weakref.finalize(group, _release, *backends_of(group))


def release_at_exit(release: Callable[[], None]) -> None:
    """Have :func:`release_groups_at_exit` call ``release``, which drops the groups a module caches."""
    _RELEASERS.append(release)


def release_groups_at_exit() -> None:
    """Run at interpreter exit, while the interpreter is still whole: once the program has destroyed the
    default group (its clean end) in a process where gradsync built groups, drop the groups gradsync's
    caches hold and collect reference cycles, so every group nothing else holds is destroyed and its gloo
    workers joined now (see the module docstring). With the default group alive (a crash, or no
    ``destroy_process_group``), exit goes as without gradsync: destroying a group waits for its pending
    collectives, which a crashed peer may never finish."""
    if not _BUILT or not dist.is_available() or dist.is_initialized():
        return
    for release in _RELEASERS:
        release()
    gc.collect()


atexit.register(release_groups_at_exit)
