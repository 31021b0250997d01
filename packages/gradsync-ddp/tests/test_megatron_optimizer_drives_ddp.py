"""A Megatron-style distributed optimizer drives gradsync's DDP through the attributes Megatron-Core's
DistributedOptimizer reads (distrib_optimizer.py at HEAD d98e8a64), and nothing else.

:class:`MegatronStyleShardOptimizer` follows Megatron's algorithm, written out here: every bucket's grad
buffer is split into ``bucket.grad_data.numel() // dp`` element shards (the layout's
``num_optimizer_shards`` must be the group size), a rank's main params are the pieces of
``buffer.param_index_map`` ranges inside its shard, their grads are read from ``param.main_grad``, the
stepped values are written into ``bucket.param_data`` at ``bucket.offset``-relative positions, and each
bucket group is gathered through the wrapper's ``_start_bucket_group_param_sync(group, force_sync=False)``
(or, with ``overlap_param_gather``, by the next forward's pre-hooks). Two ranks with different data must
end where one process trained on the global batch ends.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from ddp_testkit import (
    TinyGPT,
    flat_params,
    local_microbatches,
    make_optimizer,
    max_relative_difference,
    reference_training,
)

from gradsync.buffers import DistributedDataParallelConfig, ParamAndGradBucket
from gradsync.ddp import DistributedDataParallel
from gradsync.groups import ModelParallelConfig
from gradsync.groups.testing import run_distributed

STEPS, MICRO = 4, 2


@dataclass
class Piece:
    param: torch.nn.Parameter
    bucket: ParamAndGradBucket
    world: tuple[int, int]  # buffer coordinates of the piece
    within_param: tuple[int, int]  # the piece's range inside the flattened param
    main: torch.nn.Parameter


class MegatronStyleShardOptimizer:
    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.ddp = ddp
        self.pieces: list[Piece] = []
        for buffer in ddp.buffers + ddp.expert_parallel_buffers:
            group = buffer.data_parallel_group
            rank, size = group.rank(), group.size()
            assert buffer.num_optimizer_shards in (None, size)
            for bucket_index, bucket in enumerate(buffer.buckets):
                numel = bucket.grad_data.numel()
                assert numel % size == 0
                shard = numel // size
                lo, hi = bucket.offset + rank * shard, bucket.offset + (rank + 1) * shard
                for param, (start, end, bucket_id) in buffer.param_index_map.items():
                    a, b = max(start, lo), min(end, hi)
                    if bucket_id != bucket_index or a >= b:
                        continue
                    main = torch.nn.Parameter(param.detach().view(-1)[a - start : b - start].float().clone())
                    self.pieces.append(Piece(param, bucket, (a, b), (a - start, b - start), main))
        self.inner = make_optimizer("sgd", [piece.main for piece in self.pieces])

    def step(self) -> None:
        for piece in self.pieces:
            lo, hi = piece.within_param
            piece.main.grad = piece.param.main_grad.view(-1)[lo:hi].float()  # type: ignore[attr-defined]
        self.inner.step()
        with torch.no_grad():
            for piece in self.pieces:
                assert piece.bucket.param_data is not None
                a, b = piece.world
                offset = piece.bucket.offset
                piece.bucket.param_data.view(-1)[a - offset : b - offset].copy_(piece.main)
        if not self.ddp.ddp_config.overlap_param_gather:
            for group in self.ddp.bucket_groups + self.ddp.expert_parallel_bucket_groups:
                self.ddp._start_bucket_group_param_sync(group, force_sync=False)


def train(overlap_param_gather: bool) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        overlap_param_gather=overlap_param_gather,
        bucket_size=700,
    )
    model = TinyGPT()
    ddp = DistributedDataParallel(ModelParallelConfig(), config, model)
    assert len(ddp.bucket_groups) > 1  # several buckets, so the per-bucket coordinates matter
    optimizer = MegatronStyleShardOptimizer(ddp)
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        batches = local_microbatches(step, rank, world, MICRO)
        for index, batch in enumerate(batches):
            with ddp.no_sync() if index < len(batches) - 1 else nullcontext():
                (ddp(batch) / len(batches)).backward()
        ddp.finish_grad_sync()
        optimizer.step()
    if overlap_param_gather:
        ddp.disable_forward_pre_hook(param_sync=True)
    return flat_params(model)


@pytest.mark.parametrize("overlap_param_gather", [False, True])
def test_megatron_style_optimizer_trains_like_one_process(overlap_param_gather: bool) -> None:
    results = run_distributed(train, 2, args=(overlap_param_gather,))
    expected = reference_training("sgd", 2, MICRO, STEPS)
    assert not torch.equal(expected, flat_params(TinyGPT()))  # training moved the weights
    for params in results:
        assert max_relative_difference(params, expected) <= 1e-6
    assert torch.equal(results[0], results[1])
