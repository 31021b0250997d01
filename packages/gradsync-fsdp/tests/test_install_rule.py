"""The install rule: after a torch optimizer steps the DTensor params, the next forward installs the
updated weights on every rank, with no ``install_optimized_model_weights()`` call (plain torch loops),
and a forward that follows no step installs nothing (no gather is spent on unchanged weights)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from fsdp_testkit import (
    STRATEGIES,
    full_weights,
    local_microbatches,
    make_optimizer,
    max_relative_difference,
    reference_training,
    wrap,
)

from gradsync.groups.testing import run_distributed

STEPS = 4


def train_without_install(strategy: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    model = wrap(strategy, dtype=dtype)
    optimizer = make_optimizer(model.parameters())
    for step in range(STEPS):
        batch = local_microbatches(step, dist.get_rank(), dist.get_world_size(), 1)[0]
        model(batch).backward()
        model.finish_grad_sync()
        optimizer.step()  # no install_optimized_model_weights(): the next forward must do it
        optimizer.zero_grad()
        model.zero_grad_buffer()
    with torch.no_grad():
        model(batch)  # installs the last step's update
    return full_weights(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_forward_after_a_step_installs_the_update_on_every_rank(strategy: str, dtype: torch.dtype) -> None:
    want = reference_training(2, 1, STEPS, dtype)
    results = run_distributed(train_without_install, 2, args=(strategy, dtype))
    bound = 1e-6 if dtype == torch.float32 else 1e-2
    for rank, weights in enumerate(results):
        assert max_relative_difference(weights, want) <= bound, rank
    assert max_relative_difference(results[0], results[1]) == 0.0


def gathers_per_forward(strategy: str) -> list[int]:
    """Bytes communicated by a forward: after a step, then again without a step in between."""
    model = wrap(strategy)
    optimizer = make_optimizer(model.parameters())
    batch = local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0]
    model(batch).backward()
    model.finish_grad_sync()
    optimizer.step()
    model.zero_grad_buffer()
    counts = []
    for _ in range(2):
        before = model.communicated_bytes()
        with torch.no_grad():
            model(batch)
        counts.append(model.communicated_bytes() - before)
    return counts


@pytest.mark.parametrize("strategy", ["optim", "optim_grads"])
def test_only_a_step_triggers_the_install(strategy: str) -> None:
    for after_step, again in run_distributed(gathers_per_forward, 2, args=(strategy,)):
        assert after_step > 0
        assert again == 0
