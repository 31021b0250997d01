"""Every rank of a data-parallel group says, once per ``finish_grad_sync()``, whether it completed its part
of the step, so that a rank that abandoned its step makes every rank raise, by name, instead of leaving
the others waiting for its grads or stepping on reductions it never joined.

A rank abandons its step when its backward raised part-way and the exception was caught (the next
``zero_grad_buffer()``, ``finish_grad_sync()`` or optimizer step finds the backward never ended), when
it syncs with no backward at all, or when its training forward is followed by an optimizer step or the next
``zero_grad_buffer()`` with neither a backward nor a sync in between (a loss computation that raised, a
batch skipped after its forward).
It first completes the collectives its step left (the rest of its backward's gathers, every reduction, with
the grads it has and zeros where none arrived), so that the others' collectives end, then votes
``abandoned`` and raises :class:`AbandonedStepError`; it refuses to sync or step again until
``zero_grad_buffer()``. The others vote at their ``finish_grad_sync()``, after their reductions; the count
names the abandoning ranks, and they raise before any optimizer step can use
the grads.

The votes travel on a gloo group of their own over the same ranks (one per set of ranks, built when the
wrapper's construction ends, once per process and world: building it is a collective, which a rank that
skips a step would leave the others waiting in): a CPU tensor, so the count is read with no device sync, and
a group apart, so a vote never reorders the data collectives. One all-reduce of a vector of the group's
size per step, posted before the reductions are waited for and counted after them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import NoReturn

import torch
import torch.distributed as dist

from gradsync.groups import guard_group_teardown, release_at_exit
from gradsync.groups.torch_internals import default_group

from .collectives import Launched

BALLOT_DESC = "gradsync_step_ballot"
"""``group_desc`` of the vote groups, as torch's logs and traces show it."""

_VOTE_GROUPS: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple[int, ...], dist.ProcessGroup]] = (
    weakref.WeakKeyDictionary()
)
"""The world's default group -> global ranks -> the vote group: one per set of ranks, shared by every
data-parallel group over them (torch names a group built with local synchronization after its ranks alone,
so a second one over the same ranks cannot be built), never handed out to another world. Held by the world
weakly: after ``destroy_process_group`` the world's group and its vote groups are freed with the last
wrapper, while the interpreter is alive (a gloo group alive at interpreter exit can abort the process: see
:mod:`gradsync.groups.teardown`), and dropped at exit."""
release_at_exit(_VOTE_GROUPS.clear)


def is_vote_group(group: object) -> bool:
    """Whether ``group`` carries the votes (a test that counts the data collectives leaves them out)."""
    return any(votes is group for by_ranks in _VOTE_GROUPS.values() for votes in by_ranks.values())


BACKWARD_RAISED = (
    "its backward raised part-way (an exception caught around loss.backward()) and {call} came next, so its "
    "grads are incomplete and its collectives out of step with the other ranks'"
)
"""Why a rank whose backward never ended abandons the step (``{call}``: what found it)."""

FORWARD_WITHOUT_BACKWARD = (
    "its forward ran in training mode with grad enabled, then {call} came with no backward and no "
    "finish_grad_sync() in between (an exception caught between forward and backward, or a batch skipped "
    "after its forward, say), so its collectives are out of step with the other ranks'. A forward that "
    "needs no backward belongs under torch.no_grad() or model.eval()"
)
"""Why a rank whose training forward was followed by neither backward nor sync abandons the step
(``{call}``: what found it)."""


def unfinished_step(in_backward: bool, training_forward: bool, backward_ran: bool) -> str | None:
    """Why the step ``zero_grad_buffer()`` ends was abandoned (a backward that never ended, or a training
    forward with neither backward nor sync after it), or None: both wrappers ask it there."""
    if in_backward:
        return BACKWARD_RAISED.format(call="zero_grad_buffer()")
    if training_forward and not backward_ran:
        return FORWARD_WITHOUT_BACKWARD.format(call="zero_grad_buffer()")
    return None


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


class AbandonedStepError(RuntimeError):
    """A data-parallel rank abandoned the step: raised on that rank (with its reason) and on every other
    rank of its group (naming it)."""


def _vote_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A gloo group over ``group``'s ranks; only those ranks build it (``use_local_synchronization``)."""
    by_ranks = _VOTE_GROUPS.setdefault(default_group(), {})
    ranks = tuple(dist.get_process_group_ranks(group))
    cached = by_ranks.get(ranks)
    if cached is not None:
        return cached
    votes: dist.ProcessGroup = dist.new_group(
        list(ranks),
        backend="gloo",
        use_local_synchronization=True,
        group_desc=BALLOT_DESC,
    )
    guard_group_teardown(votes)
    by_ranks[ranks] = votes
    return votes


