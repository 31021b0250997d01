"""The padded and unpadded layouts: the spec's exact numbers, the utilities, and buffer grouping."""

from __future__ import annotations

import math

import pytest
import torch

from gradsync.buffers import (
    BufferKey,
    ParamSpec,
    bucket_end_divisor,
    compute_full_param_layout,
    compute_param_layout,
    group_params_for_buffers,
    group_specs_for_buffers,
    is_expert_parallel,
    pad_bucket_end,
    pad_param_start,
    pad_to_divisor,
)

BUCKET_SIZES = [None, 9000, 9025, 9050, 18000, 18050, 20000]


def test_expert_params_are_those_marked_allreduce_false() -> None:
    dense, expert = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    expert.allreduce = False  # type: ignore[attr-defined]
    assert not is_expert_parallel(dense)
    assert is_expert_parallel(expert)
    assert ParamSpec.of(expert).is_expert_parallel
    assert not ParamSpec.of(dense).is_expert_parallel


def test_padding_utilities() -> None:
    assert (pad_to_divisor(128, 64), pad_to_divisor(65, 64), pad_to_divisor(0, 64)) == (128, 128, 0)
    assert [pad_param_start(i) for i in (0, 1, 63, 64, 65)] == [0, 64, 64, 64, 128]
    assert pad_bucket_end(1, 4, False) == 128
    assert pad_bucket_end(1, 4, True) == math.lcm(4, 128, 65536)
    assert pad_bucket_end(384, 3, False) == 384
    assert bucket_end_divisor(3, False) == 384


def model_numels(num_layers: int, bias: bool) -> list[int]:
    """Registration order of Linear(95, 95) layers: weight, bias, weight, bias, ..."""
    numels = []
    for _ in range(num_layers):
        numels.append(95 * 95)
        if bias:
            numels.append(95)
    return numels


def expected_buckets(
    numels: list[int], bucket_size: int | None, dp: int, distopt: bool, shared_last: bool
) -> list[tuple[int, int]]:
    """(unpadded, padded) per bucket, recomputed the way the spec's test describes it."""
    sizes: list[int] = []
    order = list(reversed(numels))
    if shared_last and distopt:
        sizes.append(order.pop(0))  # the shared embedding alone, first in reverse order
    current = 0
    for numel in order:
        if distopt:
            current = pad_to_divisor(current, 64)
        current += numel
        if bucket_size is not None and current >= bucket_size:
            sizes.append(current)
            current = 0
    if current:
        sizes.append(current)
    divisor = math.lcm(dp, 128) if distopt else 1
    return [(s, pad_to_divisor(s, divisor)) for s in sizes]


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
@pytest.mark.parametrize("bucket_size", BUCKET_SIZES)
@pytest.mark.parametrize("distopt", [False, True])
@pytest.mark.parametrize(("bias", "shared"), [(False, False), (True, False), (False, True)])
def test_bucket_sizes(dp: int, bucket_size: int | None, distopt: bool, bias: bool, shared: bool) -> None:
    numels = model_numels(10, bias)
    flags = [False] * len(numels)
    if shared:
        flags[-1] = True
    layout = compute_param_layout(
        numels, bucket_size, padded=distopt, data_parallel_world_size=dp, shared_embedding=flags
    )
    got = [
        (unpadded, end - start)
        for unpadded, (start, end) in zip(
            layout.per_bucket_numel_unpadded, layout.bucket_indices, strict=True
        )
    ]
    assert got == expected_buckets(numels, bucket_size, dp, distopt, shared)
    if bucket_size is None:
        assert len(got) == (2 if shared and distopt else 1)
    if distopt:
        assert all(end % dp == 0 and start % dp == 0 for start, end in layout.bucket_indices)


