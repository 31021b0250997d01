"""NaN/Inf checks name the rank, bucket and param of the local grads before their reduction, on every rank,
read once per step at finish_grad_sync (no host read per bucket in the backward); large grads warn."""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from buffers_testkit import buffers_for, device, model_parallel, toy_model

from gradsync.buffers import DistributedDataParallelConfig, LargeGradDetector
from gradsync.buffers.grad_checks import LocalGradNorms
from gradsync.groups.testing import run_distributed


def nan_and_inf_are_named(kind: str, bad_rank: int | None) -> None:
    """A non-finite grad on ``bad_rank`` (every rank when None): that rank names its param, the others
    name that rank; all raise at finish_grad_sync, and the next clean step passes (the norms are reset)."""
    rank = dist.get_rank()
    with model_parallel() as groups:
        model = toy_model(num_layers=3)
        buffers = buffers_for(model, DistributedDataParallelConfig(check_for_nan_in_grad=True), groups)
        if bad_rank in (None, rank):
            model[1].weight.main_grad[2, 3] = float("nan") if kind == "NaN" else float("inf")  # type: ignore[union-attr,operator]
            message = (
                rf"Rank {rank}, node .*, device {re.escape(str(device()))}: Unexpected result (nan|inf) "
                rf"\(message='found {kind} in local grad norm for bucket #0 in backward pass before "
                r"data-parallel communication collective'\); first offending param: 1\.weight"
            )
        else:
            message = rf"Rank {rank}, .*: rank\(s\) \[{bad_rank}\] found NaN or Inf in their local grad norm for bucket #0"
        with pytest.raises(RuntimeError, match=message):
            buffers.finish_grad_sync()
        buffers.reset()
        buffers.buffers[0].grad_data.fill_(1.0)
        buffers.finish_grad_sync()


@pytest.mark.parametrize("bad_rank", [None, 1])
@pytest.mark.parametrize("kind", ["NaN", "Inf"])
def test_non_finite_grads_raise_with_rank_bucket_and_param(kind: str, bad_rank: int | None) -> None:
    run_distributed(nan_and_inf_are_named, 2, args=(kind, bad_rank))


def host_reads_per_step(overlap: bool) -> tuple[int, int, int]:
    """Collectives the check adds plus host reads of tensors: while the backward's reductions launch, and
    in all after finish_grad_sync; and the number of bucket groups (one without overlap, one per bucket
    with it)."""
    with model_parallel() as groups:
        model = toy_model(num_layers=4)
        config = DistributedDataParallelConfig(
            check_for_nan_in_grad=True, overlap_grad_reduce=overlap, bucket_size=24 * 25
        )
        buffers = buffers_for(model, config, groups)
        events: list[str] = []
        gather, float_of = LocalGradNorms.gather, torch.Tensor.__float__

        def counted(self: LocalGradNorms, *args: Any) -> list[list[float]]:
            events.append("gather")
            return gather(self, *args)

        def read(tensor: torch.Tensor) -> float:
            events.append("read")
            return float_of(tensor)

        LocalGradNorms.gather = counted  # type: ignore[method-assign]
        torch.Tensor.__float__ = read  # type: ignore[assignment,method-assign]
        try:
            if overlap:
                for group in buffers.bucket_groups:
                    group.start_grad_sync()
            during = len(events)
            buffers.finish_grad_sync()
        finally:
            LocalGradNorms.gather = gather  # type: ignore[method-assign]
            torch.Tensor.__float__ = float_of  # type: ignore[method-assign]
        assert sum(len(group.buckets) for group in buffers.bucket_groups) > 1 or not overlap  # (one
        # bucket without overlap, as Megatron-Core)
        return during, len(events), len(buffers.bucket_groups)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_check_reads_norms_once_per_step(overlap: bool) -> None:
    for during, total, bucket_groups in run_distributed(host_reads_per_step, 2, args=(overlap,)):
        assert during == 0
        assert total == bucket_groups  # one gather per group (its host read is a .tolist())


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
