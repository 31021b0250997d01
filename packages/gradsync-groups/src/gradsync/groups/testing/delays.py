"""A race probe: asynchronous collectives that start late and complete only when waited.

On gloo with small tensors an asynchronous collective has usually finished before the caller reads its
output, so a missing or misplaced ``wait()`` passes every test. Inside :func:`delayed_collectives`, a call
with ``async_op=True`` does not communicate at all: it returns a :class:`DeferredWork` whose ``wait()``
sleeps a random time and only then runs the real collective, synchronously. Until that wait the output
holds its local, un-reduced values, so code that reads it too early fails every time instead of once in a
thousand runs. Each call also sleeps a random time before it starts, with a different random stream on
each rank, which skews the ranks as a slow network would. Synchronous calls keep their semantics (a sleep,
then the real collective).

Only attributes are patched: the functions ``torch.distributed`` exports (:data:`DEFAULT_COLLECTIVES`),
which code calling ``dist.all_reduce(...)`` looks up at call time, plus the ``extra_targets`` the caller
names. A module that holds its own alias of a collective (``mod.reduce_fn = dist.reduce_scatter_tensor``)
is only probed if ``(mod, "reduce_fn")`` is passed: this layer cannot know the layers above it.

Deferred collectives run in the order their works are waited, interleaved with the synchronous ones. On
gloo every rank must therefore wait its works in the same order; code whose wait order differs between
ranks deadlocks here (the harness then times out with every stack), which is a bug the probe reveals, not
one it introduces, as soon as a real backend is slow enough. A work that is never waited never
communicates: leaving the block with deferred works still pending raises ``RuntimeError``.
"""

from __future__ import annotations

import functools
import inspect
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["DEFAULT_COLLECTIVES", "CollectiveProbe", "DeferredWork", "delayed_collectives"]

DEFAULT_COLLECTIVES: tuple[str, ...] = (
    "all_reduce",
    "reduce_scatter_tensor",
    "all_gather_into_tensor",
    "broadcast",
    "all_to_all_single",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "reduce_scatter_single",
    "all_gather_single",
)
"""Names patched on ``torch.distributed`` (those this torch lacks are skipped)."""


class CollectiveProbe:
    """What the probe intercepted, so a test can prove that its collectives really went through it."""

    def __init__(self, seed: int, rank: int, max_delay_s: float, defer_completion: bool) -> None:
        self.max_delay_s = max_delay_s
        self.defer_completion = defer_completion
        self.calls: Counter[str] = Counter()
        """Intercepted calls per patched name, synchronous or not."""
        self.deferred = 0
        """Asynchronous calls whose collective was deferred to ``wait()``."""
        self.completed = 0
        """Deferred collectives that have run."""
        self._pending: list[DeferredWork] = []
        self._rng = random.Random(seed * 1_000_003 + rank)
        self._lock = threading.Lock()

    @property
    def pending(self) -> list[str]:
        """Names of the deferred collectives not waited yet, in issue order."""
        with self._lock:
            return [work.name for work in self._pending]

    def sleep(self) -> None:
        """Sleep a random time in ``[0, max_delay_s]`` from this rank's random stream."""
        if self.max_delay_s > 0:
            with self._lock:
                delay = self._rng.uniform(0.0, self.max_delay_s)
            time.sleep(delay)

    def _defer(self, name: str, run: Callable[[], Any]) -> DeferredWork:
        work = DeferredWork(self, name, run)
        with self._lock:
            self.deferred += 1
            self._pending.append(work)
        return work

    def _done(self, work: DeferredWork) -> None:
        with self._lock:
            self.completed += 1
            self._pending.remove(work)

    def wrap(self, name: str, collective: Callable[..., Any]) -> Callable[..., Any]:
        """``collective`` with a delayed start and, for ``async_op=True`` calls, a deferred completion."""
        try:
            signature: inspect.Signature | None = inspect.signature(collective)
        except (TypeError, ValueError):  # no signature (a builtin): only a keyword async_op is seen
            signature = None

        @functools.wraps(collective)
        def delayed(*args: Any, **kwargs: Any) -> Any:
            try:
                arguments = signature.bind(*args, **kwargs) if signature is not None else None
            except TypeError:
                return collective(*args, **kwargs)  # the collective's own error, undelayed
            with self._lock:
                self.calls[name] += 1
            self.sleep()
            given = arguments.arguments if arguments is not None else kwargs
            if not given.get("async_op", False):
                return collective(*args, **kwargs)
            if not self.defer_completion:
                return _LateWait(self, collective(*args, **kwargs))
            if arguments is None:
                run = functools.partial(collective, *args, **{**kwargs, "async_op": False})
            else:
                arguments.arguments["async_op"] = False
                run = functools.partial(collective, *arguments.args, **arguments.kwargs)
            return self._defer(name, run)

        return delayed


class DeferredWork:
    """Stands in for a collective's work: the collective itself runs, synchronously, inside ``wait()``."""

    def __init__(self, probe: CollectiveProbe, name: str, run: Callable[[], Any]) -> None:
        self.name = name
        self._probe = probe
        self._run: Callable[[], Any] | None = run
        self._lock = threading.Lock()

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Sleep, then run the collective (once; later calls return at once)."""
        with self._lock:
            run, self._run = self._run, None
            if run is not None:
                try:
                    self._probe.sleep()
                    run()
                finally:
                    self._probe._done(self)
        return True

    def is_completed(self) -> bool:
        return self._run is None


class _LateWait:
    """A real work whose ``wait()`` starts late (``defer_completion=False``)."""

    def __init__(self, probe: CollectiveProbe, work: Any) -> None:
        self._probe, self._work = probe, work

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._probe.sleep()
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@contextmanager
def delayed_collectives(
    seed: int,
    max_delay_s: float = 0.003,
    *,
    defer_completion: bool = True,
    extra_targets: Iterable[tuple[object, str]] = (),
) -> Iterator[CollectiveProbe]:
    """Patch ``torch.distributed``'s collectives (and ``extra_targets``) with delayed ones in this process.

    ``seed`` and the rank choose the sleeps, so a failing run can be repeated. ``extra_targets`` are
    ``(object, attribute)`` pairs holding other references to collectives, for instance a module-level
    alias that its module looks up at call time. Everything is restored on exit, also on an exception;
    leaving without an exception while deferred works are still pending raises ``RuntimeError``.
    """
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    probe = CollectiveProbe(seed, rank, max_delay_s, defer_completion)
    targets: dict[tuple[int, str], tuple[object, str]] = {}
    for name in DEFAULT_COLLECTIVES:
        if hasattr(dist, name):
            targets[(id(dist), name)] = (dist, name)
    for owner, attribute in extra_targets:
        if not callable(getattr(owner, attribute)):
            raise TypeError(f"{owner!r}.{attribute} is not a collective function")
        targets[(id(owner), attribute)] = (owner, attribute)
    originals: list[tuple[object, str, Any]] = []
    try:
        for owner, attribute in targets.values():
            original = getattr(owner, attribute)
            originals.append((owner, attribute, original))
            setattr(owner, attribute, probe.wrap(attribute, original))
        yield probe
    finally:
        for owner, attribute, original in reversed(originals):
            setattr(owner, attribute, original)
    if probe.pending:
        raise RuntimeError(
            f"{len(probe.pending)} asynchronous collectives were never waited, so they never ran: "
            f"{', '.join(probe.pending)}"
        )