def test_spec_numbers_at_dp8() -> None:
    numels = model_numels(10, bias=False)
    layout = compute_param_layout(numels, 9000, padded=True, data_parallel_world_size=8)
    assert layout.per_bucket_numel_unpadded == [9025] * 10
    assert [e - s for s, e in layout.bucket_indices] == [9088] * 10
    layout = compute_param_layout(numels, 18000, padded=True, data_parallel_world_size=8)
    assert layout.per_bucket_numel_unpadded[0] == 18113
    assert layout.bucket_indices[0] == (0, 18176)
    assert layout.param_index_map[8] == (9088, 18113, 0)  # second param of the bucket starts 64-aligned


def test_default_layout_examples() -> None:
    layout = compute_param_layout([100 * 100, 50 * 50], None)
    assert layout.param_index_map == {1: (0, 2500, 0), 0: (2500, 12500, 0)}
    assert layout.bucket_indices == [(0, 12500)]
    assert layout.num_optimizer_shards is None
    assert compute_param_layout([10000] * 3, 15000).per_bucket_numel_unpadded == [20000, 10000]
    assert compute_param_layout([97, 103], None).bucket_indices == [(0, 200)]


def test_padded_layout_rules() -> None:
    shared_last = compute_param_layout(
        [1000, 1000], None, padded=True, data_parallel_world_size=2, shared_embedding=[False, True]
    )
    assert len(shared_last.bucket_indices) == 2
    shared_first = compute_param_layout(
        [1000, 1000], None, padded=True, data_parallel_world_size=2, shared_embedding=[True, False]
    )
    assert len(shared_first.bucket_indices) == 2  # no empty bucket when the shared param comes first
    three = compute_param_layout([5000] * 3, 8000, padded=True, data_parallel_world_size=2)
    assert len(three.bucket_indices) == 2
    assert len(three.per_bucket_numel_unpadded) == 2
    trailing = compute_param_layout(
        [5000, 5000, 5000, 300],
        8000,
        padded=True,
        data_parallel_world_size=8,
        shared_embedding=[False, False, False, True],
    )
    assert trailing.bucket_params(0) == [3]
    high = compute_param_layout(
        [1000], None, padded=True, data_parallel_world_size=2, pad_for_high_nccl_busbw=True
    )
    assert high.bucket_indices == [(0, 65536)]
    sizes = [64 * k for k in (3, 7, 1, 12)]
    padded = compute_param_layout(sizes, 500, padded=True, data_parallel_world_size=1)
    plain = compute_param_layout(sizes, 500)
    assert padded.param_index_map == plain.param_index_map
    assert padded.per_bucket_numel_unpadded == plain.per_bucket_numel_unpadded


def test_shard_param_ranges_follow_the_optimizer_contract() -> None:
    layout = compute_param_layout([300, 100], None, padded=True, data_parallel_world_size=4)
    # reverse order: param 1 at [0, 100), param 0 at [128, 428); bucket padded to 512, shards of 128.
    assert layout.param_index_map == {1: (0, 100, 0), 0: (128, 428, 0)}
    assert layout.bucket_indices == [(0, 512)]
    rank0 = layout.shard_param_ranges(0, 0, 4)
    assert [(r.param_index, r.param_range, r.local) for r in rank0] == [(1, (0, 100), (0, 100))]
    rank1 = layout.shard_param_ranges(0, 1, 4)
    assert [(r.param_index, r.param_range, r.gbuf_world) for r in rank1] == [(0, (0, 128), (128, 256))]
    rank3 = layout.shard_param_ranges(0, 3, 4)
    assert [(r.param_index, r.param_range, r.local) for r in rank3] == [(0, (256, 300), (0, 44))]


