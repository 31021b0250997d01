"""Ranks that disagree and user mistakes under MegatronFSDP (world 2): each raises by name on every rank,
or works. A strategy, config field or unit list set on one rank only; replicas that start from different
weights; an optimizer step without ``finish_grad_sync()``; a rank that abandoned its step (its backward
raised and was caught, or it ran none); a param
frozen at wrap time and unfrozen later; a second wrapper over params a live wrapper holds; plain
``torch.save`` of the model's and the optimizer's state dicts. Each rank returns what it raised, so a test
sees every rank's outcome (a rank left waiting in a collective would fail the call by its timeout)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fsdp_testkit import (
    STRATEGIES,
    Block,
    TinyTransformer,
    Trainer,
    cached_reference,
    full_weights,
    local_microbatches,
    make_optimizer,
    max_relative_difference,
    reference_training,
    shard_index,
    wrap,
)
from torch.distributed.tensor import DTensor

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.buffers.testing import ABANDONED_BY_RANK_ONE
from gradsync.fsdp import MegatronFSDP, fully_shard, fully_shard_model
from gradsync.fsdp import fsdp2 as torch_style
from gradsync.groups.testing import run_distributed, step_abandoned_on_rank_one, test_device


def outcome(action: Callable[[], Any]) -> str:
    try:
        action()
    except (ValueError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "ok"


def on_rank_one(value: Any, otherwise: Any) -> Any:
    return value if dist.get_rank() == 1 else otherwise


def built_with_rank_one_differing(setting: str) -> str:
    strategy = on_rank_one("no_shard", "optim_grads_params") if setting == "strategy" else "optim"
    config: dict[str, Any] = {}
    if setting in ("check_for_nan_in_grad", "average_in_collective"):
        config[setting] = on_rank_one(True, False)
    if setting == "bucket_size":
        config[setting] = on_rank_one(1000, None)
    units = on_rank_one(False, True) if setting == "fsdp_unit_modules" else True
    return outcome(lambda: wrap(strategy, units=units, **config))


@pytest.mark.parametrize(
    ("setting", "field"),
    [
        ("strategy", "data_parallel_sharding_strategy"),  # hung in the gather lane's new_group
        ("check_for_nan_in_grad", "check_for_nan_in_grad"),  # hung in finish_grad_sync
        ("average_in_collective", "average_in_collective"),  # ZeRO-3 replicas agreed, wrongly
        ("bucket_size", "bucket_size"),  # gloo aborted on a size mismatch
        ("fsdp_unit_modules", "fsdp_unit_modules"),
    ],
)
def test_a_setting_on_one_rank_raises_on_every_rank_before_any_other_collective(
    setting: str, field: str
) -> None:
    for message in run_distributed(built_with_rank_one_differing, 2, args=(setting,), timeout=60):
        assert message.startswith("ValueError: MegatronFSDP: data-parallel ranks 0 and 1 were built"), message
        assert f"{field}=" in message


def trained_from_own_seeds(strategy: str, init_sync: bool) -> dict[str, torch.Tensor]:
    model = TinyTransformer(seed=dist.get_rank())  # every rank seeds itself: the replicas start apart
    config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=strategy,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
    )
    fsdp = MegatronFSDP(model, shard_index(), config, fsdp_unit_modules=[Block], init_sync=init_sync)
    trainer = Trainer(fsdp, make_optimizer(fsdp.parameters()))
    for step in range(3):
        trainer.step(step, 1)
    return full_weights(fsdp)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_replicas_start_from_the_first_rank(strategy: str) -> None:
    want = reference_training(2, 1, 3)  # seed 0: rank 0's weights
    for rank, got in enumerate(run_distributed(trained_from_own_seeds, 2, args=(strategy, True))):
        assert max_relative_difference(got, want) <= 1e-6, rank


def test_without_init_sync_replicas_keep_their_own_weights() -> None:
    """The reference's behaviour, kept by ``init_sync=False`` (no_shard: nothing else re-syncs them)."""
    first, second = run_distributed(trained_from_own_seeds, 2, args=("no_shard", False))
    assert max_relative_difference(first, second) > 1e-2


