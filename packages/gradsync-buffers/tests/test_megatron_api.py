"""gradsync-buffers against Megatron-Core's ``param_and_grad_buffer`` and ``param_layout`` API (HEAD
d98e8a64, transcribed from the reference docs and the source): names, argument order and defaults, and
what the Megatron-named pieces do. Deviations are listed in the table with their reason."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from gradsync import buffers
from gradsync.buffers import DistributedDataParallelConfig
from gradsync.buffers.param_ready import PARAM_READY_CALLBACK_ATTR
from gradsync.groups.testing import run_distributed
from gradsync.groups.testing.api_table import REQUIRED, signature_mismatches

R = REQUIRED
Bucket, Buffer, Group = (
    buffers._ParamAndGradBucket,
    buffers._ParamAndGradBuffer,
    buffers._ParamAndGradBucketGroup,
)

# (callable, Megatron's parameters, gradsync's extra parameters after them: why)
TABLE: list[tuple[Any, list[tuple[str, Any]], dict[str, str]]] = [
    (
        Buffer.__init__,
        [
            ("ddp_config", R),
            ("param_dtype", R),
            ("grad_dtype", R),
            ("params_with_names", R),
            ("data_parallel_group", R),
            ("bucket_size", R),
            ("param_to_name", R),
            ("gradient_scaling_factor", R),
            ("param_indices", R),
            ("nccl_ub", R),
            ("pg_collection", None),
            ("param_layout", None),
        ],
        {},
    ),
    (Buffer.scale_gradients, [("scaling_factor", R)], {}),
    (Buffer.reset, [], {}),
    (Buffer.offload_to_cpu, [("move_params", True), ("move_grads", True)], {}),
    (Buffer.reload_from_cpu, [("move_params", True), ("move_grads", True)], {}),
    (
        Bucket.__init__,
        [
            ("params", R),
            ("param_data", R),
            ("grad_data", R),
            ("offset", R),
            ("numel_unpadded", R),
            ("gradient_scaling_factor", R),
            ("bucket_id", R),
            ("param_index_map", R),
            ("params_with_extra_main_grads", R),
        ],
        {"param_names": "names for error messages; optional"},
    ),
    (
        Group.__init__,
        [("buckets", R), ("ddp_config", R), ("collective_group", R), ("collective_group_size", R)],
        {
            "inter_distributed_optimizer_instance_group": "keyword-only: no global parallel state to read it from"
        },
    ),
    (Group.reset, [], {}),
    (Group.check_grads, [("check_for_nan_or_inf", R), ("check_for_large", R)], {}),
    (Group.start_param_sync, [("force_sync", False)], {}),
    (Group.finish_param_sync, [("skip_next_bucket_dispatch", False)], {}),
    (Group.start_grad_sync, [("force_all_reduce", False)], {}),
    (Group.finish_grad_sync, [("force_all_reduce", False)], {}),
    (Group.free_overlap_buffers, [], {}),
    (Group.register_grad_ready, [("param", R), ("force_all_reduce", False)], {}),
    (buffers.shard_buffer, [("buffer", R), ("data_parallel_world_size", R)], {}),
    (buffers.group_params_for_buffers, [("params", R), ("grad_reduce_in_fp32", R)], {}),
    (
        buffers.partition_buckets,
        [
            ("buffers", R),
            ("force_single_bucket_group", False),
            ("reduce_scatter_with_fp32_accumulation", False),
        ],
        {
            "inter_distributed_optimizer_instance_group": "keyword-only: no global parallel state to read it from"
        },
    ),
    (
        buffers.reduce_scatter_with_fp32_accumulation,
        [
            ("output_tensor", R),
            ("input_tensor", R),
            ("op", R),
            ("group", R),
            ("async_op", R),
            ("all_to_all_output_tensor", None),
        ],
        {},
    ),
    (buffers.pad_to_divisor, [("value", R), ("divisor", R)], {}),
    (buffers.pad_param_start, [("param_start_index", R)], {}),
    (buffers.bucket_end_divisor, [("data_parallel_world_size", R), ("pad_for_high_nccl_busbw", R)], {}),
    (
        buffers.pad_bucket_end,
        [("bucket_end_index", R), ("data_parallel_world_size", R), ("pad_for_high_nccl_busbw", R)],
        {},
    ),
    (
        buffers.BufferKey,
        [
            ("param_dtype", R),
            ("grad_dtype", R),
            ("is_expert_parallel", R),
            ("is_managed_by_layer_wise_optimizer", False),
        ],
        {},
    ),
    (buffers.ensure_params_ready, [("params", R)], {}),
]


@pytest.mark.parametrize(("func", "megatron", "extra"), TABLE, ids=[t[0].__qualname__ for t in TABLE])
def test_signature_matches_megatron(
    func: Any, megatron: list[tuple[str, Any]], extra: dict[str, str]
) -> None:
    assert signature_mismatches(func, megatron, list(extra)) == []


def test_layout_dataclasses_have_megatrons_fields() -> None:
    layout = buffers.PerBufferParamLayout()
    assert (layout.param_index_map, layout.bucket_indices, layout.per_bucket_numel_unpadded) == ({}, [], [])
    assert (layout.param_indices, layout.num_optimizer_shards) == ([], None)
    assert buffers.FullParamLayout().layouts == {}
    assert PARAM_READY_CALLBACK_ATTR == "_ensure_param_ready_callback"


def megatron_constructed_buffer() -> dict[str, Any]:
    """A buffer built with Megatron's positional arguments, its bucket group, and an offload round trip."""
    rank = dist.get_rank()
    config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    params = [torch.nn.Parameter(torch.full((4, 3), float(rank + 1))), torch.nn.Parameter(torch.ones(5))]
    names = {p: f"p{i}" for i, p in enumerate(params)}
    buffer = Buffer(
        config, torch.float32, torch.float32, [(p, names[p]) for p in params], dist.group.WORLD, None, names,
        1.0, [0, 1], False,
    )  # fmt: skip
    group = buffers.partition_buckets([buffer])[0]
    for p in params:
        p.main_grad.fill_(float(rank + 2))  # type: ignore[attr-defined]
    main_grad, weight = params[0].main_grad, params[0].data  # type: ignore[attr-defined]
    buffer.offload_to_cpu()
    freed = (
        buffer.grad_data.untyped_storage().nbytes() == 0 and buffer.param_data.untyped_storage().nbytes() == 0
    )  # type: ignore[union-attr]
    buffer.reload_from_cpu()
    return {
        "indices": buffer.param_indices,
        "megatron_names": (
            group.intra_distributed_optimizer_instance_group is dist.group.WORLD,
            group.intra_distributed_optimizer_instance_size,
            group.intra_distributed_optimizer_instance_rank == rank,
            group.data_parallel_group is dist.group.WORLD,
        ),
        "freed": freed,
        "views_kept": params[0].main_grad is main_grad and params[0].data.data_ptr() == weight.data_ptr(),  # type: ignore[attr-defined]
        "grads_zeroed": bool(main_grad.eq(0).all()),
        "weights_back": bool(params[0].data.eq(rank + 1).all()),
    }


