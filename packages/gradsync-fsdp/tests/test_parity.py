"""Every strategy on 2 and 4 gloo ranks: 20 SGD-momentum steps of a tied-embedding transformer equal one
process on the concatenated global batch (fp32: max relative param difference <= 1e-6), and so does
gradient accumulation over 4 microbatches with no_sync / sync / set_model_auto_sync, or with every microbatch
reducing (no no_sync() at all, as torch DDP and FSDP2 users write it)."""

from __future__ import annotations

import functools

import pytest
import torch
from fsdp_testkit import STRATEGIES, Trainer, full_weights, max_relative_difference, reference_training

from gradsync.groups.testing import run_distributed

STEPS = 20


@functools.lru_cache(maxsize=8)
def reference(world: int, micro: int, steps: int) -> dict[str, torch.Tensor]:
    return reference_training(world, micro, steps)


def train(
    strategy: str, micro: int, steps: int, accumulation: str, config: dict[str, bool]
) -> dict[str, torch.Tensor]:
    trainer = Trainer.build(strategy, **config)
    for step in range(steps):
        trainer.step(step, micro, accumulation)
    return full_weights(trainer.model)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_matches_single_process(strategy: str, world: int) -> None:
    results = run_distributed(train, world, args=(strategy, 1, STEPS, "no_sync", {}))
    for rank, weights in enumerate(results):
        assert max_relative_difference(weights, reference(world, 1, STEPS)) <= 1e-6, rank


@pytest.mark.parametrize(
    "accumulation", ["no_sync", "sync", "auto", "deferred", "forwards_first", "always_sync", "plain"]
)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradient_accumulation_over_four_microbatches(strategy: str, accumulation: str) -> None:
    results = run_distributed(train, 2, args=(strategy, 4, 4, accumulation, {}))
    for rank, weights in enumerate(results):
        assert max_relative_difference(weights, reference(2, 4, 4)) <= 1e-6, rank


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_without_overlap_or_units(strategy: str) -> None:
    """Reductions at finish_grad_sync and gathers at install time, with every param outside units."""
    config = {"overlap_grad_reduce": False, "overlap_param_gather": False, "units": False}
    results = run_distributed(train, 2, args=(strategy, 2, 4, "no_sync", config))
    for rank, weights in enumerate(results):
        assert max_relative_difference(weights, reference(2, 2, 4)) <= 1e-6, rank
