"""Ranks that disagree and user mistakes (world 2): every one raises by name on every rank, or works.

A config field or argument set on one rank only, replicas that start from different weights, an optimizer
step without ``finish_grad_sync()``, a rank that abandons its step (its backward raised and was caught,
or it ran none), a param frozen at wrap time and unfrozen later, a second wrapper over
params a live wrapper holds. Each rank catches what it raised and returns the message, so a test sees
every rank's outcome (a rank that hung would fail the call by its timeout)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ddp_testkit import (
    TinyGPT,
    Trainer,
    flat_params,
    local_microbatches,
    make_optimizer,
    max_relative_difference,
    reference_training,
)

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.buffers.step_ballot import is_vote_group
from gradsync.buffers.testing import ABANDONED_BY_RANK_ONE
from gradsync.ddp import DistributedDataParallel, DistributedOptimizer
from gradsync.groups import ModelParallelConfig
from gradsync.groups.testing import run_distributed, step_abandoned_on_rank_one

PLAIN = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=4000)
DISTOPT = dataclasses.replace(PLAIN, use_distributed_optimizer=True, overlap_param_gather=True)


def outcome(action: Callable[[], Any]) -> str:
    """``ok`` or the exception's type and message (so every rank's outcome comes back)."""
    try:
        action()
    except (ValueError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "ok"


def build_with_rank_one_differing(field: str, value: Any) -> str:
    config = dataclasses.replace(PLAIN, **({field: value} if dist.get_rank() == 1 else {}))
    return outcome(lambda: DistributedDataParallel(ModelParallelConfig(), config, TinyGPT()))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("check_for_nan_in_grad", True),  # hung in finish_grad_sync
        ("average_in_collective", True),  # replicas trained apart
        ("bucket_size", 1000),  # gloo aborted on a size mismatch
        ("use_distributed_optimizer", True),
    ],
)
def test_a_config_field_set_on_one_rank_raises_on_every_rank(field: str, value: Any) -> None:
    for message in run_distributed(build_with_rank_one_differing, 2, args=(field, value)):
        assert message.startswith("ValueError: DistributedDataParallel: data-parallel ranks 0 and 1"), message
        assert f"{field}=" in message


def unused_on_rank_one() -> str:
    unused = ("position",) if dist.get_rank() == 1 else ()
    return outcome(
        lambda: DistributedDataParallel(ModelParallelConfig(), PLAIN, TinyGPT(), unused_parameters=unused)
    )


def test_an_argument_given_on_one_rank_raises_on_every_rank() -> None:
    for message in run_distributed(unused_on_rank_one, 2):
        assert "unused_parameters=" in message, message


def trained_from_own_seeds(config: DistributedDataParallelConfig, init_sync: bool) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = TinyGPT(seed=rank)  # every rank seeds itself: the replicas start apart
    ddp = DistributedDataParallel(ModelParallelConfig(), config, model, init_sync=init_sync)
    optimizer: Any = make_optimizer("sgd", ddp.parameters())
    if config.use_distributed_optimizer:
        optimizer = DistributedOptimizer(optimizer, ddp)
    trainer = Trainer(model, ddp, optimizer)
    for step in range(3):
        trainer.step(step, rank, world, 1)
    return trainer.full_params()


@pytest.mark.parametrize("config", [PLAIN, DISTOPT], ids=["ddp", "distopt"])
def test_replicas_start_from_the_first_rank(config: DistributedDataParallelConfig) -> None:
    want = reference_training("sgd", 2, 1, 3)  # seed 0: rank 0's weights
    for rank, got in enumerate(run_distributed(trained_from_own_seeds, 2, args=(config, True))):
        assert max_relative_difference(got, want) <= 1e-5, rank


def test_without_init_sync_replicas_keep_their_own_weights() -> None:
    """The reference's behaviour, kept by ``init_sync=False``: the caller broadcasts (or not)."""
    first, second = run_distributed(trained_from_own_seeds, 2, args=(PLAIN, False))
    assert max_relative_difference(first, second) > 1e-2


def step_without_finish(config: DistributedDataParallelConfig) -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = Trainer.build(config, "sgd")
    trainer.ddp.zero_grad_buffer()
    trainer.ddp(local_microbatches(0, rank, world, 1)[0]).backward()
    before = flat_params(trainer.model)
    message = outcome(trainer.optimizer.step)
    assert torch.equal(flat_params(trainer.model), before)  # refused before anything moved
    trainer.ddp.finish_grad_sync()  # the fix the message names: then the same step runs
    assert outcome(trainer.optimizer.step) == "ok"
    return message


