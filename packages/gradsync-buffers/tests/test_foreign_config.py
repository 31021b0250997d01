"""`as_ddp_config`: Megatron-Core's own DDP config objects (of any recent version) become gradsync's.

The stand-in below has exactly the fields and defaults of Megatron-Core 0.19.2's
``DistributedDataParallelConfig`` (branch core_r0.19.0, transcribed field by field: no
``megatron_fsdp_version``, which arrived later, and no ``preserve_fp32_weights``, which left earlier).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from gradsync.buffers import (
    DistributedDataParallelConfig,
    as_ddp_config,
    refuse_fields_ddp_cannot_honour,
)


@dataclasses.dataclass
class MegatronDDPConfig_0_19_2:
    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    align_param_gather: bool = False
    use_distributed_optimizer: bool = False
    num_distributed_optimizer_instances: int = 1
    check_for_nan_in_grad: bool = False
    check_for_large_grads: bool = False
    bucket_size: int | None = None
    num_buckets: int | None = None
    pad_buckets_for_high_nccl_busbw: bool = False
    reduce_scatter_with_fp32_accumulation: bool = False
    param_name_patterns_for_fp32_local_accumulation: tuple[str, ...] = ()
    average_in_collective: bool = False
    fp8_param_gather: bool = False
    fp4_param_gather: bool = False
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    use_megatron_fsdp: bool = False
    use_custom_fsdp: bool = False
    data_parallel_sharding_strategy: str = "no_shard"
    gradient_reduce_div_fusion: bool = True
    suggested_communication_unit_size: int | None = None
    keep_fp8_transpose_cache: bool = False
    nccl_ub: bool = False
    fsdp_double_buffer: bool = False
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False
    fsdp_all_gather_in_start_param_sync: bool = True
    outer_dp_sharding_strategy: str = "no_shard"
    disable_symmetric_registration: bool = False
    fsdp_manual_registration: bool = False
    delay_wgrad_compute: bool = False
    megatron_fsdp_main_params_dtype: torch.dtype | None = torch.float32
    megatron_fsdp_main_grads_dtype: torch.dtype | None = None
    megatron_fsdp_grad_comm_dtype: torch.dtype | None = None
    megatron_fsdp_use_decoupled_grad: bool = False
    megatron_fsdp_cuda_graph_mode: bool = False
    megatron_fsdp_enable_fine_grained_param_gather: bool = False
    megatron_fsdp_max_pool_double_buffer: bool = False


@dataclasses.dataclass
class FutureMegatronDDPConfig(MegatronDDPConfig_0_19_2):
    """A later version with a field gradsync has never heard of."""

    megatron_fsdp_version: int = 1
    some_future_feature: bool = False
    future_tuning_knob: int = 7


SET = {
    "overlap_grad_reduce": True,
    "use_distributed_optimizer": True,
    "overlap_param_gather": True,
    "bucket_size": 12_345,
    "check_for_nan_in_grad": True,
    "average_in_collective": True,
    "pad_buckets_for_high_nccl_busbw": True,
    "num_distributed_optimizer_instances": 2,
    "gradient_reduce_div_fusion": False,
    "megatron_fsdp_main_grads_dtype": torch.bfloat16,
}


def test_megatron_0_19_2_config_is_read_field_by_field() -> None:
    foreign = MegatronDDPConfig_0_19_2(**SET)  # type: ignore[arg-type]
    converted = as_ddp_config(foreign)
    assert type(converted) is DistributedDataParallelConfig
    for f in dataclasses.fields(foreign):
        assert getattr(converted, f.name) == getattr(foreign, f.name), f.name
    # Fields 0.19.2 lacks take gradsync's defaults.
    assert converted.megatron_fsdp_version == 1
    assert converted.preserve_fp32_weights is True


def test_every_field_gradsync_knows_is_carried() -> None:
    # Each field set to a non-default value, one at a time (combinations gradsync rejects are skipped).
    flip = {bool: lambda v: not v, int: lambda v: v + 1, str: lambda v: "optim"}
    carried = 0
    for f in dataclasses.fields(MegatronDDPConfig_0_19_2):
        if type(f.default) not in flip:
            continue
        value = flip[type(f.default)](f.default)  # type: ignore[no-untyped-call]
        foreign = MegatronDDPConfig_0_19_2(**{f.name: value})
        try:
            expected = DistributedDataParallelConfig(**{f.name: value})
        except (ValueError, AssertionError):
            with pytest.raises(ValueError, match="DistributedDataParallelConfig"):
                as_ddp_config(foreign)
            continue
        assert as_ddp_config(foreign) == expected, f.name
        carried += 1
    assert carried >= 20


def test_refusal_by_field_name_no_attribute_error() -> None:
    # Today's failure: AttributeError ... 'megatron_fsdp_version' from the field checks.
    refuse_fields_ddp_cannot_honour(MegatronDDPConfig_0_19_2(overlap_grad_reduce=True), "DDP")
    with pytest.raises(ValueError, match=r"data_parallel_sharding_strategy='optim'"):
        refuse_fields_ddp_cannot_honour(
            MegatronDDPConfig_0_19_2(data_parallel_sharding_strategy="optim"), "DDP"
        )


def test_unknown_field_at_its_default_is_dropped() -> None:
    converted = as_ddp_config(FutureMegatronDDPConfig(overlap_grad_reduce=True, megatron_fsdp_version=2))
    assert converted.overlap_grad_reduce is True
    assert converted.megatron_fsdp_version == 2
    assert not hasattr(converted, "some_future_feature")


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"some_future_feature": True}, ["some_future_feature=True"]),
        ({"future_tuning_knob": 0}, ["future_tuning_knob=0"]),
        (
            {"some_future_feature": True, "future_tuning_knob": 9},
            ["some_future_feature=True", "future_tuning_knob=9"],
        ),
    ],
)
def test_unknown_field_away_from_its_default_is_refused_by_name(
    kwargs: dict[str, object], named: list[str]
) -> None:
    with pytest.raises(ValueError, match="FutureMegatronDDPConfig") as info:
        as_ddp_config(FutureMegatronDDPConfig(**kwargs))  # type: ignore[arg-type]
    for text in named:
        assert text in str(info.value)
    for unset in {"some_future_feature", "future_tuning_knob"} - kwargs.keys():
        assert unset not in str(info.value)  # at its default: not named


def test_plain_object_with_attributes() -> None:
    converted = as_ddp_config(SimpleNamespace(use_distributed_optimizer=True, bucket_size=64, extra=None))
    assert converted.use_distributed_optimizer is True
    assert converted.bucket_size == 64
    assert converted.overlap_grad_reduce is False
    with pytest.raises(ValueError, match=r"extra_flag=True"):
        as_ddp_config(SimpleNamespace(overlap_grad_reduce=True, extra_flag=True))

    class WithClassDefaults:
        overlap_grad_reduce = True  # a class attribute, not in vars(instance)

    assert as_ddp_config(WithClassDefaults()).overlap_grad_reduce is True


def test_gradsync_config_is_returned_as_is_and_foreign_values_are_validated() -> None:
    own = DistributedDataParallelConfig(overlap_grad_reduce=True)
    assert as_ddp_config(own) is own
    with pytest.raises(ValueError, match="num_buckets and bucket_size"):
        as_ddp_config(MegatronDDPConfig_0_19_2(num_buckets=2, bucket_size=10))
    patterns = as_ddp_config(SimpleNamespace(param_name_patterns_for_fp32_local_accumulation=["a.*"]))
    assert patterns.param_name_patterns_for_fp32_local_accumulation == ("a.*",)
    with pytest.raises(TypeError, match="as_ddp_config"):
        as_ddp_config(42)
