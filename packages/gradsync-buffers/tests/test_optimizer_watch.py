"""The one process-wide optimizer hook: it meets each optimizer at its first step and when its param
groups change, lets every wrapper whose params the optimizer holds attach itself once, and costs an
optimizer that holds no wrapper's param nothing per param."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from gradsync.buffers.optimizer_watch import _meet, guard_steps, watch_optimizers
from gradsync.buffers.wrapper_claims import claim


class CountingList(list[Any]):
    """A param group's list that counts how often it is walked."""

    walks = 0

    def __iter__(self) -> Iterator[Any]:
        CountingList.walks += 1
        return super().__iter__()


class Wrapper:
    def __init__(self) -> None:
        self.attached: list[torch.optim.Optimizer] = []
        self.refused = 0

    def attach_to_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.attached.append(optimizer)
        guard_steps(optimizer, self)

    def refuse_unsynced_step(self) -> None:
        self.refused += 1


def params(n: int) -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(3)) for _ in range(n)]


def test_an_optimizer_holding_no_wrapped_param_is_walked_once() -> None:
    optimizer = torch.optim.SGD(params(4), lr=0.1)
    optimizer.param_groups[0]["params"] = CountingList(optimizer.param_groups[0]["params"])
    CountingList.walks = 0
    for _ in range(5):
        _meet(optimizer, (), {})
    assert CountingList.walks == 1  # the first meeting; then a tuple per group, no param read


def test_each_wrapper_attaches_once_and_a_new_group_is_met() -> None:
    watch_optimizers()
    first, second = Wrapper(), Wrapper()
    mine = params(2)
    claim(mine, first)
    optimizer = torch.optim.SGD([*mine, *params(1)], lr=0.1)
    for p in optimizer.param_groups[0]["params"]:
        p.grad = torch.ones(3)
    optimizer.step()
    optimizer.step()
    assert (first.attached, first.refused) == ([optimizer], 2)
    theirs = params(1)
    claim(theirs, second)
    theirs[0].grad = torch.ones(3)
    optimizer.add_param_group({"params": theirs})
    optimizer.step()
    assert (len(first.attached), first.refused) == (1, 3)
    assert (second.attached, second.refused) == ([optimizer], 1)


def test_a_dropped_wrapper_is_freed_and_one_built_again_is_met() -> None:
    watch_optimizers()
    wrapper = Wrapper()
    mine = params(1)
    claim(mine, wrapper)
    mine[0].grad = torch.ones(3)
    optimizer = torch.optim.SGD(mine, lr=0.1)
    optimizer.step()
    assert wrapper.refused == 1
    dropped = weakref.ref(wrapper)
    del wrapper
    gc.collect()
    assert dropped() is None  # the optimizer's hooks hold it weakly
    optimizer.step()  # the guard finds no wrapper and lets the step run
    again = Wrapper()  # a wrapper built again over the same params, the optimizer kept
    claim(mine, again)
    optimizer.step()
    assert (again.attached, again.refused) == ([optimizer], 1)


def test_a_refusal_stops_the_step() -> None:
    class Refusing(Wrapper):
        def refuse_unsynced_step(self) -> None:
            raise RuntimeError("unsynced")

    watch_optimizers()
    wrapper = Refusing()
    mine = params(1)
    claim(mine, wrapper)
    mine[0].grad = torch.ones(3)
    before = mine[0].detach().clone()
    optimizer = torch.optim.SGD(mine, lr=0.1)
    with pytest.raises(RuntimeError, match="unsynced"):
        optimizer.step()
    assert torch.equal(mine[0].detach(), before)
