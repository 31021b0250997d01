"""DistributedOptimizer behaves like a torch optimizer: LR schedulers and param_groups edits act on what is
stepped, weights loaded after it was built are never overwritten silently, and the clipping norm counts
every grad element once (a tied embedding across pipeline stages included)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ddp_testkit import TinyGPT, Trainer, flat_params, global_batch, max_relative_difference
from torch import nn
from torch.optim import lr_scheduler

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.ddp import DistributedDataParallel, DistributedOptimizer
from gradsync.groups import ModelParallelConfig, destroy_process_groups, initialize_model_parallel
from gradsync.groups.testing import run_distributed

STEPS = 8
SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "step": lambda opt: lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
    "lambda": lambda opt: lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)),
    "one-cycle": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS),
}
SHARDED = DistributedDataParallelConfig(
    use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=600
)
UNSHARDED = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=600)


def edit_groups(optimizer: torch.optim.Optimizer, step: int) -> None:
    if step == 4:
        for group in optimizer.param_groups:
            group["momentum"] = 0.5  # a param_groups edit mid-training must reach the stepped optimizer


def reference_with_scheduler(name: str, world: int) -> torch.Tensor:
    model = TinyGPT()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = SCHEDULERS[name](optimizer)
    for step in range(STEPS):
        optimizer.zero_grad()
        model(global_batch(step, world, 1)).backward()
        edit_groups(optimizer, step)
        optimizer.step()
        scheduler.step()
    return flat_params(model)


def train_with_scheduler(name: str, config: DistributedDataParallelConfig) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = Trainer.build(config, "sgd")
    optimizer = DistributedOptimizer(
        torch.optim.SGD(trainer.ddp.parameters(), lr=0.05, momentum=0.9), trainer.ddp
    )
    trainer.optimizer = optimizer
    assert isinstance(optimizer, torch.optim.Optimizer)
    scheduler = SCHEDULERS[name](optimizer)
    for step in range(STEPS):
        edit_groups(optimizer, step)
        trainer.step(step, rank, world, 1)
        scheduler.step()
    return trainer.full_params()


@pytest.mark.parametrize("config", [SHARDED, UNSHARDED], ids=["sharded", "unsharded"])
@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_lr_schedulers_and_param_group_edits(name: str, config: DistributedDataParallelConfig) -> None:
    got = run_distributed(train_with_scheduler, 2, args=(name, config))[0]
    assert max_relative_difference(got, reference_with_scheduler(name, 2)) <= 1e-6


def loading_weights_after_building(config: DistributedDataParallelConfig) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = Trainer.build(config, "sgd")
    if not isinstance(trainer.optimizer, DistributedOptimizer):  # the unsharded mixed-precision recipe
        trainer.optimizer = DistributedOptimizer(trainer.optimizer, trainer.ddp)
    pretrained = TinyGPT(seed=5).state_dict()
    trainer.ddp.load_state_dict(pretrained)
    with pytest.raises(RuntimeError, match="reload_model_params"):
        trainer.step(0, rank, world, 1)
    trainer.optimizer.reload_model_params()
    for step in range(STEPS):
        trainer.step(step, rank, world, 1)
    return trainer.full_params()


@pytest.mark.parametrize("config", [SHARDED, UNSHARDED], ids=["sharded", "unsharded"])
def test_weights_loaded_after_the_optimizer_was_built(config: DistributedDataParallelConfig) -> None:
    got = run_distributed(loading_weights_after_building, 2, args=(config,))[0]
    model = TinyGPT(seed=5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        optimizer.zero_grad()
        model(global_batch(step, 2, 1)).backward()
        optimizer.step()
    assert max_relative_difference(got, flat_params(model)) <= 1e-6


class Stage(nn.Module):
    """One pipeline stage holding its copy of a tied embedding (``shared_embedding`` on both stages)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(dist.get_rank())  # the two stages hold different weights, as real stages do
        self.tied = nn.Parameter(torch.randn(6, 4))
        self.tied.shared_embedding = True  # type: ignore[attr-defined]
        self.layer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.layer(x @ self.tied) ** 2).sum()