def test_megatron_constructor_and_names_and_offload() -> None:
    for result in run_distributed(megatron_constructed_buffer, 2):
        assert result["indices"] == [0, 1]
        assert result["megatron_names"] == (True, 2, True, True)
        assert result["freed"]
        assert result["views_kept"]
        assert result["grads_zeroed"]
        assert result["weights_back"]


def mismatched_nccl_ub() -> None:
    param = torch.nn.Parameter(torch.ones(3))
    config = DistributedDataParallelConfig()
    with pytest.raises(ValueError, match=r"nccl_ub=True but ddp_config.nccl_ub=False"):
        Buffer(
            config, torch.float32, torch.float32, [(param, "w")], dist.group.WORLD, None, {}, 1.0, [0], True
        )
    buffer = Buffer(
        config, torch.float32, torch.float32, [(param, "w")], dist.group.WORLD, None, {}, 1.0, [0], False
    )
    with pytest.raises(ValueError, match="reduce_scatter_with_fp32_accumulation=True"):
        buffers.partition_buckets([buffer], False, True)


def test_megatron_arguments_that_disagree_with_the_config_are_refused() -> None:
    run_distributed(mismatched_nccl_ub, 1)


def test_ensure_params_ready_calls_each_callback_once_in_first_seen_order() -> None:
    calls: list[str] = []
    first, second = (lambda: calls.append("first")), (lambda: calls.append("second"))
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(4)]
    for param, callback in zip(params, [second, None, second, first], strict=True):
        if callback is not None:
            setattr(param, PARAM_READY_CALLBACK_ATTR, callback)
    buffers.ensure_params_ready([*params, torch.zeros(2)])  # a tensor without the attribute is skipped
    assert calls == ["second", "first"]


