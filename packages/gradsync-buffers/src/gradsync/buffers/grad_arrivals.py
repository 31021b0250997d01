"""Which grads of a reduction unit have arrived in this backward, against what a complete unit holds: the
one readiness mechanism of both wrappers.

A unit is complete when every param's count of grads equals the count it expects. gradsync-ddp's bucket
groups learn the expected counts from the first iteration (a param used twice in a forward may get two
grads, as the reference counts them); MegatronFSDP's buckets expect one grad per param. A running count of
the params whose count differs keeps each arrival O(1) instead of a comparison of two maps.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

Key = TypeVar("Key", bound=Hashable)


class GradArrivals(Generic[Key]):
    """The grads counted per param (by any key: the param, or its index in a bucket) in this backward."""

    __slots__ = ("_mismatched", "counts", "expected")

    def __init__(self, expected: dict[Key, int]) -> None:
        self.expected = expected
        self.counts: dict[Key, int] = {}
        self._mismatched = len(expected)

    def arrive(self, key: Key) -> bool:
        """Count one grad of ``key``; whether every count now equals its expected one (a grad's own hook
        calls this: one call, where :meth:`arrive_all` would add a tuple and a loop)."""
        before = self.counts.get(key, 0)
        self.counts[key] = before + 1
        want = self.expected.get(key, 0)
        self._mismatched += (before == want) - (before + 1 == want)
        return self._mismatched == 0

    def arrive_all(self, keys: Iterable[Key]) -> bool:
        """Count one grad of each of ``keys`` (a unit's grads taken at once, in one call instead of one per
        grad); whether every count now equals its expected one."""
        counts, expected = self.counts, self.expected
        mismatched = self._mismatched
        for key in keys:
            before = counts.get(key, 0)
            counts[key] = before + 1
            want = expected.get(key, 0)
            mismatched += (before == want) - (before + 1 == want)
        self._mismatched = mismatched
        return mismatched == 0

    def restart(self, expected: dict[Key, int] | None = None) -> None:
        """Start counting a new backward (expecting ``expected`` from now on, when given)."""
        if expected is not None:
            self.expected = expected
        self.counts = {}
        self._mismatched = len(self.expected)

    def missing(self, keys: Iterable[Key]) -> list[Key]:
        """Those of ``keys`` with no grad yet."""
        return [key for key in keys if key not in self.counts]
