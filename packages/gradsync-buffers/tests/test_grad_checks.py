"""NaN/Inf checks name the rank, bucket and param before any collective; large grads warn."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.distributed as dist
from buffers_testkit import buffers_for, device, model_parallel, toy_model

from gradsync.buffers import DistributedDataParallelConfig, LargeGradDetector
from gradsync.groups.testing import run_distributed


def nan_and_inf_are_named(kind: str) -> None:
    rank = dist.get_rank()
    with model_parallel() as groups:
        model = toy_model(num_layers=3)
        buffers = buffers_for(model, DistributedDataParallelConfig(check_for_nan_in_grad=True), groups)
        model[1].weight.main_grad[2, 3] = float("nan") if kind == "NaN" else float("inf")  # type: ignore[union-attr,operator]
        message = (
            rf"Rank {rank}, node .*, device {re.escape(str(device()))}: Unexpected result (nan|inf) \(message='found {kind} in local "
            r"grad norm for bucket #0 in backward pass before data-parallel communication collective'\); "
            r"first offending param: 1\.weight"
        )
        with pytest.raises(RuntimeError, match=message):
            buffers.finish_grad_sync()
        assert not buffers.bucket_groups[0].grad_reduce_dispatched
        dist.barrier()  # every rank raised before communicating: still aligned


@pytest.mark.parametrize("kind", ["NaN", "Inf"])
def test_non_finite_grads_raise_with_rank_bucket_and_param(kind: str) -> None:
    run_distributed(nan_and_inf_are_named, 2, args=(kind,))


def large_grads_warn() -> None:
    with model_parallel() as groups:
        model = toy_model(num_layers=2)
        buffers = buffers_for(model, DistributedDataParallelConfig(check_for_large_grads=True), groups)
        (group,) = buffers.bucket_groups
        group.large_grad_detector = LargeGradDetector(warmup=3)
        for _ in range(3):
            buffers.reset()
            buffers.buffers[0].grad_data.fill_(1.0)
            buffers.finish_grad_sync()
        buffers.reset()
        buffers.buffers[0].grad_data.fill_(9.0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # 9x the largest seen: no warning
            buffers.finish_grad_sync()
        buffers.reset()
        buffers.buffers[0].grad_data.fill_(10.5)
        with pytest.warns(RuntimeWarning, match="found unexpected large grads in bucket #0"):
            buffers.finish_grad_sync()


def test_unexpectedly_large_grads_warn() -> None:
    run_distributed(large_grads_warn, 1)


def test_detector_ignores_non_finite_values() -> None:
    detector = LargeGradDetector(warmup=1)
    assert not detector.is_unexpectedly_large(float("nan"))
    assert not detector.is_unexpectedly_large(2.0)
    assert detector.is_unexpectedly_large(20.0)
    assert not detector.is_unexpectedly_large(19.0)
    assert torch.isfinite(torch.tensor(detector.max_seen))
