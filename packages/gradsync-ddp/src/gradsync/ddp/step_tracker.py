"""Where a DistributedDataParallel's rank is in its step, so that a step gone wrong raises on every rank.

A rank that abandons a step (its backward raised and the exception was caught, or it syncs with no
backward) would leave the other ranks waiting in collectives it never issues; an optimizer step on grads
no ``finish_grad_sync()`` reduced would apply this rank's unreduced grads. The tracker notes each phase of
the step and, at a sync, a step or a ``zero_grad_buffer()``, abandons or refuses through the step's
ballot (:mod:`gradsync.buffers.step_ballot`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import NoReturn

import torch
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig, GradBuffers
from gradsync.buffers.step_ballot import StepBallot, unfinished_step
from gradsync.buffers.wrapper_claims import refuse_unfrozen
from gradsync.groups.torch_internals import queue_backward_end_callback


class StepTracker:
    """One wrapper's step phases and its ballot. ``finish_forward_gathers`` issues the param gathers the
    other ranks' forward still waits for when this rank abandons the step."""

    def __init__(
        self,
        ballot: StepBallot,
        grad_buffers: GradBuffers,
        ddp_config: DistributedDataParallelConfig,
        frozen_at_wrap: Sequence[tuple[str, nn.Parameter]],
        finish_forward_gathers: Callable[[], None],
    ) -> None:
        self.ballot, self.grad_buffers, self.ddp_config = ballot, grad_buffers, ddp_config
        self.frozen_at_wrap = frozen_at_wrap
        self.finish_forward_gathers = finish_forward_gathers
        self.grads_pending = False  # a backward ran since the last finish_grad_sync / zero_grad_buffer
        self.backward_this_cycle = True  # a backward ran since zero_grad_buffer (none called yet: unknown)
        self.in_backward = False  # a backward delivered grads and has not ended (it raised, if it never)
        self.forward_unsynced = False  # a training forward ran since the last sync or zero_grad_buffer

    def grad_arrived(self) -> None:
        """A param's grad reached its main_grad: a backward is under way."""
        self.grads_pending = self.backward_this_cycle = True
        if not self.in_backward:  # the engine runs the callback when this backward ends, not if it raises
            self.in_backward = True
            queue_backward_end_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        self.in_backward = False

    @contextmanager
    def syncing_grads(self) -> Iterator[None]:
        """Around ``finish_grad_sync()``'s reductions: abandon a step this rank cannot finish, vote, and
        raise after the reductions if another rank abandoned it."""
        self.forward_unsynced = False
        counted = self.ballot.vote_to_sync(
            self.in_backward, self.backward_this_cycle, self._grads, self.abandon
        )
        yield
        counted()
        self.grads_pending = False

    @contextmanager
    def zeroing_grads(self) -> Iterator[None]:
        """Around ``zero_grad_buffer()``: abandon a step left unfinished, then start the next one."""
        reason = unfinished_step(self.in_backward, self.forward_unsynced, self.backward_this_cycle)
        if reason is not None:
            self.abandon(reason)
        self.forward_unsynced = False
        yield
        self.grads_pending = self.backward_this_cycle = self.ballot.abandoned = False

    def refuse_unsynced_step(self) -> None:
        """Raise before an optimizer step that would apply wrong grads."""
        forward_only = self.forward_unsynced and not self.backward_this_cycle
        self.ballot.refuse_abandoned("an optimizer step", self.in_backward, self.abandon, forward_only)
        if self.grads_pending:  # every rank usually runs the same code: each raises, no collective waits
            raise RuntimeError(
                f"{self.ballot.who}: optimizer step after a backward whose grads were not synchronised; "
                "call model.finish_grad_sync() (finalize_model_grads does) between the last backward and "
                "the step: stepping now would apply this rank's unreduced grads, or none"
            )
        refuse_unfrozen(self.frozen_at_wrap, self.ballot.who)

    def abandon(self, reason: str) -> NoReturn:
        """Complete this step's collectives for the other ranks, then raise on every rank."""
        self.in_backward = self.grads_pending = self.forward_unsynced = False
        self.ballot.abandon(self._complete_collectives, reason)

    def _complete_collectives(self) -> None:
        """What the other ranks' forward, backward and finish_grad_sync still communicate: the forward's
        param gathers, then every bucket group's reduction. Those the abandoned backward did not launch
        are launched now, in the order the others launch them (:meth:`GradBuffers.launch_order`)."""
        self.finish_forward_gathers()
        if self.ddp_config.overlap_grad_reduce:
            for group in self.grad_buffers.launch_order():
                if not group.grad_reduce_dispatched:
                    group.start_grad_sync()
        self.grad_buffers.finish_grad_sync()

    def _grads(self) -> Iterator[torch.Tensor]:
        return (buffer.grad_data for buffer in self.grad_buffers.all_buffers)
