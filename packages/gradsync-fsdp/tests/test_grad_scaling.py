"""Gradient scaling follows gradsync-buffers' one rule for both wrappers: grads are averaged over the
data-parallel group, or, with ``calculate_per_token_loss``, summed (the caller divides by the global
token count); per-token losses cannot be averaged in the collective, so that combination is refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from fsdp_testkit import (
    MICRO_ROWS,
    SEQ,
    STRATEGIES,
    TinyTransformer,
    full_weights,
    local_microbatches,
    make_optimizer,
    max_relative_difference,
    reference_training,
    shard_index,
)

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.fsdp import MegatronFSDP, fully_shard_model
from gradsync.groups.testing import run_distributed

STEPS = 3


def train_per_token(strategy: str) -> dict[str, torch.Tensor]:
    module = TinyTransformer()
    model = fully_shard_model(
        module, zero_dp_strategy=strategy, calculate_per_token_loss=True, sync_model_each_microbatch=False
    )
    optimizer = make_optimizer(model.parameters())
    tokens_per_rank = MICRO_ROWS * (SEQ - 1)
    for step in range(STEPS):
        batch = local_microbatches(step, dist.get_rank(), dist.get_world_size(), 1)[0]
        (model(batch) * tokens_per_rank).backward()  # the summed per-token loss of this rank
        model.finish_grad_sync()
        model.scale_gradients(1.0 / (tokens_per_rank * dist.get_world_size()))  # global token count
        optimizer.step()
        model.install_optimized_model_weights()
        model.zero_grad_buffer()
    return full_weights(model)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_per_token_loss_sums_grads_across_ranks(strategy: str) -> None:
    want = reference_training(2, 1, STEPS)
    for rank, weights in enumerate(run_distributed(train_per_token, 2, args=(strategy,))):
        assert max_relative_difference(weights, want) <= 1e-6, rank


def per_token_with_average() -> None:
    with pytest.raises(ValueError, match="average_in_collective=True cannot be combined with calculate_per"):
        fully_shard_model(TinyTransformer(), calculate_per_token_loss=True, average_in_collective=True)
    config = DistributedDataParallelConfig(use_megatron_fsdp=True, average_in_collective=True)
    with pytest.raises(ValueError, match="average_in_collective=True cannot be combined with calculate_per"):
        MegatronFSDP(TinyTransformer(), shard_index(), config, calculate_per_token_loss=True)


def test_per_token_loss_with_average_in_collective_is_refused() -> None:
    run_distributed(per_token_with_average, 2)
