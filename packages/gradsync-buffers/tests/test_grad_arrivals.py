"""The readiness count both wrappers share (:mod:`gradsync.buffers.grad_arrivals`): a unit is complete the
moment every param's count of grads equals its expected count, and not while any differs, too few or too
many."""

from __future__ import annotations

from gradsync.buffers.grad_arrivals import GradArrivals


def test_a_unit_completes_when_every_count_matches_and_not_while_one_is_over() -> None:
    arrivals = GradArrivals({"used_twice": 2, "once": 1})
    assert [arrivals.arrive(k) for k in ("used_twice", "once", "used_twice")] == [False, False, True]
    arrivals.restart()
    assert arrivals.missing(["used_twice", "once"]) == ["used_twice", "once"]
    # a third grad of the param used twice: the counts no longer match, even once the other arrives
    assert [arrivals.arrive(k) for k in ("used_twice",) * 3 + ("once",)] == [False] * 4
    assert arrivals.counts == {"used_twice": 3, "once": 1}


def test_counts_learned_from_a_first_backward_become_what_later_ones_wait_for() -> None:
    arrivals: GradArrivals[int] = GradArrivals({})
    for key in (0, 1, 1):
        arrivals.arrive(key)
    arrivals.restart(expected=dict(arrivals.counts))
    assert arrivals.expected == {0: 1, 1: 2}
    assert arrivals.missing([0, 1, 2]) == [0, 1, 2]
    assert [arrivals.arrive(k) for k in (1, 0, 1)] == [False, False, True]
