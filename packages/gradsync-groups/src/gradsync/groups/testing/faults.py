"""Faults a test injects into a training step where users' code meets them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle


class InjectedFault(RuntimeError):
    """What :func:`raise_in_backward` raises."""


def raise_in_backward(module: nn.Module) -> RemovableHandle:
    """Make the backward of every forward through ``module`` raise :class:`InjectedFault` once the grad
    reaches ``module``'s output: the layers after it have run their backward, the ones before it have not,
    as when an OOM or a user's NaN guard stops a backward part-way. Remove the handle to disarm it."""

    def arm(_module: nn.Module, _args: Any, output: torch.Tensor) -> None:
        def fail(_grad: torch.Tensor) -> None:
            raise InjectedFault(f"backward stopped at {type(module).__name__}'s output")

        output.register_hook(fail)  # type: ignore[no-untyped-call]

    return module.register_forward_hook(arm)


def step_abandoned_on_rank_one(
    how: str,
    fault_at: nn.Module,
    forward: Callable[[], torch.Tensor],
    sync: Callable[[], None],
    next_call: Callable[[], None],
) -> RuntimeError | None:
    """One step that rank 1 abandons, ``how``: ``"raised"`` (its backward raises at ``fault_at``'s output,
    the loop catches it and goes on with ``next_call``), ``"loss_raised"`` (the loss raises after the
    forward, before any backward; the loop goes on with ``next_call``), ``"no_backward"`` (it runs
    ``sync`` after the forward without a backward) or ``"no_forward"`` (it runs ``sync`` alone: a batch
    skipped whole). Every other rank runs forward, backward and ``sync``. Returns what the step raised on
    this rank."""
    skipping = dist.get_rank() == 1
    if skipping and how == "no_forward":
        try:
            sync()
        except RuntimeError as error:
            return error
        return None
    armed = raise_in_backward(fault_at) if skipping and how == "raised" else None
    loss = forward()
    if armed is not None:
        armed.remove()
    try:
        try:
            if skipping and how == "loss_raised":
                raise InjectedFault("the loss computation raised after the forward")
            if not skipping or how == "raised":
                loss.backward()  # type: ignore[no-untyped-call]
            sync()
        except InjectedFault:  # the user's loop skips the batch and goes on
            next_call()
    except RuntimeError as error:
        return error
    return None
