"""A unit's grads reach their buckets in its post-backward, one call per bucket (as torch FSDP2 takes a
param group's), not through a hook per grad: a backward makes as many Python calls into gradsync with four
layers per unit as with one. A grad that lands after its unit's post-backward (its param also used before
the unit, outside it) still counts: the backward's end takes it, and training matches one process."""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fsdp_testkit import DIM, STRATEGIES, make_optimizer, max_relative_difference, shard_index
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.fsdp import MegatronFSDP, MixedPrecisionPolicy, fully_shard_model
from gradsync.groups.testing import run_distributed, test_device

STEPS, ROWS = 3, 4


class Unit(nn.Sequential):
    """One FSDP unit of linear layers."""


def backward_calls(strategy: str, layers_per_unit: int) -> int:
    """The Python calls into gradsync's code during the second backward of a stack of 3 units."""
    torch.manual_seed(0)
    module = nn.Sequential(
        *(Unit(*(nn.Linear(DIM, DIM) for _ in range(layers_per_unit))) for _ in range(3))
    ).to(test_device())
    model = fully_shard_model(module, zero_dp_strategy=strategy, fsdp_unit_modules=[Unit])
    batch = torch.randn(ROWS, DIM, device=test_device()) * (dist.get_rank() + 1)
    model(batch).square().sum().backward()  # the first backward borrows buffers
    model.finish_grad_sync()
    model.zero_grad_buffer()
    loss = model(batch).square().sum()
    count = 0

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        nonlocal count
        count += event == "call" and "gradsync" in frame.f_code.co_filename

    sys.setprofile(profile)
    try:
        loss.backward()
    finally:
        sys.setprofile(None)
    return count


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_units_grads_cost_calls_per_bucket_not_per_grad(strategy: str) -> None:
    def calls(layers: int) -> list[int]:
        return run_distributed(backward_calls, 2, args=(strategy, layers))

    one, four = calls(1), calls(4)
    assert one[0] > 0
    assert one == four, (one, four)  # 18 more grads per rank, not one more call


class UsedBeforeItsUnit(nn.Module):
    """``unit``'s weight also feeds a branch before the unit runs, outside it: in backward its grad
    lands after the unit's post-backward has taken the unit's other grads."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(DIM, DIM)
        self.unit = Unit(nn.Linear(DIM, DIM))
        self.post = nn.Linear(DIM, 1)
        self.to(test_device())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.pre(x)
        branch = F.linear(x, self.unit[0].weight)  # the unit's weight, before the unit
        return self.post(torch.tanh(self.unit(hidden)) + branch).square().mean()


def batch(step: int, world: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(world * ROWS, DIM, generator=generator).to(test_device())


def reference(dtype: torch.dtype, world: int) -> dict[str, torch.Tensor]:
    """One process on the global batch; bf16 with fp32 main weights, as MegatronFSDP keeps them."""
    model = UsedBeforeItsUnit().to(dtype)
    params = list(model.parameters())
    mains = [nn.Parameter(p.detach().float()) for p in params]
    optimizer = make_optimizer(mains)
    for step in range(STEPS):
        model.zero_grad()
        model(batch(step, world).to(dtype)).backward()
        for main, param in zip(mains, params, strict=True):
            main.grad = param.grad.float()
        optimizer.step()
        with torch.no_grad():
            for main, param in zip(mains, params, strict=True):
                param.copy_(main)
    return {name: m.detach().cpu() for (name, _), m in zip(model.named_parameters(), mains, strict=True)}


def train_with_a_late_grad(strategy: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    config = DistributedDataParallelConfig(
        use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy, overlap_grad_reduce=True
    )
    model = MegatronFSDP(
        UsedBeforeItsUnit().to(dtype),
        shard_index(),
        config,
        fsdp_unit_modules=[Unit],
        mixed_precision_policy=MixedPrecisionPolicy(torch.float32, None, None),
    )
    optimizer = make_optimizer(model.parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(STEPS):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        model(batch(step, world)[rank * ROWS : (rank + 1) * ROWS].to(dtype)).backward()
        model.finish_grad_sync()
        optimizer.step()
        model.install_optimized_model_weights()
    return {r.name: r.sharded.full_tensor().float().cpu() for r in model.params}


@pytest.mark.parametrize(
    ("strategy", "dtype"),
    [("optim", torch.float32), ("optim_grads", torch.bfloat16)],  # a main_grad view; a borrowed buffer
)
def test_a_grad_landing_after_its_units_post_backward_counts(strategy: str, dtype: torch.dtype) -> None:
    """ZeRO-3 is left out: a weight used outside its unit is read while the unit is released."""
    want = reference(dtype, 2)
    bound = 1e-5 if dtype == torch.float32 else 2e-2
    for got in run_distributed(train_with_a_late_grad, 2, args=(strategy, dtype)):
        assert max_relative_difference(got, want) < bound, strategy
