"""Every attribute Megatron-Core's DistributedOptimizer reads from a DDP wrapper's buffers, their buckets
and bucket groups (audited in megatron/core/optimizer/distrib_optimizer.py at HEAD d98e8a64, with the
helpers it calls: Megatron's own ``partition_buckets`` over the same buffers, ``get_megatron_optimizer``'s
buffer filter, the layer-wise bucket tag check and ``DistributedDataParallel._start_bucket_group_param_sync``).

Each value is checked against an independent computation from the params and the padding rules, on two
ranks with different values per rank:

- buffer: ``num_optimizer_shards`` (distrib_optimizer.py:219), ``data_parallel_group`` (rank, size),
  ``data_parallel_world_size``, ``ddp_config``, ``param_dtype`` / ``grad_dtype`` (the range-map keys),
  ``buckets``, ``params``, ``param_index_map`` ((start, end, bucket) with ``main_grad`` there),
  ``numel_unpadded``, ``param_indices``;
- bucket: ``grad_data`` (its numel divisible by the DP size), ``param_data``, ``offset``,
  ``numel_unpadded``, ``params_list`` / ``params``;
- bucket group: ``buckets``, ``params``, ``param_to_bucket``, ``start_param_sync(force_sync=...)`` and
  ``_post_param_sync()``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from buffers_testkit import buffers_for, device, model_parallel
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.groups.testing import run_distributed


def mixed_model(rank: int) -> nn.Module:
    """fp32 and bf16 params (two buffers), sizes that force start padding; values differ per rank."""
    torch.manual_seed(rank)
    model = nn.Module()
    model.a = nn.Linear(7, 5)
    model.b = nn.Linear(5, 3).to(torch.bfloat16)
    model.c = nn.Linear(3, 70)
    return model.to(device())


def pad(value: int, divisor: int) -> int:
    return -(-value // divisor) * divisor


def expected_layout(params: list[nn.Parameter], dp: int) -> tuple[dict[int, tuple[int, int]], int, int]:
    """Megatron's distributed-optimizer layout of one single-bucket buffer, from its rules alone: params
    in reverse order, each start padded to 64 elements, the bucket end to lcm(dp, 128)."""
    spans, cursor = {}, 0
    for index in reversed(range(len(params))):
        start = pad(cursor, 64)
        spans[index] = (start, start + params[index].numel())
        cursor = start + params[index].numel()
    divisor = dp * 128 // torch.gcd(torch.tensor(dp), torch.tensor(128)).item()
    return spans, cursor, pad(cursor, int(divisor))


def check_reads(sharded: bool) -> dict[str, Any]:
    rank, dp = dist.get_rank(), dist.get_world_size()
    model = mixed_model(rank)
    config = DistributedDataParallelConfig(use_distributed_optimizer=sharded, grad_reduce_in_fp32=True)
    failures: list[str] = []

    def expect(ok: bool, what: str) -> None:
        if not ok:
            failures.append(what)

    with model_parallel() as groups:
        built = buffers_for(model, config, groups)
        trainable = dict(model.named_parameters())
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for param in trainable.values():
            by_dtype.setdefault(param.dtype, []).append(param)
        expect(len(built.buffers) == len(by_dtype), "one buffer per param dtype")
        for buffer in built.buffers:
            params = by_dtype[buffer.param_dtype]
            expect(buffer.params == params, "buffer.params: the dtype's params in registration order")
            expect(buffer.grad_dtype == torch.float32, "grad_dtype: fp32 with grad_reduce_in_fp32")
            expect(buffer.ddp_config == config, "ddp_config")
            expect(buffer.num_optimizer_shards == (dp if sharded else None), "num_optimizer_shards")
            group = buffer.data_parallel_group
            expect((group.rank(), group.size()) == (rank, dp), "data_parallel_group")
            expect(buffer.data_parallel_world_size == dp, "data_parallel_world_size")
            expect(buffer.param_indices == list(range(len(params))), "param_indices")
            expect(len(buffer.buckets) == 1, "no bucket size: one bucket")
            bucket = buffer.buckets[0]
            if sharded:
                spans, unpadded, padded = expected_layout(params, dp)
            else:  # no padding at all without the distributed optimizer
                spans, cursor = {}, 0
                for index in reversed(range(len(params))):
                    spans[index] = (cursor, cursor + params[index].numel())
                    cursor += params[index].numel()
                unpadded = padded = cursor
            for index, param in enumerate(params):
                start, end, bucket_id = buffer.param_index_map[param]
                expect((start, end, bucket_id) == (*spans[index], 0), f"param_index_map[{index}]")
                view = buffer.grad_data[start:end]
                expect(param.main_grad.data_ptr() == view.data_ptr(), "main_grad at its start")  # type: ignore[attr-defined]
                if sharded:
                    expect(param.data_ptr() == buffer.param_data[start:end].data_ptr(), "param in param_data")  # type: ignore[index]
            expect(buffer.numel_unpadded == unpadded, f"buffer.numel_unpadded {buffer.numel_unpadded}")
            expect(bucket.numel_unpadded == unpadded, "bucket.numel_unpadded")
            expect(bucket.offset == 0, "bucket.offset")
            expect(bucket.grad_data.numel() == padded, f"bucket.grad_data numel {bucket.grad_data.numel()}")
            expect(bucket.grad_data.numel() % dp == 0 or not sharded, "bucket size divisible by dp")
            expect(bucket.grad_data.data_ptr() == buffer.grad_data.data_ptr(), "bucket.grad_data view")
            if sharded:
                assert bucket.param_data is not None
                assert buffer.param_data is not None
                expect(bucket.param_data.data_ptr() == buffer.param_data.data_ptr(), "bucket.param_data")
                expect(bucket.param_data.numel() == padded, "bucket.param_data numel")
            else:
                expect(bucket.param_data is None, "no param_data without the distributed optimizer")
            expect(set(bucket.params_list) == set(params) == bucket.params, "bucket params")
            expect(not hasattr(bucket.params_list[0], "is_managed_by_layer_wise_optimizer"), "untagged")

        for bucket_group in built.bucket_groups:
            owned = {p for b in bucket_group.buckets for p in b.params_list}
            expect(bucket_group.params == owned, "bucket group params")
            expect(
                all(bucket_group.param_to_bucket[p] in bucket_group.buckets for p in owned), "param_to_bucket"
            )
        if sharded:
            # The optimizer's step: owners write their shard of the param buffer, then each group's
            # gather through start_param_sync(force_sync=...) and _post_param_sync().
            for buffer in built.buffers:
                assert buffer.param_data is not None
                size = buffer.param_data.numel() // dp
                buffer.param_data[rank * size : (rank + 1) * size] = float(rank + 1)
            for bucket_group in built.bucket_groups:
                bucket_group.start_param_sync(force_sync=True)
                bucket_group._post_param_sync()
            for buffer in built.buffers:
                assert buffer.param_data is not None
                size = buffer.param_data.numel() // dp
                want = torch.arange(1, dp + 1, dtype=buffer.param_dtype, device=device()).repeat_interleave(
                    size
                )
                expect(torch.equal(buffer.param_data, want), "param_data gathered from every owner")
    return {"failures": failures}


def test_every_attribute_megatrons_distributed_optimizer_reads() -> None:
    for sharded in (True, False):
        for result in run_distributed(check_reads, 2, args=(sharded,)):
            assert result["failures"] == [], (sharded, result["failures"])