def step_without_finish(strategy: str) -> str:
    trainer = Trainer.build(strategy)
    trainer.model.zero_grad_buffer()
    trainer.model(local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0]).backward()
    before = full_weights(trainer.model)
    message = outcome(trainer.optimizer.step)
    after = full_weights(trainer.model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # refused before anything moved
    trainer.model.finish_grad_sync()  # the fix the message names: then the same step runs
    assert outcome(trainer.optimizer.step) == "ok"
    return message


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_step_without_finish_grad_sync_raises_on_every_rank(strategy: str) -> None:
    for message in run_distributed(step_without_finish, 2, args=(strategy,)):
        assert message.startswith("RuntimeError: MegatronFSDP: optimizer step after a backward"), message


def abandoned_then_retried(
    strategy: str, skip: str, outer: int = 1, dtype: torch.dtype = torch.float32
) -> tuple[str, dict[str, torch.Tensor]]:
    """Step 0; step 1 abandoned on rank 1 (``skip``: its backward raised and was caught, its loss raised
    before any backward, it synced with none, or with no forward either); every rank catches what it raised and takes step 1
    again, then step 2."""
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = Trainer.build(strategy, outer=outer, dtype=dtype)
    trainer.step(0, 1)
    trainer.model.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    (batch,) = local_microbatches(1, rank, world, 1)
    raised = step_abandoned_on_rank_one(
        skip,
        trainer.model.module.blocks[0],
        lambda: trainer.model(batch),
        trainer.model.finish_grad_sync,
        trainer.model.zero_grad_buffer,
    )
    message = f"{type(raised).__name__}: {raised}"
    trainer.step(1, 1)
    trainer.step(2, 1)
    return message, full_weights(trainer.model)


@pytest.mark.parametrize("skip", ["raised", "loss_raised", "no_backward", "no_forward"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_rank_that_abandons_its_step_makes_every_rank_raise_and_leaves_no_trace(
    strategy: str, skip: str
) -> None:
    """Rank 1 completes the step's collectives (gathers its backward did not reach, every reduction) so
    rank 0 does not wait; both raise by name before any step; retried, training matches one process."""
    check_every_rank_raised(
        run_distributed(abandoned_then_retried, 2, args=(strategy, skip), timeout=15), skip
    )


def trained_without_a_fault(strategy: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    trainer = Trainer.build(strategy, dtype=dtype)
    for step in range(3):
        trainer.step(step, 1)
    return full_weights(trainer.model)


@pytest.mark.parametrize(
    ("strategy", "skip"),
    [("no_shard", "raised"), ("optim_grads_params", "raised"), ("optim_grads_params", "no_forward")],
)
def test_an_abandoned_bf16_step_leaves_no_trace(strategy: str, skip: str) -> None:
    """A bf16 model (fp32 main weights): after the abandoned step is caught and retried, the weights are
    bit-identical to a run in which no rank abandoned anything (``no_forward``: the rank that skipped the
    batch issued the forward's bf16 gathers itself)."""
    runs = run_distributed(abandoned_then_retried, 2, args=(strategy, skip, 1, torch.bfloat16), timeout=15)
    clean = run_distributed(trained_without_a_fault, 2, args=(strategy, torch.bfloat16))
    for (message, got), want in zip(runs, clean, strict=True):
        assert message.startswith("AbandonedStepError: MegatronFSDP: rank"), message
        assert got.keys() == want.keys()
        assert all(torch.equal(got[name], want[name]) for name in want)


def test_under_hsdp_every_replica_raises() -> None:
    """Two ZeRO-3 replicas of two ranks: rank 1's shard peer and the other replica, whose outer
    reduction its abandoned step also leaves, raise with it."""
    runs = run_distributed(abandoned_then_retried, 4, args=("optim_grads_params", "raised", 2), timeout=120)
    check_every_rank_raised(runs, "raised")


def check_every_rank_raised(runs: list[tuple[str, dict[str, torch.Tensor]]], skip: str) -> None:
    reason = ABANDONED_BY_RANK_ONE[skip]
    want = cached_reference(len(runs), 1, 3)
    for rank, (message, weights) in enumerate(runs):
        if rank == 1:
            assert message.startswith(
                f"AbandonedStepError: MegatronFSDP: rank 1 abandoned this step: {reason}"
            )
        else:
            assert message.startswith("AbandonedStepError: MegatronFSDP: rank(s) [1] of the data-parallel"), (
                message
            )
        assert max_relative_difference(weights, want) <= 1e-6


def unfrozen_after_wrapping(strategy: str) -> str:
    module = TinyTransformer()
    module.norm.weight.requires_grad_(False)
    model, optimizer = fully_shard(
        module, make_optimizer(module.parameters()), fsdp_unit_modules=[Block], zero_dp_strategy=strategy
    )
    module.norm.weight.requires_grad_(True)
    model.zero_grad_buffer()
    model(local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0]).backward()
    return outcome(optimizer.step)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_param_unfrozen_after_wrapping_raises_by_name(strategy: str) -> None:
    for message in run_distributed(unfrozen_after_wrapping, 2, args=(strategy,)):
        assert "param norm.weight had requires_grad=False when the wrapper was built" in message, message


def wrapped_twice() -> str:
    module = TinyTransformer()
    fully_shard_model(module, fsdp_unit_modules=[Block], zero_dp_strategy="optim")
    return outcome(lambda: fully_shard_model(module, fsdp_unit_modules=[Block], zero_dp_strategy="optim"))


def test_a_second_wrapper_over_live_wrapped_params_raises() -> None:
    """The module's params are the first wrapper's DTensors, which hold it: it lives as long as the
    module, so the module cannot be wrapped again (gradsync-ddp's test drops a wrapper and re-wraps)."""
    for refused in run_distributed(wrapped_twice, 2):
        assert "is held by a live MegatronFSDP" in refused, refused


def wrapped_twice_with_a_device(strategy: str) -> tuple[str, list[float]]:
    """What the second wrapper raised, and the first one's loss over two steps after it (it must train
    on: the refused wrapper moved nothing)."""
    module = TinyTransformer()
    config = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy)
    first = MegatronFSDP(module, shard_index(), config, fsdp_unit_modules=[Block])
    refused = outcome(
        lambda: MegatronFSDP(module, shard_index(), config, fsdp_unit_modules=[Block], device=test_device())
    )
    trainer = Trainer(first, make_optimizer(first.parameters()))
    losses = []
    for step in range(2):
        trainer.step(step, 1)
        with torch.no_grad():
            losses.append(float(first(local_microbatches(0, dist.get_rank(), 2, 1)[0])))
    return refused, losses


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_a_second_wrapper_given_a_device_raises_on_every_rank(strategy: str) -> None:
    """It moved the module first, which swapped the first wrapper's params for unmarked copies: nothing
    was refused, and the init broadcast crashed inside torch."""
    for refused, losses in run_distributed(wrapped_twice_with_a_device, 2, args=(strategy,)):
        assert "ValueError: MegatronFSDP: param embedding.weight is held by a live MegatronFSDP" in refused
        assert losses[1] < losses[0], losses


def moved_after_wrapping() -> tuple[str, str]:
    """What moving the wrapper raises, then what the next forward after moving the wrapped module
    raises."""
    model = wrap("optim_grads_params")
    moved_wrapper = outcome(lambda: model.to(test_device()))
    model.module.to(test_device())  # the same device: torch still swaps every param for a copy
    return moved_wrapper, outcome(lambda: model(local_microbatches(0, dist.get_rank(), 2, 1)[0]))


def test_moving_the_model_after_wrapping_raises_by_name() -> None:
    """Both went through silently: the params lost their marks (no step guard, no step tracking, no
    checkpoint chunks), and a move to another device left the optimizer stepping copies."""
    for moved_wrapper, next_forward in run_distributed(moved_after_wrapping, 2):
        assert "NotImplementedError: MegatronFSDP: moving or casting the model" in moved_wrapper
        assert "before wrapping" in moved_wrapper
        assert "RuntimeError: MegatronFSDP: param embedding.weight of the wrapped module is a copy" in (
            next_forward
        )


def assert_as_saved(loaded: Any, saved: Any, where: str = "") -> None:
    """``loaded`` holds what ``saved`` held: DTensors of the same class and placements (a RaggedDTensor's
    true split too) with equal local shards, equal tensors, equal other values."""
    if isinstance(saved, dict):
        assert loaded.keys() == saved.keys(), where
        for key in saved:
            assert_as_saved(loaded[key], saved[key], f"{where}/{key}")
    elif isinstance(saved, (list, tuple)):
        assert len(loaded) == len(saved), where
        for index, (got, want) in enumerate(zip(loaded, saved, strict=True)):
            assert_as_saved(got, want, f"{where}/{index}")
    elif isinstance(saved, DTensor):
        assert type(loaded) is type(saved), (where, type(loaded))
        assert loaded.placements == saved.placements, where
        assert getattr(loaded, "ragged_placements", None) == getattr(saved, "ragged_placements", None), where
        assert torch.equal(loaded.to_local(), saved.to_local()), where
    elif isinstance(saved, torch.Tensor):
        assert torch.equal(loaded, saved), where
    else:
        assert loaded == saved, where


def saved_with_torch_save(strategy: str, directory: str) -> dict[str, torch.Tensor]:
    """Two steps, ``torch.save`` of both state dicts, then a fresh wrapper loads them (``torch.load``)
    and takes two more steps; what it ends with."""
    rank = dist.get_rank()

    def build() -> tuple[Any, Any]:
        module = TinyTransformer()
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
        return fully_shard(module, optimizer, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)

    def train(model: Any, optimizer: Any, steps: range) -> None:
        for step in steps:
            optimizer.zero_grad()
            model(local_microbatches(step, rank, 2, 1)[0]).backward()
            optimizer.step()

    model, optimizer = build()
    train(model, optimizer, range(2))
    path = Path(directory) / f"rank{rank}.pt"
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save(state, path)
    model, optimizer = build()
    saved = torch.load(path)  # torch's default: weights_only=True from torch 2.6
    assert_as_saved(saved, state)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    train(model, optimizer, range(2, 4))
    return full_weights(model)


def uninterrupted(strategy: str) -> dict[str, torch.Tensor]:
    module = TinyTransformer()
    model, optimizer = fully_shard(
        module,
        torch.optim.AdamW(module.parameters(), lr=1e-2),
        fsdp_unit_modules=[Block],
        zero_dp_strategy=strategy,
    )
    for step in range(4):
        optimizer.zero_grad()
        model(local_microbatches(step, dist.get_rank(), 2, 1)[0]).backward()
        optimizer.step()
    return full_weights(model)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_torch_save_of_both_state_dicts_resumes_exactly(strategy: str, tmp_path: Path) -> None:
    """It failed: a closure on the shards' checkpoint description (optim, ZeRO-3) and torch's DTensor
    pickling of views into a flat buffer (no_shard); then torch.load's default weights_only=True, which
    refused gradsync's classes (every strategy but no_shard)."""
    want = run_distributed(uninterrupted, 2, args=(strategy,))[0]
    for rank, got in enumerate(run_distributed(saved_with_torch_save, 2, args=(strategy, str(tmp_path)))):
        assert all(torch.equal(got[k], want[k]) for k in want), rank


def torch_style_saved(directory: str) -> dict[str, torch.Tensor]:
    rank = dist.get_rank()

    def build() -> tuple[TinyTransformer, torch.optim.Optimizer]:
        model = TinyTransformer()
        for block in model.blocks:
            torch_style.fully_shard(block)
        torch_style.fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(model: TinyTransformer, optimizer: torch.optim.Optimizer, steps: range) -> dict[str, Any]:
        for step in steps:
            model(local_microbatches(step, rank, 2, 1)[0]).backward()
            optimizer.step()
            optimizer.zero_grad()
        return {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}

    model, optimizer = build()
    train(model, optimizer, range(2))
    path = Path(directory) / f"rank{rank}.pt"
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save(state, path)
    model, optimizer = build()
    saved = torch.load(path)
    assert_as_saved(saved, state)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    resumed = train(model, optimizer, range(2, 4))
    model, optimizer = build()
    straight = train(model, optimizer, range(4))
    return {k: torch.tensor(float(torch.equal(resumed[k], straight[k]))) for k in straight}


def test_torch_save_under_the_fsdp2_api_resumes_exactly(tmp_path: Path) -> None:
    for rank, equal in enumerate(run_distributed(torch_style_saved, 2, args=(str(tmp_path),))):
        assert all(float(v) == 1.0 for v in equal.values()), (rank, equal)
