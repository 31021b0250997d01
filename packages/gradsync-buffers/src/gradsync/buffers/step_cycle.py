"""One wrapper's training step as a cycle, and the rules that end a step gone wrong on every rank.

Both wrappers (gradsync-ddp's ``DistributedDataParallel``, gradsync-fsdp's ``MegatronFSDP``) run the same
cycle: ``zero_grad_buffer()`` (zeroed), a training forward, a backward, ``finish_grad_sync()`` (synced),
an optimizer step (stepped), and the next ``zero_grad_buffer()``. Each wrapper notes the phases from its
own hooks into one :class:`StepCycle` and asks it, at a sync, a step or a zeroing, whether the call may
go on. What may not is decided here, with its error text, for both:

- a backward that started and never ended (it raised, and the exception was caught), or a training
  forward followed by neither a backward nor a sync, abandons the step at the next sync, step or zeroing;
- a sync with no backward since the zeroing and nothing in the grads abandons it (the rank skipped the
  batch while the others wait in its reductions);
- an optimizer step after a backward whose grads no sync reduced is refused (it would apply this rank's
  own grads, or none), as is one after a param frozen at wrap time was unfrozen;
- an abandoning rank completes the step's collectives for the others and votes; every rank then raises by
  name (:mod:`gradsync.buffers.step_ballot`).

A wrapper whose optimizer writes the updated weights somewhere its forward does not read (MegatronFSDP's
main weights) also marks the step here: the weights await their install, and the grads the step consumed
take no more grads until the next zeroing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import NoReturn

import torch
from torch import nn

from gradsync.groups.torch_internals import queue_backward_end_callback

from .step_ballot import StepBallot, unfinished_step
from .wrapper_claims import refuse_unfrozen


class StepCycle:
    """Where one wrapper's rank is in its step, each fact with the event that sets and clears it, and the
    ``ballot`` its abandoned steps vote through. ``frozen_at_wrap``: the params frozen when the model was
    wrapped (an optimizer step refuses to run once one of them trains)."""

    def __init__(self, ballot: StepBallot, frozen_at_wrap: Sequence[tuple[str, nn.Parameter]] = ()) -> None:
        self.ballot = ballot
        self.frozen_at_wrap = frozen_at_wrap
        self.in_backward = False
        """A backward started and has not ended (yet, or ever: a backward that raised)."""
        self.grads_pending = False
        """A backward ran since the last ``finish_grad_sync()`` / ``zero_grad_buffer()``."""
        self.backward_ran = True
        """A backward ran since ``zero_grad_buffer()`` (True before the first: unknown)."""
        self.forward_unsynced = False
        """A training forward ran since the last sync or ``zero_grad_buffer()``."""
        self.forwards_awaiting_backward = 0
        """Training forwards whose backward has not ended (MegatronFSDP keeps the compute params)."""
        self.grads_finished = False
        """``finish_grad_sync()`` ran since the last backward: a second call changes nothing."""
        self.microbatch_count = 0
        """Backwards since the last ``finish_grad_sync()``."""
        self.weights_uninstalled = False
        """An optimizer step updated weights the forward does not read yet (until they are installed)."""
        self.grads_consumed = False
        """An optimizer step consumed the grad buffers: no grad may be added until ``zero_grad_buffer()``."""

    @property
    def who(self) -> str:
        return self.ballot.who

    # --- the phases, as each wrapper's hooks see them ------------------------------------------------
    def forward_ran(self) -> None:
        """A forward in training mode with grad enabled (noted before it runs: one that raises counts)."""
        self.forward_unsynced = True

    def backward_began(self) -> None:
        """A backward reached the model (its first grad, or the root's pre-backward)."""
        self.in_backward = True
        self.grads_finished = False
        self.grads_pending = self.backward_ran = True

    def backward_ended(self) -> None:
        self.in_backward = False
        self.microbatch_count += 1
        self.forwards_awaiting_backward = max(0, self.forwards_awaiting_backward - 1)

    def grad_arrived(self) -> None:
        """A grad reached its buffer outside any hook that saw the backward begin: the first one begins it
        and queues its end (the engine runs the callback when the backward ends, not when it raises)."""
        if not self.in_backward:
            self.backward_began()
            queue_backward_end_callback(self.backward_ended)
        self.grads_pending = self.backward_ran = True

    def stepped(self) -> None:
        """An optimizer step updated the main weights from the grads (MegatronFSDP)."""
        self.weights_uninstalled = self.grads_consumed = True

    # --- the calls that end a phase ------------------------------------------------------------------
    @contextmanager
    def syncing(
        self, grads: Callable[[], Iterable[torch.Tensor]], abandon: Callable[[str], NoReturn]
    ) -> Iterator[None]:
        """Around ``finish_grad_sync()``'s reductions: abandon a step this rank cannot finish, vote, and
        raise after the reductions if another rank abandoned it."""
        self.forward_unsynced = False
        counted = self.ballot.vote_to_sync(self.in_backward, self.backward_ran, grads, abandon)
        yield
        counted()
        self.grads_pending = False

    def before_zeroing(self, abandon: Callable[[str], NoReturn]) -> None:
        """``zero_grad_buffer()`` ends the cycle: abandon a step left unfinished."""
        reason = unfinished_step(self.in_backward, self.forward_unsynced, self.backward_ran)
        if reason is not None:
            abandon(reason)
        self.forward_unsynced = False
        self.forwards_awaiting_backward = 0  # the cycle is over (a training forward alone abandoned it)

    def zeroed(self) -> None:
        """The buffers are zero: the next cycle starts."""
        self.grads_pending = self.backward_ran = self.grads_finished = False
        self.grads_consumed = False
        self.ballot.abandoned = self.ballot.others_abandoned = False

    def refuse_unsynced_step(self, abandon: Callable[[str], NoReturn]) -> None:
        """Raise before an optimizer step that would apply wrong grads (every rank usually runs the same
        code: each raises alike, and no collective waits)."""
        self.ballot.refuse_abandoned(
            "an optimizer step",
            self.in_backward,
            abandon,
            forward_without_backward=self.forward_unsynced and not self.backward_ran,
        )
        if self.grads_pending:
            raise RuntimeError(
                f"{self.who}: optimizer step after a backward whose grads were not synchronised; call "
                "model.finish_grad_sync() (finalize_model_grads does) between the last backward and the "
                "step: stepping now would apply this rank's unreduced grads, or none"
            )
        refuse_unfrozen(self.frozen_at_wrap, self.who)

    def abandon(self, complete_collectives: Callable[[], None], reason: str) -> NoReturn:
        """Complete this step's collectives for the other ranks (which may read the phase: the backward
        still counts as running), then raise on every rank."""
        self.grads_pending = self.forward_unsynced = False
        try:
            self.ballot.abandon(complete_collectives, reason)
        finally:
            self.in_backward = False  # one vote per abandoned step, whatever the completion raised

    @property
    def step_left_broken(self) -> bool:
        """The step was abandoned here or elsewhere, or left unfinished: nothing of it may be used."""
        abandoned = self.ballot.abandoned or self.ballot.others_abandoned
        unfinished = unfinished_step(self.in_backward, self.forward_unsynced, self.backward_ran)
        return abandoned or unfinished is not None
