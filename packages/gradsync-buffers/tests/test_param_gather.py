"""The distributed optimizer's param all-gather: every rank ends with identical, complete params."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from buffers_testkit import buffers_for, device, model_parallel, toy_model, with_and_without_probe
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig, GradBuffers, shard_buffer
from gradsync.groups.testing import run_distributed


def gather_owned_shards(overlap: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    with model_parallel() as groups:
        built: list[tuple[nn.Sequential, GradBuffers]] = []

        def run() -> list[torch.Tensor]:
            model = toy_model(num_layers=4)
            config = DistributedDataParallelConfig(
                use_distributed_optimizer=True,
                overlap_grad_reduce=True,
                overlap_param_gather=overlap,
                bucket_size=700,
            )
            buffers = buffers_for(model, config, groups)
            built.append((model, buffers))
            (buffer,) = buffers.buffers
            assert buffer.param_data is not None
            # This rank's shard of each bucket holds the "updated" values; the others are stale garbage.
            for bucket in buffer.buckets:
                assert bucket.param_data is not None
                updated = shard_buffer(
                    updated_params(buffer.numel)[bucket.offset :][: bucket.param_data.numel()], world
                )
                for r, shard in enumerate(shard_buffer(bucket.param_data, world)):
                    shard.copy_(updated[r] if r == rank else torch.full_like(shard, -1.0 - rank))
            if overlap:
                # The forward pass starts at the last group (the model's first layers) and chains onward.
                last = buffers.bucket_groups[-1]
                last.finish_param_sync()
                for group in reversed(buffers.bucket_groups[:-1]):
                    assert group.param_gather_dispatched
                    group.finish_param_sync()
            else:
                buffers.start_param_sync()
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            return [buffer.param_data, flat]

        gathered_buffer, flat = with_and_without_probe(run, seed=rank)
        model, buffers = built[0]
        (buffer,) = buffers.buffers
        assert len(buffers.bucket_groups) > 1
        for param in model.parameters():  # param.data is a view into the param buffer
            start, end, _ = buffer.param_index_map[param]
            assert param.data.data_ptr() == buffer.param_data[start:end].data_ptr()  # type: ignore[index]
        assert torch.equal(gathered_buffer, updated_params(buffer.numel))
        expected_flat = torch.cat(
            [
                updated_params(buffer.numel)[start:end]
                for start, end, _ in (buffer.param_index_map[p] for p in model.parameters())
            ]
        )
        assert torch.equal(flat, expected_flat)
        records = [r for g in buffers.bucket_groups for r in g.stats.records]
        assert {r.op for r in records} == {"all_gather"}
        assert all(r.end is not None and r.group_size == world for r in records)


def updated_params(numel: int) -> torch.Tensor:
    """The params after the optimizer step, as every rank must see them once gathered."""
    return torch.arange(numel, dtype=torch.float32, device=device())


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_leaves_identical_params(overlap: bool, world: int) -> None:
    run_distributed(gather_owned_shards, world, args=(overlap,))