def overlap_buffers_freed() -> dict[str, bool]:
    """Megatron-Core's ``free_overlap_buffers`` (called before an async checkpoint save) finishes the
    param gather in flight and drops every bucket's ``layerwise_gather_list`` (the per-rank receive views
    of its layer-wise gather), so the allocator can reclaim them."""
    config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_param_gather=True)
    params = [torch.nn.Parameter(torch.ones(4, 3)), torch.nn.Parameter(torch.ones(5))]
    buffer = Buffer(
        config, torch.float32, torch.float32, [(p, f"p{i}") for i, p in enumerate(params)], dist.group.WORLD,
        None, {}, 1.0, [0, 1], False,
    )  # fmt: skip
    group = buffers.partition_buckets([buffer])[0]
    fresh = all(bucket.layerwise_gather_list is None for bucket in group.buckets)
    group.start_param_sync()
    in_flight = group.param_gather_handle is not None
    for bucket in group.buckets:  # what Megatron's layer-wise gather leaves there while it is in flight
        bucket.layerwise_gather_list = [bucket.grad_data[:1], bucket.grad_data[1:2]]
    group.free_overlap_buffers()
    return {
        "fresh": fresh,
        "in_flight": in_flight,
        "handle_dropped": group.param_gather_handle is None,
        "lists_dropped": all(bucket.layerwise_gather_list is None for bucket in group.buckets),
    }


def test_free_overlap_buffers_drops_the_layerwise_gather_list() -> None:
    for result in run_distributed(overlap_buffers_freed, 2):
        assert result == {"fresh": True, "in_flight": True, "handle_dropped": True, "lists_dropped": True}


def megatron_keyed_layout() -> dict[str, Any]:
    """A layout keyed by Parameter, as Megatron-Core's ``PerBufferParamLayout`` is (last param first),
    given to the buffer: its ``param_index_map`` and the ``main_grad`` views follow it."""
    config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    params = [torch.nn.Parameter(torch.ones(4, 3)), torch.nn.Parameter(torch.ones(5))]
    layout = buffers.PerBufferParamLayout(
        param_index_map={params[1]: (0, 5, 0), params[0]: (64, 76, 0)},
        bucket_indices=[(0, 128)],
        per_bucket_numel_unpadded=[76],
        param_indices=[0, 1],
        num_optimizer_shards=dist.get_world_size(),
    )
    buffer = Buffer(
        config, torch.float32, torch.float32, [(p, f"p{i}") for i, p in enumerate(params)], dist.group.WORLD,
        None, {}, 1.0, [0, 1], False, None, layout,
    )  # fmt: skip
    stranger = buffers.PerBufferParamLayout(
        param_index_map={torch.nn.Parameter(torch.ones(5)): (0, 5, 0), params[0]: (64, 76, 0)},
        bucket_indices=[(0, 128)],
        per_bucket_numel_unpadded=[76],
        num_optimizer_shards=dist.get_world_size(),
    )
    with pytest.raises(ValueError, match="1 of them not among the buffer's 2"):
        Buffer(
            config, torch.float32, torch.float32, [(torch.nn.Parameter(torch.ones(5)), "q"), (params[0], "w")],
            dist.group.WORLD, None, {}, 1.0, [0, 1], False, None, stranger,
        )  # fmt: skip
    return {
        "index_map": buffer.param_index_map == layout.param_index_map,
        "views": [
            p.main_grad.data_ptr() - buffer.grad_data.data_ptr()  # type: ignore[attr-defined]
            for p in params
        ],
        "positional": buffer.layout.param_index_map == {1: (0, 5, 0), 0: (64, 76, 0)},
        "buckets": [len(b.params_list) for b in buffer.buckets],
    }


def test_a_layout_keyed_by_param_as_megatrons_is_used() -> None:
    for result in run_distributed(megatron_keyed_layout, 2):
        assert result == {"index_map": True, "views": [64 * 4, 0], "positional": True, "buckets": [2]}
