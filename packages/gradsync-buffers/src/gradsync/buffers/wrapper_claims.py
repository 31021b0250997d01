"""Which gradsync wrapper owns a param, and the optimizer-step guard that asks the owner whether a step
may run.

A param belongs to one live wrapper. A second wrapper over params a first one still holds would lose their
grads to the first one's hooks (each moves the grad into its own buffer and clears ``param.grad``), so
training through the second would never move the weights. The owner is held weakly: dropping a wrapper
frees its params for another.

torch runs global optimizer step pre-hooks before every ``torch.optim.Optimizer.step``. One such hook asks
the owner of each param the optimizer holds to refuse a step that would apply wrong grads: a backward
whose grads were never synchronised (``finish_grad_sync`` forgotten: this rank's unreduced grads, or
none), or a param frozen when the wrapper was built and trainable now (its grads bypass the buffers).
A rank that syncs with no backward since ``zero_grad_buffer()`` abandons the step (:mod:`.step_ballot`).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import Optimizer, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

OWNER_ATTR = "_gradsync_wrapper"
"""The attribute of a wrapped param holding (weakly) the wrapper that owns it."""


class StepGuard(Protocol):
    def refuse_unsynced_step(self) -> None: ...


def live_owner(param: nn.Parameter) -> object | None:
    ref = getattr(param, OWNER_ATTR, None)
    return ref() if ref is not None else None


def first_owned_elsewhere(named_params: Sequence[tuple[str, nn.Parameter]], wrapper: object) -> str | None:
    """``"<name> is held by a live <Wrapper>"`` for the first param another live wrapper owns, else None
    (a string every rank can compare)."""
    for name, param in named_params:
        owner = live_owner(param)
        if owner is not None and owner is not wrapper:
            return f"{name} is held by a live {type(owner).__name__}"
    return None


def refuse_owned_elsewhere(owned: str | None, who: str) -> None:
    """Raise when :func:`first_owned_elsewhere` found a param (call it only once every rank agrees)."""
    if owned is not None:
        raise ValueError(
            f"{who}: param {owned}, whose hooks would take the param's grads, so training through this "
            "wrapper would never move it. Drop the first wrapper (and every reference to it) before "
            "wrapping the module again, or wrap a fresh module."
        )


def claim(params: Iterable[nn.Parameter], wrapper: object) -> None:
    ref = weakref.ref(wrapper)
    for param in params:
        setattr(param, OWNER_ATTR, ref)


def refuse_unfrozen(frozen: Sequence[tuple[str, nn.Parameter]], who: str) -> None:
    """Raise naming the first param that was frozen at wrap time and is trainable now."""
    thawed = next((name for name, param in frozen if param.requires_grad), None)
    if thawed is not None:
        raise RuntimeError(
            f"{who}: param {thawed} had requires_grad=False when the wrapper was built and is trainable "
            "now; the wrapper has no grad buffer or hook for it, so its grads would not be synchronised. "
            "Set requires_grad before wrapping (build the wrapper again after changing it)."
        )


def skipped_backward(backward_ran: bool, grads: Callable[[], Iterable[torch.Tensor]]) -> str | None:
    """Why a rank that syncs grads with no backward since ``zero_grad_buffer()`` and nothing written into
    its grads abandons the step (it skipped the batch while the other ranks' reductions wait for its
    grads), or None. Grads written by hand (tests, custom accumulation) are synced as given; only on this
    rare path are the grads read (a host sync on an accelerator)."""
    if backward_ran or any(bool(grad.any()) for grad in grads()):
        return None
    return (
        f"finish_grad_sync() on rank {dist.get_rank()} with no backward since zero_grad_buffer(); every "
        "data-parallel rank must run forward and backward every step"
    )


_OWNERS: weakref.WeakKeyDictionary[Optimizer, dict[str, tuple[tuple[int, ...], list[weakref.ref[Any]]]]] = (
    weakref.WeakKeyDictionary()
)
"""Per optimizer and attribute: its params' identities when last looked at, and (weakly) their owners."""


def owners_of(optimizer: Optimizer, attr: str) -> list[weakref.ref[Any]]:
    """The distinct objects the ``attr`` attribute of ``optimizer``'s params names (a weak reference or the
    object itself), walked again only when its params change: this runs at every step, and comparing
    identities costs a tuple where reading attributes costs a lookup per param."""
    identities = tuple(id(param) for group in optimizer.param_groups for param in group["params"])
    cached = _OWNERS.setdefault(optimizer, {}).get(attr)
    if cached is not None and cached[0] == identities:
        return cached[1]
    owners: dict[int, Any] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            owner = getattr(param, attr, None)
            if isinstance(owner, weakref.ref):
                owner = owner()
            if owner is not None:
                owners.setdefault(id(owner), owner)
    refs = [weakref.ref(owner) for owner in owners.values()]
    _OWNERS[optimizer][attr] = (identities, refs)
    return refs


@functools.cache
def guard_optimizer_steps() -> RemovableHandle:
    """Register the global step pre-hook (once per process)."""
    return register_optimizer_step_pre_hook(_refuse_unsynced_steps)


def _refuse_unsynced_steps(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    for ref in owners_of(optimizer, OWNER_ATTR):
        owner = ref()
        if owner is not None:
            owner.refuse_unsynced_step()
