"""Run a function, or a pytest test body, on N spawned ranks, on the CPU over gloo or on CUDA devices.

>>> results = run_distributed(my_module_level_fn, world_size=4, args=(3,))   # one result per rank

Ranks build their tensors on :func:`test_device`: the CPU unless ``GRADSYNC_TEST_DEVICE=cuda`` (or
``device="cuda"``) asks for GPUs, which run over NCCL when each rank can have its own GPU and over gloo with
CUDA tensors when ranks must share them.

A hang fails within ``timeout`` seconds with every rank's Python stack (:class:`RankTimeout`); the first
failing rank's exception and traceback come back as :class:`RankFailure` naming that rank; stragglers are
killed. Ranks are pooled per world size, backend and device, and reused across tests (set
``GRADSYNC_TEST_REUSE_RANKS=0`` to spawn fresh ranks for every call). Functions and arguments travel by
pickle, so functions must be defined at module level.

One failure is not the test's: gloo's TCP mesh setup, on a loaded machine, now and then sees a peer close a
connection attempt it is about to retry ("Gloo connectFullMesh failed ... Connection closed by peer"). Such
a call runs once more on fresh ranks, with a warning; a second failure is raised, so a real fault (a rank
that crashes while its group forms) still fails the test.
"""

from __future__ import annotations

import atexit
import importlib
import os
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from .delays import CollectiveProbe, DeferredWork, delayed_collectives
from .devices import backend_for, requested_device, test_device
from .faults import InjectedFault, raise_in_backward, step_abandoned_on_rank_one
from .pool import RankFailure, RankPool, RankTimeout, Rendezvous

__all__ = [
    "CollectiveProbe",
    "DeferredWork",
    "InjectedFault",
    "RankFailure",
    "RankPool",
    "RankTimeout",
    "delayed_collectives",
    "distributed_test",
    "raise_in_backward",
    "run_distributed",
    "shutdown_pools",
    "step_abandoned_on_rank_one",
    "test_device",
]

DEFAULT_TIMEOUT_S = 120.0
_TRANSIENT_CONNECT = re.compile(r"Gloo connectFullMesh failed .*Connection (closed|reset) by peer")
_pools: dict[tuple[int, str, str, Rendezvous], RankPool] = {}


def _reuse_ranks() -> bool:
    return os.environ.get("GRADSYNC_TEST_REUSE_RANKS", "1") != "0"


def shutdown_pools() -> None:
    """Stop every pooled rank (also registered to run at exit)."""
    while _pools:
        _, pool = _pools.popitem()
        pool.close(kill=not pool.alive)


atexit.register(shutdown_pools)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    backend: str | None = None,
    device: str | None = None,
    rendezvous: Rendezvous = "file",
    reuse: bool | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks in one default process group.

    Returns the per-rank results in rank order. ``device`` (``"cpu"`` or ``"cuda"``; default
    ``GRADSYNC_TEST_DEVICE``, else ``"cpu"``) is where the ranks build tensors, see :func:`test_device`;
    the backend follows from it (gloo on the CPU; NCCL on CUDA with a GPU per rank, else gloo) unless
    ``backend`` names one. ``reuse=False`` gives the call fresh ranks of its own, which suits tests that
    are expected to fail (a failure kills the pool either way).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    device = requested_device(device)
    backend = backend or backend_for(device, world_size)
    if backend == "nccl" and device != "cuda":
        raise ValueError(
            f"backend='nccl' takes CUDA tensors, but the test device is {device!r}: pass device='cuda' "
            "or set GRADSYNC_TEST_DEVICE=cuda"
        )
    reuse = _reuse_ranks() if reuse is None else reuse
    key = (world_size, backend, device, rendezvous)
    call = (fn, tuple(args), dict(kwargs or {}), timeout)
    try:
        return _run_on_pool(key, reuse, *call)
    except RankFailure as failure:
        if not _TRANSIENT_CONNECT.search(failure.traceback_text):
            raise
        warnings.warn(
            f"gloo's mesh setup failed on rank {failure.rank} ({failure.exception}); running "
            f"{getattr(fn, '__name__', fn)!r} once more on fresh ranks",
            RuntimeWarning,
            stacklevel=2,
        )
    return _run_on_pool(key, reuse, *call)


def _run_on_pool(
    key: tuple[int, str, str, Rendezvous],
    reuse: bool,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float,
) -> list[Any]:
    world_size, backend, device, rendezvous = key
    pool = _pools.pop(key, None) if reuse else None
    if pool is None or not pool.alive:
        pool = RankPool(world_size, backend, device=device, rendezvous=rendezvous, pg_timeout_s=timeout)
    results = pool.run(fn, args, kwargs, timeout)  # raises after killing the pool
    if reuse:
        _pools[key] = pool
    else:
        pool.close()
    return results


@dataclass(frozen=True)
class _TestBody:
    """A picklable reference to a test body that ``distributed_test`` replaced in its module."""

    module: str
    qualname: str

    def __call__(self) -> Any:
        target: Any = importlib.import_module(self.module)
        for part in self.qualname.split("."):
            target = getattr(target, part)
        return getattr(target, "__gradsync_body__", target)()


F = TypeVar("F", bound=Callable[[], Any])


def distributed_test(
    world_sizes: Sequence[int] = (2,), *, timeout: float = DEFAULT_TIMEOUT_S, device: str | None = None
) -> Callable[[F], Callable[[int], None]]:
    """Turn a module-level, argument-free test body into a pytest test run on each world size.

    The body runs on every rank with the default process group initialised, reads its rank from
    ``torch.distributed`` and builds its tensors on :func:`test_device`. ``device`` pins the test to one
    device (as :func:`run_distributed`'s); by default ``GRADSYNC_TEST_DEVICE`` decides. Example::

        @distributed_test(world_sizes=[2, 4])
        def test_all_reduce():
            t = torch.ones(1, device=test_device())
            dist.all_reduce(t)
            assert t.item() == dist.get_world_size()
    """
    import pytest

    def decorate(body: F) -> Callable[[int], None]:
        ref = _TestBody(body.__module__, body.__qualname__)

        def test(world_size: int) -> None:
            run_distributed(ref, world_size, timeout=timeout, device=device)

        test.__name__ = body.__name__
        test.__qualname__ = body.__qualname__
        test.__module__ = body.__module__
        test.__doc__ = body.__doc__
        test.__gradsync_body__ = body  # type: ignore[attr-defined]
        parametrized: Callable[[int], None] = pytest.mark.parametrize("world_size", list(world_sizes))(test)
        return parametrized

    return decorate