@pytest.mark.parametrize("config", [PLAIN, DISTOPT], ids=["ddp", "distopt"])
def test_a_step_without_finish_grad_sync_raises_on_every_rank(config: DistributedDataParallelConfig) -> None:
    for message in run_distributed(step_without_finish, 2, args=(config,)):
        assert message.startswith("RuntimeError: DistributedDataParallel: optimizer step after a backward")
        assert "finish_grad_sync()" in message


def unfrozen_after_wrapping(config: DistributedDataParallelConfig) -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = TinyGPT()
    model.position.requires_grad_(False)
    ddp = DistributedDataParallel(ModelParallelConfig(), config, model)
    optimizer: Any = make_optimizer("sgd", model.parameters())  # position among them: trained later
    if config.use_distributed_optimizer:
        optimizer = DistributedOptimizer(optimizer, ddp)
    model.position.requires_grad_(True)
    ddp.zero_grad_buffer()
    ddp(local_microbatches(0, rank, world, 1)[0]).backward()
    ddp.finish_grad_sync()
    return outcome(optimizer.step)


@pytest.mark.parametrize("config", [PLAIN, DISTOPT], ids=["ddp", "distopt"])
def test_a_param_unfrozen_after_wrapping_raises_by_name(config: DistributedDataParallelConfig) -> None:
    for message in run_distributed(unfrozen_after_wrapping, 2, args=(config,)):
        assert "param position had requires_grad=False when the wrapper was built" in message, message


def wrapped_twice() -> tuple[str, str]:
    model = TinyGPT()
    first = DistributedDataParallel(ModelParallelConfig(), PLAIN, model)
    refused = outcome(lambda: DistributedDataParallel(ModelParallelConfig(), PLAIN, model))
    del first
    gc.collect()
    return refused, outcome(lambda: DistributedDataParallel(ModelParallelConfig(), PLAIN, model))


def test_a_second_wrapper_over_live_wrapped_params_raises() -> None:
    for refused, after_drop in run_distributed(wrapped_twice, 2):
        assert "param position is held by a live DistributedDataParallel" in refused, refused
        assert after_drop == "ok"  # dropping the first frees the params


def abandoned_then_retried(
    config: DistributedDataParallelConfig, skip: str, dtype: torch.dtype = torch.float32
) -> tuple[str, torch.Tensor]:
    """Step 0; step 1 abandoned on rank 1 (``skip``: its backward raised and was caught, its loss raised
    before any backward, it synced with no backward or no forward either, or it stepped the optimizer
    after a forward with neither backward nor sync); every rank catches what it raised and takes step 1
    again, then step 2."""
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = Trainer.build(config, "sgd", dtype=dtype)
    trainer.step(0, rank, world, 1)
    trainer.ddp.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    (batch,) = local_microbatches(1, rank, world, 1)
    stepping = skip == "step_without_backward"

    def sync() -> None:
        if not stepping or rank == 0:
            trainer.ddp.finish_grad_sync()
        if stepping:
            trainer.optimizer.step()

    raised = step_abandoned_on_rank_one(
        "no_backward" if stepping else skip,
        trainer.model.attention,
        lambda: trainer.ddp(batch),
        sync,
        trainer.ddp.zero_grad_buffer,
    )
    message = f"{type(raised).__name__}: {raised}"
    trainer.step(1, rank, world, 1)
    trainer.step(2, rank, world, 1)
    return message, trainer.full_params()


