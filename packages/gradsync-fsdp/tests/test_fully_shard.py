"""The megatron-fsdp user API: fully_shard with no mesh shards over the default group, keeps the
optimizer's param groups and hyper-parameters, and its patched step/zero_grad train like one process on
the global batch, with torch LR schedulers and AdamW on the DTensor shards."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from fsdp_testkit import (
    STRATEGIES,
    Block,
    TinyTransformer,
    full_weights,
    global_batch,
    local_microbatches,
    max_relative_difference,
    named_weights,
)
from torch import nn

from gradsync.fsdp import MegatronFSDP, fully_shard
from gradsync.groups.testing import run_distributed

STEPS = 4


def grouped_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    """Two groups with their own hyper-parameters: 1-D params without weight decay, at half the lr."""
    matrices = [p for p in model.parameters() if p.dim() > 1]
    vectors = [p for p in model.parameters() if p.dim() <= 1]
    groups: list[dict[str, Any]] = [
        {"params": matrices},
        {"params": vectors, "lr": 0.05, "weight_decay": 0.0},
    ]
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=0.01, eps=1e-4, weight_decay=0.1)
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=0.01)


def reference(kind: str, world: int) -> dict[str, torch.Tensor]:
    model = TinyTransformer()
    optimizer = grouped_optimizer(model, kind)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for step in range(STEPS):
        model(global_batch(step, world, 1)).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return named_weights(model)


def train(strategy: str, kind: str) -> dict[str, torch.Tensor]:
    module = TinyTransformer()
    model, optimizer = fully_shard(
        module, grouped_optimizer(module, kind), fsdp_unit_modules=[Block], zero_dp_strategy=strategy
    )
    assert isinstance(model, MegatronFSDP)
    assert model.model_auto_sync
    assert [g["lr"] for g in optimizer.param_groups] == [0.1 if kind == "sgd" else 0.01, 0.05]
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for step in range(STEPS):
        batch = local_microbatches(step, dist.get_rank(), dist.get_world_size(), 1)[0]
        model(batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return full_weights(model)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fully_shard_trains_like_one_process(strategy: str, kind: str) -> None:
    want = reference(kind, 2)
    for rank, weights in enumerate(run_distributed(train, 2, args=(strategy, kind))):
        assert max_relative_difference(weights, want) <= 1e-6, rank
