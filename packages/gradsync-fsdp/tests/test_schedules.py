"""Schedules real training loops use, found by review: every forward before the backwards with auto-sync
and activation checkpointing; weights read after an optimizer step before any forward; a layer that gets
grads on one rank only (ranks must launch their reductions in one order), and zeroed twice in a row (the
second zeroing writes nothing unless grads were written); a backward after a step without
zero_grad_buffer() is refused instead of counting the stepped grads twice; reductions launch as buckets
complete, while the backward still runs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from fsdp_testkit import (
    STRATEGIES,
    Trainer,
    full_weights,
    local_microbatches,
    make_optimizer,
    max_relative_difference,
    reference_training,
    shard_index,
    wrap,
)
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.fsdp import MegatronFSDP, MixedPrecisionPolicy
from gradsync.groups.testing import run_distributed, test_device


def forwards_first_auto_sync(strategy: str, checkpoint: str) -> dict[str, torch.Tensor]:
    """A pipeline warm-up under auto-sync: the first backward ends with finish_grad_sync, and the second
    backward's recomputation must still find the compute params in the modules."""
    trainer = Trainer.build(strategy, checkpoint=checkpoint)
    model, rank, world = trainer.model, dist.get_rank(), dist.get_world_size()
    for step in range(2):
        model.zero_grad_buffer()
        trainer.optimizer.zero_grad()
        model.set_model_auto_sync(True)
        losses = [model(batch) / 2 for batch in local_microbatches(step, rank, world, 2)]
        for loss in losses:
            loss.backward()
        model.set_model_auto_sync(False)
        trainer.optimizer.step()
        model.install_optimized_model_weights()
    return full_weights(model)


@pytest.mark.parametrize("checkpoint", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_forwards_first_with_auto_sync_and_recomputation(strategy: str, checkpoint: str) -> None:
    want = reference_training(2, 2, 2)
    for rank, weights in enumerate(run_distributed(forwards_first_auto_sync, 2, args=(strategy, checkpoint))):
        assert max_relative_difference(weights, want) <= 1e-6, rank


def exported_before_and_after_a_forward(strategy: str, dtype: torch.dtype) -> float:
    model = wrap(strategy, dtype=dtype)
    optimizer = make_optimizer(model.parameters())
    batch = local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0]
    model(batch).backward()
    model.finish_grad_sync()
    optimizer.step()  # nobody installs: the export must
    before = model.full_state_dict(rank0_only=False)
    model.zero_grad_buffer()
    with torch.no_grad():
        model(batch)
    after = model.full_state_dict(rank0_only=False)
    return max(float((before[k].float() - after[k].float()).abs().max()) for k in after)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_weights_read_after_a_step_are_the_stepped_ones(strategy: str, dtype: torch.dtype) -> None:
    assert run_distributed(exported_before_and_after_a_forward, 2, args=(strategy, dtype)) == [0.0, 0.0]


WIDTH = 4