def test_grouping_into_buffers() -> None:
    bf16 = torch.bfloat16
    dense, expert = ParamSpec((4, 4), bf16), ParamSpec((4, 4), bf16, is_expert_parallel=True)
    assert group_specs_for_buffers([dense, dense], grad_reduce_in_fp32=True) == {
        BufferKey(bf16, torch.float32, False): [0, 1]
    }
    assert group_specs_for_buffers([dense], grad_reduce_in_fp32=False) == {BufferKey(bf16, bf16, False): [0]}
    grouped = group_specs_for_buffers([dense, expert, dense], grad_reduce_in_fp32=False)
    assert grouped == {BufferKey(bf16, bf16, False): [0, 2], BufferKey(bf16, bf16, True): [1]}
    mixed = group_specs_for_buffers([dense, ParamSpec((2,), torch.float32)], grad_reduce_in_fp32=False)
    assert len(mixed) == 2


def test_grouping_params_has_megatrons_shape() -> None:
    """Megatron's examples: dense, expert, dense give dense indices [0, 1] and expert [0], params kept."""
    bf16 = torch.bfloat16
    a, b, c = (torch.nn.Parameter(torch.zeros(3, dtype=bf16)) for _ in range(3))
    b.allreduce = False  # type: ignore[attr-defined]
    grouped = group_params_for_buffers([a, b, c], grad_reduce_in_fp32=True)
    assert list(grouped) == [BufferKey(bf16, torch.float32, False), BufferKey(bf16, torch.float32, True)]
    dense_params, dense_indices = grouped[BufferKey(bf16, torch.float32, False)]
    assert dense_params[0] is a
    assert dense_params[1] is c
    assert dense_indices == [0, 1]
    assert grouped[BufferKey(bf16, torch.float32, True)][1] == [0]
    frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    with pytest.raises(ValueError, match=r"positions \[1\] do not require grad"):
        group_params_for_buffers([a, frozen], grad_reduce_in_fp32=False)


def test_a_layout_keyed_by_param_as_megatron_keys_it_and_back_by_position() -> None:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (300, 100, 50)]
    specs = [ParamSpec.of(p) for p in params]
    full = compute_full_param_layout(specs, 200, padded=True, data_parallel_world_size=4)
    (key,) = full.layouts
    positional = full.layouts[key]
    keyed = full.keyed_by(params).layouts[key]
    assert positional.is_positional()
    assert not keyed.is_positional()
    # Megatron-Core's keying: the Parameter itself, in layout order (last param first), same ranges.
    assert [id(k) for k in keyed.param_index_map] == [id(p) for p in reversed(params)]
    assert [keyed.param_index_map[p] for p in params] == [positional.param_index_map[i] for i in range(3)]
    assert keyed.bucket_indices == positional.bucket_indices
    assert [id(k) for k in keyed.bucket_params(0)] == [id(p) for p in reversed(params)]
    back = keyed.by_position(params)
    assert back.param_index_map == positional.param_index_map
    assert list(back.param_index_map) == list(positional.param_index_map)
    assert positional.by_position(params) is positional
    with pytest.raises(ValueError, match="1 of them not among the buffer's 3"):
        keyed.by_position([params[0], params[1], torch.nn.Parameter(torch.zeros(50))])
    with pytest.raises(ValueError, match="positions"):
        positional.keyed_by(params[:2])


def test_full_layout_pads_experts_for_the_expert_dp_size() -> None:
    specs = [ParamSpec((1000,), torch.bfloat16), ParamSpec((1000,), torch.bfloat16, is_expert_parallel=True)]
    full = compute_full_param_layout(
        specs, None, padded=True, data_parallel_world_size=3, expert_data_parallel_world_size=256
    )
    dense = full.layouts[BufferKey(torch.bfloat16, torch.bfloat16, False)]
    expert = full.layouts[BufferKey(torch.bfloat16, torch.bfloat16, True)]
    assert dense.numel % 384 == 0
    assert expert.numel % 256 == 0
    assert dense.param_index_map[0][0] == expert.param_index_map[0][0] == 0
    assert full.members == {
        BufferKey(torch.bfloat16, torch.bfloat16, False): [0],
        BufferKey(torch.bfloat16, torch.bfloat16, True): [1],
    }
