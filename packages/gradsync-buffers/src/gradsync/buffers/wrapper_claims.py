"""Which gradsync wrapper owns a param, and the optimizer-step guard that asks the owner whether a step
may run.

A param belongs to one live wrapper. A second wrapper over params a first one still holds would lose their
grads to the first one's hooks (each moves the grad into its own buffer and clears ``param.grad``), so
training through the second would never move the weights.

Claims are not stamped on the params: torch's own conversions (``module.to()``, ``swap_tensors``) carry or
drop a param's attributes in ways a wrapper cannot see. Each wrapper holds the map of what it claimed, by
identity; the process keeps only a weak set of the wrappers that claimed anything, so a wrapper that is
collected frees its params for another (a MegatronFSDP lives as long as its module: Megatron's
``_megatron_fsdp_model`` on each param points back at it). Nothing here holds a weak reference to a tensor:
torch refuses to swap one that has any (``module.to()`` on a wrapped module would fail inside torch instead of
being refused by name at the next forward).

An optimizer holding a wrapper's params finds the wrapper through these claims
(:mod:`.optimizer_watch`), which then refuses a step that would apply wrong grads: a backward whose grads
were never synchronised (``finish_grad_sync`` forgotten: this rank's unreduced grads, or none), or a
param frozen when the wrapper was built and trainable now (its grads bypass the buffers). A rank that
syncs with no backward since ``zero_grad_buffer()`` abandons the step (:mod:`.step_ballot`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence

import torch
from torch import nn

CLAIMS_ATTR = "_gradsync_claims"
"""The attribute of a wrapper holding what it claimed: ``id(tensor) -> tensor``."""

_CLAIMANTS: weakref.WeakSet[object] = weakref.WeakSet()
"""Every live wrapper that claimed a tensor."""


def _claims(wrapper: object) -> dict[int, torch.Tensor]:
    claimed: dict[int, torch.Tensor] = getattr(wrapper, CLAIMS_ATTR)
    return claimed


def live_owner(tensor: torch.Tensor) -> object | None:
    """The live wrapper that claimed ``tensor``, or None."""
    for wrapper in _CLAIMANTS:
        if _claims(wrapper).get(id(tensor)) is tensor:
            return wrapper
    return None


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


_CLAIMS_MADE = [0]  # one counter, mutated in place


def claims_made() -> int:
    """How many times :func:`claim` ran in this process: a wrapper built since a count was read."""
    return _CLAIMS_MADE[0]


def claim(tensors: Iterable[torch.Tensor], wrapper: object) -> None:
    """Make ``wrapper`` the owner of each of ``tensors`` (none of which another live wrapper owns: the
    wrappers refuse that first, :func:`refuse_owned_elsewhere`)."""
    _CLAIMS_MADE[0] += 1
    if wrapper not in _CLAIMANTS:
        setattr(wrapper, CLAIMS_ATTR, {})
        _CLAIMANTS.add(wrapper)
    _claims(wrapper).update((id(tensor), tensor) for tensor in tensors)


def refuse_unfrozen(frozen: Sequence[tuple[str, nn.Parameter]], who: str) -> None:
    """Raise naming the first param that was frozen at wrap time and is trainable now."""
    thawed = next((name for name, param in frozen if param.requires_grad), None)
    if thawed is not None:
        raise RuntimeError(
            f"{who}: param {thawed} had requires_grad=False when the wrapper was built and is trainable "
            "now; the wrapper has no grad buffer or hook for it, so its grads would not be synchronised. "
            "Set requires_grad before wrapping (build the wrapper again after changing it)."
        )