class StepBallot:
    """The votes of one wrapper over its data-parallel ``groups`` (groups of one rank need none). The
    wrapper calls :meth:`prepare` once its construction's checks have passed on every rank (one that
    raised earlier would leave the others waiting in the build)."""

    def __init__(self, groups: Sequence[dist.ProcessGroup], who: str, enabled: bool = True) -> None:
        """``enabled`` False (``check_abandoned_steps=False``): no votes; a rank that abandons its step
        raises alone, before any collective."""
        self.enabled = enabled
        groups = groups if enabled else []
        self.data_groups = list({id(group): group for group in groups if group.size() > 1}.values())
        self._groups: list[tuple[dist.ProcessGroup, dist.ProcessGroup]] | None = None
        self.who = who
        self.abandoned = False  # this rank abandoned the step; zero_grad_buffer() clears it
        self.others_abandoned = False  # the count named other ranks; zero_grad_buffer() clears it

    def prepare(self) -> None:
        """Build the vote groups (a collective over each data-parallel group), so that no step has to."""
        if self._groups is None:
            self._groups = [(group, _vote_group(group)) for group in self.data_groups]

    @property
    def groups(self) -> list[tuple[dist.ProcessGroup, dist.ProcessGroup]]:
        """(data-parallel group, its vote group) pairs."""
        self.prepare()
        assert self._groups is not None
        return self._groups

    def post(self) -> Callable[[], None]:
        """Vote "completed" on every group; the returned function waits for the count and raises
        :class:`AbandonedStepError` naming the ranks that abandoned the step, if any."""
        counts = [self._vote(group, votes, abandoned=False) for group, votes in self.groups]

        def check() -> None:
            for work, tally, group in counts:
                work.wait()
                abandoned = [dist.get_global_rank(group, i) for i in tally.nonzero().flatten().tolist()]
                if abandoned:
                    self.others_abandoned = True
                    raise AbandonedStepError(
                        f"{self.who}: rank(s) {abandoned} of the data-parallel group abandoned this step "
                        f"(each raised its reason), so the grads reduced on rank {dist.get_rank()} lack "
                        "their part: no rank may step on them. Fix the cause on those ranks; to skip a "
                        "batch on one rank, run its backward with the loss multiplied by 0 (see "
                        "docs/troubleshooting.md#a-rank-abandons-its-step)."
                    )

        return check

    def vote_to_sync(
        self,
        backward_unfinished: bool,
        backward_ran: bool,
        grads: Callable[[], Iterable[torch.Tensor]],
        abandon: Callable[[str], NoReturn],
    ) -> Callable[[], None]:
        """Before ``finish_grad_sync()``'s reductions, as both wrappers run them: ``abandon`` a step this
        rank cannot finish (:meth:`refuse_abandoned`, :func:`skipped_backward`), else vote it completed.
        The returned check, run after the reductions, raises if another rank abandoned it."""
        self.refuse_abandoned("finish_grad_sync()", backward_unfinished, abandon)
        skipped = skipped_backward(backward_ran, grads)
        if skipped is not None:
            abandon(skipped)
        return self.post()

    def refuse_abandoned(
        self,
        call: str,
        backward_unfinished: bool,
        abandon: Callable[[str], NoReturn],
        forward_without_backward: bool = False,
    ) -> None:
        """Before ``call`` (a sync or an optimizer step): raise if this rank abandoned the step (until
        ``zero_grad_buffer()``), and ``abandon`` it if a backward started and never ended, or if a training
        forward had neither a backward nor a sync after it (asked before a step: stepping would move the
        weights while the other ranks wait in this step's reductions)."""
        if self.abandoned:
            raise AbandonedStepError(
                f"{self.who}: {call} on rank {dist.get_rank()} in a step it abandoned; call "
                "zero_grad_buffer() and start the next step"
            )
        if backward_unfinished:
            abandon(BACKWARD_RAISED.format(call=call))
        if forward_without_backward:
            abandon(FORWARD_WITHOUT_BACKWARD.format(call=call))

    def abandon(self, complete_collectives: Callable[[], None], reason: str) -> NoReturn:
        """Complete the collectives the other ranks still wait for, vote "abandoned", raise ``reason``."""
        self.abandoned = True
        if not self.enabled:  # completing the collectives would let the others step on them unwarned
            raise AbandonedStepError(f"{self.who}: rank {dist.get_rank()} abandoned this step: {reason}")
        failure: BaseException | None = None
        try:
            complete_collectives()
        except Exception as error:  # the vote must still go out, or the others would wait for it
            failure = error
        for work, _, _ in [self._vote(group, votes, abandoned=True) for group, votes in self.groups]:
            work.wait()
        raise AbandonedStepError(
            f"{self.who}: rank {dist.get_rank()} abandoned this step: {reason}. It completed the step's "
            "collectives with the grads it had (zeros where none arrived) so that the other data-parallel "
            "ranks do not wait, and they raise too, naming this rank."
        ) from failure

    @staticmethod
    def _vote(
        group: dist.ProcessGroup, votes: dist.ProcessGroup, abandoned: bool
    ) -> tuple[Launched, torch.Tensor, dist.ProcessGroup]:
        # A fresh tally per vote: one whose count was never read (its step raised in between) may still be
        # in flight when the next vote goes out.
        tally = torch.zeros(group.size(), dtype=torch.int32)
        tally[dist.get_rank(group)] = int(abandoned)
        # recorded, so that the hang watchdog sees a rank waiting for the count (the others may be stuck
        # in a collective this rank never launched: it names this rank's vote, and this rank raises too)
        return (
            Launched([dist.all_reduce(tally, group=votes, async_op=True)]).record(
                "all_reduce", "step_ballot.vote", tally, votes, data=False
            ),
            tally,
            group,
        )
