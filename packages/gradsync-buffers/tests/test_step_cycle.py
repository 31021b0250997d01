"""The step cycle both wrappers note their phases into, walked by hand at 2 ranks with a real ballot: a
healthy step passes; an unsynced step, a frozen param unfrozen and an abandoned step are refused with the
shared messages; an abandoning rank completes its collectives once and every rank raises, naming it; the
next zeroing starts a clean cycle."""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

from gradsync.buffers.step_ballot import StepBallot
from gradsync.buffers.step_cycle import StepCycle
from gradsync.groups.testing import run_distributed


def outcome(call: Callable[[], object]) -> str:
    try:
        call()
    except Exception as error:  # the test reads what each rank raised
        return f"{type(error).__name__}: {error}"
    return "ok"


def walk_the_cycle() -> list[str]:
    """Each rank's outcome of each call, in order; the two ranks differ where rank 1 goes wrong."""
    rank = dist.get_rank()
    ballot = StepBallot([dist.group.WORLD], "Wrapper")  # type: ignore[list-item]
    ballot.prepare()
    frozen = nn.Parameter(torch.zeros(1), requires_grad=False)
    cycle = StepCycle(ballot, [("frozen", frozen)])
    grads = [torch.ones(2)]
    completed: list[str] = []

    def abandon(reason: str) -> NoReturn:
        cycle.abandon(lambda: completed.append(reason[:20]), reason)

    def sync() -> None:
        with cycle.syncing(lambda: grads, abandon):
            pass

    def new_step(*, backward: bool = True) -> None:
        cycle.before_zeroing(abandon)
        cycle.zeroed()
        cycle.forward_ran()
        if backward:
            cycle.backward_began()
            cycle.backward_ended()

    out = []
    new_step()
    out.append(outcome(lambda: cycle.refuse_unsynced_step(abandon)))  # no sync since the backward
    out += [outcome(sync), outcome(lambda: cycle.refuse_unsynced_step(abandon))]
    cycle.before_zeroing(abandon)
    cycle.zeroed()
    cycle.forward_ran()
    cycle.backward_began()
    if rank == 0:
        cycle.backward_ended()  # rank 1's backward raised part-way: it never ends
    out += [outcome(sync), str(cycle.step_left_broken)]
    out.append(outcome(lambda: cycle.refuse_unsynced_step(abandon)))  # either way, refused until zeroed
    new_step(backward=rank == 0)  # rank 1's loss raised after its forward
    out.append(outcome(sync) if rank == 0 else outcome(lambda: cycle.before_zeroing(abandon)))
    new_step()
    sync()
    out.append(str(cycle.step_left_broken))
    frozen.requires_grad_(True)
    out.append(outcome(lambda: cycle.refuse_unsynced_step(abandon)))
    out.append(f"completed {completed}")
    return out


def test_the_cycle_refuses_and_abandons_by_its_rules_on_every_rank() -> None:
    healthy, failing = run_distributed(walk_the_cycle, 2, timeout=40)  # a broken rule hangs a vote
    unsynced = (
        "RuntimeError: Wrapper: optimizer step after a backward whose grads were not synchronised; call "
        "model.finish_grad_sync()"
    )
    for out in (healthy, failing):
        assert out[0].startswith(unsynced), out[0]
        assert out[1:3] == ["ok", "ok"], out
        assert out[8].startswith("RuntimeError: Wrapper: param frozen had requires_grad=False"), out[8]
        assert out[7] == "False", out  # the zeroing started a clean cycle
        assert out[4] == "True", out  # abandoned here or elsewhere: nothing of the step may be used
    assert healthy[3].startswith("AbandonedStepError: Wrapper: rank(s) [1] of the data-parallel group"), (
        healthy
    )
    assert failing[3].startswith(
        "AbandonedStepError: Wrapper: rank 1 abandoned this step: its backward raised"
    )
    assert healthy[5].startswith(unsynced), healthy  # its sync raised: the grads were never synced
    assert failing[5].startswith("AbandonedStepError: Wrapper: an optimizer step on rank 1 in a step it"), (
        failing
    )
    assert healthy[6].startswith("AbandonedStepError: Wrapper: rank(s) [1] of the data-parallel group")
    assert failing[6].startswith("AbandonedStepError: Wrapper: rank 1 abandoned this step: its forward ran")
    assert healthy[9] == "completed []", healthy
    assert failing[9] == "completed ['its backward raised ', 'its forward ran in t']", failing
