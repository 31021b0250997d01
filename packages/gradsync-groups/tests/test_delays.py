"""The race probe: deferred collectives leave their outputs untouched until waited, then give the real
result; synchronous calls, aliases, restoration and never-waited works."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from gradsync.groups.testing import DeferredWork, delayed_collectives, run_distributed, test_device

# A module-level alias, as a module that substitutes its collectives would hold one.
reduce_alias = dist.all_reduce


def deferred_until_waited() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    local = torch.arange(4 * world, dtype=torch.float32, device=test_device()) * (rank + 1)
    total = torch.arange(4 * world, dtype=torch.float32, device=test_device()) * (world * (world + 1) // 2)
    own = slice(4 * rank, 4 * (rank + 1))
    with delayed_collectives(seed=7) as probe:
        reduced = local.clone()
        scattered = torch.zeros(4, device=test_device())
        gathered = torch.zeros(4 * world, device=test_device())
        broadcast = local.clone()
        exchanged = torch.zeros(4 * world, device=test_device())
        works = [
            dist.all_reduce(reduced, async_op=True),
            dist.reduce_scatter_tensor(scattered, local, async_op=True),
            dist.all_gather_into_tensor(gathered, local[own], async_op=True),
            dist.broadcast(broadcast, 1, None, True),  # async_op given positionally
            dist.all_to_all_single(exchanged, local, async_op=True),
        ]
        assert all(isinstance(w, DeferredWork) and not w.is_completed() for w in works)
        # Nothing has communicated: a read before wait() sees the local data.
        assert torch.equal(reduced, local)
        assert not scattered.any()
        assert not gathered.any()
        assert torch.equal(broadcast, local)
        assert not exchanged.any()
        assert probe.pending == [
            "all_reduce",
            "reduce_scatter_tensor",
            "all_gather_into_tensor",
            "broadcast",
            "all_to_all_single",
        ]
        for work in works:
            assert work.wait()
            assert work.is_completed()
        works[0].wait()  # a second wait does not run the collective again
        assert (probe.deferred, probe.completed, probe.pending) == (5, 5, [])
    assert torch.equal(reduced, total)
    assert torch.equal(scattered, total[own])
    base = torch.arange(4 * world, dtype=torch.float32, device=test_device())
    assert torch.equal(gathered, torch.cat([base[4 * r : 4 * (r + 1)] * (r + 1) for r in range(world)]))
    assert torch.equal(broadcast, base * 2)
    expected = torch.cat([base[own] * (r + 1) for r in range(world)])
    assert torch.equal(exchanged, expected)


@pytest.mark.parametrize("world", [2, 4])
def test_async_outputs_are_unchanged_until_wait_then_reduced(world: int) -> None:
    run_distributed(deferred_until_waited, world)


def synchronous_calls_alias_and_restore() -> None:
    rank = dist.get_rank()
    originals = {name: getattr(dist, name) for name in ("all_reduce", "broadcast")}
    module = sys.modules[__name__]
    with delayed_collectives(seed=1, extra_targets=[(module, "reduce_alias")]) as probe:
        assert dist.all_reduce is not originals["all_reduce"]
        value = torch.tensor([rank + 1.0], device=test_device())
        assert dist.all_reduce(value) is None  # synchronous: reduced on return
        assert value.item() == 3.0
        aliased = torch.tensor([rank + 1.0], device=test_device())
        work = module.reduce_alias(aliased, async_op=True)
        assert aliased.item() == rank + 1.0
        work.wait()
        assert aliased.item() == 3.0
        assert probe.calls == {"all_reduce": 1, "reduce_alias": 1}
    assert module.reduce_alias is originals["all_reduce"]
    with pytest.raises(ValueError, match="inside the block"), delayed_collectives(seed=2):
        raise ValueError("inside the block")
    assert {name: getattr(dist, name) for name in originals} == originals


def test_synchronous_calls_aliases_and_restoration() -> None:
    run_distributed(synchronous_calls_alias_and_restore, 2)


def never_waited_is_an_error() -> None:
    rank = dist.get_rank()
    never_waited = r"1 asynchronous collectives were never waited, so they never ran: all_reduce"
    with pytest.raises(RuntimeError, match=never_waited), delayed_collectives(seed=3):
        dist.all_reduce(torch.ones(1, device=test_device()), async_op=True)
    value = torch.tensor([rank + 1.0], device=test_device())
    dist.all_reduce(value)  # the ranks are still aligned: the dropped collective never ran anywhere
    assert value.item() == 3.0


def test_a_work_never_waited_is_reported() -> None:
    run_distributed(never_waited_is_an_error, 2)


def late_wait_without_deferral() -> None:
    rank = dist.get_rank()
    with delayed_collectives(seed=4, defer_completion=False) as probe:
        value = torch.tensor([rank + 1.0], device=test_device())
        work = dist.all_reduce(value, async_op=True)
        assert not isinstance(work, DeferredWork)
        work.wait()
        assert value.item() == 3.0
        assert probe.deferred == 0
        assert probe.calls["all_reduce"] == 1


def test_without_deferral_the_real_work_is_waited_late() -> None:
    run_distributed(late_wait_without_deferral, 2)
