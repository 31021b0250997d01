"""Several distributed-optimizer instances: force_all_reduce reduces whole buckets across instances, and
the across-instance all-reduce never blocks the backward hook that dispatches a group (gloo's wait blocks
the host, so the second collective is issued when the handle is waited)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from buffers_testkit import buffers_for, expected_grads, fill_local_grads, model_parallel, toy_model

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.groups.testing import run_distributed


def across_instances(force_all_reduce: bool) -> None:
    rank = dist.get_rank()
    config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, num_distributed_optimizer_instances=2
    )
    with model_parallel(num_distributed_optimizer_instances=2) as groups:
        buffers = buffers_for(toy_model(), config, groups)
        buffers.reset()
        fill_local_grads(buffers, rank)
        inter_calls: list[int] = []
        original = dist.all_reduce

        def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("group") is groups.inter_dist_opt:
                inter_calls.append(tensor.numel())
            return original(tensor, *args, **kwargs)

        dist.all_reduce = counting  # type: ignore[assignment]
        try:
            for group in buffers.all_bucket_groups:
                group.start_grad_sync(force_all_reduce)
            assert inter_calls == []  # nothing waited on (nor issued across instances) at dispatch
            for group in buffers.all_bucket_groups:
                group.finish_grad_sync(force_all_reduce)
        finally:
            dist.all_reduce = original
        (buffer,) = buffers.buffers
        intra = groups.intra_dp_cp
        assert intra is not None
        if force_all_reduce:
            assert inter_calls == [end - start for start, end in buffer.bucket_indices]  # whole buckets
            shard = None
        else:
            assert sum(inter_calls) == buffer.numel // intra.size()  # this rank's shards only
            shard = (intra.rank(), intra.size())
        expected = expected_grads(
            buffer, rank, range(dist.get_world_size()), 1 / dist.get_world_size(), average=False, shard=shard
        )
        assert torch.equal(buffer.grad_data, expected)


@pytest.mark.parametrize("force_all_reduce", [False, True])
def test_reductions_across_optimizer_instances(force_all_reduce: bool) -> None:
    run_distributed(across_instances, 4, args=(force_all_reduce,))
