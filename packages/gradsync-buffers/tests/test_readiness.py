"""Readiness with overlap_grad_reduce: golden counts, dispatch on the last grad, and the errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from buffers_testkit import (
    buffers_for,
    emulate_backward,
    expected_grads,
    finish_first_iteration,
    model_parallel,
    rank_grad_of,
    toy_model,
    with_and_without_probe,
)

from gradsync.buffers import DistributedDataParallelConfig, GradBuffers
from gradsync.groups.testing import run_distributed

OVERLAP = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=600)


def dispatch_the_moment_counts_match() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    built: list[GradBuffers] = []
    with model_parallel() as groups:

        def run() -> list[torch.Tensor]:
            model = toy_model(num_layers=3)
            buffers = buffers_for(model, OVERLAP, groups)
            built.append(buffers)
            groups_list = buffers.bucket_groups
            assert len(groups_list) == 3
            emulate_backward(buffers, model)  # first iteration: only counts
            assert not any(g.grad_reduce_dispatched for g in groups_list)
            buffers.finish_grad_sync()  # dispatch + wait everything
            buffers.reset()
            grad_of = rank_grad_of(buffers, rank)
            for name, param in reversed(list(model.named_parameters())):
                param.main_grad.add_(grad_of(param))  # type: ignore[attr-defined]
                (group,) = [g for g in groups_list if param in g.params]
                before = group.grad_reduce_dispatched
                group.register_grad_ready(param)
                last_of_group = all(p in group.per_param_grad_ready_counts for p in group.params)
                assert group.grad_reduce_dispatched == last_of_group, name
                assert not before
            buffers.finish_grad_sync()
            once = buffers.buffers[0].grad_data.clone()
            buffers.finish_grad_sync()  # idempotent within an iteration when overlapping
            assert torch.equal(buffers.buffers[0].grad_data, once)
            return [buffers.buffers[0].grad_data]

        (result,) = with_and_without_probe(run, seed=rank)
        (buffer,) = built[0].buffers
        expected = expected_grads(buffer, rank, range(world), 1.0 / world, average=False, shard=None)
        assert torch.equal(result, expected)


def test_groups_dispatch_when_their_last_grad_arrives() -> None:
    run_distributed(dispatch_the_moment_counts_match, 2)


def param_used_twice() -> None:
    with model_parallel() as groups:
        model = toy_model(num_layers=1, bias=False)
        (weight,) = model.parameters()
        buffers = buffers_for(model, OVERLAP, groups)
        (group,) = buffers.bucket_groups
        for _ in range(2):  # first iteration: the param is used twice per backward
            group.register_grad_ready(weight)
        buffers.finish_grad_sync()
        buffers.reset()
        assert group.golden_per_param_grad_ready_counts == {weight: 2}
        group.register_grad_ready(weight)
        assert not group.grad_reduce_dispatched
        group.register_grad_ready(weight)
        assert group.grad_reduce_dispatched
        buffers.finish_grad_sync()


def test_a_param_used_twice_is_dispatched_after_its_second_grad() -> None:
    run_distributed(param_used_twice, 2)


def never_ready_group_names_the_missing_param() -> None:
    with model_parallel() as groups:
        model = toy_model(num_layers=2)
        buffers = buffers_for(model, OVERLAP, groups)
        finish_first_iteration(buffers, model)
        emulate_backward(buffers, model, skip=frozenset({"0.weight"}))
        stuck = [g for g in buffers.bucket_groups if not g.grad_reduce_dispatched]
        assert len(stuck) == 1
        message = r"Communication call has not been issued for this bucket \(1/2 params have grad available\). Params that never got a grad: 0\.weight"
        with pytest.raises(RuntimeError, match=message):
            stuck[0].finish_grad_sync()
        for group in buffers.bucket_groups:
            if group is not stuck[0]:
                group.finish_grad_sync()


def test_a_group_that_never_becomes_ready_names_its_missing_params() -> None:
    run_distributed(never_ready_group_names_the_missing_param, 2)


def readiness_misuse() -> None:
    with model_parallel() as groups:
        model = toy_model(num_layers=2)
        plain = buffers_for(model, DistributedDataParallelConfig(), groups)
        with pytest.raises(
            RuntimeError,
            match=r"register_grad_ready\(\) should only be called when overlap_grad_reduce is True",
        ):
            plain.bucket_groups[0].register_grad_ready(next(model.parameters()))
        other = toy_model(num_layers=2)
        overlap = buffers_for(other, OVERLAP, groups)
        with pytest.raises(ValueError, match="Param is not in the bucket group"):
            overlap.bucket_groups[0].register_grad_ready(next(model.parameters()))
        emulate_backward(overlap, other, skip=frozenset({"1.bias"}))
        (group,) = [g for g in overlap.bucket_groups if other[1].bias in g.params]
        with pytest.raises(
            RuntimeError, match=r"params of a bucket group got no grad in the first iteration: 1\.bias"
        ):
            group.reset()


def test_readiness_misuse_is_reported() -> None:
    run_distributed(readiness_misuse, 1)


def no_sync_keeps_counting_off() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    with model_parallel() as groups:
        model = toy_model(num_layers=2)
        buffers = buffers_for(model, OVERLAP, groups)
        finish_first_iteration(buffers, model)
        for group in buffers.bucket_groups:
            group.is_last_microbatch = False  # what no_sync does
        emulate_backward(buffers, model, rank_grad_of(buffers, rank))
        assert not any(g.per_param_grad_ready_counts for g in buffers.bucket_groups)
        assert not any(g.grad_reduce_dispatched for g in buffers.bucket_groups)
        for group in buffers.bucket_groups:
            group.is_last_microbatch = True
        emulate_backward(buffers, model, rank_grad_of(buffers, rank))
        buffers.finish_grad_sync()
        (buffer,) = buffers.buffers
        once = expected_grads(buffer, rank, range(world), 1.0 / world, average=False, shard=None)
        assert torch.equal(buffer.grad_data, once * 2)  # both microbatches, reduced once


def test_microbatches_outside_the_last_only_accumulate() -> None:
    run_distributed(no_sync_keeps_counting_off, 2)
