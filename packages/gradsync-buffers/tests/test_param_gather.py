"""The distributed optimizer's param all-gather: every rank ends with identical, complete params."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from buffers_testkit import buffers_for, model_parallel, toy_model

from gradsync.buffers import DistributedDataParallelConfig, shard_buffer
from gradsync.groups.testing import run_distributed


def gather_owned_shards(overlap: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    with model_parallel() as groups:
        model = toy_model(num_layers=4)
        config = DistributedDataParallelConfig(
            use_distributed_optimizer=True,
            overlap_grad_reduce=True,
            overlap_param_gather=overlap,
            bucket_size=700,
        )
        buffers = buffers_for(model, config, groups)
        (buffer,) = buffers.buffers
        assert buffer.param_data is not None
        for param in model.parameters():  # param.data is a view into the param buffer
            start, end, _ = buffer.param_index_map[param]
            assert param.data.data_ptr() == buffer.param_data[start:end].data_ptr()
        expected = torch.arange(buffer.numel, dtype=torch.float32)
        for bucket in buffer.buckets:
            assert bucket.param_data is not None
            for r, shard in enumerate(shard_buffer(bucket.param_data, world)):
                # This rank's shard holds the "updated" values; the others are stale garbage.
                target = shard_buffer(
                    expected[bucket.offset : bucket.offset + bucket.param_data.numel()], world
                )[r]
                shard.copy_(target if r == rank else torch.full_like(shard, -1.0 - rank))
        if overlap:
            # The forward pass starts at the last group (the model's first layers) and chains onward.
            last = buffers.bucket_groups[-1]
            last.finish_param_sync()
            for group in reversed(buffers.bucket_groups[:-1]):
                assert group.param_gather_dispatched
                group.finish_param_sync()
        else:
            buffers.start_param_sync()
        assert torch.equal(buffer.param_data, expected)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        assert all(torch.equal(g, flat) for g in gathered)
        records = [r for g in buffers.bucket_groups for r in g.stats.records]
        assert {r.op for r in records} == {"all_gather"}
        assert all(r.end is not None and r.group_size == world for r in records)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_leaves_identical_params(overlap: bool, world: int) -> None:
    run_distributed(gather_owned_shards, world, args=(overlap,))
