"""Where a MegatronFSDP model is in its training cycle (``zero_grad_buffer()`` to the optimizer step).

The forward and backward hooks write these facts and the step's checks read them; one object holds them so
both sides see the same state, and a step abandoned part-way can be told from a finished one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Cycle:
    """The facts of the current cycle, each with the event that sets and clears it."""

    in_backward: bool = False
    """The root's pre-backward ran and its post-backward not (yet, or ever: a backward that raised)."""
    grads_pending: bool = False
    """A backward ran since the last ``finish_grad_sync()`` / ``zero_grad_buffer()``."""
    backward_ran: bool = True
    """A backward ran since ``zero_grad_buffer()`` (True before the first: unknown)."""
    forward_unsynced: bool = False
    """A training forward ran since the last sync or ``zero_grad_buffer()``."""
    forwards_awaiting_backward: int = 0
    """Training forwards whose backward has not ended: while any, the modules keep the compute params."""
    grads_finished: bool = False
    """``finish_grad_sync()`` ran since the last backward: a second call changes nothing."""
    microbatch_count: int = 0
    """Backwards since the last ``finish_grad_sync()``."""
