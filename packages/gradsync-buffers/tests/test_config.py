"""DistributedDataParallelConfig: the reference's fields and defaults, and every rejected combination."""

from __future__ import annotations

import dataclasses

import pytest

from gradsync.buffers import DistributedDataParallelConfig, default_bucket_size, effective_bucket_size

REFERENCE_DEFAULTS = {
    "grad_reduce_in_fp32": False,
    "overlap_grad_reduce": False,
    "overlap_param_gather": False,
    "align_param_gather": False,
    "use_distributed_optimizer": False,
    "num_distributed_optimizer_instances": 1,
    "check_for_nan_in_grad": False,
    "check_for_large_grads": False,
    "bucket_size": None,
    "pad_buckets_for_high_nccl_busbw": False,
    "reduce_scatter_with_fp32_accumulation": False,
    "average_in_collective": False,
    "fp8_param_gather": False,
    "reuse_grad_buf_for_mxfp8_param_ag": False,
    "use_megatron_fsdp": False,
    "use_custom_fsdp": False,
    "data_parallel_sharding_strategy": "no_shard",
    "gradient_reduce_div_fusion": True,
    "suggested_communication_unit_size": None,
    "preserve_fp32_weights": True,
    "keep_fp8_transpose_cache": False,
    "nccl_ub": False,
    "fsdp_double_buffer": False,
    "outer_dp_sharding_strategy": "no_shard",
    "disable_symmetric_registration": False,
    "delay_wgrad_compute": False,
}


def test_reference_fields_defaults_and_order() -> None:
    config = DistributedDataParallelConfig()
    names = [f.name for f in dataclasses.fields(config)]
    assert names[: len(REFERENCE_DEFAULTS)] == list(REFERENCE_DEFAULTS)
    for name, default in REFERENCE_DEFAULTS.items():
        assert getattr(config, name) == default, name
    assert config.param_name_patterns_for_fp32_local_accumulation == ()
    assert config.num_buckets is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"reduce_scatter_with_fp32_accumulation": True}, "requires use_distributed_optimizer=True"),
        (
            {"num_distributed_optimizer_instances": 2},
            r"num_distributed_optimizer_instances=2 requires use_distributed_optimizer=True",
        ),
        ({"num_distributed_optimizer_instances": 0}, r"num_distributed_optimizer_instances must be >= 1"),
        (
            {"overlap_param_gather": True},
            r"overlap_param_gather=True requires use_distributed_optimizer=True or use_megatron_fsdp=True",
        ),
        (
            {"data_parallel_sharding_strategy": "zero3"},
            r"data_parallel_sharding_strategy='zero3' is unknown; use one of no_shard, optim, optim_grads, optim_grads_params",
        ),
        ({"outer_dp_sharding_strategy": "full"}, r"outer_dp_sharding_strategy='full' is unknown"),
        ({"megatron_fsdp_version": 3}, "megatron_fsdp_version must be either 1 or 2"),
        ({"reuse_grad_buf_for_mxfp8_param_ag": True}, "needs fp8_param_gather=True"),
        (
            {"grad_reduce_in_fp32": True, "param_name_patterns_for_fp32_local_accumulation": ("*.weight",)},
            "set grad_reduce_in_fp32=False",
        ),
        ({"num_buckets": 4, "bucket_size": 1000}, "num_buckets and bucket_size cannot both be set"),
        ({"num_buckets": 0}, "num_buckets must be greater than 0"),
        ({"bucket_size": 0}, "bucket_size must be a positive number of elements or None"),
        (
            {
                "use_distributed_optimizer": True,
                "reduce_scatter_with_fp32_accumulation": True,
                "average_in_collective": True,
            },
            "set average_in_collective=False",
        ),
        (
            {
                "use_distributed_optimizer": True,
                "reduce_scatter_with_fp32_accumulation": True,
                "num_distributed_optimizer_instances": 2,
            },
            "not supported with num_distributed_optimizer_instances > 1",
        ),
    ],
)
def test_incompatible_combinations_are_rejected(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DistributedDataParallelConfig(**kwargs)  # type: ignore[arg-type]


VALID_COMBINATIONS = [
    {"use_distributed_optimizer": True, "overlap_param_gather": True, "overlap_grad_reduce": True},
    {"use_megatron_fsdp": True, "overlap_param_gather": True},
    {"use_distributed_optimizer": True, "reduce_scatter_with_fp32_accumulation": True},
    {"use_distributed_optimizer": True, "num_distributed_optimizer_instances": 2},
]


@pytest.mark.parametrize("kwargs", VALID_COMBINATIONS)
def test_valid_combinations_are_kept_as_given(kwargs: dict[str, object]) -> None:
    config = DistributedDataParallelConfig(**kwargs)  # type: ignore[arg-type]
    for name, value in kwargs.items():
        assert getattr(config, name) == value, name
    untouched = {f.name for f in dataclasses.fields(config)} - set(kwargs)
    for name in untouched:
        assert getattr(config, name) == getattr(DistributedDataParallelConfig(), name), name


def test_nccl_ub_implies_double_buffer() -> None:
    assert DistributedDataParallelConfig(nccl_ub=True).fsdp_double_buffer
    assert DistributedDataParallelConfig(megatron_fsdp_max_pool_double_buffer=True).fsdp_double_buffer


def test_use_custom_fsdp_maps_to_use_megatron_fsdp_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match="use_custom_fsdp is deprecated"):
        config = DistributedDataParallelConfig(use_custom_fsdp=True)
    assert config.use_megatron_fsdp


def test_effective_bucket_size_is_derived_and_the_config_never_changes() -> None:
    config = DistributedDataParallelConfig(overlap_grad_reduce=True)
    before = dataclasses.replace(config)
    assert default_bucket_size(8) == 40_000_000
    assert default_bucket_size(64) == 64_000_000
    assert effective_bucket_size(config, 64) == 64_000_000
    assert effective_bucket_size(config, 8, single_bucket=True) is None
    assert effective_bucket_size(DistributedDataParallelConfig(), 8) is None  # no overlap: one bucket
    assert (
        effective_bucket_size(DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=9000), 8)
        == 9000
    )
    assert (
        effective_bucket_size(
            DistributedDataParallelConfig(overlap_grad_reduce=True, num_buckets=4), 8, total_params=1000
        )
        == 250
    )
    assert config == before
    assert config.bucket_size is None