class SometimesUnused(nn.Module):
    """Three equal-sized buckets; ``third`` is used on some ranks only (data-dependent routing)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second, self.third = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.to(test_device(), dtype)

    def forward(self, x: torch.Tensor, use_third: bool) -> torch.Tensor:
        y = self.second(self.first(x))
        return (self.third(y) if use_third else y).square().sum()


def inputs(rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(rank)).to(test_device(), dtype)


def sometimes_unused(
    strategy: str, coalesced: bool, dtype: torch.dtype = torch.float32, **options: Any
) -> MegatronFSDP:
    """``coalesced``: each layer a unit, their three buckets reduced as one group. ``dtype``: the model's
    (bf16 gets Megatron's recipe: fp32 main weights and grads). ``options``: more of MegatronFSDP's
    arguments."""
    if dtype != torch.float32:
        options["mixed_precision_policy"] = MixedPrecisionPolicy(torch.float32, torch.float32)
    config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=strategy,
        overlap_grad_reduce=True,
        bucket_size=None if coalesced else WIDTH * WIDTH + WIDTH,
    )
    units = [nn.Linear] if coalesced else None
    model = MegatronFSDP(SometimesUnused(dtype), shard_index(), config, fsdp_unit_modules=units, **options)
    assert len(model.buckets) == 3
    assert len(model._hooks.reductions.groups) == (1 if coalesced else 3)
    return model


def grads_with_a_rank_skipping_a_layer(strategy: str, coalesced: bool) -> list[torch.Tensor]:
    model = sometimes_unused(strategy, coalesced)
    rank = dist.get_rank()
    model(inputs(rank), use_third=rank == 0).backward()
    model.finish_grad_sync()
    return [p.grad.full_tensor().cpu() if p.grad is not None else torch.zeros(0) for p in model.parameters()]


@pytest.mark.parametrize(
    ("strategy", "coalesced"), [("no_shard", False), ("no_shard", True), ("optim", True)]
)
def test_reductions_pair_up_when_a_layer_gets_grads_on_one_rank_only(strategy: str, coalesced: bool) -> None:
    reference = SometimesUnused()
    for rank in range(2):
        (reference(inputs(rank), use_third=rank == 0) / 2).backward()
    want = [p.grad.cpu() for p in reference.parameters()]
    for rank, got in enumerate(
        run_distributed(grads_with_a_rank_skipping_a_layer, 2, args=(strategy, coalesced))
    ):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"rank {rank}")


def grad_buffers_zeroed_twice(strategy: str, dtype: torch.dtype) -> dict[str, bool]:
    """The Megatron loop's habit under fully_shard_optimizer: ``optimizer.zero_grad()`` (which zeros the
    grad buffers) then ``model.zero_grad_buffer()``. The second zeroing is skipped only where nothing wrote
    the grads in between: not where a reduction alone filled a bucket (the third layer on rank 1, whose
    only grads come from rank 0 over the collective; per-token loss leaves the grads unscaled, so there the
    collective is the only write), nor where a user wrote through a view."""
    model = sometimes_unused(strategy, coalesced=False, dtype=dtype, calculate_per_token_loss=True)
    rank = dist.get_rank()
    grads = [bucket.grad for bucket in model.buckets]
    assert all(grad.dtype == torch.float32 for grad in grads)
    model.zero_grad_buffer()
    model(inputs(rank, dtype), use_third=rank == 0).backward()
    model.finish_grad_sync()
    filled = all(bool(grad.any()) for grad in grads if grad.numel())
    model.zero_grad_buffer()
    zeroed_after_reduction = not any(bool(grad.any()) for grad in grads)
    versions = [grad._version for grad in grads]
    model.zero_grad_buffer()
    skipped = [grad._version for grad in grads] == versions
    grads[-1][:1].fill_(1.0)
    model.zero_grad_buffer()
    zeroed_after_write = not any(bool(grad.any()) for grad in grads)
    return {
        "filled": filled,
        "zeroed after a reduction": zeroed_after_reduction,
        "second zeroing skipped": skipped,
        "zeroed after a write through a view": zeroed_after_write,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_second_zero_grad_buffer_writes_nothing_unless_grads_were_written(
    strategy: str, dtype: torch.dtype
) -> None:
    for rank, checks in enumerate(run_distributed(grad_buffers_zeroed_twice, 2, args=(strategy, dtype))):
        assert all(checks.values()), (rank, checks)


def backward_after_a_step_without_zeroing(strategy: str) -> str:
    model = wrap(strategy)
    optimizer = make_optimizer(model.parameters())
    batch = local_microbatches(0, dist.get_rank(), dist.get_world_size(), 1)[0]
    model(batch).backward()
    model.finish_grad_sync()
    optimizer.step()
    optimizer.zero_grad()  # the torch habit, which leaves MegatronFSDP's grad buffers as they are
    with pytest.raises(RuntimeError, match="without zero_grad_buffer") as caught:
        model(batch).backward()
    return str(caught.value)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_backward_after_a_step_without_zero_grad_buffer_is_refused(strategy: str) -> None:
    run_distributed(backward_after_a_step_without_zeroing, 2, args=(strategy,), reuse=False)


def launches_before_the_backward_reaches_the_embedding(strategy: str) -> list[tuple[int, int]]:
    """For two steps: how many reductions had launched when the backward reached the embedding's output
    (every block's grads are in by then), and how many launched in the whole backward."""
    model, rank, world = wrap(strategy), dist.get_rank(), dist.get_world_size()
    reductions = model._hooks.reductions
    launched: list[object] = []
    launch = reductions.launch

    def counted(group: Any) -> None:
        launched.append(group)
        launch(group)

    reductions.launch = counted  # type: ignore[method-assign]
    seen: list[int] = []

    def watch_embedding_output(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        out.register_hook(lambda grad: seen.append(len(launched)))  # type: ignore[no-untyped-call]

    model.module.embedding.register_forward_hook(watch_embedding_output)
    counts = []
    for step in range(2):
        model.zero_grad_buffer()
        model(local_microbatches(step, rank, world, 1)[0]).backward()
        model.finish_grad_sync()
        counts.append((seen[-1], len(launched)))
        launched.clear()
    return counts


def test_reductions_launch_during_the_backward_as_buckets_complete() -> None:
    """Overlap: under ZeRO-3 a unit's reduction launches once its last grad is in, before the backward
    ends (the other strategies coalesce this model's buckets into one reduction at its end)."""
    for rank, counts in enumerate(
        run_distributed(launches_before_the_backward_reaches_the_embedding, 2, args=("optim_grads_params",))
    ):
        for early, total in counts:
            assert 0 < early < total, (rank, counts)


def reductions_in_flight_at_the_vote(
    strategy: str, dtype: torch.dtype
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """For two steps: how many reductions were still in flight when ``finish_grad_sync()`` posted the step's
    vote; and the weights the steps trained."""
    trainer = Trainer.build(strategy, dtype=dtype)
    model, rank, world = trainer.model, dist.get_rank(), dist.get_world_size()
    reductions, ballot = model._hooks.reductions, model.steps.ballot
    post = ballot.post
    at_vote: list[int] = []

    def counted() -> Any:
        at_vote.append(len(reductions.in_flight))
        return post()

    ballot.post = counted  # type: ignore[method-assign]
    for step in range(2):
        model.zero_grad_buffer()
        trainer.optimizer.zero_grad()
        model(local_microbatches(step, rank, world, 1)[0]).backward()
        model.finish_grad_sync()
        trainer.optimizer.step()
        model.install_optimized_model_weights()
    return at_vote, full_weights(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_vote_goes_out_before_the_last_reduction_is_waited(strategy: str, dtype: torch.dtype) -> None:
    """no_shard and ZeRO-1 wait for the backward's reductions in ``finish_grad_sync()``, after the step's
    vote is posted, so its round trip overlaps theirs; ZeRO-2/3 wait at the backward's end, as the next
    backward adds into the same unreduced buffers. Training matches one process either way (bf16: bf16
    weights over fp32 main weights and grads, within test_mixed_precision's bound)."""
    want = reference_training(2, 1, 2, dtype)
    bound = 1e-6 if dtype == torch.float32 else 6e-3
    for rank, (at_vote, weights) in enumerate(
        run_distributed(reductions_in_flight_at_the_vote, 2, args=(strategy, dtype))
    ):
        if strategy in ("no_shard", "optim"):
            assert len(at_vote) == 2, (rank, at_vote)
            assert all(count > 0 for count in at_vote), (rank, at_vote)
        else:
            assert at_vote == [0, 0], rank
        assert max_relative_difference(weights, want) <= bound, rank
