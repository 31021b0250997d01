"""A torch.profiler trace names MegatronFSDP's phases (as torch FSDP2's names its own), on every rank, for
the phases the strategy has; without a profiler nothing is recorded, so no label costs a step anything."""

from __future__ import annotations

import pytest
import torch
from fsdp_testkit import Trainer

from gradsync.fsdp import hooks
from gradsync.groups.testing import run_distributed

EVERY_STRATEGY = {
    "root_pre_forward",
    "post_forward",
    "root_post_backward",
    "reduce",
    "finish_grad_sync",
    "zero_grad_buffer",
}
ZERO3_ONLY = {"pre_backward", "post_backward"}  # a unit's weights gathered again and released in backward


def labels_in_a_profiled_step(strategy: str) -> set[str]:
    trainer = Trainer.build(strategy)
    trainer.step(0, 1)  # the first step builds what later steps reuse
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        trainer.step(1, 1)
    prefix = "MegatronFSDP::"
    return {e.name[len(prefix) :] for e in profile.events() if e.name.startswith(prefix)}


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_a_profile_names_the_phases(strategy: str) -> None:
    for names in run_distributed(labels_in_a_profiled_step, 2, args=(strategy,)):
        assert names >= EVERY_STRATEGY
        assert (names >= ZERO3_ONLY) == (strategy == "optim_grads_params")
        assert "pre_forward" in names


def test_no_label_is_recorded_without_a_profiler(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[str] = []
    monkeypatch.setattr(torch.profiler, "record_function", opened.append)
    assert hooks.labelled("phase")(lambda x: x + 1)(1) == 2
    assert opened == []
