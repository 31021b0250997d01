"""gradsync-buffers' matrix optimizers under the distributed optimizer: with the shard-alignment policy
each needs (``tensor`` for Muon; ``block:RxC`` rows for BlockShampoo), the main params are whole params or
whole tile rows, each rank steps its own, and training equals one process with the same optimizer;
without a policy the pieces are flat and Muon refuses them by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from ddp_testkit import TinyGPT, flat_params, global_batch, local_microbatches, max_relative_difference
from torch import nn

from gradsync.buffers import BlockShampoo, DistributedDataParallelConfig, Muon, muon_param_groups
from gradsync.ddp import DistributedDataParallel, DistributedOptimizer
from gradsync.groups import ModelParallelConfig
from gradsync.groups.testing import RankFailure, run_distributed

DISTOPT = DistributedDataParallelConfig(
    use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=600
)
POLICIES = {
    "muon": {"*": "tensor"},
    "shampoo": {"mlp.*.weight": "block:4x8", "*.bias": "block:8", "*": "tensor"},
}


def make_optimizer(name: str, named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    # eps well above fp32 rounding noise, whose summation order differs between the runs compared
    if name == "muon":
        return Muon(muon_param_groups(named), lr=0.02, weight_decay=0.1, adamw_eps=1e-4)
    return BlockShampoo([p for _, p in named], lr=0.01, block_size=(4, 8), eps=1e-2, grafting_eps=1e-4)


def train(name: str, alignment: Any, steps: int) -> tuple[torch.Tensor, list[tuple[str, tuple[int, ...]]]]:
    model = TinyGPT(0)
    ddp = DistributedDataParallel(ModelParallelConfig(), DISTOPT, model, shard_alignment=alignment)
    optimizer = DistributedOptimizer(make_optimizer(name, list(ddp.named_parameters())), ddp)
    for step in range(steps):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        (batch,) = local_microbatches(step, dist.get_rank(), dist.get_world_size(), 1)
        ddp(batch).backward()
        ddp.finish_grad_sync()
        optimizer.step()
    return flat_params(model), [(p.name, tuple(p.main.shape)) for p in optimizer.pieces]


def reference(name: str, world: int, steps: int) -> torch.Tensor:
    model = TinyGPT(0)
    optimizer = make_optimizer(name, list(model.named_parameters()))
    for step in range(steps):
        optimizer.zero_grad()
        model(global_batch(step, world, 1)).backward()
        optimizer.step()
    return flat_params(model)


@pytest.mark.parametrize("name", ["muon", "shampoo"])
def test_matrix_optimizers_train_like_one_process(name: str) -> None:
    want = reference(name, 2, 4)
    results = run_distributed(train, 2, args=(name, POLICIES[name], 4))
    for rank, (got, _) in enumerate(results):
        assert max_relative_difference(got, want) <= 1e-6, rank
    if name == "shampoo":  # the MLP weights are cut between the ranks, on whole tile rows
        pieces = [piece for _, owned in results for piece in owned]
        assert [shape for n, shape in pieces if n == "mlp.0.weight"] == [(32, 16), (32, 16)]
        assert [shape for n, shape in pieces if n == "mlp.2.weight"] == [(8, 64), (8, 64)]


def test_muon_refuses_flat_pieces() -> None:
    with pytest.raises(RankFailure, match="sharded with shard_alignment 'row', which may cut it"):
        run_distributed(train, 2, args=("muon", None, 1), reuse=False)


@pytest.mark.parametrize(
    ("name", "alignment", "message"),
    [
        ("muon", {"*.weight": "block:4x16", "*": "tensor"}, "shard_alignment='tensor'"),
        ("shampoo", None, "may cut its 4x8 tiles: shard it with shard_alignment='block:4x8'"),
    ],
)
def test_parts_of_params_are_refused_not_stepped(name: str, alignment: Any, message: str) -> None:
    """Whole rows of a matrix (a ``block`` policy) are not a matrix for Muon, and a flat piece is no
    tile for BlockShampoo: both refuse the policy, on every rank, before any piece is built."""
    with pytest.raises(RankFailure, match=message):
        run_distributed(train, 2, args=(name, alignment, 1), reuse=False)


def checkpoint_shampoo() -> str:
    model = TinyGPT(0)
    ddp = DistributedDataParallel(ModelParallelConfig(), DISTOPT, model, shard_alignment=POLICIES["shampoo"])
    optimizer = DistributedOptimizer(make_optimizer("shampoo", list(ddp.named_parameters())), ddp)
    ddp.zero_grad_buffer()
    (batch,) = local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)
    ddp(batch).backward()
    ddp.finish_grad_sync()
    optimizer.step()
    try:
        optimizer.sharded_state_dict()
    except ValueError as error:
        return str(error)
    return "saved"


def test_per_tile_state_is_refused_by_ddp_checkpoints() -> None:
    """BlockShampoo's statistics are per tile of each rank's piece: gradsync-ddp's per-param checkpoint
    entries cannot hold them, so every rank refuses before any collective (gradsync-fsdp's DCP can)."""
    for message in run_distributed(checkpoint_shampoo, 2):
        assert "cannot reshard it" in message