def norm_counts_the_tied_embedding_once(sharded: bool) -> tuple[float, float, float]:
    groups = initialize_model_parallel(pipeline_model_parallel_size=2)
    config = ModelParallelConfig(pipeline_model_parallel_size=2)
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(use_distributed_optimizer=sharded),
        Stage(),
        pg_collection=groups,
    )
    optimizer = DistributedOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1), ddp)
    ddp.zero_grad_buffer()
    ddp(torch.randn(3, 6, generator=torch.Generator().manual_seed(dist.get_rank()))).backward()
    ddp.finish_grad_sync()
    # After finalize both stages' tied copies hold the same summed grad; emulate that here.
    tied = ddp.module.tied
    dist.all_reduce(tied.main_grad, group=groups.embd)  # type: ignore[attr-defined]
    squares = torch.tensor([sum(float(p.main_grad.double().pow(2).sum()) for p in ddp.params_with_grad)])  # type: ignore[attr-defined]
    tied_squares = float(tied.main_grad.double().pow(2).sum())  # type: ignore[attr-defined]
    dist.all_reduce(squares)
    expected = math.sqrt(float(squares) - tied_squares)  # the tied grad once, not once per stage
    calls = []
    original = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_reduce = counting  # type: ignore[assignment]
    try:
        norm = optimizer.get_grad_norm()
    finally:
        dist.all_reduce = original
    assert len(calls) == 1  # one collective for the whole norm
    before = [p.main.grad.clone() for p in optimizer.pieces]  # type: ignore[union-attr]
    assert optimizer.clip_grad_norm(0.0) == pytest.approx(norm)
    assert all(torch.equal(p.main.grad, b) for p, b in zip(optimizer.pieces, before, strict=True))  # type: ignore[arg-type]
    clipped = optimizer.clip_grad_norm(norm / 4)
    after = optimizer.get_grad_norm()
    destroy_process_groups(groups)
    return norm, expected, after / clipped


@pytest.mark.parametrize("sharded", [False, True])
def test_grad_norm_counts_a_tied_embedding_once_and_max_norm_zero_does_not_clip(sharded: bool) -> None:
    for norm, expected, ratio in run_distributed(norm_counts_the_tied_embedding_once, 2, args=(sharded,)):
        assert norm == pytest.approx(expected, rel=1e-6)
        assert ratio == pytest.approx(0.25, rel=1e-4)


def state_dict_goes_to_the_saving_rank_only() -> tuple[int, int, int]:
    trainer = Trainer.build(SHARDED, "adam")
    trainer.step(0, dist.get_rank(), dist.get_world_size(), 1)
    gathers = []
    original = dist.gather

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if tensor.is_floating_point():  # the state's values (scalars such as `step` travel as bytes)
            gathers.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.gather = counting  # type: ignore[assignment]
    try:
        state = trainer.optimizer.state_dict()["state"]
    finally:
        dist.gather = original
    largest_bucket = max(b.grad_data.numel() for b in trainer.ddp.buffers[0].buckets)
    assert max(gathers) == largest_bucket // dist.get_world_size()  # one bucket's shard at a time
    assert all(
        v.device.type == "cpu" for entry in state.values() for v in entry.values() if torch.is_tensor(v)
    )
    assert len(gathers) == 3 * len(trainer.ddp.buffers[0].buckets)  # param, exp_avg, exp_avg_sq per bucket
    return len(state), len(trainer.ddp.params_with_grad), len(gathers)


def test_state_dict_is_gathered_bucket_by_bucket_to_rank_0() -> None:
    (saved, params, gathers), (elsewhere, _, _) = run_distributed(state_dict_goes_to_the_saving_rank_only, 2)
    assert saved == params
    assert elsewhere == 0
    assert gathers > 3
