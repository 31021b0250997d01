"""The fp32-accumulating reduce-scatter equals an fp32 reduction of the low-precision inputs."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from buffers_testkit import device, probe_collectives

from gradsync.buffers import reduce_scatter_with_fp32_accumulation, shard_buffer
from gradsync.groups.testing import run_distributed


def gathered_inputs(data: torch.Tensor) -> list[torch.Tensor]:
    gathered = [torch.empty_like(data) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, data)
    return gathered


def fp32_reference(gathered: list[torch.Tensor]) -> torch.Tensor:
    """This rank's shard of the sum of every rank's input, accumulated in fp32 from an all_gather of the
    inputs (another collective and a local sum), then cast back."""
    reference = torch.stack(gathered).sum(dim=0, dtype=torch.float32).to(gathered[0].dtype)
    return shard_buffer(reference, len(gathered))[dist.get_rank()]


def matches_fp32_reference(async_op: bool, dtype: torch.dtype, probe: bool) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    generator = torch.Generator().manual_seed(1234 + rank)
    data = (torch.randn(4096, generator=generator) * 100).to(dtype=dtype, device=device())
    gathered = gathered_inputs(data)
    expected = fp32_reference(gathered)
    low_precision_sum = gathered[0].clone()
    for part in gathered[1:]:
        low_precision_sum += part  # every partial sum rounded to the low precision, as a ring would
    own = shard_buffer(data, world)[rank]
    local = own.clone()
    with probe_collectives(seed=rank) if probe else contextlib.nullcontext():
        handle = reduce_scatter_with_fp32_accumulation(own, data, dist.ReduceOp.SUM, None, async_op)
        if async_op:
            assert handle is not None
            handle.wait()
        else:
            assert handle is None
    assert not torch.equal(expected, local)
    assert torch.equal(own, expected)
    if world >= 4:
        assert not torch.equal(expected, shard_buffer(low_precision_sum, world)[rank])


@pytest.mark.parametrize(("async_op", "probe"), [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("world", [2, 4])
def test_fp32_accumulation_equals_fp32_reference(
    async_op: bool, probe: bool, dtype: torch.dtype, world: int
) -> None:
    run_distributed(matches_fp32_reference, world, args=(async_op, dtype, probe))


def scratch_and_errors() -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    data = (torch.arange(8 * world, dtype=torch.bfloat16, device=device()) + 1) * (rank + 1)
    expected = fp32_reference(gathered_inputs(data))
    for scratch in (None, torch.full_like(data, float("nan"))):
        own = torch.full((8,), float("nan"), dtype=torch.bfloat16, device=device())
        reduce_scatter_with_fp32_accumulation(own, data, dist.ReduceOp.SUM, None, False, scratch)
        assert torch.equal(own, expected)
        if scratch is not None:
            # The caller's scratch received every rank's copy of this rank's shard: rank r's row is r's.
            for r, row in enumerate(scratch.view(world, -1)):
                mine = shard_buffer((torch.arange(8 * world, device=device()) + 1) * (r + 1), world)[rank]
                assert torch.equal(row, mine.to(torch.bfloat16))
    out = torch.empty(8, dtype=torch.bfloat16, device=device())
    with pytest.raises(
        ValueError, match=r"all_to_all_output_tensor shape \(\(3,\), torch.bfloat16\) does not match"
    ):
        reduce_scatter_with_fp32_accumulation(
            out, data, dist.ReduceOp.SUM, None, False, torch.empty(3, dtype=torch.bfloat16, device=device())
        )
    with pytest.raises(ValueError, match="only sums"):
        reduce_scatter_with_fp32_accumulation(out, data, dist.ReduceOp.AVG, None, False)
    dist.barrier()  # nothing was sent by the failing calls: the ranks are still aligned


def test_caller_scratch_matches_the_fp32_reference_and_bad_calls_fail_before_communication() -> None:
    run_distributed(scratch_and_errors, 2)


def power_of_two_prescale_is_exact() -> None:
    values = (torch.randn(1000) * 7).to(torch.bfloat16)
    for k in (1, 2, 3, 4):
        scaled = (values * (1.0 / 2**k)).sum(dtype=torch.float32)
        assert torch.equal(scaled, values.sum(dtype=torch.float32) / 2**k)


def test_power_of_two_prescale_equals_scaling_the_fp32_sum() -> None:
    power_of_two_prescale_is_exact()
