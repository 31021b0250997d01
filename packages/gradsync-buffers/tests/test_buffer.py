"""Buffers and bucket groups on real ranks: views, fp32 local accumulation, substitutable collectives,
telemetry, and refusal of CUDA-only features off CUDA."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from buffers_testkit import (
    buffers_for,
    device,
    emulate_backward,
    expected_grads,
    fill_local_grads,
    finish_first_iteration,
    model_parallel,
    rank_grad_of,
    toy_model,
    with_and_without_probe,
)
from torch import nn

from gradsync.buffers import (
    DistributedDataParallelConfig,
    GradBuffers,
    ParamAndGradBuffer,
    collectives,
    compute_param_layout,
)
from gradsync.groups.testing import run_distributed


def views_into_the_buffers() -> None:
    with model_parallel() as groups:
        model = toy_model(num_layers=3, dtype=torch.bfloat16)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
        buffers = buffers_for(model, config, groups)
        (buffer,) = buffers.buffers
        assert buffer.grad_dtype == torch.float32
        assert buffer.param_dtype == torch.bfloat16
        for name, param in model.named_parameters():
            start, end, _ = buffer.param_index_map[param]
            assert param.main_grad.dtype == torch.float32  # type: ignore[attr-defined]
            assert param.main_grad.data_ptr() == buffer.grad_data[start:end].data_ptr()  # type: ignore[attr-defined]
            assert torch.equal(param.detach(), before[name])  # values survive the move into param_data
            assert param.data.data_ptr() == buffer.param_data[start:end].data_ptr()  # type: ignore[index]
            bucket = buffer.param_to_bucket[param]
            local_start, local_end = bucket.param_to_index[param]
            assert (local_start + bucket.offset, local_end + bucket.offset) == (start, end)
        buffer.grad_data.fill_(2.0)
        buffer.scale_gradients(0.5)
        assert torch.equal(buffer.grad_data, torch.ones_like(buffer.grad_data))
        buffer.reset()
        assert not buffer.grad_data.any()
        plain = buffers_for(toy_model(num_layers=2), DistributedDataParallelConfig(), groups)
        assert plain.buffers[0].param_data is None
        assert plain.buffers[0].buckets[0].param_data is None


def test_params_and_grads_are_views_into_the_buffers() -> None:
    run_distributed(views_into_the_buffers, 2)


def fp32_local_accumulation() -> None:
    with model_parallel() as groups:
        model = toy_model(num_layers=3, dtype=torch.bfloat16)
        config = DistributedDataParallelConfig(param_name_patterns_for_fp32_local_accumulation=("*.weight",))
        buffers = buffers_for(model, config, groups)
        (buffer,) = buffers.buffers
        promoted = {p for n, p in model.named_parameters() if n.endswith("weight")}
        for name, param in model.named_parameters():
            if param in promoted:
                assert param.main_grad.dtype == torch.float32, name  # type: ignore[attr-defined]
                assert param.main_grad_copy_in_grad_buffer.dtype == torch.bfloat16  # type: ignore[attr-defined]
                assert not param.main_grad.any()  # type: ignore[attr-defined]  # zeroed, never uninitialised
            else:
                assert param.main_grad.dtype == torch.bfloat16  # type: ignore[attr-defined]
                assert not hasattr(param, "main_grad_copy_in_grad_buffer")
        assert set(buffer.buckets[0].params_with_extra_main_grads) == promoted
        for param in promoted:
            param.main_grad.fill_(4.0)  # type: ignore[attr-defined]
        buffer.scale_gradients(0.5)
        assert all(torch.equal(p.main_grad, torch.full_like(p.main_grad, 2.0)) for p in promoted)  # type: ignore[attr-defined]
        every = buffers_for(
            toy_model(num_layers=2, dtype=torch.bfloat16),
            DistributedDataParallelConfig(param_name_patterns_for_fp32_local_accumulation=("all",)),
            groups,
        )
        assert len(every.buffers[0].extra_main_grads) == 4


def test_fp32_local_accumulation_for_matching_params() -> None:
    run_distributed(fp32_local_accumulation, 2)


def fp32_local_accumulation_syncs(overlap: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    config = DistributedDataParallelConfig(
        param_name_patterns_for_fp32_local_accumulation=("*.weight",),
        overlap_grad_reduce=overlap,
        bucket_size=700 if overlap else None,
    )
    built: list[tuple[nn.Sequential, GradBuffers]] = []
    with model_parallel() as groups:

        def run() -> list[torch.Tensor]:
            model = toy_model(num_layers=3, dtype=torch.bfloat16)
            buffers = buffers_for(model, config, groups)
            built.append((model, buffers))
            if overlap:
                finish_first_iteration(buffers, model)
            emulate_backward(buffers, model, rank_grad_of(buffers, rank))
            buffers.finish_grad_sync()
            weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
            # Once the sync has finished, each fp32 main grad holds the reduced value of its buffer copy.
            for weight in weights:
                assert torch.equal(weight.main_grad, weight.main_grad_copy_in_grad_buffer.float())  # type: ignore[attr-defined]
            return [buffers.buffers[0].grad_data, *(w.main_grad for w in weights)]  # type: ignore[attr-defined]

        grad_data, *main_grads = with_and_without_probe(run, seed=rank)
        model, buffers = built[0]
        (buffer,) = buffers.buffers
        assert len(buffers.bucket_groups) > 1 if overlap else len(buffers.bucket_groups) == 1
        expected = expected_grads(buffer, rank, range(world), 1.0 / world, average=False, shard=None)
        assert torch.equal(grad_data, expected)
        weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
        for weight, main_grad in zip(weights, main_grads, strict=True):
            start, end, _ = buffer.param_index_map[weight]
            assert torch.equal(main_grad, expected[start:end].float().view(weight.shape))


@pytest.mark.parametrize("overlap", [False, True])
def test_fp32_main_grads_receive_the_reduced_grads(overlap: bool) -> None:
    run_distributed(fp32_local_accumulation_syncs, 2, args=(overlap,))


class Counting:
    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner(*args, **kwargs)


def substitutable_collectives_and_stats() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    with model_parallel() as groups:
        model = toy_model(num_layers=2)
        buffers = buffers_for(model, DistributedDataParallelConfig(use_distributed_optimizer=True), groups)
        (buffer,) = buffers.buffers
        # the reduce-scatter's path calls torch's reduce-scatter through the late-bound alias, or all_to_all
        group = buffers.bucket_groups[0].collective_group
        path = collectives.reduce_scatter_path(group, buffer.grad_data.device)
        home, name = (
            (dist, "all_to_all_single") if path == "all_to_all" else (collectives, "dist_reduce_scatter_func")
        )
        counting = Counting(getattr(home, name))
        setattr(home, name, counting)
        try:
            fill_local_grads(buffers, rank)
            buffers.finish_grad_sync(force_all_reduce=True)
            assert counting.calls == 0
            reduced = expected_grads(buffer, rank, range(world), 1.0 / world, average=False, shard=None)
            assert torch.equal(buffer.grad_data, reduced)
            buffers.reset()
            fill_local_grads(buffers, rank)
            buffers.finish_grad_sync()
            assert counting.calls == 1
            scattered = expected_grads(
                buffer, rank, range(world), 1.0 / world, average=False, shard=(rank, world)
            )
            assert torch.equal(buffer.grad_data, scattered)
        finally:
            setattr(home, name, counting.inner)
        (record,) = buffers.bucket_groups[0].stats.records
        grad_data = buffer.grad_data
        assert (record.op, record.bytes, record.group_size) == (
            "reduce_scatter",
            grad_data.numel() * 4,
            world,
        )
        assert record.seconds is not None
        assert record.seconds >= 0


def test_collectives_are_looked_up_at_call_time_and_recorded() -> None:
    run_distributed(substitutable_collectives_and_stats, 2)


def single_group_when_bucketing_is_disabled() -> None:
    with model_parallel() as groups:
        config = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=100)
        split = buffers_for(toy_model(num_layers=3), config, groups)
        assert len(split.bucket_groups) == len(split.buffers[0].buckets) > 1
        single = buffers_for(toy_model(num_layers=3), config, groups, disable_bucketing=True)
        assert len(single.bucket_groups) == 1
        assert len(single.buffers[0].buckets) == 1
        assert single.bucket_size is None


def test_disable_bucketing_gives_one_bucket_group() -> None:
    run_distributed(single_group_when_bucketing_is_disabled, 2)


def cuda_only_features_refused() -> None:
    with model_parallel() as groups:
        model = toy_model(num_layers=1)
        with pytest.raises(
            RuntimeError,
            match=r"nccl_ub=True \(NCCL user buffers\) needs CUDA tensors on an NCCL group; this buffer is on cpu over the gloo backend",
        ):
            buffers_for(model, DistributedDataParallelConfig(nccl_ub=True), groups)
        with pytest.raises(NotImplementedError, match="fp8_param_gather=True needs Transformer Engine"):
            buffers_for(model, DistributedDataParallelConfig(fp8_param_gather=True), groups)
        layout = compute_param_layout(
            [p.numel() for p in model.parameters()], None, padded=True, data_parallel_world_size=4
        )
        named = [(p, n) for n, p in model.named_parameters()]
        distopt = DistributedDataParallelConfig(use_distributed_optimizer=True)
        with pytest.raises(
            ValueError,
            match="Parameter layout was built for 4 optimizer shards but the buffer's data-parallel group has 2 ranks",
        ):
            ParamAndGradBuffer(
                distopt,
                torch.float32,
                torch.float32,
                named,
                groups.dp,  # type: ignore[arg-type]
                None,
                1.0,
                param_layout=layout,
            )


@pytest.mark.skipif(device().type != "cpu", reason="checks the refusal on CPU tensors over gloo")
def test_cuda_only_features_are_refused_off_cuda() -> None:
    run_distributed(cuda_only_features_refused, 2)


def missing_groups_are_named() -> None:
    from gradsync.buffers import build_grad_buffers
    from gradsync.groups import ProcessGroupCollection

    model = toy_model(num_layers=1)
    with pytest.raises(ValueError, match="pg_collection needs one of dp_cp, dp"):
        build_grad_buffers(
            list(model.named_parameters()), DistributedDataParallelConfig(), ProcessGroupCollection()
        )
    model[0].weight.allreduce = False  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="pg_collection needs one of intra_expt_dp, expt_dp"):
        build_grad_buffers(
            list(model.named_parameters()),
            DistributedDataParallelConfig(),
            ProcessGroupCollection(dp=dist.group.WORLD),
        )


def test_missing_groups_are_named_before_any_collective() -> None:
    run_distributed(missing_groups_are_named, 1)
