"""The one process-wide optimizer hook gradsync registers, and why it has to be process-wide.

A user builds the optimizer on a wrapper's params, and the wrapper never sees it. Yet the wrapper must act
around each of its steps: refuse a step that would apply wrong grads (both wrappers), and learn that the
weights changed and step on local tensors (MegatronFSDP). torch's per-optimizer step hooks need the
optimizer in hand, so one global pre-step hook meets every optimizer at its first step, and again when its
param groups change. It finds the wrappers that claimed the params it holds (:func:`.wrapper_claims.claim`)
and lets each attach its own per-optimizer hooks, once, through ``attach_to_optimizer(optimizer)``.

Between changes, a step costs this hook one lookup and a tuple of (list identity, length) per param group:
an optimizer that holds no gradsync param pays that, and nothing per param. A change is a group added, a
group's params list replaced or resized, or any wrapper built since (it may have claimed params the
optimizer already holds); a param swapped in place inside the same list goes unseen.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from torch.optim.optimizer import Optimizer, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from .wrapper_claims import claims_made, live_owner

_SHAPES_KEPT = 8
"""Param-group shapes remembered per optimizer: a step on lent local tensors shows a second one."""


class OptimizerUser(Protocol):
    """A wrapper whose params an optimizer holds."""

    def attach_to_optimizer(self, optimizer: Optimizer) -> None: ...


class StepGuard(Protocol):
    def refuse_unsynced_step(self) -> None: ...


@dataclass
class _Met:
    shapes: set[tuple[tuple[int, int], ...]] = field(default_factory=set)
    attached: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)
    claims: int = -1
    """:func:`claims_made` at the last meeting: a wrapper built since, over params the optimizer already
    held (a model wrapped again, the optimizer kept), is met at the next step."""


_MET: weakref.WeakKeyDictionary[Optimizer, _Met] = weakref.WeakKeyDictionary()


@functools.cache
def watch_optimizers() -> RemovableHandle:
    """Register the hook (once per process)."""
    return register_optimizer_step_pre_hook(_meet)


def _meet(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    shape = tuple((id(group["params"]), len(group["params"])) for group in optimizer.param_groups)
    met = _MET.get(optimizer)
    if met is None:
        met = _MET[optimizer] = _Met()
    elif shape in met.shapes and met.claims == claims_made():
        return
    if len(met.shapes) >= _SHAPES_KEPT:
        met.shapes.clear()
    met.shapes.add(shape)
    for owner in _owners(optimizer):
        if owner not in met.attached:
            met.attached.add(owner)
            owner.attach_to_optimizer(optimizer)
    met.claims = claims_made()


def _owners(optimizer: Optimizer) -> list[OptimizerUser]:
    owners: dict[int, OptimizerUser] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            owner = live_owner(param)
            if owner is not None:
                owners.setdefault(id(owner), cast(OptimizerUser, owner))
    return list(owners.values())


def weak_step_hook(owner: object, method: str) -> Callable[[Optimizer, Any, Any], None]:
    """A step hook calling ``owner.<method>()`` that holds ``owner`` weakly (an optimizer may outlive the
    wrapper it stepped) and does nothing once it is gone."""
    ref = weakref.ref(owner)

    def call(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        live = ref()
        if live is not None:
            getattr(live, method)()

    return call


def guard_steps(optimizer: Optimizer, owner: StepGuard) -> None:
    """Before each of ``optimizer``'s steps, ``owner`` (held weakly) may refuse it."""
    optimizer.register_step_pre_hook(weak_step_hook(owner, "refuse_unsynced_step"))