@pytest.mark.parametrize("skip", ["raised", "loss_raised", "no_backward"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
@pytest.mark.parametrize("config", [PLAIN, DISTOPT], ids=["ddp", "distopt"])
def test_a_rank_that_abandons_its_step_makes_every_rank_raise_and_leaves_no_trace(
    config: DistributedDataParallelConfig, overlap: bool, skip: str
) -> None:
    """Rank 1 completes the reductions it left so rank 0 does not wait; both raise by name before any
    step; retried, training matches one process on the whole batch."""
    config = dataclasses.replace(
        config, overlap_grad_reduce=overlap, overlap_param_gather=overlap and config.overlap_param_gather
    )
    (waited, params0), (abandoned, params1) = run_distributed(
        abandoned_then_retried, 2, args=(config, skip), timeout=90
    )
    who = "AbandonedStepError: DistributedDataParallel"
    assert waited.startswith(f"{who}: rank(s) [1] of the data-parallel group abandoned this step"), waited
    reason = ABANDONED_BY_RANK_ONE[skip]
    assert abandoned.startswith(f"{who}: rank 1 abandoned this step: {reason}"), abandoned
    want = reference_training("sgd", 2, 1, 3)
    for got in (params0, params1):
        assert max_relative_difference(got, want) <= 1e-6


@pytest.mark.parametrize("skip", ["no_forward", "step_without_backward"])
@pytest.mark.parametrize("config", [PLAIN, DISTOPT], ids=["ddp", "distopt"])
def test_a_rank_that_skips_its_batch_makes_every_rank_raise(
    config: DistributedDataParallelConfig, skip: str
) -> None:
    """A batch skipped whole (sync with no forward), or one whose forward ran and whose backward and sync
    were skipped before an optimizer step: the step would move rank 1's weights alone."""
    test_a_rank_that_abandons_its_step_makes_every_rank_raise_and_leaves_no_trace(config, True, skip)


def trained_without_a_fault(config: DistributedDataParallelConfig, dtype: torch.dtype) -> torch.Tensor:
    trainer = Trainer.build(config, "sgd", dtype=dtype)
    for step in range(3):
        trainer.step(step, dist.get_rank(), dist.get_world_size(), 1)
    return trainer.full_params()


@pytest.mark.parametrize("config", [PLAIN, DISTOPT], ids=["ddp", "distopt"])
def test_an_abandoned_bf16_step_leaves_no_trace(config: DistributedDataParallelConfig) -> None:
    """bf16 params and grads: after the abandoned step is caught and retried, the weights are bit-identical
    to a run in which no rank abandoned anything."""
    outcomes = run_distributed(abandoned_then_retried, 2, args=(config, "raised", torch.bfloat16), timeout=90)
    clean = run_distributed(trained_without_a_fault, 2, args=(config, torch.bfloat16))
    for (message, got), want in zip(outcomes, clean, strict=True):
        assert message.startswith("AbandonedStepError: DistributedDataParallel: rank"), message
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, want)


def votes_then_abandoned_without_them(check: bool) -> tuple[int, str]:
    """The votes one healthy step casts; then, with ``check_abandoned_steps`` off, rank 1 syncs with no
    backward (rank 0 stops after its backward: nothing would come to end its reduction)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    # no overlap: rank 0's backward launches no reduction that rank 1 would leave in flight
    config = dataclasses.replace(PLAIN, overlap_grad_reduce=False, check_abandoned_steps=check)
    trainer = Trainer.build(config, "sgd")
    votes: list[int] = []
    original = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        votes.extend([1] if is_vote_group(kwargs.get("group")) else [])
        return original(*args, **kwargs)

    dist.all_reduce = counting  # type: ignore[assignment]
    try:
        trainer.step(0, rank, world, 1)
    finally:
        dist.all_reduce = original
    if check:
        return len(votes), ""
    trainer.ddp.zero_grad_buffer()
    loss = trainer.ddp(local_microbatches(1, rank, world, 1)[0])
    if rank == 0:
        loss.backward()
        return len(votes), "ran its backward"
    return len(votes), outcome(trainer.ddp.finish_grad_sync)


@pytest.mark.parametrize("check", [True, False])
def test_check_abandoned_steps_false_casts_no_vote_and_raises_alone(check: bool) -> None:
    """The opt-out: no vote per step, and a rank that abandons its step raises before any collective
    (completing them would let the others step on them unwarned)."""
    (votes0, ran), (votes1, refused) = run_distributed(votes_then_abandoned_without_them, 2, args=(check,))
    assert votes0 == votes1 == (1 if check else 0)
    if not check:
        assert ran == "ran its backward"
        assert refused.startswith(
            "AbandonedStepError: DistributedDataParallel: rank 1 abandoned this step"
        ), refused


def uneven_accumulation(config: DistributedDataParallelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0 accumulates three microbatches, rank 1 two (all but the last under no_sync()): gradsync-ddp
    communicates once per cycle, so nothing waits. This rank's synced grads, and the mean over ranks of
    each rank's own accumulated grads computed on a plain copy of the model."""
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = Trainer.build(config, "sgd")
    plain = TinyGPT()
    micro = 3 - rank
    batches = local_microbatches(0, rank, world, micro)
    for index, batch in enumerate(batches):
        with trainer.ddp.no_sync() if index < micro - 1 else contextlib.nullcontext():
            (trainer.ddp(batch) / micro).backward()
        (plain(batch) / micro).backward()
    trainer.ddp.finish_grad_sync()
    want = torch.cat([p.grad.flatten() for p in plain.parameters()])
    dist.all_reduce(want)
    got = torch.cat([p.main_grad.flatten() for p in trainer.model.parameters()])  # type: ignore[union-attr]
    return got, want / world


def test_uneven_accumulation_syncs_once_with_each_ranks_weighting() -> None:
    for rank, (got, want) in enumerate(run_distributed(uneven_accumulation, 2, args=(PLAIN,))):
        assert max_relative_difference(got, want) <= 1e-6, rank
