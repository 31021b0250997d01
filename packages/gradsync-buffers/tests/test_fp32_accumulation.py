"""The fp32-accumulating reduce-scatter equals an fp32 reduction of the low-precision inputs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gradsync.buffers import reduce_scatter_with_fp32_accumulation, shard_buffer
from gradsync.groups.testing import run_distributed


def matches_fp32_reference(async_op: bool, dtype: torch.dtype) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    generator = torch.Generator().manual_seed(1234 + rank)
    data = (torch.randn(4096, generator=generator) * 100).to(dtype)
    gathered = [torch.empty_like(data) for _ in range(world)]
    dist.all_gather(gathered, data)
    reference = torch.stack(gathered).sum(dim=0, dtype=torch.float32).to(dtype)
    low_precision_sum = gathered[0].clone()
    for part in gathered[1:]:
        low_precision_sum += part  # every partial sum rounded to the low precision, as a ring would
    own = shard_buffer(data, world)[rank]
    handle = reduce_scatter_with_fp32_accumulation(own, data, dist.ReduceOp.SUM, None, async_op)
    if async_op:
        assert handle is not None
        handle.wait()
    else:
        assert handle is None
    expected = shard_buffer(reference, world)[rank]
    assert torch.equal(own, expected)
    if world >= 4:
        assert not torch.equal(expected, shard_buffer(low_precision_sum, world)[rank])


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("world", [2, 4])
def test_fp32_accumulation_equals_fp32_reference(async_op: bool, dtype: torch.dtype, world: int) -> None:
    run_distributed(matches_fp32_reference, world, args=(async_op, dtype))


def scratch_and_errors() -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    data = torch.arange(8 * world, dtype=torch.bfloat16) + rank
    first = data.clone()
    reduce_scatter_with_fp32_accumulation(
        shard_buffer(first, world)[rank], first.clone(), dist.ReduceOp.SUM, None, False
    )
    second = data.clone()
    scratch = torch.empty_like(second)
    reduce_scatter_with_fp32_accumulation(
        shard_buffer(second, world)[rank], second.clone(), dist.ReduceOp.SUM, None, False, scratch
    )
    assert torch.equal(first, second)
    out = torch.empty(8, dtype=torch.bfloat16)
    with pytest.raises(
        ValueError, match=r"all_to_all_output_tensor shape \(\(3,\), torch.bfloat16\) does not match"
    ):
        reduce_scatter_with_fp32_accumulation(
            out, data, dist.ReduceOp.SUM, None, False, torch.empty(3, dtype=torch.bfloat16)
        )
    with pytest.raises(ValueError, match="only sums"):
        reduce_scatter_with_fp32_accumulation(out, data, dist.ReduceOp.AVG, None, False)
    dist.barrier()  # nothing was sent by the failing calls: the ranks are still aligned


def test_caller_scratch_and_validation_before_communication() -> None:
    run_distributed(scratch_and_errors, 2)


def power_of_two_prescale_is_exact() -> None:
    values = (torch.randn(1000) * 7).to(torch.bfloat16)
    for k in (1, 2, 3, 4):
        scaled = (values * (1.0 / 2**k)).sum(dtype=torch.float32)
        assert torch.equal(scaled, values.sum(dtype=torch.float32) / 2**k)


def test_power_of_two_prescale_equals_scaling_the_fp32_sum() -> None:
    power_of_two_prescale_is_exact()
